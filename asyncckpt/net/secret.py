"""The job's secret: what a writer must prove before a partner sends or takes a replica.

Every node of a job reaches its root (the shared directory its durable checkpoints go
to), and a process outside the job normally does not -- or not as the job's user. So the
secret lives there, in a file only its owner can read, made once by whichever node comes
first: written whole to a private tmp file, then linked into place (`link` fails if the
name exists, on NFS too), so every node reads the same 32 bytes and none ever reads half
a file. An object-store root has no such file: the job passes the secret in
ASYNCCKPT_JOB_SECRET instead (as it passes its store credentials).
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path
from typing import Any

from asyncckpt.errors import ReplicaAuthError

SECRET_NAME = ".asyncckpt.job-secret"
SECRET_ENV = "ASYNCCKPT_JOB_SECRET"
SECRET_BYTES = 32
_FILE_MAX = 4 * SECRET_BYTES  # 64 hex characters and a newline fit; anything larger is not ours


def job_secret(root: str | os.PathLike[str] | Any) -> bytes:
    """The job's 32-byte secret: ASYNCCKPT_JOB_SECRET (hex) if set, else the root's
    secret file, created (mode 0600) if absent.

    Args:
        root: the job's checkpoint root: a local or shared directory, or a `Storage`
            (its `local_dir()`).
    Returns:
        32 bytes, the same on every node that reads the same root.
    Raises:
        ReplicaAuthError: the environment's secret is not 64 hex digits; the root is an
            object store and no secret is in the environment; the file is not a regular
            file of ours, is open to others, or malformed (a planted file is refused,
            never trusted).
    Hazard: anyone who can read the root as the job's user can read the secret; it
        guards replicas against other users and other jobs, not against the job's user.
    """
    env = os.environ.get(SECRET_ENV)
    if env:
        return _parse(env, f"${SECRET_ENV}")
    directory = _directory(root)
    path = directory / SECRET_NAME
    try:
        return _read(path)
    except FileNotFoundError:
        pass
    tmp = directory / f"{SECRET_NAME}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
    except OSError as e:
        raise ReplicaAuthError(f"cannot create the job secret in {directory}: "
                               f"{e.strerror or e}", file=str(tmp)) from None
    try:
        try:
            os.write(fd, (secrets.token_bytes(SECRET_BYTES).hex() + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another node made it first: everyone reads that one
        _fsync_dir(directory)
    finally:
        tmp.unlink(missing_ok=True)
    return _read(path)


def _directory(root: Any) -> Path:
    local = getattr(root, "local_dir", None)
    if callable(local):
        directory = local()
        if directory is None:
            raise ReplicaAuthError(f"the root {root} is not a directory of this machine: "
                                   f"pass the job secret in {SECRET_ENV} (64 hex digits)")
        return Path(directory)
    text = os.fspath(root)
    if "://" in text:
        raise ReplicaAuthError(f"the root {text} is an object store: pass the job secret in "
                               f"{SECRET_ENV} (64 hex digits)")
    return Path(text)


def _read(path: Path) -> bytes:
    """The secret in `path`, checked. Raises FileNotFoundError if there is none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise ReplicaAuthError(f"cannot read the job secret: {e.strerror or e}",
                               file=str(path)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise ReplicaAuthError(
                f"the job secret must be a regular file of uid {os.getuid()} with mode 0600 "
                f"(found uid {st.st_uid}, mode {stat.filemode(st.st_mode)}): refused",
                file=str(path))
        text = os.read(fd, _FILE_MAX + 1)
    finally:
        os.close(fd)
    if len(text) > _FILE_MAX:
        raise ReplicaAuthError("the job secret file is larger than a secret", file=str(path))
    return _parse(text.decode("ascii", "replace"), str(path))


def _parse(text: str, where: str) -> bytes:
    try:
        value = bytes.fromhex(text.strip())
    except ValueError:
        value = b""
    if len(value) != SECRET_BYTES:
        raise ReplicaAuthError(f"the job secret in {where} is not {2 * SECRET_BYTES} hex "
                               "digits")
    return value


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
