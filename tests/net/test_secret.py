"""The job's secret (net/secret.py): made once in the root, the same for every node, read
only by its owner, and a planted or damaged one refused rather than trusted."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from asyncckpt.errors import ReplicaAuthError
from asyncckpt.net.secret import SECRET_ENV, SECRET_NAME, job_secret


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)


def test_made_once_private_and_the_same_for_every_reader(tmp_path: Path) -> None:
    first = job_secret(tmp_path)
    assert len(first) == 32 and job_secret(str(tmp_path)) == first
    path = tmp_path / SECRET_NAME
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert bytes.fromhex(path.read_text().strip()) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == [SECRET_NAME]  # no tmp file left


def test_nodes_racing_to_make_it_all_read_one(tmp_path: Path) -> None:
    got: list[bytes] = []
    barrier = threading.Barrier(8)

    def node() -> None:
        barrier.wait()
        got.append(job_secret(tmp_path))
    threads = [threading.Thread(target=node) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and len(set(got)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [SECRET_NAME]


def test_a_secret_open_to_others_is_refused(tmp_path: Path) -> None:
    path = tmp_path / SECRET_NAME
    path.write_text("ab" * 32)
    path.chmod(0o644)
    with pytest.raises(ReplicaAuthError, match="mode 0600"):
        job_secret(tmp_path)


def test_a_planted_symlink_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("ab" * 32)
    target.chmod(0o600)
    (tmp_path / SECRET_NAME).symlink_to(target)
    with pytest.raises(ReplicaAuthError, match="cannot read"):
        job_secret(tmp_path)


@pytest.mark.parametrize("body", ["", "zz" * 32, "ab" * 31, "ab" * 200])
def test_a_malformed_secret_is_refused(tmp_path: Path, body: str) -> None:
    path = tmp_path / SECRET_NAME
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, body.encode())
    os.close(fd)
    with pytest.raises(ReplicaAuthError, match="job secret"):
        job_secret(tmp_path)


def test_the_environment_overrides_and_serves_object_stores(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ReplicaAuthError, match=SECRET_ENV):
        job_secret("s3://bucket/prefix")
    monkeypatch.setenv(SECRET_ENV, "cd" * 32)
    assert job_secret("s3://bucket/prefix") == bytes.fromhex("cd" * 32)
    assert job_secret(tmp_path) == bytes.fromhex("cd" * 32)
    assert not (tmp_path / SECRET_NAME).exists()
    monkeypatch.setenv(SECRET_ENV, "cd" * 8)
    with pytest.raises(ReplicaAuthError, match="64 hex"):
        job_secret(tmp_path)


def test_a_storage_is_read_through_its_local_dir(tmp_path: Path) -> None:
    class Local:
        def local_dir(self) -> Path:
            return tmp_path

    class Remote:
        def local_dir(self) -> None:
            return None
    assert job_secret(Local()) == job_secret(tmp_path)
    with pytest.raises(ReplicaAuthError, match=SECRET_ENV):
        job_secret(Remote())
