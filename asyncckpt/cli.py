"""The `asyncckpt` command: writer, verify, ls, inspect, gc, export, copy.

Exit codes are part of the interface: verify exits 0 when everything checked is good,
1 when anything is corrupt, 2 for usage errors or a path that is not a checkpoint;
`writer` exits 0 after a clean shutdown and 3 when another writer holds the root.
`--json` prints one machine-readable document on stdout; progress goes to stderr, and
only on a terminal.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from asyncckpt.cli_parser import parser
from asyncckpt.config import WriterKnobs, parse_knob
from asyncckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    WriterLockedError,
    WriterUnavailableError,
)
from asyncckpt.format.layout import step_dir_name
from asyncckpt.rank.launch import default_job
from asyncckpt.storage.registry import open_storage
from asyncckpt.storage.registry import parse as root_path
from asyncckpt.storage.timeline import read_current
from asyncckpt.writer import commit, retention


def main(argv: list[str] | None = None) -> int:
    """Run the command `argv` (default: the process's arguments); returns its exit status."""
    args = parser().parse_args(argv)
    commands = {"writer": _writer, "verify": _verify, "ls": _ls, "inspect": _inspect, "gc": _gc,
                "export": _export, "copy": _copy, "import-dcp": _import_dcp, "flush": _flush}
    return commands[args.command](args)


def _writer(args: argparse.Namespace) -> int:
    from asyncckpt.writer.server import WriterServer
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s asyncckpt-writer[%(process)d] %(levelname)s "
                               "%(message)s")
    for noisy in ("botocore", "boto3", "urllib3"):  # an s3:// root: its client logs each request
        logging.getLogger(noisy).setLevel(logging.WARNING)
    overrides = dict(kv.split("=", 1) for kv in args.knob)
    try:
        knobs = WriterKnobs.from_env(**{k: parse_knob(WriterKnobs, k, v)
                                        for k, v in overrides.items()}, codec=args.codec)
        server = WriterServer(args.root, knobs, args.address, job=args.job or default_job())
    except WriterLockedError as e:
        print(f"asyncckpt writer: {e}", file=sys.stderr)
        return 3
    except (ValueError, CheckpointError) as e:  # a bad knob, an unusable root or lock file
        print(f"asyncckpt writer: {e}", file=sys.stderr)
        if args.ready_line:
            print(f"ASYNCCKPT_FAILED {' '.join(str(e).split())}", flush=True)
        return 2

    def shutdown(*_: object) -> None:
        threading.Thread(target=server.stop, name="asyncckpt-stop").start()

    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    if args.parent_pid:
        threading.Thread(target=_watch_parent, args=(args.parent_pid, shutdown),
                         daemon=True).start()
    if args.ready_line:
        print(f"ASYNCCKPT_READY {server.address}", flush=True)
    else:
        print(f"asyncckpt writer listening; export ASYNCCKPT_ADDRESS={server.address}",
              file=sys.stderr, flush=True)
    server.serve_forever()
    server.stop()
    return 0


PARENT_POLL_S = 0.5  # how often a writer started by a parent looks whether it still lives


def _watch_parent(pid: int, shutdown) -> None:
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != pid:
            logging.getLogger("asyncckpt.writer").info("parent %d exited; shutting down", pid)
            shutdown()
            return


def _flush(args: argparse.Namespace) -> int:
    from asyncckpt.ipc.protocol import writer_address
    from asyncckpt.read.memory import flush
    try:
        step = flush(writer_address(args.address))
    except WriterUnavailableError as e:
        print(f"asyncckpt flush: {e}", file=sys.stderr)
        return 2
    except CheckpointError as e:
        print(f"asyncckpt flush: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"step": step}))
    else:
        print(f"flushed memory generation {step}" if step is not None else
              "nothing to flush: no memory generation newer than the root's newest step")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from asyncckpt.read.verification import verify_iter
    bar = _ProgressBar() if sys.stderr.isatty() and not args.json else None
    reports = []
    try:
        for report in verify_iter(args.path, progress=bar.update if bar else None):
            if bar:
                bar.finish()
            reports.append(report)
            if not args.json:
                status = "OK" if report.ok else "CORRUPT"
                detail = (f"{report.frames} frames, {report.stored_bytes / 2**20:.1f} MiB, "
                          f"{report.seconds:.2f} s") if report.ok else "; ".join(report.problems)
                print(f"{status:7} {report.path}  {detail}")
    except (CheckpointNotFoundError, OSError) as e:  # OSError: an object store unreachable
        print(f"asyncckpt verify: {e}", file=sys.stderr)
        return 2
    ok = all(r.ok for r in reports)
    if args.json:
        json.dump({"ok": ok, "checkpoints": [r.to_json() for r in reports]}, sys.stdout, indent=1)
        print()
    return 0 if ok else 1


def _ls(args: argparse.Namespace) -> int:
    from asyncckpt.read.checkpoint import Checkpoint
    root = root_path(args.root)
    now = time.time()
    try:
        storage = open_storage(root)
        if not storage.is_dir(root):
            print(f"asyncckpt ls: {root} is not a directory", file=sys.stderr)
            return 2
        latest = storage.read_latest()
        steps = storage.step_dirs()
        under_way = storage.in_progress()
        current = read_current(storage)
    except CheckpointError as e:  # the root's timeline file is damaged
        print(f"asyncckpt ls: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"asyncckpt ls: {e}", file=sys.stderr)
        return 2
    rows: list[dict[str, Any]] = []
    for step in steps:  # a step-N failing its checks is listed as damaged
        directory = root / step_dir_name(step)
        try:
            with Checkpoint.open(directory) as ckpt:
                m = ckpt.manifest
            live = current.keeps(m.timeline.id, step)  # else abandoned (format/timeline.py)
            rows.append({"step": step, "state": "committed" if live else "abandoned",
                         "path": str(directory),
                         "world_size": m.world_size, "raw_bytes": m.raw_size,
                         "stored_bytes": m.stored_size, "ratio": m.stored_size / max(m.raw_size, 1),
                         "age_seconds": now - m.created, "latest": step == latest,
                         "timeline": m.timeline.id})
        except CheckpointError as e:
            rows.append({"step": step, "state": "damaged", "path": str(directory),
                         "error": str(e), "latest": step == latest})
    for save in under_way:
        rows.append({"step": save.step, "state": "in-progress", "path": str(save.path),
                     "stored_bytes": save.stored_bytes, "age_seconds": now - save.modified,
                     "latest": False})
    if args.memory is not None:
        from asyncckpt.ipc.protocol import writer_address
        from asyncckpt.read.memory import ls_rows
        try:
            rows += ls_rows(writer_address(args.memory or None))
        except (CheckpointError, OSError, EOFError, ValueError) as e:  # ValueError: protocol
            print(f"asyncckpt ls: the writer's memory generations: {e}", file=sys.stderr)
            return 2
    if args.json:  # the root's current timeline at top level, then the steps
        json.dump({"timeline": current.to_json(), "steps": rows}, sys.stdout, indent=1)
        print()
        return 0
    if not current.is_root:
        print(f"current {current.describe()}; steps of other timelines are abandoned")
    print(f"{'STEP':>10}  {'STATE':11} {'SIZE':>10} {'RATIO':>6} {'AGE':>8}  PATH")
    for r in rows:
        size = f"{r['stored_bytes'] / 2**20:.1f}M" if "stored_bytes" in r else "-"
        ratio = f"{r['ratio']:.3f}" if "ratio" in r else "-"
        age = _age(r["age_seconds"]) if "age_seconds" in r else "-"
        mark = " <- latest" if r["latest"] else ""
        if r["state"] == "abandoned":
            mark += f" (timeline {r['timeline'] or 'root'})"
        print(f"{r['step']:>10}  {r['state']:11} {size:>10} {ratio:>6} {age:>8}  {r['path']}{mark}")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from asyncckpt.read.checkpoint import Checkpoint
    from asyncckpt.read.summary import inspect_summary, summary_text
    try:
        with Checkpoint.open(args.path) as ckpt:
            summary = inspect_summary(ckpt)
    except CheckpointError as e:
        print(f"asyncckpt inspect: {e}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(summary, sys.stdout, indent=1)
        print()
        return 0
    print(summary_text(summary))
    return 0


def _gc(args: argparse.Namespace) -> int:
    root = root_path(args.root)
    try:
        storage = open_storage(root)
        if args.keep_last < 1 or not storage.is_dir(root):
            print("asyncckpt gc: need an existing root and --keep-last >= 1", file=sys.stderr)
            return 2
        lock = storage.take(None, exclusive=True)
    except WriterLockedError as e:
        print(f"asyncckpt gc: {e}; a running writer applies retention itself "
              "(writer knob keep_last, or Checkpointer options)", file=sys.stderr)
        return 3
    except OSError as e:  # an object store that cannot be reached
        print(f"asyncckpt gc: {e}", file=sys.stderr)
        return 2
    try:
        removed_tmp = storage.sweep(alone=True)
        pruned = retention.prune(storage, args.keep_last, args.keep_every)
        commit.update_latest(storage)
    finally:
        lock.release()
    result = {"deleted_steps": pruned.deleted, "retired_steps": pruned.retired,
              "reclaimed_steps": pruned.reclaimed, "removed_tmp": removed_tmp,
              "kept_steps": storage.committed_steps(),
              "still_referenced": storage.retired_steps()}
    if args.json:
        json.dump(result, sys.stdout, indent=1)
        print()
    else:
        print(f"deleted steps {pruned.deleted or 'none'}; retired (data still referenced) "
              f"{pruned.retired or 'none'}; reclaimed retired {pruned.reclaimed or 'none'}; "
              f"removed {len(removed_tmp)} abandoned tmp "
              f"director{'y' if len(removed_tmp) == 1 else 'ies'}; kept {result['kept_steps']}")
    return 0


def _export(args: argparse.Namespace) -> int:
    import torch

    from asyncckpt.config import parse_size
    from asyncckpt.errors import CheckpointError, CorruptCheckpointError
    from asyncckpt.read.export import export_hf
    bar = _ProgressBar() if sys.stderr.isatty() and not args.json else None
    try:
        index = export_hf(args.path, args.out, rank=args.rank, contents=args.contents or None,
                          dtype=getattr(torch, args.dtype) if args.dtype else None,
                          max_shard_size=parse_size(args.max_shard_size),
                          progress=(lambda done, total: bar.update("export", done, total))
                          if bar else None, tokenizer=args.tokenizer, jobs=args.jobs,
                          part=args.part)
    except (CheckpointError, ValueError) as e:
        print(f"asyncckpt export: {e}", file=sys.stderr)
        return 1 if isinstance(e, CorruptCheckpointError) else 2
    finally:
        if bar:
            bar.finish()
    shards = sorted(set(index["weight_map"].values()))
    if args.json:
        json.dump({"out": args.out, "shards": shards, "written": index["shards"],
                   "complete": index["complete"], **index["metadata"],
                   "tensors": len(index["weight_map"]), "files": index["files"]}, sys.stdout,
                  indent=1)
        print()
    elif index["complete"]:
        print(f"wrote {len(index['weight_map'])} tensors, "
              f"{index['metadata']['total_size'] / 2**20:.1f} MiB, in {len(shards)} shard(s) "
              f"to {args.out}"
              + (f", with {', '.join(index['files'])}" if index["files"] else ""))
    else:
        print(f"wrote {len(index['shards'])} of {len(shards)} shards to {args.out}; the part "
              "that writes the last one writes the index")
    return 0


def _copy(args: argparse.Namespace) -> int:
    from asyncckpt.errors import CorruptCheckpointError
    from asyncckpt.read.copying import copy_step
    try:
        out = copy_step(args.path, args.out, args.step)
    except FileExistsError as e:
        print(f"asyncckpt copy: {e}", file=sys.stderr)
        return 2
    except CheckpointError as e:
        print(f"asyncckpt copy: {e}", file=sys.stderr)
        return 1 if isinstance(e, CorruptCheckpointError) else 2
    from asyncckpt.storage.local import read_manifest
    m = read_manifest(out)
    if args.json:
        json.dump({"out": str(out), "step": m.step, "bytes": m.stored_size}, sys.stdout, indent=1)
        print()
    else:
        print(f"wrote step {m.step} to {out}: {m.stored_size / 2**20:.1f} MiB, self-contained")
    return 0


def _import_dcp(args: argparse.Namespace) -> int:
    from asyncckpt.config import parse_size
    from asyncckpt.errors import (
        CheckpointNotFoundError,
        CorruptCheckpointError,
        UntrustedPickleError,
    )
    from asyncckpt.integrations.dcp_import import import_dcp
    from asyncckpt.storage.registry import storage_at
    try:
        out = import_dcp(args.source, args.root, args.step, part_bytes=parse_size(args.part_size))
    except (CheckpointError, ValueError) as e:
        print(f"asyncckpt import-dcp: {e}", file=sys.stderr)
        source_error = (CheckpointNotFoundError, CorruptCheckpointError, UntrustedPickleError)
        return 1 if isinstance(e, source_error) else 2
    m = storage_at(out).read_manifest(out)
    if args.json:
        json.dump({"out": str(out), "step": m.step, "bytes": m.stored_size,
                   "raw_bytes": m.raw_size}, sys.stdout, indent=1)
        print()
    else:
        print(f"imported {args.source} as step {m.step}: {out} ({m.raw_size / 2**20:.1f} MiB, "
              f"{m.stored_size / 2**20:.1f} MiB stored)")
    return 0


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


class _ProgressBar:
    """One line on stderr: `update(name, done, total)` redraws it, both in the same unit."""

    def __init__(self) -> None:
        self.drawn = False

    def update(self, name: str, done: int, total: int) -> None:
        frac = min(1.0, done / max(total, 1))
        sys.stderr.write(f"\r{Path(name).name} [{'#' * int(frac * 30):30}] {frac:5.1%}")
        sys.stderr.flush()
        self.drawn = True

    def finish(self) -> None:
        if self.drawn:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
        self.drawn = False


if __name__ == "__main__":
    sys.exit(main())
