"""Control channel: private runtime dir, keys, JSON messages."""

from __future__ import annotations

import multiprocessing
import os
import threading

import pytest

from asyncckpt.errors import WriterUnavailableError
from asyncckpt.ipc import protocol


def test_runtime_dir_must_be_private(tmp_path, monkeypatch):
    private = tmp_path / "rt"
    monkeypatch.setenv("ASYNCCKPT_RUNTIME_DIR", str(private))
    assert protocol.runtime_dir() == private and (private.stat().st_mode & 0o777) == 0o700
    private.chmod(0o755)
    with pytest.raises(WriterUnavailableError, match="mode 0700"):
        protocol.runtime_dir()


def test_handshake_and_messages(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCCKPT_RUNTIME_DIR", str(tmp_path / "rt"))
    sock, address, key = protocol.create_endpoint()
    assert (os.stat(protocol.key_path(address)).st_mode & 0o777) == 0o600
    assert protocol.read_authkey(address) == key
    served = {}

    def serve() -> None:
        conn = protocol.accept(sock.accept()[0], key, timeout=5)
        served["msg"] = protocol.recv(conn)
        protocol.send(conn, "welcome", n=[1, 2])
        conn.close()

    thread = threading.Thread(target=serve)
    thread.start()
    conn = protocol.dial(address, key, timeout=5)
    protocol.send(conn, "hello", rank=3)
    assert protocol.recv(conn) == {"op": "welcome", "n": [1, 2]}
    thread.join()
    assert served["msg"] == {"op": "hello", "rank": 3}
    conn.close()

    def refuse() -> None:
        with pytest.raises((multiprocessing.AuthenticationError, OSError, EOFError)):
            protocol.accept(sock.accept()[0], key, timeout=5)

    thread = threading.Thread(target=refuse)
    thread.start()
    with pytest.raises(WriterUnavailableError, match="refused"):
        protocol.dial(address, b"wrong key", timeout=5)
    thread.join()
    sock.close()
    protocol.remove_endpoint(address)
    with pytest.raises(WriterUnavailableError, match="no writer"):
        protocol.dial(address, key, timeout=1)


def test_endpoints_of_dead_writers_are_swept(tmp_path, monkeypatch):
    rt = tmp_path / "rt"
    monkeypatch.setenv("ASYNCCKPT_RUNTIME_DIR", str(rt))
    protocol.runtime_dir()
    dead = [rt / "writer-999999999-abcd.sock", rt / "writer-999999999-abcd.key"]
    live = rt / f"writer-{os.getpid()}-beef.key"
    for path in dead + [live]:
        path.write_text("x")
    sock, address, _ = protocol.create_endpoint()
    assert not any(p.exists() for p in dead) and live.exists()
    sock.close()
    protocol.remove_endpoint(address)
