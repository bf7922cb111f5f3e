"""Reading ``.metadata`` runs no code: it is unpickled against an allow-list of what DCP puts in it.

A checkpoint is a file people download and share, and a pickle is a program: unpickling calls
whatever the file names. torch's DCP (2.13) reads ``.metadata`` with plain ``pickle.load``
(``FileSystemReader.read_metadata``), so a crafted one runs its code inside ``dcp.load``, on
every rank, before anything is checked. Here ``_Unpickler``'s ``find_class`` hands out only
the objects in ``ALLOWED``, what DCP's metadata is made of; anything else raises
``UntrustedCheckpointError``, naming it. The checkpoint's other pickles (the values stored as
bytes) are read in ``zero/checkpoint/reader.py``; the trust model is in notes/07-checkpoints.md,
"Trust".

[Note: why the allowed set is safe]
A pickle can call code only through objects that ``find_class`` gives it (GLOBAL,
STACK_GLOBAL, INST, OBJ, and the copyreg extension codes EXT1/2/4, which CPython resolves
through ``find_class`` too) or through a persistent id (refused below). With those it can:
- call one (REDUCE, NEWOBJ): each allowed class only stores its arguments (the dataclasses,
  ``torch.Size``), looks them up (the enum, the layouts), or parses a string (the paths, which
  are pure paths that never touch the file system); a dtype is not callable at all;
- BUILD one: the only ``__setstate__`` is ``TensorProperties``', which assigns five fields and
  maps an enum; otherwise BUILD updates the object's ``__dict__`` or calls ``setattr``,
- and APPEND/SETITEM on one call its ``append``/``__setitem__``, which none of them has.
So everything a pickle can reach is data or one of these harmless callables. One hole is
left: BUILD on an object that is not new (an allowed class itself, an enum member) changes it
for the whole process (a pickle can give ``StorageMeta`` a class attribute). ``load_metadata``
checks that none of them changed, and refuses the file (undoing the change) if one did.
"""

from __future__ import annotations

import io
import pickle
from pathlib import PurePosixPath, PureWindowsPath

import torch
import torch.distributed.checkpoint.metadata as md
from torch.distributed.checkpoint.filesystem import _StorageInfo


class UntrustedCheckpointError(RuntimeError):
    """The checkpoint holds a pickle that would do more than build data: it was not run."""


ADVICE = ("the file is corrupt, or was made to run code when loaded; nothing in it was run. "
          "Do not trust this checkpoint: load one you saved yourself or got from a source you "
          "trust (notes/07-checkpoints.md, 'Trust')")


def _layout(name: str) -> torch.layout:  # torch pickles a layout as _get_layout(str(layout))
    return _LAYOUTS[name]


def _posix_path(*parts: str) -> PurePosixPath:  # a PosixPath pickles as PosixPath(*parts)
    return PurePosixPath(*parts)


def _windows_path(*parts: str) -> PureWindowsPath:
    return PureWindowsPath(*parts)


_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
_DTYPES = {v for v in vars(torch).values() if isinstance(v, torch.dtype)}

# What DCP's .metadata holds (torch 2.13), as (module, name) -> the object handed out. From
# torch/distributed/checkpoint/metadata.py and filesystem.py, checked against the .metadata
# written by zero.save and by FSDP2 (dcp.save of get_state_dict), AdamW and SGD
# (tests/test_checkpoint_security.py). Containers, strings, numbers, bools and None need no
# import: pickle has opcodes for them.
ALLOWED: dict[tuple[str, str], object] = {
    # the dataclasses a Metadata is made of, and the enum TensorProperties pickles its
    # memory_format as
    **{("torch.distributed.checkpoint.metadata", name): getattr(md, name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")},
    # storage_data's values: which file, offset and length hold each chunk
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,  # sizes, chunk offsets and sizes
    **{("torch", str(d).removeprefix("torch.")): d for d in _DTYPES},  # TensorProperties.dtype
    ("torch.serialization", "_get_layout"): _layout,  # TensorProperties.layout
    # StorageMeta.checkpoint_id: FileSystemWriter's path (pathlib._local from Python 3.13 on)
    **{(module, name): make for module in ("pathlib", "pathlib._local") for name, make in (
        ("PosixPath", _posix_path), ("WindowsPath", _windows_path))},
}

# The allowed objects that a BUILD could change for the whole process: classes, enum members,
# our functions (dtypes and layouts have no __dict__; torch.Size, a C type, refuses setattr).
_SHARED = [o for o in ALLOWED.values() if hasattr(o, "__dict__")] + list(md._MEM_FORMAT_ENCODING)


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str):
        if (module, name) in ALLOWED:
            return ALLOWED[module, name]
        raise UntrustedCheckpointError(
            f"{self.where} asks for {module}.{name}, which DCP's metadata never holds: {ADVICE}")

    def persistent_load(self, pid):
        raise UntrustedCheckpointError(
            f"{self.where} holds a persistent id ({str(pid)[:80]!r}), which DCP's metadata "
            f"never does: {ADVICE}")


def load_metadata(data: bytes, where: str):
    """Unpickle ``data`` (the bytes of the file ``where``) with nothing but ``ALLOWED``.

    Raises ``UntrustedCheckpointError`` for anything else, or pickle's own error for a file
    that is not a pickle; what it returns, the caller still has to check (``checkpoint_dir``).
    """
    before = [(o, dict(vars(o))) for o in _SHARED]
    try:
        return _Unpickler(io.BytesIO(data), where).load()
    finally:
        _undo_changes(before, where)


def _undo_changes(before: list, where: str) -> None:
    changed = []
    for o, saved in before:
        now = vars(o)
        if now.keys() != saved.keys() or any(now[k] is not v for k, v in saved.items()):
            changed.append(repr(o))
            for k in now.keys() - saved.keys():
                delattr(o, k)
            for k, v in saved.items():
                if now.get(k) is not v:
                    setattr(o, k, v)
    if changed:
        raise UntrustedCheckpointError(
            f"{where} tries to change {', '.join(changed)} for the whole process, which DCP's "
            f"metadata never does (undone): {ADVICE}")
