"""Disk offload's files: every write checked complete, every read checked, nothing left behind.

The optimizer state disk offload keeps (``zero/features/disk_offload.py``) is the only copy there is,
so its files are held to what a checkpoint is held to:

- a write that the disk cuts short (a full disk, a file-size limit) raises at once, naming
  the file and the error, and the caller still holds the bytes in memory;
- a read checks the file's length and a CRC-32 of its bytes against what was written: a bit
  flipped, a file truncated, lengthened or overwritten is a named error, never a step on
  wrong moments;
- the directory is this process's own (``zero-optimizer-state-*``, with a mark naming the
  process and host), removed when the store goes, on SIGTERM (torchrun's way of stopping a
  failed job's workers; the handler then calls the one it replaced), and, where a process
  died without cleaning up (SIGKILL, the OOM killer), by the next store made in the same
  directory on the same host: only directories with a mark whose process is gone.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import tempfile
import threading
import weakref
import zlib

PREFIX = "zero-optimizer-state-"
MARK = ".zero-optimizer-state"  # in each directory a store makes: "<pid> <host>"

# The directories this process made and has not removed yet: the SIGTERM handler removes
# them. (A signal handler is process-wide by nature; so is this list.)
_LIVE: set[str] = set()
_HANDLER_LOCK = threading.Lock()


class StateFileError(RuntimeError):
    """A state file could not be written whole, or does not hold what was written."""


class StateFiles:
    """A fresh directory of state files under ``directory``, written and read checked.

    Args:
        directory: where to make it (a local SSD, say); stale directories of dead processes
            found there are removed first.
    """

    def __init__(self, directory: str):
        os.makedirs(directory, exist_ok=True)
        self.reclaimed = reclaim(directory)
        self.root = tempfile.mkdtemp(prefix=PREFIX, dir=directory)
        with open(os.path.join(self.root, MARK), "w") as f:
            f.write(f"{os.getpid()} {socket.gethostname()}\n")
        self.written: dict[str, tuple[int, int]] = {}  # path -> (bytes, CRC-32)
        _LIVE.add(self.root)
        _handle_sigterm()
        weakref.finalize(self, _remove, self.root)

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
        with open(path, "rb", buffering=0) as f:
            length = os.fstat(f.fileno()).st_size
            got = f.readinto(view) if length == size else -1
        if length != size or got != size:
            raise StateFileError(
                f"the optimizer state file {path} has {length} bytes, but {size} were written "
                "to it: it was changed on disk, and the state is lost. Resume from a "
                "checkpoint (zero.load)")
        if zlib.crc32(view) != crc:
            raise StateFileError(
                f"the optimizer state file {path} does not hold what was written to it (its "
                "CRC-32 differs): the disk changed it, and the state is lost. Resume from a "
                "checkpoint (zero.load)")

    def remove(self, path: str) -> None:
        self.written.pop(path, None)
        os.remove(path)


def reclaim(directory: str) -> list[str]:
    """Remove the directories under ``directory`` that a store of a process now dead made on
    this host (its mark says which); returns them. Nothing without a mark is touched."""
    host, gone = socket.gethostname(), []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if not name.startswith(PREFIX) or os.path.islink(path) or not os.path.isdir(path):
            continue
        try:
            with open(os.path.join(path, MARK)) as f:
                pid, mark_host = f.read().split()
            pid = int(pid)
        except (OSError, ValueError):
            continue  # not one of ours, or one being made
        if mark_host == host and pid != os.getpid() and not _alive(pid):
            shutil.rmtree(path, ignore_errors=True)
            gone.append(path)
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's: alive
    return True


def _remove(root: str) -> None:
    _LIVE.discard(root)
    shutil.rmtree(root, ignore_errors=True)


def _handle_sigterm() -> None:
    """Install the SIGTERM handler once (from the main thread: elsewhere Python refuses, and
    a reclaim by the next run is what remains)."""
    if threading.current_thread() is not threading.main_thread():
        return
    with _HANDLER_LOCK:
        previous = signal.getsignal(signal.SIGTERM)
        if getattr(previous, "_zero_state_files", False):
            return

        def on_sigterm(signum, frame):
            for root in list(_LIVE):
                _remove(root)
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN:  # the default: die of SIGTERM, as without us
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)

        on_sigterm._zero_state_files = True
        signal.signal(signal.SIGTERM, on_sigterm)
