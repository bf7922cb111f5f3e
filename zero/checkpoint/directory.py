"""The checkpoint directory: versions, the atomic flip of ``latest``, keep-last-K, one writer.

    ckpt/v000002/  ckpt/v000003/  ckpt/latest -> v000003  ckpt/.zero-lock

Each version is a complete DCP checkpoint marked as ours (``.zero-version``: only those are
ever deleted); ``latest`` is flipped by one ``os.replace`` once DCP has written everything.
notes/08-checkpoints.md, "Versions" and "Loading beside a save", tells the rest.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import socket
import time

MARK = ".zero-version"  # in each version directory zero.save creates
LOCK = ".zero-lock"  # in the checkpoint directory, while a save runs


def lock(path: str) -> int:
    """Hold ``path``'s lock for one save (an ``flock``ed file naming its holder, let go by the
    kernel if it dies); refuse if a job holds it. ``unlock`` removes the file first: a job
    that opened the old file then finds, once locked, it is not the one at ``path``: again."""
    _refuse_plain_dcp(path)
    os.makedirs(path, exist_ok=True)
    file = os.path.join(path, LOCK)
    while True:
        fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 300).decode(errors="replace").strip() or "it has not said who"
            os.close(fd)
            raise RuntimeError(
                f"another job is saving into {path} ({holder}): two jobs must not save into one "
                "directory (each would delete the other's versions); give each job its own "
                "path (the lock goes with that save, or with its process if it dies)") from None
        if _same_file(fd, file):
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, saving since "
                 f"{time.strftime('%Y-%m-%d %H:%M:%S')}".encode())
    return fd


def unlock(path: str, fd: int) -> None:
    try:
        os.remove(os.path.join(path, LOCK))
    finally:
        os.close(fd)  # (closing lets go of the lock)


def _same_file(fd: int, file: str) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(file)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _refuse_plain_dcp(path: str) -> None:
    if os.path.exists(os.path.join(path, ".metadata")):
        raise ValueError(f"{path} holds a plain DCP checkpoint (it has a .metadata): zero.save "
                         "keeps its versions in a directory of their own; choose another path")


def next_version(path: str) -> str:
    """Create the next ``v<number>`` directory, past every existing one, and mark it ours."""
    _refuse_plain_dcp(path)
    os.makedirs(path, exist_ok=True)
    taken = [int(d[1:]) for d in os.listdir(path) if re.fullmatch(r"v\d+", d)]
    version = f"v{max(taken, default=0) + 1:06d}"
    os.mkdir(os.path.join(path, version))  # (fails rather than share a directory)
    with open(os.path.join(path, version, MARK), "w") as f:
        f.write("written by zero.save, which may delete this directory (keep=K)\n")
    return version


def commit(path: str, version: str, keep: int = 1) -> None:
    """Flip ``latest`` to ``version``, then delete our versions but the newest ``keep`` complete."""
    tmp = os.path.join(path, "latest.tmp")
    if os.path.lexists(tmp):
        os.remove(tmp)
    os.symlink(version, tmp)  # relative: the directory can be moved or copied whole
    os.replace(tmp, os.path.join(path, "latest"))  # atomic: the old target or the new, never none
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # the flip itself survives a power cut
    finally:
        os.close(fd)
    ours = _ours(path)
    complete = [v for v in ours if os.path.exists(os.path.join(path, v, ".metadata"))]
    kept = set(complete[-keep:]) | {version}
    for v in ours:
        if v not in kept:
            delete_version(path, v)
    for d in os.listdir(path):  # a deletion a crash cut short
        if d.startswith(".deleting.") and os.path.isfile(os.path.join(path, d, MARK)):
            shutil.rmtree(os.path.join(path, d), ignore_errors=True)


def _ours(path: str) -> list[str]:
    """The version directories zero.save made in ``path``, oldest first."""
    found = [d for d in os.listdir(path) if re.fullmatch(r"v\d+", d)
             and os.path.isfile(os.path.join(path, d, MARK))]
    return sorted(found, key=lambda d: int(d[1:]))


def delete_version(path: str, version: str) -> None:
    """Delete one of our versions, renamed out of sight first: a reader finds all of it or none."""
    gone = os.path.join(path, f".deleting.{version}.{os.getpid()}")
    try:
        os.rename(os.path.join(path, version), gone)
    except OSError:
        return
    shutil.rmtree(gone, ignore_errors=True)


def discard(path: str, version: str) -> None:
    """Delete a failed save's version (ours, and not what ``latest`` names)."""
    try:
        current = os.readlink(os.path.join(path, "latest"))
    except OSError:
        current = None
    if version != current and os.path.isfile(os.path.join(path, version, MARK)):
        delete_version(path, version)


def resolve(path: str) -> str:
    """The DCP directory to read: ``path`` itself, or the version ``path/latest`` names, once."""
    if os.path.lexists(os.path.join(path, ".metadata")):
        return path
    latest = os.path.join(path, "latest")
    try:
        return os.path.join(path, os.readlink(latest))
    except OSError:
        if os.path.isdir(latest):  # a copy that made the link a directory
            return latest
    raise FileNotFoundError(
        f"no checkpoint at {path}: neither {path}/.metadata (a DCP checkpoint) nor "
        f"{path}/latest (written by zero.save) exists")


def check_out_file(out_file: str, path: str, ckpt: str) -> None:
    """Refuse an ``out_file`` that would replace a file of the checkpoint, or is a directory."""
    where = os.path.realpath(os.path.dirname(os.path.abspath(out_file)))
    name = os.path.basename(out_file)
    inside = where == os.path.realpath(ckpt)
    ours = where == os.path.realpath(path) and (name in ("latest", "latest.tmp", LOCK)
                                                or re.fullmatch(r"v\d+", name))
    if inside or ours:
        raise ValueError(f"{out_file} is a file of the checkpoint {ckpt} itself: export would "
                         "replace it; write the consolidated model somewhere else")
    if os.path.isdir(out_file):
        raise ValueError(f"{out_file} is a directory: give export the name of the file to write "
                         f"(e.g. {os.path.join(out_file, 'model.pt')})")
