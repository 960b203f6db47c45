"""config.py: knob defaults, environment overrides, size parsing and validation messages."""

from __future__ import annotations

import dataclasses
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

from asyncckpt.config import (
    MAX_FRAME_BYTES,
    ClientKnobs,
    MiB,
    ReadLimits,
    ReplicaKnobs,
    WriterKnobs,
    parse_size,
)
from asyncckpt.writer.dedup import DedupIndex

SETS = (ClientKnobs, WriterKnobs, ReadLimits)
FIELDS = {f.name for cls in (*SETS, ReplicaKnobs) for f in dataclasses.fields(cls)}


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """A clean slate: no ASYNCCKPT_<KNOB> variable set."""
    for name in FIELDS:
        monkeypatch.delenv(f"ASYNCCKPT_{name.upper()}", raising=False)
    return monkeypatch


def test_defaults(env):
    c, w, r = (cls.from_env() for cls in SETS)
    assert (c, w, r) == (ClientKnobs(), WriterKnobs(), ReadLimits())
    assert ((c.slot_size, c.ring_size, c.connect_timeout, c.ring_slots)
            == (4 * MiB, 64 * MiB, 30.0, 16))
    assert ((w.codec, w.zstd_level, w.shutdown_timeout, w.max_frame_bytes)
            == ("auto", 1, 120.0, 256 * MiB))
    assert (r.max_manifest_bytes, r.max_frame_bytes, r.read_threads) == (512 * MiB, 256 * MiB, 2)


def test_env_overrides(env):
    env.setenv("ASYNCCKPT_SLOT_SIZE", "1MiB")
    env.setenv("ASYNCCKPT_RING_SIZE", "8M")
    env.setenv("ASYNCCKPT_CODEC", "raw")
    env.setenv("ASYNCCKPT_ZSTD_LEVEL", "3")
    env.setenv("ASYNCCKPT_CONNECT_TIMEOUT", "2.5")
    env.setenv("ASYNCCKPT_MAX_MANIFEST_BYTES", "1GiB")
    c, w, r = (cls.from_env() for cls in SETS)
    assert (c.slot_size, c.ring_size, w.codec, w.zstd_level) == (MiB, 8 * MiB, "raw", 3)
    assert c.connect_timeout == w.connect_timeout == 2.5 and isinstance(c.connect_timeout, float)
    assert r.max_manifest_bytes == 1 << 30
    assert c.ring_slots == 8


def test_keyword_overrides_beat_env_and_none_is_ignored(env):
    env.setenv("ASYNCCKPT_SLOT_SIZE", "1MiB")
    env.setenv("ASYNCCKPT_CODEC", "raw")
    c = ClientKnobs.from_env(slot_size=64 << 10, ring_size=256 << 10, connect_timeout=None)
    assert (c.slot_size, c.ring_size, c.connect_timeout) == (64 << 10, 256 << 10, 30.0)
    assert WriterKnobs.from_env(codec=None).codec == "raw"


def test_knobs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ClientKnobs().slot_size = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        WriterKnobs().codec = "raw"  # type: ignore[misc]


@pytest.mark.parametrize("text,value", [
    ("4194304", 4 * MiB), ("4MiB", 4 * MiB), ("4M", 4 * MiB), ("4m", 4 * MiB), ("4MB", 4 * MiB),
    ("4mib", 4 * MiB), ("1GiB", 1 << 30), ("1G", 1 << 30), ("2k", 2048), ("2KiB", 2048),
    ("1T", 1 << 40), ("1TiB", 1 << 40), ("0", 0), ("512", 512), ("512B", 512),
    (" 64KiB ", 64 << 10),
])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "abc", "-1", "-1MiB", "1.5M", "M", "MiB", "4X", "4 Mi B",
                                  "0x10", "1e6"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


@pytest.mark.parametrize("cls,kwargs,fragments", [
    (ClientKnobs, {"slot_size": 65536, "ring_size": 100_000},
     ["ring_size", "multiple of slot_size (65536)", "100000"]),
    (ClientKnobs, {"slot_size": 65536, "ring_size": 4096}, ["ring_size", "4096"]),
    (ClientKnobs, {"slot_size": 5000}, ["slot_size", "multiple of 4096", "5000"]),
    (ClientKnobs, {"slot_size": 0}, ["slot_size", "0"]),
    (ClientKnobs, {"slot_size": 512 * MiB, "ring_size": 512 * MiB},
     ["slot_size", "256 MiB", "536870912"]),
    (ClientKnobs, {"connect_timeout": 0.0}, ["connect_timeout", "positive", "0.0"]),
    (WriterKnobs, {"codec": "lz4"}, ["codec", "'lz4'", "zstd"]),
    (WriterKnobs, {"zstd_level": 23}, ["zstd_level", "23"]),
    (WriterKnobs, {"zstd_level": -8}, ["zstd_level", "-8"]),
    (WriterKnobs, {"shutdown_timeout": -1.0}, ["shutdown_timeout", "-1.0"]),
    (WriterKnobs, {"max_frame_bytes": 100}, ["max_frame_bytes", "100"]),
    (ReadLimits, {"read_threads": 0}, ["read_threads", "0"]),
])
def test_validation_names_knob_and_value(env, cls, kwargs, fragments):
    with pytest.raises(ValueError) as info:
        cls.from_env(**kwargs)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_validation_applies_to_env_values(env):
    env.setenv("ASYNCCKPT_RING_SIZE", "5MiB")
    with pytest.raises(ValueError, match=r"ring_size must be .*4194304.*got 5242880"):
        ClientKnobs.from_env()
    env.setenv("ASYNCCKPT_RING_SIZE", "8MiB")
    env.setenv("ASYNCCKPT_CODEC", "gzip")
    with pytest.raises(ValueError, match="codec.*'gzip'"):
        WriterKnobs.from_env()
    ClientKnobs.from_env()  # a rank does not care about the writer's codec


def test_unparsable_env_value_names_variable(env):
    env.setenv("ASYNCCKPT_SLOT_SIZE", "lots")
    with pytest.raises(ValueError, match=r"ASYNCCKPT_SLOT_SIZE='lots' is not a valid int"):
        ClientKnobs.from_env()
    env.delenv("ASYNCCKPT_SLOT_SIZE")
    env.setenv("ASYNCCKPT_CONNECT_TIMEOUT", "soon")
    with pytest.raises(ValueError, match=r"ASYNCCKPT_CONNECT_TIMEOUT='soon' is not a valid float"):
        WriterKnobs.from_env()


def test_unknown_knob_is_named(env):
    with pytest.raises(ValueError, match=r"'slot_sise' is no knob") as info:
        ClientKnobs.from_env(slot_sise=4096)
    assert "slot_size" in str(info.value)  # lists the known ones


def test_a_knob_of_another_process_is_an_error_naming_its_home(env):
    with pytest.raises(ValueError, match=r"'codec' belongs to start_writer"):
        ClientKnobs.from_env(codec="raw")
    with pytest.raises(ValueError, match=r"'ring_size' belongs to connect\(\)"):
        WriterKnobs.from_env(ring_size=1 << 20)
    with pytest.raises(ValueError, match=r"'read_threads' belongs to load\(limits=\)"):
        WriterKnobs.from_env(read_threads=4)


def test_connect_validates_knobs_before_touching_anything():
    import asyncckpt
    with pytest.raises(ValueError, match="ring_size"):
        asyncckpt.connect("/nonexistent/writer.sock", rank=0, world_size=1,
                          slot_size=65536, ring_size=65536 * 3 + 1)
    with pytest.raises(ValueError, match="is no knob"):
        asyncckpt.connect("/nonexistent/writer.sock", rank=0, world_size=1, ring_slots=4)
    with pytest.raises(ValueError, match="'keep_last' belongs to start_writer"):
        asyncckpt.connect("/nonexistent/writer.sock", rank=0, world_size=1, keep_last=3)


def run_writer_cli(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncckpt", "writer", "--root",
                           str(tmp_path / "ckpt"), *args], capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)


@pytest.mark.process  # runs the writer's CLI
def test_writer_cli_rejects_bad_knobs_with_exit_2(tmp_path):
    bad = run_writer_cli(tmp_path, "--knob", "bogus_knob=1")
    assert bad.returncode == 2 and "bogus_knob" in bad.stderr
    bad = run_writer_cli(tmp_path, "--knob", "flush_bytes=-1")
    assert bad.returncode == 2 and "flush_bytes" in bad.stderr and "-1" in bad.stderr
    bad = run_writer_cli(tmp_path, "--knob", "ring_size=1MiB")  # a rank's knob
    assert bad.returncode == 2 and "belongs to connect()" in bad.stderr


# -- bugs ------------------------------------------------------------------------------------------

def test_negative_zstd_level_from_env(env):
    env.setenv("ASYNCCKPT_ZSTD_LEVEL", "-3")
    assert WriterKnobs.from_env().zstd_level == -3


def test_the_readme_knob_table_lists_exactly_the_knobs():
    """Every knob (and its environment variable) is documented, and nothing the table
    lists is a constant that no longer reads ASYNCCKPT_<NAME>."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme.split("| set (where it goes) | knob | default | meaning |", 1)[1]
    table = table.split("\n\n", 1)[0]
    listed = {name for row in table.splitlines() if row.startswith("|")
              for name in re.findall(r"`(\w+)`", row.split("|")[2])}
    assert listed == FIELDS


def test_defaults_shared_with_other_modules_come_from_config():
    assert WriterKnobs().max_frame_bytes == ReadLimits().max_frame_bytes == MAX_FRAME_BYTES
    assert inspect.signature(DedupIndex).parameters["max_frame_bytes"].default == MAX_FRAME_BYTES


def test_replica_knobs_read_the_environment_and_are_checked(env):
    from asyncckpt.config import ReplicaKnobs
    env.setenv("ASYNCCKPT_REPLICA_MBPS", "250")
    env.setenv("ASYNCCKPT_REPLICA_CHUNK_BYTES", "4MiB")
    knobs = ReplicaKnobs.from_env(replica_timeout=2.5)
    assert (knobs.replica_mbps, knobs.replica_chunk_bytes, knobs.replica_timeout) == \
        (250.0, 4 * MiB, 2.5)
    for bad, cause in (({"replica_chunk_bytes": 100}, "replica_chunk_bytes"),
                       ({"replica_mbps": -1.0}, "replica_mbps"),
                       ({"replica_timeout": 0.0}, "replica_timeout")):
        with pytest.raises(ValueError, match=cause):
            ReplicaKnobs.from_env(**bad)
    with pytest.raises(ValueError, match="'ring_size' belongs to connect"):
        ReplicaKnobs.from_env(ring_size=1 << 20)
