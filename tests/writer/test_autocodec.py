"""codec="auto": the chooser picks the codec with the shortest predicted time to durable
from what it measured, and a writer with codec auto saves and loads bit-exact."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same, running_writer

import asyncckpt
from asyncckpt.format import encoding
from asyncckpt.format.encoding import FrameEncoder
from asyncckpt.format.layout import TensorSpec
from asyncckpt.storage.local import read_manifest
from asyncckpt.writer.autocodec import CodecChooser

GB = 1e9


def measured(threads: int, disk_gbps: float, encode_gbps: dict[str, float],
             ratio: dict[str, float], cores: int = 64) -> CodecChooser:
    """A chooser that has seen a lot of evidence (priors negligible)."""
    chooser = CodecChooser(threads, cores=cores)
    for codec in ("raw", "zstd", "bytegroup"):
        chooser.encoded(codec, int(100 * GB), int(100 * GB * ratio[codec]),
                        100 / encode_gbps[codec])
    chooser.written(int(100 * GB), 100 / disk_gbps)
    return chooser


CPU = {"raw": 10.0, "zstd": 0.6, "bytegroup": 1.0}
RATIO = {"raw": 1.0, "zstd": 0.9, "bytegroup": 0.8}


def test_fast_disk_picks_raw():
    choice = measured(2, 5.0, CPU, RATIO).choose()
    assert choice.codec == "raw"
    assert abs(choice.predicted["raw"] - 0.2) < 0.01  # 1 GB / 5 GB/s
    assert abs(choice.predicted["bytegroup"] - 0.5) < 0.01  # encode-bound: 1 GB / (2 x 1 GB/s)


def test_slow_disk_picks_bytegroup():
    choice = measured(2, 0.5, CPU, RATIO).choose()
    assert choice.codec == "bytegroup"
    assert abs(choice.predicted["bytegroup"] - 1.6) < 0.01  # 0.8 GB / 0.5 GB/s


def test_busy_cores_pick_raw_even_on_a_moderate_disk():
    busy = {"raw": 10.0, "zstd": 0.2, "bytegroup": 0.3}
    assert measured(1, 1.3, busy, RATIO).choose().codec == "raw"
    assert measured(8, 1.3, busy, RATIO).choose().codec == "bytegroup"


def test_writing_competes_with_encoding_for_few_cores():
    """2 cores, buffered writes at 1.5 GB/s, 1.2 GB/s per encoder thread (this VM): each
    stage alone would favour bytegroup, but both on 2 cores do not."""
    rates = {"raw": 10.0, "zstd": 0.6, "bytegroup": 1.2}
    two = measured(2, 1.5, rates, RATIO, cores=2).choose()
    assert two.codec == "raw"
    assert abs(two.predicted["bytegroup"] - (1 / 1.2 + 0.8 / 1.5) / 2) < 0.01
    assert measured(2, 1.5, rates, RATIO, cores=16).choose().codec == "bytegroup"


def test_zstd_wins_only_where_it_compresses_better():
    ratio = {"raw": 1.0, "zstd": 0.3, "bytegroup": 0.8}  # e.g. text-like or sparse data
    assert measured(4, 0.3, CPU, ratio).choose().codec == "zstd"


def test_estimates_follow_new_measurements():
    chooser = measured(2, 5.0, CPU, RATIO)
    assert chooser.choose().codec == "raw"
    for _ in range(10):  # the disk became slow (e.g. a network filesystem under load)
        chooser.save_done()
        chooser.written(int(GB), 1 / 0.3)
    assert chooser.choose().codec == "bytegroup"


def test_priors_choose_something_sensible():
    choice = CodecChooser(2).choose()
    assert choice.codec in ("raw", "bytegroup")
    assert set(choice.to_json()["predicted_s_per_gb"]) == {"raw", "zstd", "bytegroup"}


@pytest.mark.process  # the writer runs in its own process
def test_writer_with_codec_auto_saves_and_loads_bit_exact(tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {"w": (torch.randn(300_000, generator=g) * 0.02).bfloat16(),
             "m": torch.randn(200_000, generator=g) * 1e-4, "step": 3}
    with running_writer(tmp_path, "auto") as writer:
        with asyncckpt.connect(writer.address, rank=0, world_size=1, slot_size=64 << 10,
                               ring_size=256 << 10) as client:
            handles = [client.save(step, state) for step in (1, 2)]
            paths = [h.wait(60) for h in handles]
    for handle, path in zip(handles, paths):
        assert_same(state, asyncckpt.load(path))
        auto = handle.stats.auto
        part = read_manifest(path).ranks[0]
        assert auto["codec"] == part.codec == handle.stats.codec
        assert set(auto["predicted_s_per_gb"]) == {"raw", "zstd", "bytegroup"}


def test_trials_price_the_other_codecs_on_the_first_mib_of_a_frame():
    """A raw save tries the other codecs on a sample: each trial adds the sample's bytes
    (not the frame's) to their evidence, and the sample's ratio."""
    chooser = CodecChooser(threads=2, trial_every=1)
    before = {c: (e.raw, e.stored) for c, e in chooser._codecs.items()}
    frame = 4 << 20
    spec = TensorSpec("w", "F32", (frame // 4,), 0, frame)
    encoder = FrameEncoder("raw", 1, [spec], chooser=chooser)
    raw = memoryview(bytes(frame))  # zeros: every codec shrinks them to almost nothing
    encoder.encode(0, raw, {})
    for codec, e in chooser._codecs.items():
        added, stored = e.raw - before[codec][0], e.stored - before[codec][1]
        if codec == "raw":
            assert (added, stored) == (frame, frame)
        else:
            assert added == encoding._TRIAL_BYTES < frame
            assert 0 < stored < added / 100


def test_saves_too_small_to_measure_never_flip_the_codec():
    """0.1 MiB saves 'measured' the disk at 0.03 GB/s (fsync latency) and the choice
    flipped between raw, zstd and bytegroup every save."""
    chooser = measured(2, 5.0, CPU, RATIO)
    assert chooser.choose().codec == "raw"
    for _ in range(50):
        chooser.written(100 << 10, 0.003)  # 0.03 GB/s
        chooser.save_done(100 << 10)
        assert chooser.choose().codec == "raw"


def test_the_current_codec_stays_unless_another_is_clearly_faster():
    rates = {"raw": 10.0, "zstd": 0.6, "bytegroup": 1.0}
    chooser = measured(2, 2.5, rates, RATIO)  # raw 0.4 s/GB, bytegroup 0.5 s/GB
    assert chooser.choose().codec == "raw"
    for _ in range(3):  # the disk slows so that bytegroup is 5% faster: noise, kept
        chooser.save_done()
        chooser.written(int(100 * GB), 100 / 1.9)
    choice = chooser.choose()
    assert choice.predicted["bytegroup"] < choice.predicted["raw"] and choice.codec == "raw"
    for _ in range(5):  # much slower: bytegroup clearly wins
        chooser.save_done()
        chooser.written(int(100 * GB), 100 / 0.5)
    assert chooser.choose().codec == "bytegroup"
