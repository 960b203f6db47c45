"""A writer on an `s3://bucket/prefix` root, driven as a user would, against a real S3
server (SeaweedFS on loopback): ranks save, the manifest object commits, and `load`,
`verify`, `ls`, retention, incremental references, the Checkpointer and replacing a
committed step work as on a local root."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
from conftest import SMALL_RING, use_s3

import asyncckpt
from asyncckpt.errors import StepAlreadyCommittedError
from asyncckpt.read.checkpoint import Checkpoint
from asyncckpt.storage.location import root_path, storage_for

MiB = 1 << 20


def state(seed: int, mib: int = 4) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(mib * MiB // 4, generator=g),
            "h": torch.randn(64, 64, generator=g).to(torch.bfloat16),
            "step": seed, "name": f"s{seed}"}


def same(a: dict, b: dict) -> bool:
    return (torch.equal(a["w"], b["w"]) and torch.equal(a["h"], b["h"])
            and a["step"] == b["step"] and a["name"] == b["name"])


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "asyncckpt", *args], capture_output=True,
                          text=True, timeout=120)


def object_keys(root: str) -> set[str]:
    storage = storage_for(root)
    prefix = storage._prefix  # type: ignore[attr-defined]
    return {item["Key"][len(prefix):] for item in storage._list(prefix)}  # type: ignore[attr-defined]


@pytest.fixture
def s3_writer(s3_root, tmp_path):
    w = asyncckpt.start_writer(s3_root, codec="zstd", log_file=tmp_path / "writer.log")
    yield w
    w.stop(timeout=60)


def test_two_ranks_save_and_every_reader_gets_their_bytes_back(s3_root, s3_writer):
    clients = [asyncckpt.connect(s3_writer.address, rank=r, world_size=2, **SMALL_RING)
               for r in range(2)]
    try:
        for step in (1, 2):
            handles = [c.save(step, state(10 * step + r)) for r, c in enumerate(clients)]
            paths = {h.wait(timeout=120) for h in handles}
            assert paths == {root_path(f"{s3_root}/step-{step:08d}")}
    finally:
        for c in clients:
            c.close(timeout=60)
    for step in (1, 2):
        for r in range(2):
            assert same(asyncckpt.load(s3_root, step=step, rank=r), state(10 * step + r))
    assert same(asyncckpt.load(s3_root, rank=1), state(21))  # the newest step
    assert storage_for(s3_root).read_latest() == 2
    done = cli("verify", s3_root, "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    assert [c["step"] for c in json.loads(done.stdout)["checkpoints"]] == [1, 2]
    listed = cli("ls", s3_root, "--json")
    rows = json.loads(listed.stdout)["steps"]
    assert [(r["step"], r["state"], r["latest"]) for r in rows] == [
        (1, "committed", False), (2, "committed", True)]
    inspected = cli("inspect", s3_root, "--json")
    summary = json.loads(inspected.stdout)
    assert (summary["step"], summary["world_size"]) == (2, 2), inspected.stderr
    assert {t["name"] for t in summary["tensors"]} >= {"w", "h"}
    assert "Traceback" not in done.stderr + listed.stderr + inspected.stderr


def test_retention_and_incremental_references_work_on_the_bucket(s3_root, s3_writer):
    base = state(1)
    with asyncckpt.connect(s3_writer.address, rank=0, world_size=1) as c:
        for step in (1, 2, 3):
            s = dict(base, step=step)  # the big tensor unchanged: stored once, referenced
            c.save(step, s, keep_last=2).wait(timeout=120)
    storage = storage_for(s3_root)
    assert storage.committed_steps() == [2, 3]
    assert storage.retired_steps() == [1]  # deleted by retention, its frames referenced
    assert "step-00000001/manifest.json" not in object_keys(s3_root)
    loaded = asyncckpt.load(s3_root, step=3)
    assert torch.equal(loaded["w"], base["w"]) and loaded["step"] == 3
    with Checkpoint.open(s3_root, 3) as ckpt:
        assert 1 in ckpt.manifest.referenced_steps
    assert cli("verify", s3_root).returncode == 0


def test_a_retired_step_nothing_references_is_saved_over_on_the_bucket(s3_root, s3_writer):
    """Step 1 retired by retention (step 3 references its frames); once 2 and 3 are
    retired too (an integration's own deletion), nothing kept references step 1, and a
    new save of step 1 deletes the retired one first and commits."""
    base = state(1)
    storage = storage_for(s3_root)
    with asyncckpt.connect(s3_writer.address, rank=0, world_size=1) as c:
        for step in (1, 2, 3):
            c.save(step, dict(base, step=step), keep_last=2).wait(timeout=120)
        assert storage.retired_steps() == [1]
        for step in (2, 3):
            storage.retire(step)
        c.save(1, state(7), keep_last=2).wait(timeout=120)
    assert storage.committed_steps() == [1]
    assert same(asyncckpt.load(s3_root, step=1), state(7))
    assert cli("verify", s3_root).returncode == 0


def test_the_checkpointer_saves_and_restores_through_the_bucket(s3_root, s3_writer):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    ckpt = asyncckpt.Checkpointer(s3_root, model=model, optimizer=opt,
                                  address=s3_writer.address)
    ckpt.save(5, force=True).wait(timeout=120)
    ckpt.close()
    fresh = torch.nn.Linear(64, 32)
    fresh_opt = torch.optim.Adam(fresh.parameters())
    again = asyncckpt.Checkpointer(s3_root, model=fresh, optimizer=fresh_opt,
                                   address=s3_writer.address)
    assert again.restore() == 5
    again.close()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 fresh.state_dict().values()))
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"],
                       fresh_opt.state_dict()["state"][0]["exp_avg"])


def test_replacing_a_committed_step_swaps_it_whole_while_loads_read_it(s3_root, s3_writer):
    """A save with `replace` of a committed step on an object store (one conditional put
    of its manifest): loads running meanwhile each get one version whole, never an error
    or a mix; the replaced attempts' folders are gone after."""
    import threading
    seeds = (1, 2, 3)
    loaded: list[int] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def load_again() -> None:
        while not done.is_set():
            try:
                got = asyncckpt.load(s3_root, step=1)
                assert same(got, state(got["step"])), got["step"]
                loaded.append(got["step"])
            except BaseException as e:
                errors.append(e)
                return
    with asyncckpt.connect(s3_writer.address, rank=0, world_size=1) as c:
        c.save(1, state(1), replace=True).wait(timeout=120)  # nothing to replace: a save
        reader = threading.Thread(target=load_again)
        reader.start()
        try:
            for seed in seeds[1:]:
                c.save(1, state(seed), replace=True).wait(timeout=120)
        finally:
            done.set()
            reader.join(timeout=120)
        with pytest.raises(StepAlreadyCommittedError, match="replace=True"):
            c.save(1, state(9)).wait(timeout=120)
    assert errors == [] and loaded and set(loaded) <= set(seeds)
    assert same(asyncckpt.load(s3_root, step=1), state(seeds[-1]))
    assert len({k.split("/")[1] for k in object_keys(s3_root) if "/attempt-" in k}) == 1
    assert storage_for(s3_root).in_progress() == []


def test_a_load_that_a_replace_overtakes_reads_the_new_version_whole(s3_root, s3_writer,
                                                                      monkeypatch):
    """A load read the old manifest; the replacing save commits and deletes the old files
    before the load opens its data file: the load opens the step again and returns the
    new version, never the old manifest over the new files (a checksum error)."""
    from asyncckpt.storage.s3client import S3ReadFile
    real = S3ReadFile.__init__
    with asyncckpt.connect(s3_writer.address, rank=0, world_size=1) as c:
        c.save(1, state(1)).wait(timeout=120)
        overtaken: list[str] = []

        def opening(self, s3, location, *args, **kwargs) -> None:
            if not overtaken and ".safetensors" in location.name:
                overtaken.append(str(location))
                c.save(1, state(2), replace=True).wait(timeout=120)
            real(self, s3, location, *args, **kwargs)
        monkeypatch.setattr(S3ReadFile, "__init__", opening)
        got = asyncckpt.load(s3_root, step=1)
    assert overtaken and same(got, state(2))


def test_start_writer_fails_at_once_naming_a_missing_bucket_or_refused_credentials(
        s3_server, monkeypatch, tmp_path):
    use_s3(s3_server, monkeypatch, "x")
    started = time.monotonic()
    with pytest.raises(asyncckpt.WriterUnavailableError, match="bucket does not exist"):
        asyncckpt.start_writer("s3://no-such-bucket/run", log_file=tmp_path / "a.log")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(asyncckpt.WriterUnavailableError, match="refused the credentials"):
        asyncckpt.start_writer("s3://ckpt/run", log_file=tmp_path / "b.log")
    assert time.monotonic() - started < 30


def test_start_writer_fails_at_once_when_the_endpoint_is_unreachable(monkeypatch, tmp_path):
    from benchmarks.s3server import free_port
    endpoint = f"http://127.0.0.1:{free_port()}"
    for key, value in {"AWS_ENDPOINT_URL": endpoint, "AWS_ALLOW_HTTP": "true",
                       "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s",
                       "ASYNCCKPT_MAX_ATTEMPTS": "2"}.items():
        monkeypatch.setenv(key, value)
    started = time.monotonic()
    with pytest.raises(asyncckpt.WriterUnavailableError, match=f"cannot reach {endpoint}"):
        asyncckpt.start_writer("s3://ckpt/run", log_file=tmp_path / "w.log")
    assert time.monotonic() - started < 30


def test_unsupported_schemes_are_refused_everywhere_and_write_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for url in ("gs://b/run", "az://c/run", "file:///tmp/run"):
        for use in (asyncckpt.start_writer, asyncckpt.load, asyncckpt.verify):
            with pytest.raises(asyncckpt.CheckpointError, match="roots are not supported"):
                use(url)
        done = cli("verify", url)
        assert done.returncode == 2 and "roots are not supported" in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_dcp_saves_to_and_loads_from_the_bucket_by_a_torchtitan_checkpoint_id(s3_root, s3_writer):
    import torch.distributed.checkpoint as dcp

    from asyncckpt.dcp import StorageReader, StorageWriter
    model = {"w": torch.randn(256, 64), "b": torch.arange(7), "lr": 0.5}
    with asyncckpt.connect(s3_writer.address, rank=0, world_size=1) as c:
        dcp.save(model, checkpoint_id=f"{s3_root}/step-12", storage_writer=StorageWriter(client=c))
    assert storage_for(s3_root).committed_steps() == [12]
    into = {"w": torch.zeros(256, 64), "b": torch.zeros(7, dtype=torch.int64), "lr": 0.0}
    dcp.load(into, checkpoint_id=f"{s3_root}/step-12", storage_reader=StorageReader())
    assert torch.equal(into["w"], model["w"]) and torch.equal(into["b"], model["b"])
    assert into["lr"] == 0.5


def test_copy_and_export_read_a_bucket_step_into_local_directories(s3_root, s3_writer, tmp_path):
    base = state(1)
    with asyncckpt.connect(s3_writer.address, rank=0, world_size=1) as c:
        c.save(1, base).wait(timeout=120)
        c.save(2, dict(base, step=2)).wait(timeout=120)  # references step 1's frames
    copied = asyncckpt.copy_step(s3_root, tmp_path / "copy", step=2)
    assert same(asyncckpt.load(copied), dict(base, step=2))
    assert cli("verify", str(copied)).returncode == 0
    asyncckpt.export_hf(s3_root, tmp_path / "hf", step=2, contents=None)
    from safetensors.torch import load_file
    tensors = {}
    for shard in (tmp_path / "hf").glob("*.safetensors"):
        tensors.update(load_file(shard))
    assert len(tensors) == 2 and any(torch.equal(t, base["w"]) for t in tensors.values()), \
        sorted(tensors)


def test_a_second_job_is_refused_while_a_writer_holds_the_bucket_root(s3_root, s3_writer,
                                                                       tmp_path):
    with pytest.raises(asyncckpt.WriterLockedError, match="another writer holds"):
        asyncckpt.start_writer(s3_root, log_file=tmp_path / "second.log", job="another-job")
    done = cli("gc", s3_root, "--keep-last", "1")
    assert done.returncode == 3 and "another writer holds" in done.stderr, done.stderr


def test_gc_prunes_a_bucket_root_once_no_writer_holds_it(s3_root, tmp_path):
    w = asyncckpt.start_writer(s3_root, codec="raw", log_file=tmp_path / "w.log")
    try:
        with asyncckpt.connect(w.address, rank=0, world_size=1) as c:
            for step in (1, 2, 3):
                c.save(step, state(step, 1)).wait(timeout=120)
    finally:
        w.stop(timeout=60)
    done = cli("gc", s3_root, "--keep-last", "1", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["deleted_steps"] == [1, 2]
    assert storage_for(s3_root).committed_steps() == [3]
    assert {k.split("/")[0] for k in object_keys(s3_root)} == {
        "step-00000003", "latest", ".asyncckpt.root"}
    assert same(asyncckpt.load(s3_root), state(3, 1))


def test_a_second_attempt_at_a_committed_step_fails_and_the_step_stays_whole(
        s3_root, tmp_path, monkeypatch):
    # two writers of one job save step 5 (a restarted attempt while the old writer still
    # finishes): B's data is durable first, but B is held at its data's last point until
    # A has committed; B's commit is then refused, and its cleanup must not touch A's step
    monkeypatch.setenv("ASYNCCKPT_SLOW_AT", "data_fsynced:6")
    b = asyncckpt.start_writer(s3_root, codec="raw", log_file=tmp_path / "b.log", job="j")
    monkeypatch.delenv("ASYNCCKPT_SLOW_AT")
    a = asyncckpt.start_writer(s3_root, codec="zstd", log_file=tmp_path / "a.log", job="j")
    try:
        with asyncckpt.connect(b.address, rank=0, world_size=1) as cb, \
                asyncckpt.connect(a.address, rank=0, world_size=1) as ca:
            late = cb.save(5, state(50, 2))
            ca.save(5, state(5, 2)).wait(timeout=120)  # B still sleeps past its data
            with pytest.raises(StepAlreadyCommittedError, match="already (committed|has a)"):
                late.wait(timeout=120)
    finally:
        a.stop(timeout=60)
        b.stop(timeout=60)
    assert storage_for(s3_root).committed_steps() == [5]
    assert storage_for(s3_root).read_latest() == 5
    assert same(asyncckpt.load(s3_root, step=5), state(5, 2))
    assert cli("verify", s3_root).returncode == 0


def test_a_writer_stopped_past_its_lease_wakes_to_refused_saves_and_deletes_nothing(
        s3_root, tmp_path, monkeypatch):
    import os
    import signal
    monkeypatch.setenv("ASYNCCKPT_LEASE_RENEW", "0.5")
    a = asyncckpt.start_writer(s3_root, codec="raw", log_file=tmp_path / "a.log", job="a",
                               keep_last=1)
    b = None
    try:
        with asyncckpt.connect(a.address, rank=0, world_size=1) as ca:
            ca.save(1, state(1, 1)).wait(timeout=120)
            os.kill(a.pid, signal.SIGSTOP)  # a long GC pause, a partition: no renewal
            try:
                time.sleep(3.2)  # three periods and a second, by the store's clock
                b = asyncckpt.start_writer(s3_root, codec="raw", log_file=tmp_path / "b.log",
                                           job="b")
                with asyncckpt.connect(b.address, rank=0, world_size=1) as cb:
                    for step in (2, 3):
                        cb.save(step, state(step, 1)).wait(timeout=120)
                before = object_keys(s3_root)
            finally:
                os.kill(a.pid, signal.SIGCONT)
            with pytest.raises(asyncckpt.SaveFailedError, match="lost its lease") as lost:
                ca.save(4, state(4, 1)).wait(timeout=120)  # would prune 1..3 (keep_last=1)
            assert "job b on" in str(lost.value) and "step 4" in str(lost.value)
        assert object_keys(s3_root) == before
    finally:
        a.stop(timeout=60)
        if b is not None:
            b.stop(timeout=60)
    assert storage_for(s3_root).committed_steps() == [1, 2, 3]
    for step in (1, 2, 3):
        assert same(asyncckpt.load(s3_root, step=step), state(step, 1))
