"""config.py: knob defaults, environment overrides, size parsing and validation messages."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from asyncckpt.config import MiB, Knobs, parse_size

FIELDS = [f.name for f in dataclasses.fields(Knobs)]


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """A clean slate: no ASYNCCKPT_<KNOB> variable set."""
    for name in FIELDS:
        monkeypatch.delenv(f"ASYNCCKPT_{name.upper()}", raising=False)
    return monkeypatch


def test_defaults(env):
    k = Knobs.from_env()
    assert k == Knobs()
    assert (k.slot_size, k.ring_size, k.codec, k.zstd_level) == (4 * MiB, 64 * MiB, "auto", 1)
    assert (k.connect_timeout, k.shutdown_timeout) == (30.0, 120.0)
    assert (k.max_manifest_bytes, k.max_frame_bytes) == (512 * MiB, 256 * MiB)
    assert k.ring_slots == 16


def test_env_overrides(env):
    env.setenv("ASYNCCKPT_SLOT_SIZE", "1MiB")
    env.setenv("ASYNCCKPT_RING_SIZE", "8M")
    env.setenv("ASYNCCKPT_CODEC", "raw")
    env.setenv("ASYNCCKPT_ZSTD_LEVEL", "3")
    env.setenv("ASYNCCKPT_CONNECT_TIMEOUT", "2.5")
    env.setenv("ASYNCCKPT_MAX_MANIFEST_BYTES", "1GiB")
    k = Knobs.from_env()
    assert (k.slot_size, k.ring_size, k.codec, k.zstd_level) == (MiB, 8 * MiB, "raw", 3)
    assert k.connect_timeout == 2.5 and isinstance(k.connect_timeout, float)
    assert k.max_manifest_bytes == 1 << 30
    assert k.ring_slots == 8


def test_keyword_overrides_beat_env_and_none_is_ignored(env):
    env.setenv("ASYNCCKPT_SLOT_SIZE", "1MiB")
    env.setenv("ASYNCCKPT_CODEC", "raw")
    k = Knobs.from_env(slot_size=64 << 10, ring_size=256 << 10, codec=None)
    assert (k.slot_size, k.ring_size, k.codec) == (64 << 10, 256 << 10, "raw")


def test_knobs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Knobs().slot_size = 1  # type: ignore[misc]


@pytest.mark.parametrize("text,value", [
    ("4194304", 4 * MiB), ("4MiB", 4 * MiB), ("4M", 4 * MiB), ("4m", 4 * MiB), ("4MB", 4 * MiB),
    ("4mib", 4 * MiB), ("1GiB", 1 << 30), ("1G", 1 << 30), ("2k", 2048), ("2KiB", 2048),
    ("1T", 1 << 40), ("1TiB", 1 << 40), ("0", 0), ("512", 512), ("512B", 512), (" 64KiB ", 64 << 10),
])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "abc", "-1", "-1MiB", "1.5M", "M", "MiB", "4X", "4 Mi B",
                                  "0x10", "1e6"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


@pytest.mark.parametrize("kwargs,fragments", [
    ({"slot_size": 65536, "ring_size": 100_000}, ["ring_size", "multiple of slot_size (65536)", "100000"]),
    ({"slot_size": 65536, "ring_size": 4096}, ["ring_size", "4096"]),
    ({"slot_size": 5000}, ["slot_size", "multiple of 4096", "5000"]),
    ({"slot_size": 0}, ["slot_size", "0"]),
    ({"slot_size": 8192, "ring_size": 8192, "max_frame_bytes": 4096}, ["slot_size", "max_frame_bytes (4096)", "8192"]),
    ({"codec": "lz4"}, ["codec", "'lz4'", "zstd"]),
    ({"zstd_level": 23}, ["zstd_level", "23"]),
    ({"zstd_level": -8}, ["zstd_level", "-8"]),
    ({"connect_timeout": 0.0}, ["connect_timeout", "positive", "0.0"]),
    ({"shutdown_timeout": -1.0}, ["shutdown_timeout", "-1.0"]),
])
def test_validation_names_knob_and_value(env, kwargs, fragments):
    with pytest.raises(ValueError) as info:
        Knobs.from_env(**kwargs)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_validation_applies_to_env_values(env):
    env.setenv("ASYNCCKPT_RING_SIZE", "5MiB")
    with pytest.raises(ValueError, match=r"ring_size must be .*4194304.*got 5242880"):
        Knobs.from_env()
    env.setenv("ASYNCCKPT_RING_SIZE", "8MiB")
    env.setenv("ASYNCCKPT_CODEC", "gzip")
    with pytest.raises(ValueError, match="codec.*'gzip'"):
        Knobs.from_env()


def test_unparsable_env_value_names_variable(env):
    env.setenv("ASYNCCKPT_SLOT_SIZE", "lots")
    with pytest.raises(ValueError, match=r"ASYNCCKPT_SLOT_SIZE='lots' is not a valid int"):
        Knobs.from_env()
    env.delenv("ASYNCCKPT_SLOT_SIZE")
    env.setenv("ASYNCCKPT_CONNECT_TIMEOUT", "soon")
    with pytest.raises(ValueError, match=r"ASYNCCKPT_CONNECT_TIMEOUT='soon' is not a valid float"):
        Knobs.from_env()


def test_unknown_knob_is_named(env):
    with pytest.raises(ValueError, match=r"unknown knob\(s\) \['slot_sise'\]") as info:
        Knobs.from_env(slot_sise=4096)
    assert "slot_size" in str(info.value)  # lists the known ones


def test_connect_validates_knobs_before_touching_anything():
    import asyncckpt
    with pytest.raises(ValueError, match="ring_size"):
        asyncckpt.connect("/nonexistent/writer.sock", rank=0, world_size=1,
                          slot_size=65536, ring_size=65536 * 3 + 1)
    with pytest.raises(ValueError, match="unknown knob"):
        asyncckpt.connect("/nonexistent/writer.sock", rank=0, world_size=1, ring_slots=4)


def run_writer_cli(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncckpt", "writer", "--root",
                           str(tmp_path / "ckpt"), *args], capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)


def test_writer_cli_rejects_bad_knobs_with_exit_2(tmp_path):
    bad = run_writer_cli(tmp_path, "--knob", "bogus_knob=1")
    assert bad.returncode == 2 and "bogus_knob" in bad.stderr
    bad = run_writer_cli(tmp_path, "--knob", "slot_size=65536", "--knob", "ring_size=100000")
    assert bad.returncode == 2 and "ring_size" in bad.stderr and "100000" in bad.stderr


# -- bugs -------------------------------------------------------------------------------------------

def test_negative_zstd_level_from_env(env):
    env.setenv("ASYNCCKPT_ZSTD_LEVEL", "-3")
    assert Knobs.from_env().zstd_level == -3
