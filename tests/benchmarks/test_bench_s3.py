"""`make bench-s3`'s verdicts come from the figures of the run: a time to durable over
1.2x the plain upload, a cold load over 1.2x the plain download, or a writer over
256 MiB, is reported as a miss, and a peer that could not run is named as skipped, not
left out."""

from __future__ import annotations

import argparse

from benchmarks import s3


def runs(durable: float, rss: float, peer: object, load: float = 2.0) -> dict:
    limit = [{"durable_s": 10.0, "load_s": 1.0, "streamed_s": 1.5},
             {"durable_s": 12.0, "load_s": 3.0, "streamed_s": 2.5}]
    ours = [{"blocked_s": 0.0, "staged_s": 1.0, "durable_s": durable, "load_s": load,
             "load_into_s": 1.8, "writer_rss_anon_peak_mib": rss}] * 2
    return {"limit": limit, "asyncckpt": ours, "s3torchconnector": [peer] * 2}


def test_a_fast_small_writer_passes_and_the_ratios_are_to_the_median_limit():
    peer = {"blocked_s": 9.0, "staged_s": 9.0, "durable_s": 13.2, "load_s": 4.0}
    result = s3.summarize(runs(12.0, 160, peer), 1 << 30, argparse.Namespace(ring_mib=64, reps=2))
    assert result["limit"]["upload_s"] == 11.0 and result["limit"]["download_s"] == 2.0
    assert abs(result["methods"]["asyncckpt"]["durable_vs_limit"] - 12 / 11) < 1e-9
    assert abs(result["methods"]["s3torchconnector"]["durable_vs_limit"] - 1.2) < 1e-9
    assert result["limit"]["streamed_download_s"] == 2.0
    assert result["methods"]["asyncckpt"]["load_vs_limit_per_run"] == [2.0, 2.0 / 3.0]
    assert result["criteria"] == {"durable_within_1.2x_limit": True,
                                  "load_within_1.2x_limit": True,
                                  "writer_rss_within_256_mib": True}
    assert "MISS" not in s3.report(result)


def test_a_slow_or_large_writer_is_a_miss_and_a_missing_peer_is_named():
    result = s3.summarize(runs(13.5, 300, "not installed (no module)", load=2.5), 1 << 30,
                          argparse.Namespace(ring_mib=64, reps=2))
    assert result["criteria"] == {"durable_within_1.2x_limit": False,
                                  "load_within_1.2x_limit": False,
                                  "writer_rss_within_256_mib": False}
    text = s3.report(result)
    assert text.count("MISS") == 3 and "s3torchconnector | skipped: not installed" in text
