"""Which S3 client the object-store backend uses, chosen with numbers measured here.

Each candidate runs in a process of its own against one SeaweedFS server on loopback:
import time (the writer starts it), a multipart upload of `--mib` MiB fed part by part from
one reused buffer (what the writer's pipeline does: the client must not copy the whole
object), and a download by parallel ranged GETs into one preallocated buffer (what a
verified load does). Peak RSS above the process's RSS before each transfer (the
destination buffer already touched) is the client's own memory for it. Medians over
`--reps` runs, candidates interleaved.

    python -m benchmarks.s3_clients --mib 256 --reps 3 --out benchmarks/results/s3_clients.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MiB = 1 << 20
PART = 8 * MiB
IN_FLIGHT = 4
CLIENTS = ("obstore", "boto3", "s3fs")


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def run_one(client: str, mib: int, bucket: str) -> dict[str, float]:
    """One candidate's figures, in this process (called in a fresh interpreter)."""
    start = time.perf_counter()
    if client == "obstore":
        import obstore
        from obstore.store import S3Store
    elif client == "boto3":
        from concurrent.futures import ThreadPoolExecutor

        import boto3
    else:
        from concurrent.futures import ThreadPoolExecutor

        import s3fs
    imported = time.perf_counter() - start
    size = mib * MiB
    part = bytearray(os.urandom(PART))
    key = f"bench/{client}-{os.getpid()}"
    out = bytearray(b"\x01") * size  # touched now: the peaks below are the client's own
    _reset_peak()
    base = _rss()

    t0 = time.perf_counter()
    if client == "obstore":
        store = S3Store(bucket)
        with obstore.open_writer(store, key, buffer_size=PART,
                                 max_concurrency=IN_FLIGHT) as w:
            for _ in range(size // PART):
                w.write(part)
    elif client == "boto3":
        s3 = boto3.client("s3")
        up = s3.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        with ThreadPoolExecutor(IN_FLIGHT) as pool:
            done = list(pool.map(lambda n: {"PartNumber": n, "ETag": s3.upload_part(
                Bucket=bucket, Key=key, UploadId=up, PartNumber=n, Body=bytes(part))["ETag"]},
                range(1, size // PART + 1)))
        s3.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=up,
                                     MultipartUpload={"Parts": done})
    else:
        fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": os.environ["AWS_ENDPOINT_URL"]})
        with fs.open(f"{bucket}/{key}", "wb", block_size=PART) as f:
            for _ in range(size // PART):
                f.write(part)
    upload = time.perf_counter() - t0
    upload_rss = _rss() - base
    _reset_peak()
    base = _rss()

    t0 = time.perf_counter()
    view = memoryview(out)
    if client == "obstore":
        starts = list(range(0, size, PART))
        got = obstore.get_ranges(store, key, starts=starts,
                                 ends=[min(s + PART, size) for s in starts])
        for s, b in zip(starts, got):
            view[s:s + len(b)] = memoryview(b)
    elif client == "boto3":
        def fetch(s: int) -> None:
            body = s3.get_object(Bucket=bucket, Key=key,
                                 Range=f"bytes={s}-{min(s + PART, size) - 1}")["Body"]
            view[s:s + PART] = body.read()
        with ThreadPoolExecutor(IN_FLIGHT) as pool:
            list(pool.map(fetch, range(0, size, PART)))
    else:
        def fetch(s: int) -> None:
            view[s:s + PART] = fs.cat_file(f"{bucket}/{key}", start=s, end=min(s + PART, size)) \
                if hasattr(fs, "cat_file") else _s3fs_range(fs, f"{bucket}/{key}", s, PART)
        with ThreadPoolExecutor(IN_FLIGHT) as pool:
            list(pool.map(fetch, range(0, size, PART)))
    download = time.perf_counter() - t0
    assert bytes(out[:PART]) == bytes(part), "download returned other bytes"
    return {"import_s": imported, "upload_gbps": size / upload / 1e9,
            "download_gbps": size / download / 1e9,
            "upload_rss_mib": upload_rss / MiB, "download_rss_mib": (_rss() - base) / MiB}


def _s3fs_range(fs: object, path: str, start: int, length: int) -> bytes:
    with fs.open(path, "rb", block_size=length) as f:  # type: ignore[attr-defined]
        f.seek(start)
        return f.read(length)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--bucket", default="ckpt", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.mib, args.bucket)))
        return
    from benchmarks.s3server import SeaweedServer
    runs: dict[str, list[dict[str, float]]] = {c: [] for c in CLIENTS}
    with tempfile.TemporaryDirectory() as tmp, SeaweedServer(Path(tmp) / "data") as server:
        env = {**os.environ, **server.env()}
        for _ in range(args.reps):
            for client in CLIENTS:
                done = subprocess.run([sys.executable, "-m", "benchmarks.s3_clients",
                                       "--one", client, "--mib", str(args.mib)],
                                      env=env, capture_output=True, text=True)
                if done.returncode:
                    runs[client].append({"error": done.stderr.strip().splitlines()[-1]})
                else:
                    runs[client].append(json.loads(done.stdout.strip().splitlines()[-1]))
    lines = [f"# S3 clients against SeaweedFS on loopback ({args.mib} MiB, {PART // MiB} MiB "
             f"parts, {IN_FLIGHT} in flight, median of {args.reps})", "",
             "| client | version | import s | upload GB/s | download GB/s | upload peak RSS MiB "
             "| download peak RSS MiB |", "|---|---|---:|---:|---:|---:|---:|"]
    from importlib.metadata import version
    for client, rows in runs.items():
        ok = [r for r in rows if "error" not in r]
        if not ok:
            lines.append(f"| {client} | {version(client)} | failed: {rows[0]['error']} ||||")
            continue
        med = {k: statistics.median(r[k] for r in ok) for k in ok[0]}
        lines.append(f"| {client} | {version(client)} | {med['import_s']:.2f} | "
                     f"{med['upload_gbps']:.3f} | {med['download_gbps']:.3f} | "
                     f"{med['upload_rss_mib']:.0f} | {med['download_rss_mib']:.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
