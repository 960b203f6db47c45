"""PyTorch's and torchtitan's own checkpoint tests, run with DCP's storage and with
asyncckpt's, side by side (`make test-dcp-upstream`).

    python tests/upstream/run.py fetch [--from DIR]     # the upstream files, once
    python tests/upstream/run.py [--only NAME ...] [--timeout S]

`fetch` puts each upstream file at its pinned commit under build/upstream/src/ (from
GitHub, or from DIR/<owner>/<repo>/<path>, a copy made elsewhere); the files are not kept
in this repository. A run writes each file with its swap lines replaced (SOURCES below,
each new line marked `# asyncckpt: swap`; every line equal to the original is replaced,
and one must be there, else the run stops) to build/upstream/run/, runs it twice through
drive.py (ASYNCCKPT_UPSTREAM_STORAGE=dcp, then asyncckpt), and prints the pass table:
every test, its outcome with DCP's own storage and with asyncckpt's, and the tests that
no storage swap can pass (UNFAIR, with the reason). The table and each run's log go to
build/upstream/. Exit status 1 when a fair test that passes with DCP's own storage does
not pass with asyncckpt's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BUILD = REPO / "build" / "upstream"
MARK = "  # asyncckpt: swap"
MODES = ("dcp", "asyncckpt")
TIMEOUT = 900  # s: one file in one mode (2 cores: torch's multi-process tests are slow)
KILL_GRACE = 5.0  # s: after SIGTERM to a timed-out run's process group, before SIGKILL
PYTORCH = ("pytorch/pytorch", "Meta/PyTorch BSD-3-Clause")
TITAN = ("pytorch/torchtitan", "Meta BSD-3-Clause")


@dataclasses.dataclass(frozen=True)
class Source:
    """One upstream test file: where it comes from, its swap lines, the venv it needs."""

    repo: str
    commit: str
    path: str
    swaps: tuple[tuple[str, str], ...]
    venv: str = ".venv"
    timeout: float = TIMEOUT  # s: this file in one mode

    @property
    def name(self) -> str:
        return Path(self.path).stem


_LAST_IMPORT = "from torch.testing._internal.distributed.checkpoint_utils import with_temp_dir"
SOURCES = (
    Source("pytorch/pytorch", "5c79971bb2991e7f8dd4f18a699515aec1e063b5",
           "test/distributed/checkpoint/test_file_system_checkpoint_cpu.py", (
               ("from torch.distributed.checkpoint import (", "from swap import ("),
               ("        model_to_save = MyShardedModel3(src_spec).cuda(dist.get_rank())",
                "        model_to_save = MyShardedModel3(src_spec)"),
               ("        model_to_load = MyShardedModel3(dst_spec).cuda(dist.get_rank())",
                "        model_to_load = MyShardedModel3(dst_spec)"),
           )),
    Source("pytorch/pytorch", "6112c47f81ef6e4d24047b79181a5001e9f2055a",
           "test/distributed/checkpoint/test_dtensor_checkpoint.py", (
               (_LAST_IMPORT, "from swap import dist_cp, skip_if_lt_x_gpu, with_temp_dir"),
               ("        ).cuda()", "        ).to(self.device_type)"),
           )),
    Source("pytorch/pytorch", "877d342562d56c9478800c0ee22b7d006d4d25f8",
           "test/distributed/checkpoint/test_dtensor_resharding.py", (
               (_LAST_IMPORT, "from swap import dist_cp, skip_if_lt_x_gpu, with_temp_dir"),
           )),
    Source("pytorch/pytorch", "32af652941178e4d10c5b7b29cc3f02e5f5465bc",
           "test/distributed/checkpoint/test_format_utils.py", (
               (_LAST_IMPORT,
                "from swap import dcp, dcp_to_torch_save, skip_if_lt_x_gpu, with_temp_dir"),
               ("        model = SimpleModelUneven().cuda()",
                "        model = SimpleModelUneven()"),
           )),
    Source("pytorch/pytorch", "2a07214a24384fad76d6ca2f4c025e7961fa9a26",
           "test/distributed/checkpoint/test_save_load_api.py", (
               (_LAST_IMPORT, "from swap import dcp, skip_if_lt_x_gpu, with_temp_dir"),
               ("        model = FSDP(MyTestModule().cuda())",
                "        model = FSDP(MyTestModule())"),
           )),
    Source("pytorch/pytorch", "9c491bc34c6ab131b18cf51db02636d65ffd3472",
           "test/distributed/checkpoint/e2e/test_e2e_save_and_load.py", (
               (_LAST_IMPORT, "from swap import dcp as DCP, skip_if_lt_x_gpu, with_temp_dir"),
               ('        return torch.rand(8, 8, device="cuda")',
                '        return torch.rand(8, 8, device="cpu")'),
               ('        self.data = torch.rand(10, 10, device="cuda")',
                '        self.data = torch.rand(10, 10, device="cpu")'),
               ('        return "cpu:gloo,cuda:nccl"', '        return "gloo"'),
               ("        dummy_model = TestDummyModel().cuda()",
                "        dummy_model = TestDummyModel()"),
               ('                    torch.ones(2, dtype=torch.int64, device="cuda")',
                '                    torch.ones(2, dtype=torch.int64, device="cpu")'),
               ('                    torch.arange(2, dtype=torch.int64, device="cuda")',
                '                    torch.arange(2, dtype=torch.int64, device="cpu")'),
           ), timeout=3 * TIMEOUT),  # 17 tests of 4 processes, torch.compile among them
    Source("pytorch/torchtitan", "1fdf90d3f9b756ef709ce262bc839f1dab679b5e",
           "tests/unit_tests/test_checkpoint.py", (
               ("from torchtitan.components.checkpointer.dcp import AsyncMode, CheckpointManager",
                "from swap import AsyncMode, CheckpointManager"),
           ), venv=".venv-titan"),
)

# Tests no storage swap can pass, by "file::Class::test" (the reason is printed beside them)
UNFAIR = {
    "test_save_load_api::TestSaveAndLoadAPI::test_auto_detect":
        "asserts DCP's own choice of storage for a bare checkpoint_id (it patches "
        "FileSystemReader/Writer.validate_checkpoint_id and expects 'Cannot detect' for "
        "abc://): which storage DCP picks, not what a storage does",
    "test_format_utils::TestFormatUtils::test_torch_save_to_dcp":
        "torch_save_to_dcp writes with DCP's FileSystemWriter (hard-coded, not a swap "
        "line), then dcp.load reads that folder: a DCP-format folder, not the swapped "
        "storage's",
    "test_checkpoint::TestCheckpointManager::test_checkpointer_package_import_path":
        "asserts torchtitan's package exports its own CheckpointManager class (identity)",
    "test_checkpoint::TestCheckpointManager::test_legacy_import_path":
        "asserts torchtitan's legacy import path is its own CheckpointManager (identity)",
}


def src_path(source: Source) -> Path:
    return BUILD / "src" / source.repo / source.path


def fetch(given: Path | None) -> None:
    for source in SOURCES:
        dest = src_path(source)
        if dest.exists():
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        if given is not None:
            shutil.copyfile(given / source.repo / source.path, dest)
        else:
            url = f"https://raw.githubusercontent.com/{source.repo}/{source.commit}/{source.path}"
            with urllib.request.urlopen(url, timeout=60) as r:
                dest.write_bytes(r.read())
        print(f"fetched {source.repo}@{source.commit[:12]}:{source.path}")


def swapped(source: Source) -> Path:
    """The file with its swap lines replaced, in a folder of its own."""
    text = src_path(source).read_text()
    lines = text.split("\n")
    for old, new in source.swaps:  # every line equal to `old` (a device line may repeat)
        hits = [i for i, line in enumerate(lines) if line == old]
        if not hits:
            raise SystemExit(f"{source.path}@{source.commit[:12]}: swap line {old!r} not "
                             "found: not the pinned file?")
        for i in hits:
            lines[i] = new + MARK
    out = BUILD / "run" / source.name
    out.mkdir(parents=True, exist_ok=True)
    (out / Path(source.path).name).write_text("\n".join(lines))
    return out


def run_mode(source: Source, folder: Path, mode: str, timeout: float) -> list[dict]:
    """drive.py on the swapped file in one mode: its records, plus a "timeout" record for
    the test that was running when the file's time ran out."""
    records = BUILD / "logs" / f"{source.name}.{mode}.jsonl"
    log = records.with_suffix(".log")
    records.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "ASYNCCKPT_UPSTREAM_STORAGE": mode, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(folder), str(HERE), str(BUILD / "pydeps")])}
    env.pop("ASYNCCKPT_ADDRESS", None)  # each test's writer is its own (started per root)
    python = REPO / source.venv / "bin" / "python"
    with open(log, "w") as out:
        proc = subprocess.Popen([str(python), str(HERE / "drive.py"), source.name, str(records)],
                                cwd=folder, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(KILL_GRACE)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    found = collect(records)
    if timed_out:
        with open(records, "a") as out:
            for rec in found:
                if rec["outcome"] == "crash":
                    rec["outcome"] = "timeout"
                    out.write(json.dumps(rec) + "\n")
    return found


def collect(records: Path) -> list[dict]:
    """The outcome of each test in a run's records: its last; "crash" for a test that
    started and never ended (run_mode writes "timeout" for the one its timeout cut)."""
    result: dict[str, dict] = {}
    if records.exists():
        for line in records.read_text().splitlines():
            rec = json.loads(line)
            result[rec["id"]] = rec
    for rec in result.values():
        if rec["outcome"] == "started":
            rec["outcome"] = "crash"
            rec["detail"] = f"no outcome (see {records.with_suffix('.log').relative_to(REPO)})"
    return list(result.values())


def short(test_id: str) -> str:
    module, cls, name = test_id.rsplit(".", 2)
    return f"{module.rsplit('.', 1)[-1]}::{cls}::{name}"


def table(results: dict[str, dict[str, dict[str, dict]]]) -> tuple[str, bool]:
    """The markdown pass table, and whether every fair test that passes with DCP's own
    storage passes with asyncckpt's."""
    rows = ["| test | DCP own | asyncckpt | note |", "|---|---|---|---|"]
    summary = ["| file | tests | DCP own pass | asyncckpt pass (of those, fair) | unfair |",
               "|---|---|---|---|---|"]
    ok = True
    for name, modes in results.items():
        ids = sorted({i for recs in modes.values() for i in recs})
        own = fair_own = fair_ours = unfair = 0
        for test_id in ids:
            key = short(test_id) if test_id.count(".") >= 2 else test_id
            a, b = (modes.get(m, {}).get(test_id, {}).get("outcome", "-") for m in MODES)
            note = UNFAIR.get(key, "")
            own += a == "pass"
            if note:
                unfair += 1
                note = "unfair: " + note
            elif a == "pass":
                fair_own += 1
                fair_ours += b == "pass"
                if b != "pass":
                    ok = False
            rows.append(f"| {key} | {a} | {b} | {note} |")
        summary.append(f"| {name} | {len(ids)} | {own} | {fair_ours} of {fair_own} | {unfair} |")
    return "\n".join(summary + [""] + rows) + "\n", ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", nargs="?", default="run", choices=("run", "fetch", "table"))
    parser.add_argument("--from", dest="given", type=Path, default=None)
    parser.add_argument("--only", nargs="*", default=None, help="file stems to run")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds per file and mode (default: the file's own)")
    args = parser.parse_args()
    if args.command == "fetch":
        fetch(args.given)
        return 0
    begin = time.monotonic()
    for source in SOURCES:
        if args.command == "table" or (args.only and source.name not in args.only):
            continue
        if not (REPO / source.venv / "bin" / "python").exists():
            print(f"{source.name}: no {source.venv} (make titan-setup): not run")
            continue
        if not src_path(source).exists():
            raise SystemExit(f"{src_path(source)} missing: run `{sys.argv[0]} fetch` first")
        folder = swapped(source)
        for mode in args.modes.split(","):
            t0 = time.monotonic()
            recs = run_mode(source, folder, mode, args.timeout or source.timeout)
            passed = sum(r["outcome"] == "pass" for r in recs)
            print(f"{source.name} [{mode}]: {passed}/{len(recs)} pass, "
                  f"{time.monotonic() - t0:.0f} s", flush=True)
    # the table: every file's latest run in each mode (a run of some files, --only, keeps
    # the others' outcomes)
    results = {s.name: {m: {r["id"]: r for r in collect(BUILD / "logs" / f"{s.name}.{m}.jsonl")}
                        for m in MODES} for s in SOURCES}
    text, ok = table({name: modes for name, modes in results.items()
                      if any(modes.values())})
    (BUILD / "results.md").write_text(text)
    print(text)
    print(f"wall time {time.monotonic() - begin:.0f} s; table in {BUILD / 'results.md'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
