"""Crash torture: kill -9 a random process of a saving job, again and again.

    python scripts/faults/torture.py --kills 300 --ranks 3

A writer (keep_last=3) and N ranks save a step after another. At a random moment one
of them is SIGKILLed -- the writer or a rank -- and, as a job launcher would, the rest
of the ranks are killed too and everything that died is restarted. Some writer restarts
are armed with a crash point (asyncckpt.runtime.faults), so that deaths also land exactly
between the manifest write and the rename, after the rename, and in retention (pruning,
retiring a referenced step, reclaiming a retired one: saves are incremental, the
writer's default, and part of every state never changes). After every kill: every
committed checkpoint verifies and loads bit-exact (following its references); `latest` names a
committed step; a restarted writer has swept all tmp directories; the writer never maps
more rings than there are ranks (rings of dead ranks are released).

Between kills, the root is attacked as an unlucky user and bit rot would: a step (one
that later steps reference, or a retired one) is moved to another directory and linked
back, or one byte of a frame that the newest step references flips. The steps that
shared those bytes are damaged by the attack itself and are left out of the checks;
every step committed after it must verify and load, so new saves never reference a
linked or damaged step.

With `--s3` the root is a prefix of a bucket on a SeaweedFS server started here, and the
S3 server itself is among the victims (SIGKILLed and restarted while the writer runs).
The same checks run after every kill, and a restarted writer (the root's first: the dead
writer's lease names a process that is gone) must leave no multipart upload and no step
prefix without a manifest. The attacks on the root (a step linked back from elsewhere, a
byte flipped in place) are local-file attacks and are not run there;
tests/faults/test_s3_faults.py flips
bytes in stored objects instead. Between kills the object-store cases of torture_s3.py
run: two writers of one job saving the same steps, a writer SIGSTOPped past its lease
while another takes the root over, and another tool's uploads under the prefix that
every writer start must leave alone.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
import torture_rank  # noqa: E402
import torture_s3  # noqa: E402
from torture_rank import expected_state  # noqa: E402

import asyncckpt  # noqa: E402
from asyncckpt.read.verification import verify_checkpoint  # noqa: E402
from asyncckpt.runtime import faults  # noqa: E402
from asyncckpt.runtime.procstat import ring_mappings  # noqa: E402
from asyncckpt.storage.local import read_manifest  # noqa: E402
from asyncckpt.storage.location import (  # noqa: E402
    Location,
    ObjectPath,
    exists,
    read_manifest_at,
    storage_for,
)

# Ranks are forked from a server that has imported torch and asyncckpt once: a rank is
# saving within ~0.1 s of its start instead of spending 2 s importing torch, so the kills
# land while ranks save, not while they start.
_LAUNCHER = multiprocessing.get_context("forkserver")
_LAUNCHER.set_forkserver_preload(["torch", "asyncckpt.rank.client", "torture_rank"])


class Job:
    def __init__(self, root: Location, ranks: int, rng: random.Random, logs: Path, *,
                 name: str = "writer", job: str | None = None, keep_last: int = 3) -> None:
        self.root, self.world, self.rng = root, ranks, rng
        self.address = str(Path(tempfile.mkdtemp(prefix="torture-")) / "w.sock")
        self.log = open(logs / f"{name}.log", "ab")
        self.log_path = logs / f"{name}.log"
        self.job, self.keep_last = job, keep_last
        self.writer: subprocess.Popen | None = None
        self.ranks: list[multiprocessing.process.BaseProcess] = []

    def start_writer(self, crash_at: str | None = None) -> None:
        env = {k: v for k, v in os.environ.items() if k != "ASYNCCKPT_CRASH_AT"}
        if crash_at:
            env["ASYNCCKPT_CRASH_AT"] = crash_at
        self.writer = subprocess.Popen(
            [sys.executable, "-m", "asyncckpt", "writer", "--root", str(self.root),
             "--address", self.address, "--knob", f"keep_last={self.keep_last}",
             "--knob", "absent_rank_timeout=5", "--ready-line",
             *(["--job", self.job] if self.job else [])],
            stdout=subprocess.PIPE, stderr=self.log, env=env, text=True)
        assert self.writer.stdout is not None
        if not self.writer.stdout.readline().startswith("ASYNCCKPT_READY"):
            raise RuntimeError("writer did not start")

    def start_ranks(self) -> None:
        steps = storage_for(self.root).committed_steps()
        start = (steps[-1] if steps else 0) + 1
        self.ranks = [_LAUNCHER.Process(target=torture_rank.serve,
                                        args=(self.address, r, self.world, start))
                      for r in range(self.world)]
        for p in self.ranks:
            p.start()

    def kill_ranks(self) -> None:
        for p in self.ranks:
            if p.is_alive():
                p.kill()
        for p in self.ranks:
            p.join()

    def stop(self) -> int:
        self.kill_ranks()
        assert self.writer is not None
        if self.writer.poll() is None:
            self.writer.send_signal(signal.SIGTERM)
        return self.writer.wait(60)


def check(root: Location, world: int, damaged: set[int] = frozenset()) -> int:  # type: ignore[assignment]
    """Verify and load every committed checkpoint but the `damaged` ones (an attack
    damaged them); returns how many were checked."""
    checked = 0
    for step in storage_for(root).committed_steps():
        if step in damaged:
            continue
        directory = root / f"step-{step:08d}"
        report = verify_checkpoint(directory)
        if not report.ok:
            if not exists(directory / "manifest.json"):
                continue  # pruned by retention while we looked
            raise AssertionError(f"committed step {step} does not verify: {report.problems}")
        for rank in range(world):
            loaded = asyncckpt.load(directory, rank=rank)
            want = expected_state(rank, step)
            assert loaded["meta"] == want["meta"], (step, rank)
            assert loaded["w"].view(torch.int16).equal(want["w"].view(torch.int16)), (step, rank)
            assert loaded["opt"][0]["exp_avg"].equal(want["opt"][0]["exp_avg"]), (step, rank)
            assert loaded["frozen"].equal(want["frozen"]), (step, rank)
        checked += 1
    latest = storage_for(root).read_latest()
    assert latest is None or latest in storage_for(root).committed_steps(), f"latest names {latest}"
    return checked


def retired_now(root: Location) -> list[str]:
    return [f"step-{s:08d}.retired" for s in storage_for(root).retired_steps()]


def leftovers(root: Location) -> list[str]:
    """What a writer's start must have swept: tmp directories, or on an object store
    unfinished uploads and step prefixes without a manifest."""
    if not isinstance(root, ObjectPath):
        return [p.name for p in root.iterdir() if ".tmp-" in p.name]
    uploads, manifestless = storage_for(root).unfinished()  # type: ignore[attr-defined]
    return [f"upload {u['Key']}" for u in uploads] + [
        item["Key"] for items in manifestless.values() for item in items]


def references(root: Location) -> int:
    """Committed steps that reference older ones (a step pruned meanwhile is skipped)."""
    count = 0
    for step in storage_for(root).committed_steps():
        try:
            count += bool(read_manifest_at(root / f"step-{step:08d}").referenced_steps)
        except asyncckpt.CheckpointError:
            pass
    return count


def attack(root: Path, elsewhere: Path, rng: random.Random) -> tuple[str, set[int]]:
    """Link a referenced or retired step back from `elsewhere`, or flip a byte the newest
    step references. Returns (what was done, the committed steps that do not verify now)."""
    steps = storage_for(root).committed_steps()
    if not steps:
        return "", set()
    try:
        newest = read_manifest(root / f"step-{steps[-1]:08d}")
    except asyncckpt.CheckpointError:
        return "", set()
    refs = [f.ref for p in newest.ranks for f in p.frames if f.ref is not None
            and f.raw_length > 4096]
    if not refs:
        return "", set()
    ref = rng.choice(refs)
    name = next((n for n in (f"step-{ref.step:08d}", f"step-{ref.step:08d}.retired")
                 if (root / n).is_dir() and not (root / n).is_symlink()), None)
    if name is None:
        return "", set()
    if rng.random() < 0.5:
        elsewhere.mkdir(exist_ok=True)
        os.rename(root / name, elsewhere / name)
        os.symlink(elsewhere / name, root / name)
        what = f"linked back {name}"
    else:
        with open(root / name / ref.file, "r+b") as f:
            f.seek(ref.offset + ref.length // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x10]))
        what = f"flipped a byte of {name}/{ref.file}"
    damaged = {s for s in storage_for(root).committed_steps()
               if not verify_checkpoint(root / f"step-{s:08d}").ok}
    return what, damaged


def run(kills: int, ranks: int, seed: int, root: Location, verbose: bool = True, *,
        logs: Path | None = None, server: Any = None, case_rate: float = 0.14) -> dict:
    """`kills` kills of a job saving to `root`; with an object-store root, `server` (a
    benchmarks.s3server.SeaweedServer) is killed and restarted among them."""
    rng = random.Random(seed)
    logs = logs or root.parent  # type: ignore[assignment]

    def make_job(name: str = "writer", keep_last: int = 3) -> Job:
        return Job(root, ranks, rng, logs, name=name, keep_last=keep_last,  # type: ignore[arg-type]
                   job=torture_s3.JOB if server is not None else None)
    job = make_job()
    if server is not None:  # another tool's uploads and objects under the prefix
        torture_s3.plant_foreign(storage_for(root))
    cases = {"two_writers": 0, "stalled_holder": 0}
    armed: str | None = None
    job.start_writer()
    survived = checked = writer_kills = armed_deaths = referencing = attacks = 0
    server_kills = 0
    retired_seen: set[str] = set()
    damaged: set[int] = set()   # committed steps an attack damaged: not checked
    attacked_at: int | None = None  # the newest step when the first attack came
    after_attack: set[int] = set()  # steps committed after it, checked
    started = time.monotonic()
    try:
        while survived < kills:
            job.start_ranks()
            time.sleep(rng.uniform(0.3, 2.5))  # ranks save within 0.1 s of their start
            assert job.writer is not None
            if job.writer.poll() is not None:
                armed_deaths += 1       # an armed crash point fired by itself
                victim = "writer (crash point)"
            elif server is not None and rng.random() < 0.1:
                server.kill()
                victim = "S3 server"
            elif rng.random() < 0.3:
                job.writer.kill()
                victim = "writer"
            else:
                rank = rng.randrange(ranks)
                job.ranks[rank].kill()
                victim = f"rank {rank}"
            job.kill_ranks()
            if victim == "S3 server":
                server.start()
                server_kills += 1
            if victim.startswith("writer"):
                job.writer.wait()
                writer_kills += 1
                crash_at = rng.choice(faults.CRASH_POINTS) if rng.random() < 0.3 else None
                job.start_writer(crash_at)
                armed = crash_at
                left = leftovers(root)
                assert not left, f"writer start left {left}"
                storage = storage_for(root)
                assert storage.read_latest() == (storage.committed_steps() or [None])[-1]
            else:
                time.sleep(0.2)  # let the writer fail the step the dead rank was in
                rings = ring_mappings(job.writer.pid)
                assert rings <= ranks, f"the writer maps {rings} rings for {ranks} ranks"
            checked += check(root, ranks, damaged)
            if server is not None:
                missing = torture_s3.foreign_missing(storage_for(root))
                assert not missing, f"another tool's keys were swept: {missing}"
                pick = rng.random()
                if armed is None and job.writer.poll() is None and pick < case_rate:
                    case = "two_writers" if pick < case_rate / 2 else "stalled_holder"
                    what = getattr(torture_s3, case)(job, make_job, rng)
                    cases[case] += 1
                    checked += check(root, ranks, damaged)
                    if verbose:
                        print(f"case: {what}", flush=True)
            if attacked_at is not None:
                after_attack |= {s for s in storage_for(root).committed_steps()
                                 if s > attacked_at and s not in damaged}
            if server is None and rng.random() < 0.1 and job.writer.poll() is None:
                what, hit = attack(root, root.parent / "elsewhere", rng)
                if what:
                    attacks += 1
                    damaged |= hit
                    if attacked_at is None:
                        attacked_at = (storage_for(root).committed_steps() or [0])[-1]
                    if verbose:
                        print(f"attack: {what}; damaged steps {sorted(hit)}", flush=True)
            referencing += references(root)
            retired_seen |= set(retired_now(root))
            survived += 1
            if verbose:
                print(f"kill {survived:4d}/{kills}: {victim:22s} committed "
                      f"{storage_for(root).committed_steps()}", flush=True)
    finally:
        code = job.stop()
    result = {"kills_survived": survived, "writer_kills": writer_kills,
              "server_kills": server_kills, **cases,
              "attacks": attacks, "steps_verified_after_an_attack": len(after_attack),
              "referencing_steps_verified": referencing,
              "retired_seen": len(retired_seen), "retired_now": len(retired_now(root)),
              "crash_point_deaths": armed_deaths, "checkpoints_verified": checked,
              "last_step": (storage_for(root).committed_steps() or [0])[-1],
              "writer_exit": code, "seconds": round(time.monotonic() - started, 1)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=300)
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--s3", action="store_true",
                        help="save to s3://ckpt/torture on a SeaweedFS server started here")
    parser.add_argument("--case-rate", type=float, default=0.14,
                        help="with --s3: the chance, after each kill, of one of the "
                             "object-store cases (torture_s3.py)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="asyncckpt-torture-") as tmp:
        if args.s3:
            sys.path.insert(0, str(HERE.parents[1]))
            from benchmarks.s3server import SeaweedServer
            with SeaweedServer(Path(tmp) / "s3") as server:
                os.environ.update(server.env())
                os.environ["ASYNCCKPT_LEASE_RENEW"] = str(torture_s3.LEASE_RENEW)
                result = run(args.kills, args.ranks, args.seed, ObjectPath("/ckpt/torture"),
                             logs=Path(tmp), server=server, case_rate=args.case_rate)
        else:
            result = run(args.kills, args.ranks, args.seed, Path(tmp) / "ckpt")
    print("torture:", " ".join(f"{k}={v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
