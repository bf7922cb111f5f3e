"""Disk offload's files: every write checked complete, every read checked, nothing left behind.

The optimizer state in these files is the only copy, so they are held to what a checkpoint is;
the directory (``zero-optimizer-state-*``) goes with the store. notes/17-family.md, "Disk offload".

[Note: who may delete a directory] Nothing that may still be needed: a dead store's directory
goes only if the ``flock`` on its mark is free (and the mark's host is this one: ``flock`` on some
network file systems is local to one machine); a SIGTERM handler only where death is the action;
marks are untrusted (``_OPEN_UNTRUSTED``, ``_MARK_BYTES``). Why: notes/17-family.md, "Disk offload".
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import stat
import tempfile
import threading
import weakref
import zlib

PREFIX = "zero-optimizer-state-"
MARK = ".zero-optimizer-state"  # in each directory a store makes: "<pid> <host>", flock-ed
_MARK_BYTES = 256  # "<pid> <host>\n": a Linux host name has at most 64 bytes
_OPEN_UNTRUSTED = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_HANDLER_LOCK = threading.Lock()  # (two stores made at once install their handlers in turn)


class StateFileError(RuntimeError):
    """A state file could not be written whole, or does not hold what was written."""


class StateFiles:
    """A fresh directory of state files under ``directory``, written and read checked.

    Args:
        directory: where to make it (a local SSD, say); dead stores' directories there go first.
    """

    def __init__(self, directory: str):
        os.makedirs(directory, exist_ok=True)
        self.reclaimed = reclaim(directory)
        self.root = tempfile.mkdtemp(prefix=PREFIX, dir=directory)
        self._mark = _hold(self.root)  # the lock that says "alive" until this process dies
        self.written: dict[str, tuple[int, int]] = {}  # path -> (bytes, CRC-32)
        _handle_sigterm(self.root, os.getpid())
        weakref.finalize(self, _remove, self.root, self._mark, os.getpid())

    def write(self, path: str, data) -> None:
        """Write ``data`` (a buffer of bytes) to ``path`` whole, or raise ``StateFileError``."""
        view = memoryview(data).cast("B")
        self.written.pop(path, None)  # (whatever was there is gone from here on)
        try:
            with open(path, "wb", buffering=0) as f:
                done = 0
                while done < len(view):
                    n = f.write(view[done:])
                    if not n:
                        raise OSError(f"the disk took {done} of {len(view)} bytes")
                    done += n
        except OSError as e:
            raise StateFileError(
                f"could not write {len(view)} bytes of optimizer state to {path} ({e}): the "
                f"disk under {os.path.dirname(path)} is full or over a size limit") from e
        self.written[path] = (len(view), zlib.crc32(view))

    def read_into(self, path: str, data) -> None:
        """Fill ``data`` with the file at ``path``, checked against what was written."""
        view = memoryview(data).cast("B")
        size, crc = self.written[path]
        fd = os.open(path, _OPEN_UNTRUSTED)  # (a file swapped for a pipe must not block)
        with open(fd, "rb", buffering=0) as f:
            info = os.fstat(fd)
            length = info.st_size if stat.S_ISREG(info.st_mode) else -1
            got = f.readinto(view) if length == size else -1
        if length != size or got != size:
            raise StateFileError(
                f"the optimizer state file {path} has {length} bytes, but {size} were written "
                "to it (-1: it is no longer a regular file): it was changed on disk, and the "
                "state is lost. Resume from a checkpoint (zero.load)")
        if zlib.crc32(view) != crc:
            raise StateFileError(
                f"the optimizer state file {path} does not hold what was written to it (its "
                "CRC-32 differs): the disk changed it, and the state is lost. Resume from a "
                "checkpoint (zero.load)")

    def remove(self, path: str) -> None:
        self.written.pop(path, None)
        os.remove(path)


def _hold(root: str) -> int:
    """``root``'s mark, locked for this process's life (named once locked); its descriptor."""
    making = os.path.join(root, MARK + ".making")
    fd = os.open(making, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (nobody else has it open yet)
    os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
    os.rename(making, os.path.join(root, MARK))
    return fd


def reclaim(directory: str) -> list[str]:
    """Remove (and return) the directories under ``directory`` of dead stores of this host."""
    gone = []
    for name in sorted(os.listdir(directory)):
        if not name.startswith(PREFIX):
            continue
        path = os.path.join(directory, name)
        fd = _take_if_abandoned(path)
        if fd is None:
            continue
        try:  # (under the lock: a second reclaim at the same time skips it)
            shutil.rmtree(path, ignore_errors=True)
        finally:
            os.close(fd)
        gone.append(path)
    return gone


def _take_if_abandoned(path: str) -> int | None:
    """``path``'s mark locked by us, if a dead store of this user and host made it; else None."""
    try:
        folder = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None  # not a directory (a link to one included)
    try:
        if not stat.S_ISREG(os.stat(MARK, dir_fd=folder, follow_symlinks=False).st_mode):
            return None  # (a pipe or a device is not even opened)
        fd = os.open(MARK, _OPEN_UNTRUSTED, dir_fd=folder)
    except OSError:
        return None  # no mark: not a store's, or one being made
    finally:
        os.close(folder)
    try:
        info = os.fstat(fd)
        if (stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid()
                and info.st_size <= _MARK_BYTES and _ours(os.read(fd, _MARK_BYTES))):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # refused while the owner lives
            return fd
    except OSError:
        pass  # locked: alive, in this PID namespace or another
    os.close(fd)
    return None


def _ours(mark: bytes) -> bool:
    """Whether a mark reads "<pid> <this host>", the pid one a process can have, and not
    this process's (its own live directories: NFS emulates flock with locks a process shares
    with itself, so its own lock would not keep it from taking them)."""
    words = mark.decode("ascii", errors="replace").split()
    return (len(words) == 2 and words[0].isascii() and words[0].isdigit()
            and len(words[0]) <= 10 and int(words[0]) < 2**31 and words[1] == socket.gethostname()
            and int(words[0]) != os.getpid())


def _remove(root: str, mark: int, owner: int) -> None:
    """Remove ``root`` and drop its lock, if this process made it (not a forked child)."""
    try:
        if os.getpid() == owner:
            shutil.rmtree(root, ignore_errors=True)
    finally:
        os.close(mark)


def _handle_sigterm(root: str, owner: int) -> None:
    """Install a SIGTERM handler for ``root`` (the module note), from the main thread only."""
    if threading.current_thread() is not threading.main_thread():
        return
    with _HANDLER_LOCK:
        previous = signal.getsignal(signal.SIGTERM)
        if previous is not signal.SIG_DFL and not getattr(previous, "_zero_state_files", False):
            return  # the program's own handler, SIG_IGN, or a C handler: the program decides

        def on_sigterm(signum, frame):
            if not getattr(signal.getsignal(signal.SIGTERM), "_zero_state_files", False):
                return  # called on by a handler installed after ours: the program decides
            if os.getpid() == owner:  # (a forked child: the directory is its parent's)
                shutil.rmtree(root, ignore_errors=True)
            if callable(previous):
                previous(signum, frame)  # the store made before this one: its directory
            else:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)  # die of it, as without us
                os.kill(os.getpid(), signal.SIGTERM)

        on_sigterm._zero_state_files = True  # type: ignore[attr-defined]
        signal.signal(signal.SIGTERM, on_sigterm)
