"""bench-frameworks' fsync of a method's files: a file another rank renames meanwhile."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import frameworks_loop, measure  # noqa: E402


def test_fsync_tree_passes_over_a_file_renamed_meanwhile(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Accelerate's ranks save into one `checkpoint_N`: while one rank's bench fsyncs
    it, the other's save renames its tmp file. The listing then names a file that is
    gone; the bench must go on (it failed the whole case with FileNotFoundError)."""
    (tmp_path / "kept.bin").write_bytes(b"x")
    real = measure.files_under

    def listing_then_rename(path: Path) -> list[Path]:
        files = real(path)
        (tmp_path / ".tmp-part").write_bytes(b"y")
        files.append(tmp_path / ".tmp-part")
        (tmp_path / ".tmp-part").rename(tmp_path / "part.bin")  # the other rank's rename
        return files

    monkeypatch.setattr(measure, "files_under", listing_then_rename)
    frameworks_loop.fsync_tree(tmp_path)
    assert (tmp_path / "part.bin").read_bytes() == b"y"
