"""The `asyncckpt` command: writer, verify, ls.

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

from . import commit
from ._version import __version__
from .config import Knobs, parse_knob
from .errors import CheckpointNotFoundError, WriterLockedError
from .format import is_tmp_dir, step_dir_name, tmp_step_of
from .manifest import read_manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asyncckpt", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"asyncckpt {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    w = sub.add_parser("writer", help="run a writer in the foreground")
    w.add_argument("--root", required=True, help="checkpoint root directory")
    w.add_argument("--codec", choices=["zstd", "raw"], default=None)
    w.add_argument("--address", default=None, help="socket path (default: a private runtime dir)")
    w.add_argument("--knob", action="append", default=[], metavar="NAME=VALUE",
                   help="override a knob, e.g. zstd_level=3 (repeatable)")
    w.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    w.add_argument("--ready-line", action="store_true", help=argparse.SUPPRESS)
    w.add_argument("--log-level", default="INFO")

    v = sub.add_parser("verify", help="verify a checkpoint, or every checkpoint under a root")
    v.add_argument("path")
    v.add_argument("--json", action="store_true")

    ls = sub.add_parser("ls", help="list committed and in-progress checkpoints under a root")
    ls.add_argument("root")
    ls.add_argument("--json", action="store_true")

    args = parser.parse_args(argv)
    if args.command == "writer":
        return _writer(args)
    if args.command == "verify":
        return _verify(args)
    return _ls(args)


def _writer(args: argparse.Namespace) -> int:
    from .writer import WriterServer
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s asyncckpt-writer[%(process)d] %(levelname)s %(message)s")
    overrides = dict(kv.split("=", 1) for kv in args.knob)
    try:
        knobs = Knobs.from_env(**{k: parse_knob(k, v) for k, v in overrides.items()},
                               codec=args.codec)
        server = WriterServer(args.root, knobs, args.address)
    except WriterLockedError as e:
        print(f"asyncckpt writer: {e}", file=sys.stderr)
        return 3
    except ValueError as e:
        print(f"asyncckpt writer: {e}", file=sys.stderr)
        return 2

    def shutdown(*_: object) -> None:
        threading.Thread(target=server.stop, name="asyncckpt-stop").start()

    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    if args.parent_pid:
        threading.Thread(target=_watch_parent, args=(args.parent_pid, shutdown), daemon=True).start()
    if args.ready_line:
        print(f"ASYNCCKPT_READY {server.address}", flush=True)
    else:
        print(f"asyncckpt writer listening; export ASYNCCKPT_ADDRESS={server.address}",
              file=sys.stderr, flush=True)
    server.serve_forever()
    server.stop()
    return 0


def _watch_parent(pid: int, shutdown) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != pid:
            logging.getLogger("asyncckpt.writer").info("parent %d exited; shutting down", pid)
            shutdown()
            return


def _verify(args: argparse.Namespace) -> int:
    from .verify import checkpoints_under, verify_checkpoint, verify_root_pointer
    try:
        directories, root = checkpoints_under(args.path)
    except CheckpointNotFoundError as e:
        print(f"asyncckpt verify: {e}", file=sys.stderr)
        return 2
    bar = _ProgressBar() if sys.stderr.isatty() and not args.json else None
    reports = []
    for directory in directories:
        if bar:
            bar.start(directory.name, _stored_size(directory))
        report = verify_checkpoint(directory, bar.advance if bar else None)
        if bar:
            bar.finish()
        reports.append(report)
        if not args.json:
            status = "OK" if report.ok else "CORRUPT"
            detail = (f"{report.frames} frames, {report.stored_bytes / 2**20:.1f} MiB, "
                      f"{report.seconds:.2f} s") if report.ok else "; ".join(report.problems)
            print(f"{status:7} {directory}  {detail}")
    pointer = verify_root_pointer(root) if root else None
    if pointer:
        reports.append(pointer)
        if not args.json:
            print(f"CORRUPT {pointer.path}  {'; '.join(pointer.problems)}")
    ok = all(r.ok for r in reports)
    if args.json:
        json.dump({"ok": ok, "checkpoints": [r.to_json() for r in reports]}, sys.stdout, indent=1)
        print()
    return 0 if ok else 1


def _stored_size(directory: Path) -> int:
    try:
        return sum(f.stat().st_size for f in directory.iterdir())
    except OSError:
        return 0


def _ls(args: argparse.Namespace) -> int:
    root = Path(args.root)
    if not root.is_dir():
        print(f"asyncckpt ls: {root} is not a directory", file=sys.stderr)
        return 2
    now = time.time()
    latest = commit.read_latest(root)
    rows = []
    for step in commit.committed_steps(root):
        directory = root / step_dir_name(step)
        try:
            m = read_manifest(directory)
            rows.append({"step": step, "state": "committed", "path": str(directory),
                         "world_size": m.world_size, "raw_bytes": m.raw_size,
                         "stored_bytes": m.stored_size, "ratio": m.stored_size / max(m.raw_size, 1),
                         "age_seconds": now - m.created, "latest": step == latest})
        except Exception as e:
            rows.append({"step": step, "state": "unreadable", "path": str(directory),
                         "error": str(e), "latest": step == latest})
    for name in sorted(os.listdir(root)):
        if is_tmp_dir(name):
            path = root / name
            rows.append({"step": tmp_step_of(name), "state": "in-progress", "path": str(path),
                         "stored_bytes": _stored_size(path),
                         "age_seconds": now - path.stat().st_mtime, "latest": False})
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        print()
        return 0
    print(f"{'STEP':>10}  {'STATE':11} {'SIZE':>10} {'RATIO':>6} {'AGE':>8}  PATH")
    for r in rows:
        size = f"{r['stored_bytes'] / 2**20:.1f}M" if "stored_bytes" in r else "-"
        ratio = f"{r['ratio']:.3f}" if "ratio" in r else "-"
        age = _age(r["age_seconds"]) if "age_seconds" in r else "-"
        mark = " <- latest" if r["latest"] else ""
        print(f"{r['step']:>10}  {r['state']:11} {size:>10} {ratio:>6} {age:>8}  {r['path']}{mark}")
    return 0


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


class _ProgressBar:
    def __init__(self) -> None:
        self.name, self.total, self.done = "", 0, 0

    def start(self, name: str, total: int) -> None:
        self.name, self.total, self.done = name, max(total, 1), 0
        self._draw()

    def advance(self, n: int) -> None:
        self.done += n
        self._draw()

    def finish(self) -> None:
        sys.stderr.write("\r\033[K")
        sys.stderr.flush()

    def _draw(self) -> None:
        frac = min(1.0, self.done / self.total)
        bar = "#" * int(frac * 30)
        sys.stderr.write(f"\r{self.name} [{bar:30}] {frac:5.1%}")
        sys.stderr.flush()


if __name__ == "__main__":
    sys.exit(main())
