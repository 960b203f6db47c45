"""The `asyncckpt` command line: its subcommands, options and exit statuses.

Apart from the commands themselves (cli.py) so that what a user may type, and what each
exit status means, is read in one place; `tests/test_api_doc.py` checks docs/API.md
against it. Argument types refuse at parse time what the command would refuse later (a
URL for a local path, an unsupported root scheme), so argparse says why, with usage.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from asyncckpt._version import __version__
from asyncckpt.config import CODECS
from asyncckpt.errors import CheckpointError
from asyncckpt.storage.paths import local_path
from asyncckpt.storage.registry import parse as root_path

DESCRIPTION = "The `asyncckpt` command: writer, verify, ls, inspect, gc, export, copy."


def _path_argument(parse: Callable[[str], object]) -> Callable[[str], str]:
    """An argparse type that refuses at parse time what `parse` refuses (argparse prints
    why): a URL for a local path, an unsupported scheme for a root."""
    def check(text: str) -> str:
        try:
            parse(text)
        except CheckpointError as e:
            raise argparse.ArgumentTypeError(e.cause) from None
        return text
    return check


_root = _path_argument(root_path)  # a directory, or s3://bucket/prefix
_local = _path_argument(local_path)


def _part(text: str) -> tuple[int, int]:
    i, _, n = text.partition("/")
    try:
        part = int(i), int(n)
    except ValueError:
        part = (-1, 0)
    if not 0 <= part[0] < part[1]:
        raise argparse.ArgumentTypeError(f"{text!r} is not I/N with 0 <= I < N")
    return part


def parser() -> argparse.ArgumentParser:
    """The command line: every subcommand, option, and exit status (in its --help)."""
    parser = argparse.ArgumentParser(prog="asyncckpt", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"asyncckpt {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, epilog=EXIT_STATUS[name],
                              formatter_class=argparse.RawDescriptionHelpFormatter)

    w = command("writer", "run a writer in the foreground")
    w.add_argument("--root", required=True, type=_root,
                   help="checkpoint root: a directory, or s3://bucket/prefix")
    w.add_argument("--codec", choices=list(CODECS), default=None,
                   help="how frames are stored (default: the codec knob, auto)")
    w.add_argument("--address", default=None, help="socket path (default: a private runtime dir)")
    w.add_argument("--job", default=None,
                   help="job id shared by the writers of several nodes on one root (default: "
                        "ASYNCCKPT_JOB, else torchrun's run id and master address, if set)")
    w.add_argument("--knob", action="append", default=[], metavar="NAME=VALUE",
                   help="override a knob, e.g. zstd_level=3 (repeatable)")
    w.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    w.add_argument("--ready-line", action="store_true", help=argparse.SUPPRESS)
    w.add_argument("--log-level", default="INFO", help="DEBUG, INFO (default), WARNING, ERROR")

    v = command("verify", "verify a checkpoint, or every checkpoint under a root")
    v.add_argument("path", type=_root, help="a checkpoint directory, or a root (every step)")
    v.add_argument("--json", action="store_true", help=JSON)

    ls = command("ls", "list committed and in-progress checkpoints under a root")
    ls.add_argument("root", type=_root, help="a root: a directory, or s3://bucket/prefix")
    ls.add_argument("--memory", metavar="ADDRESS", nargs="?", const="", default=None,
                    help="also the memory generations the writer at ADDRESS (default "
                         "ASYNCCKPT_ADDRESS) holds, whole or partial, with its replicas")
    ls.add_argument("--json", action="store_true", help=JSON)

    ins = command("inspect", "tensors, shapes, dtypes, bytes and ratio per dtype")
    ins.add_argument("path", type=_root, help="a checkpoint directory, or a root (its newest step)")
    ins.add_argument("--json", action="store_true", help=JSON + " (names not cut)")

    gc = command("gc", "delete old checkpoints and abandoned tmp directories")
    gc.add_argument("root", type=_root, help="a root no writer is running on")
    gc.add_argument("--keep-last", type=int, required=True, help="keep the newest N steps (N >= 1)")
    gc.add_argument("--keep-every", type=int, default=0,
                    help="also keep every step that is a multiple of K (default 0: none)")
    gc.add_argument("--json", action="store_true", help=JSON)

    ex = command("export", "write a Hugging Face model directory (safetensors shards)")
    ex.add_argument("path", type=_root, help="a checkpoint directory, or a root (its newest step)")
    ex.add_argument("--out", required=True, type=_local, help="the model directory (local)")
    ex.add_argument("--contents", default="model", help='top-level key to export ("" for all)')
    ex.add_argument("--rank", type=int, default=0,
                    help="whose tree, for keys only some ranks saved (default 0)")
    ex.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                    help="convert floating-point tensors (default: as saved)")
    ex.add_argument("--max-shard-size", default="5GiB",
                    help="bytes per shard at most: a number with an optional unit, e.g. "
                         "500MB, 5GiB (default 5GiB)")
    ex.add_argument("--tokenizer", default=None, help="copy this directory's tokenizer files")
    ex.add_argument("--jobs", type=int, default=1,
                    help="processes writing shards side by side on this host (default 1)")
    ex.add_argument("--part", type=_part, default=(0, 1), metavar="I/N",
                    help="write the I-th of N shares of the shards (0-based), for one "
                         "export split over N hosts sharing --out; the last to finish "
                         "writes the index (every host needs the same N and --jobs: a "
                         "host that finds another's split differ exits with status 2)")
    ex.add_argument("--json", action="store_true", help=JSON)

    cp = command("copy", "write one step as a self-contained checkpoint directory "
                         "(every referenced byte materialised)")
    cp.add_argument("path", type=_local,
                    help="a root (with --step, else its newest step) or a checkpoint")
    cp.add_argument("--step", type=int, default=None, help="the step of a root (default: newest)")
    cp.add_argument("--out", required=True, type=_local, help="the new directory (must not exist)")
    cp.add_argument("--json", action="store_true", help=JSON)

    imp = command("import-dcp", "commit a checkpoint dcp.save wrote (.metadata, *.distcp) "
                                "as a verified step of a root")
    imp.add_argument("source", type=_local,
                     help="the DCP checkpoint directory (e.g. torchtitan's step-N)")
    imp.add_argument("root", type=_local, help="the asyncckpt root (a writer is started on it)")
    imp.add_argument("--step", type=int, required=True, help="the step number it becomes")
    imp.add_argument("--part-size", default="1G",
                     help="most tensor bytes held in memory at once (default 1G)")
    imp.add_argument("--json", action="store_true", help=JSON)

    fl = command("flush", "make a writer's newest memory generation a committed step now")
    fl.add_argument("--address", default=None,
                    help="the writer's socket (default: ASYNCCKPT_ADDRESS)")
    fl.add_argument("--json", action="store_true", help=JSON)

    return parser


JSON = "print the result as JSON on stdout"
_USAGE = "2 a usage error, or a path that does not exist or holds no checkpoint"
EXIT_STATUS = {
    "writer": "exit status: 0 stopped cleanly (SIGTERM/SIGINT, or its parent gone), 2 a bad "
              "knob or an unusable root, 3 the root is locked by another writer",
    "verify": f"exit status: 0 every byte checked, 1 corruption found, {_USAGE}",
    "ls": f"exit status: 0 listed (damaged steps are rows, not errors), {_USAGE}, or "
          "no writer at the --memory address",
    "inspect": f"exit status: 0 shown, {_USAGE}",
    "gc": f"exit status: 0 done, {_USAGE}, 3 a writer holds the root",
    "export": f"exit status: 0 written (or this part's share), 1 corruption found, {_USAGE}, "
              "or hosts splitting one export differently (--part N, --jobs)",
    "copy": f"exit status: 0 copied, 1 corruption found, {_USAGE}",
    "flush": "exit status: 0 committed (or nothing newer than the root's newest step to "
             "flush), 1 the flush failed (nothing committed), 2 no writer there",
    "import-dcp": "exit status: 0 committed, 1 the source is not a DCP checkpoint, or is "
                  "damaged or hostile (one line names the file), 2 a usage error or a failed save",
}
