"""Protocol fuzz: a misbehaving authenticated rank next to two ordinary ones.

One writer; two ordinary ranks (world size 2, a real `asyncckpt` client each, in
threads) save a series of steps; meanwhile a hostile client that authenticates with
the real protocol sends a seeded random stream of messages: valid saves, wrong types,
out-of-range slots, lengths, save ids, steps, world sizes, unknown ops, non-object
JSON, garbage and truncated frames, absurd length prefixes, a second hello, fds and
slot scribbles, and reconnects whenever the writer drops it (or at random). Part of
the stream is built from the protocol's own dataclasses (ipc/messages.py: every
message of either direction, coordinated saves with their commit and outcome
included), each sent whole or with one field dropped or given an odd value.

Every frame the hostile rank sends also goes through `messages.parse()` here, the
parser the writer runs, which must answer with a message or ProtocolError and nothing
else; every reply the writer sends must parse as a message.

At the end it checks what issue 11 promises: the writer is alive, every ordinary save
committed, every committed checkpoint verifies, and the writer's threads,
descriptors, sockets and ring mappings are back to where they were (small slack for
a handshake in flight). It prints one summary line with the figures and exits 1 if
any check failed.

    python scripts/faults/fuzz_protocol.py --seed 1 --messages 10000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from hostile_rank import HostileRank, Resources, alive, settled, tmp_leftovers  # noqa: E402

import asyncckpt  # noqa: E402
from asyncckpt.ipc import messages  # noqa: E402
from asyncckpt.read.verification import verify_checkpoint  # noqa: E402

HOSTILE_STEPS = 1_000_000  # the hostile's steps start here; the ordinary ranks' are 1..
SLOT = 4096
SLOTS = 4


def odd_value(rng: random.Random) -> Any:
    """A value of the wrong type or out of range for any int field."""
    return rng.choice([None, True, False, -1, -2**63, 2**62, 2**64, 2**200, 1.5, float(3),
                       "1", "", [], [1], {}, {"a": 1}, SLOT, SLOT + 1, SLOTS, 10**6])


def random_table(rng: random.Random) -> list:
    table = []
    for i in range(rng.randint(0, 4)):
        table.append([f"t{i}", rng.choice(["U8", "F32", "BF16", "I64"]),
                      [rng.randint(0, 64) for _ in range(rng.randint(0, 2))]])
    return table


def table_bytes(table: list) -> int:
    sizes = {"U8": 1, "F32": 4, "BF16": 2, "I64": 8}
    total = 0
    for _, dtype, shape in table:
        n = sizes[dtype]
        for d in shape:
            n *= d
        total += n
    return total


def plain_tree(table: list) -> dict:
    return {"dict": [[t[0], {"tensor": t[0]}] for t in table]}


class Fuzzer:
    def __init__(self, address: str, rng: random.Random) -> None:
        self.address = address
        self.rng = rng
        self.h: HostileRank | None = None
        self.sent = 0
        self.reconnects = 0
        self.refused_hellos = 0
        self.save_ids: list[int] = []
        self.steps: list[int] = []  # hostile steps it began (commit and outcome name them)
        self.next_id = 1
        self.frames = 0         # frames sent after a hello, each parsed here too
        self.frames_parsed = 0  # ... of which parse() took as a message
        self.typed = 0          # messages built from the dataclasses
        self.parser_problems: list[str] = []

    def check_frame(self, data: bytes) -> None:
        """The writer's parser, run on what we send: a message or ProtocolError."""
        self.frames += 1
        try:
            messages.parse(data)
            self.frames_parsed += 1
        except messages.ProtocolError:
            pass
        except Exception as e:  # noqa: BLE001 - what the fuzz looks for
            self.parser_problems.append(f"parse raised {type(e).__name__}: {e} on {data[:80]!r}")

    def check_reply(self, m: dict) -> None:
        try:
            messages.parse(m)
        except Exception as e:  # noqa: BLE001 - reported
            self.parser_problems.append(f"the writer sent {m!r:.80}: {type(e).__name__}: {e}")

    # -- connection ------------------------------------------------------------------

    def connect(self) -> None:
        self.close()
        rng = self.rng
        while self.h is None:
            self.reconnects += 1
            hello: dict[str, Any] = {"need_slot": rng.choice([True, False, odd_value(rng)])}
            if rng.random() < 0.1:  # a bad hello: that connection only is refused
                hello[rng.choice(["rank", "slot_size", "slots", "world_size"])] = odd_value(rng)
            try:
                self.h = HostileRank(self.address, rank=rng.randint(0, 3),
                                     world_size=rng.choice([1, 2, 4]), slot_size=SLOT,
                                     slots=SLOTS, hello=hello, timeout=5)
            except (EOFError, OSError, ConnectionError, asyncckpt.CheckpointError):
                self.refused_hellos += 1
            self.sent += 1
        self.h.on_frame = self.check_frame
        self.save_ids = []
        self.steps = []

    def close(self) -> None:
        if self.h is not None:
            self.h.close()
            self.h = None

    def drain(self) -> None:
        """Read what the writer sent (sometimes: a rank may stop reading for a while)."""
        assert self.h is not None
        if self.rng.random() < 0.2:
            return
        while self.h.conn.poll(0):
            m = self.h.recv(0)
            if m is None:
                break
            self.check_reply(m)

    # -- one random action -------------------------------------------------------------

    def step(self) -> None:
        if self.h is None or self.rng.random() < 0.01:
            self.connect()
        try:
            self.act()
            self.drain()
        except (EOFError, OSError, ValueError, TimeoutError):
            self.close()  # dropped by the writer (or our own frame could not be sent)

    def act(self) -> None:
        rng, h = self.rng, self.h
        assert h is not None
        kind = rng.random()
        ident = (rng.choice(self.save_ids) if self.save_ids and rng.random() < 0.8
                 else odd_value(rng))
        if kind < 0.12:  # a message of the protocol's own, whole or with one field changed
            self.send_typed(ident)
            self.sent += 1
            return
        kind = (kind - 0.12) / 0.88  # the other actions keep their shares of the rest
        if kind < 0.15:  # a well-formed begin (sometimes of a bad table)
            table = random_table(rng)
            if rng.random() < 0.2 and table:
                table[0][2] = [rng.choice([-1, 2**62, 1.5])] if rng.random() < 0.5 else [1] * 65
            save = self.next_id
            self.next_id += 1
            self.save_ids.append(save)
            step = HOSTILE_STEPS + rng.randint(0, 10**6)
            self.steps.append(step)
            h.begin(save, step, table, plain_tree(table),
                    world_size=rng.choice([1, 1, 1, 2, 2**40]))
            self.sent += 1
        elif kind < 0.25:  # a whole valid save of its own step
            table = random_table(rng)
            save = self.next_id
            self.next_id += 1
            h.begin(save, HOSTILE_STEPS + rng.randint(0, 10**6), table, plain_tree(table))
            data = rng.randbytes(table_bytes(table))
            h.stream(save, data)
            h.send("end", save=save)
            self.sent += 2 + (len(data) + SLOT - 1) // SLOT
        elif kind < 0.45:  # chunks: good and bad slots, lengths, ids
            slot = rng.randrange(SLOTS) if rng.random() < 0.7 else odd_value(rng)
            length = rng.randint(0, SLOT) if rng.random() < 0.7 else odd_value(rng)
            if rng.random() < 0.3:
                h.write_slot(rng.randrange(SLOTS), rng.randbytes(rng.randint(1, SLOT)))
            if rng.random() < 0.5:
                h.send("chunk", save=ident, slot=slot, length=length)
            else:  # several slots in one message: lists good, odd, of unequal lengths
                count = rng.choice([1, 2, 5, 1024, 1025])
                slots = [rng.randrange(SLOTS) for _ in range(count)]
                lengths = [rng.randint(0, SLOT) for _ in range(count)]
                if rng.random() < 0.3:
                    slots[rng.randrange(count)], lengths[-1] = slot, length
                if rng.random() < 0.1:
                    lengths = lengths[:-1]
                h.send("chunks", save=ident,
                       slots=slots if rng.random() < 0.9 else odd_value(rng), lengths=lengths)
            self.sent += 1
        elif kind < 0.55:
            h.send(rng.choice(["end", "abort", "need_slot"]), save=ident,
                   reason="fuzz" * rng.randint(0, 3))
            self.sent += 1
        elif kind < 0.65:  # begins with wrong field types
            fields: dict[str, Any] = {"save": self.next_id, "step": HOSTILE_STEPS + 7,
                                      "world_size": 1, "tensors": [], "tree": {"dict": []}}
            self.next_id += 1
            for key in rng.sample(sorted(fields), rng.randint(1, 3)):
                fields[key] = odd_value(rng) if rng.random() < 0.7 else rng.choice(
                    [[["a", "U8"]], [[1, 2, 3]], "x", {"tensor": "nope"}])
            if rng.random() < 0.3:
                fields["retention"] = odd_value(rng)
            h.send("begin", **fields)
            self.sent += 1
        elif kind < 0.75:  # messages that are not ours
            choice = rng.randrange(8)
            if choice == 0:
                h.send(rng.choice(["hello", "welcome", "free", "committed", "nop", ""]),
                       save=ident, slot=0)
            elif choice == 1:
                h.send_raw(json.dumps(rng.choice([[], 1, "op", None, [{"op": "end"}]])).encode())
            elif choice == 2:
                h.send_raw(json.dumps({"op": odd_value(rng), "save": ident}).encode())
            elif choice == 3:
                h.send_raw(rng.randbytes(rng.randint(0, 64)))
            elif choice == 4:
                h.send_raw(b"")
            elif choice == 5:
                h.send_raw(b'{"op":"chunk","save":1,"slot":0,"length":NaN}')
            elif choice == 6:
                h.send_raw(b'{"op":"end","save":' + b"9" * rng.choice([10, 5000]) + b"}")
            else:
                h.send_raw(b"[" * rng.choice([10, 5000]) + b"]" * 10)
            self.sent += 1
        elif kind < 0.80:  # frames that lie about their length, then a reconnect
            choice = rng.randrange(3)
            if choice == 0:
                h.send_wire(struct.pack("!i", 100) + b'{"op":')
            elif choice == 1:
                h.send_wire(struct.pack("!i", -5))
            else:
                h.send_wire(struct.pack("!i", 2**31 - 1) + b"x" * 100)
            self.sent += 1
            self.connect()
        elif kind < 0.85:  # a descriptor nobody asked for
            r, w = os.pipe()
            try:
                from asyncckpt.ipc import protocol
                protocol.send_fd(h.conn, r)
            finally:
                os.close(r)
                os.close(w)
            self.sent += 1
        else:  # plain good chunks for a save it began (most are refused or overflow it)
            h.send("chunk", save=ident, slot=rng.randrange(SLOTS), length=rng.randint(0, 64))
            self.sent += 1

    def send_typed(self, ident: Any) -> None:
        """One message of `messages.MESSAGES`, built valid, sent whole or with one field
        dropped or given an odd value."""
        rng, h = self.rng, self.h
        assert h is not None
        save = ident if type(ident) is int else self.next_id
        step = rng.choice(self.steps) if self.steps and rng.random() < 0.7 else \
            HOSTILE_STEPS + rng.randint(0, 10**6)
        world = rng.choice([1, 1, 2])
        name = rng.choice([f"step-{step:08d}.tmp-{rng.randbytes(4).hex()}", "..", "../../etc",
                           f"step-{step:08d}", ""])
        table = random_table(rng)
        make = rng.choice([
            lambda: self.coordinated_begin(step, table),
            lambda: messages.Chunk(save, rng.randrange(SLOTS), rng.randint(0, SLOT)),
            lambda: messages.End(save),
            lambda: messages.Abort(save, "fuzz"),
            lambda: messages.NeedSlot(),
            lambda: messages.Commit(save, step, world, tuple((r, name) for r in range(world))),
            lambda: messages.Outcome(step, rng.random() < 0.5),
            lambda: messages.Hello(rng.randrange(4), SLOT, SLOTS, 1, os.getpid(), True),
            lambda: messages.Welcome(os.getpid(), "0", "/", "x"),
            lambda: messages.Refused("fuzz"),
            lambda: messages.Free(rng.randrange(SLOTS)),
            lambda: messages.Unchanged(save, (0,)),
            lambda: messages.Durable(save, step, name),
            lambda: messages.Committed(save, step, "/", {}),
            lambda: messages.Failed(save, step, "SaveFailedError", "fuzz"),
        ])
        wire = make().to_wire()
        fields = sorted(set(wire) - {"op"})
        if fields and rng.random() < 0.5:
            key = rng.choice(fields)
            if rng.random() < 0.3:
                del wire[key]
            else:
                wire[key] = odd_value(rng)
        self.typed += 1
        op = wire.pop("op")
        h.send(op, **wire)

    def coordinated_begin(self, step: int, table: list) -> messages.Begin:
        """A coordinated save's begin (its chunks and end may come among later actions)."""
        save = self.next_id
        self.next_id += 1
        self.save_ids.append(save)
        self.steps.append(step)
        return messages.Begin(save, step, 1, tuple((n, d, tuple(s)) for n, d, s in table),
                              plain_tree(table), coordinated=True)


def ordinary_rank(address: str, rank: int, steps: int, results: dict, stop: threading.Event,
                  rng: random.Random) -> None:
    try:
        client = asyncckpt.connect(address, rank=rank, world_size=2, slot_size=64 << 10,
                                   ring_size=256 << 10)
    except Exception as e:  # noqa: BLE001 - reported
        results[rank] = [f"connect: {type(e).__name__}: {e}"]
        return
    out = results.setdefault(rank, [])
    try:
        for step in range(1, steps + 1):
            g = torch.Generator().manual_seed(step * 10 + rank)
            state = {"w": torch.randn(64 << 10, generator=g), "rank": rank, "step": step}
            try:
                out.append(client.save(step, state).wait(60))
            except Exception as e:  # noqa: BLE001 - reported
                out.append(f"step {step}: {type(e).__name__}: {e}")
            stop.wait(rng.uniform(0.05, 0.4))
    finally:
        client.close(timeout=30)


def run(seed: int, messages: int, steps: int, max_seconds: float, workdir: Path) -> int:
    rng = random.Random(seed)
    root = workdir / "ckpt"
    writer = asyncckpt.start_writer(root, codec="zstd", log_file=workdir / "writer.log",
                                    shutdown_timeout=30)
    problems: list[str] = []
    try:
        pid = writer.pid
        time.sleep(0.5)  # the writer starts its watcher thread after its ready line
        base = Resources.of(pid)  # compared once every client, ordinary or not, is gone
        results: dict[int, list] = {}
        stop = threading.Event()
        ranks = [threading.Thread(target=ordinary_rank, args=(writer.address, r, steps, results,
                                                              stop, random.Random(seed + r + 1)))
                 for r in (0, 1)]
        for t in ranks:
            t.start()
        fuzz = Fuzzer(writer.address, rng)
        started = time.monotonic()
        peak = base
        # at least `messages`, and for as long as the ordinary ranks are saving
        while ((fuzz.sent < messages or any(t.is_alive() for t in ranks))
               and time.monotonic() - started < max_seconds):
            fuzz.step()
            if fuzz.sent % 500 < 3:
                now = Resources.of(pid)
                peak = Resources(*(max(a, b) for a, b in zip(dataclass_values(peak),
                                                             dataclass_values(now))))
        fuzz.close()
        problems.extend(fuzz.parser_problems[:10])
        fuzz_seconds = time.monotonic() - started
        stop.set()
        for t in ranks:
            t.join(300)
        hostile_commits = sum(1 for p in root.iterdir()
                              if p.name.startswith("step-") and ".tmp-" not in p.name
                              and int(p.name[5:]) >= HOSTILE_STEPS)
        if fuzz.sent < messages:
            problems.append(f"only {fuzz.sent} of {messages} messages in {max_seconds:g} s")
        if not alive(pid):
            problems.append("the writer died")
        committed = []
        for rank in (0, 1):
            for r in results.get(rank, ["no result"]):
                if isinstance(r, Path):
                    committed.append(r)
                else:
                    problems.append(f"rank {rank}: {r}")
        grown = settled(pid, base, timeout=15)
        if grown:
            problems.append(f"writer resources grew: {grown}")
        after = Resources.of(pid)
        bad = []
        for d in sorted(p for p in root.iterdir()
                        if p.name.startswith("step-") and ".tmp-" not in p.name):
            report = verify_checkpoint(d)
            if not report.ok:
                bad.append(f"{d.name}: {'; '.join(report.problems)[:200]}")
        if bad:
            problems.append(f"{len(bad)} committed checkpoints fail verify: {bad[:3]}")
        leftovers = tmp_leftovers(root)
        if leftovers:
            problems.append(f"tmp directories left: {leftovers[:5]}")
        print(f"fuzz-protocol seed={seed}: {fuzz.sent} messages from the hostile rank in "
              f"{fuzz_seconds:.1f} s, {fuzz.reconnects} reconnects "
              f"({fuzz.refused_hellos} refused), {fuzz.typed} built from the dataclasses, "
              f"{fuzz.frames_parsed} of {fuzz.frames} "
              f"frames parsed as messages here (the others ProtocolError), "
              f"{hostile_commits} hostile saves committed; ordinary saves committed "
              f"{len(set(p.name for p in committed))}/{steps} steps ({len(committed)}/{2 * steps} "
              f"rank saves); writer threads {base.threads}->{after.threads} (peak {peak.threads}), "
              f"fds {base.fds}->{after.fds} (peak {peak.fds}), ring mappings "
              f"{base.ring_maps}->{after.ring_maps}, peak RSS {after.hwm / 2**20:.0f} MiB; "
              f"{'OK' if not problems else 'FAILED'}", flush=True)
    finally:
        code = writer.stop(timeout=60)
        if code != 0:
            problems.append(f"writer exit code {code}")
    for p in problems:
        print(f"  problem: {p}", file=sys.stderr)
    return 1 if problems else 0


def dataclass_values(r: Resources) -> tuple:
    return (r.threads, r.fds, r.sockets, r.ring_maps, r.rss, r.hwm)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--steps", type=int, default=8, help="ordinary steps (world size 2)")
    parser.add_argument("--max-seconds", type=float, default=600)
    parser.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    args = parser.parse_args()
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
        return run(args.seed, args.messages, args.steps, args.max_seconds, Path(args.dir))
    with tempfile.TemporaryDirectory(prefix="asyncckpt-fuzz-") as d:
        return run(args.seed, args.messages, args.steps, args.max_seconds, Path(d))


if __name__ == "__main__":
    sys.exit(main())
