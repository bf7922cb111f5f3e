"""Reading ``.metadata`` runs no code: it is unpickled against an allow-list of what DCP puts in it.

torch's DCP (2.13) reads ``.metadata`` with plain ``pickle.load``
(``FileSystemReader.read_metadata``), so a crafted one runs its code inside ``dcp.load``, on
every rank. Here ``_Unpickler.find_class`` hands out only ``ALLOWED``; anything else raises
``UntrustedCheckpointError``, naming it. The trust model: notes/08-checkpoints.md, "Trust".

[Note: why the allowed set is safe]
Each allowed object only stores its arguments, looks them up or parses a string; a BUILD on one
that already exists would change it for the whole process: ``load_metadata`` undoes it and
refuses the file. notes/08-checkpoints.md, "Trust", "Why that set is safe".

[Note: memory and time in proportion to the file]
The pure-Python unpickler (a dict memo; BYTEARRAY8 refused), small keys only (a tuple's hash walks
all of it, in C); nothing else grows faster than the file (each opcode reads its own bytes and
makes one object). notes/08-checkpoints.md, "Trust", "Memory and time in proportion to the file".
"""

from __future__ import annotations

import io
import pickle
from typing import Any, ClassVar
from pathlib import PurePosixPath, PureWindowsPath

import torch
import torch.distributed.checkpoint.metadata as md
from torch.distributed.checkpoint.filesystem import _StorageInfo


class UntrustedCheckpointError(RuntimeError):
    """The checkpoint holds a pickle that would do more than build data: it was not run."""


ADVICE = ("the file is corrupt, or was made to run code when loaded; nothing in it was run. "
          "Do not trust this checkpoint: load one you saved yourself or got from a source you "
          "trust (notes/08-checkpoints.md, 'Trust')")


def _layout(name: str) -> torch.layout:  # torch pickles a layout as _get_layout(str(layout))
    if type(name) is not str:
        raise pickle.UnpicklingError(f"a layout is named by a string, not a {type(name).__name__}")
    return _LAYOUTS[name]


def _mem_format(value: int) -> md._MEM_FORMAT_ENCODING:  # the enum, called with its value
    if type(value) is not int:
        raise pickle.UnpicklingError(f"_MEM_FORMAT_ENCODING has int values, not {type(value).__name__}")
    return md._MEM_FORMAT_ENCODING(value)


def _posix_path(*parts: str) -> PurePosixPath:  # a PosixPath pickles as PosixPath(*parts)
    return PurePosixPath(*parts)


def _windows_path(*parts: str) -> PureWindowsPath:
    return PureWindowsPath(*parts)


_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
_DTYPES = {v for v in vars(torch).values() if isinstance(v, torch.dtype)}

# What DCP's .metadata holds (torch 2.13's checkpoint/metadata.py and filesystem.py, checked
# against zero.save's and FSDP2's: tests/checkpoint/test_checkpoint_security.py), as
# (module, name) -> the object handed out; each entry's field: notes/08, "Trust", the table.
ALLOWED: dict[tuple[str, str], object] = {
    **{("torch.distributed.checkpoint.metadata", name): getattr(md, name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta")},
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): _mem_format,
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
_SHARED = ([o for o in ALLOWED.values() if hasattr(o, "__dict__")]
           + [md._MEM_FORMAT_ENCODING, *md._MEM_FORMAT_ENCODING])

_KEY_NODES = 64  # a key's parts, at most: DCP's are a string, a path or a MetadataIndex
_ATOMS = (str, bytes, int, float, bool, type(None))


def _small_key(obj) -> bool:
    """Whether ``obj`` is a key like DCP's, cheap to hash: at most ``_KEY_NODES`` parts."""
    todo, left = [obj], _KEY_NODES
    while todo:
        o = todo.pop()
        left -= 1
        if left < 0:
            return False
        if type(o) in _ATOMS or isinstance(o, torch.dtype):
            continue
        if type(o) in (tuple, torch.Size) and len(o) <= left:
            todo.extend(o)
        elif type(o) is md.MetadataIndex:  # hashed as (fqn, offset)
            todo += [vars(o).get("fqn"), vars(o).get("offset")]
        else:
            return False
    return True


def _keys_checked(load, keys):
    """``load`` (an opcode that hashes ``keys(stack)``), once every key is small."""
    def checked(self):
        for key in keys(self.stack):
            if not _small_key(key):
                raise pickle.UnpicklingError(
                    f"it uses a {type(key).__name__} as a key that is not a small string, "
                    "number, tuple or MetadataIndex, as DCP's keys are")
        load(self)
    return checked


class _Unpickler(pickle._Unpickler):
    """The pure-Python unpickler (a dict memo), handing out only ``ALLOWED``, small keys only."""

    dispatch: ClassVar[dict[int, Any]] = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]
    stack: list[Any]  # (the pure-Python unpickler's, which load() sets; typeshed omits it)
    # (the pure-Python unpickler starts a new stack at each MARK: the items are the stack)
    for _op, _keys in ((pickle.SETITEM, lambda s: s[-2:-1]), (pickle.SETITEMS, lambda s: s[0::2]),
                       (pickle.DICT, lambda s: s[0::2]), (pickle.ADDITEMS, lambda s: s),
                       (pickle.FROZENSET, lambda s: s)):
        dispatch[_op[0]] = _keys_checked(dispatch[_op[0]], _keys)
    del _op, _keys

    def load_bytearray8(self):  # it allocates the count before reading; DCP never writes one
        raise pickle.UnpicklingError("it holds a BYTEARRAY8, which DCP's metadata never does")

    dispatch[pickle.BYTEARRAY8[0]] = load_bytearray8

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
            f"{self.where} holds a persistent id (a {type(pid).__name__}), which DCP's "
            f"metadata never does: {ADVICE}")


class _Opaque(dict):
    """What a dry run builds for whatever a pickle names: nothing is looked up or called."""

    def __init__(self, *args, **kwargs):
        super().__init__()

    def _ignored(self, *args):
        pass

    append = extend = __setstate__ = _ignored


class _DryRun(_Unpickler):
    """A torch.save pickle walked with ``_Opaque`` for each global: small keys, bounded tuples."""

    def __init__(self, data: bytes, where: str):
        super().__init__(io.BytesIO(data), where)
        self.budget = len(data)
        self.tuples: dict[int, tuple] = {}  # id -> (the tuple, its depth, its parts)

    def find_class(self, module: str, name: str):
        return _Opaque

    def persistent_load(self, pid):
        return _Opaque()

    def _tuple_checked(self):
        t = self.stack[-1]
        parts = [self.tuples.get(id(x), (x, 0, 1)) for x in t]
        depth, count = 1 + max((d for _, d, _ in parts), default=0), 1 + sum(c for *_, c in parts)
        if depth > _KEY_NODES or count > self.budget:
            raise pickle.UnpicklingError(
                f"it builds a tuple {depth} levels deep, of {count} parts counted whole: at most "
                f"{_KEY_NODES} levels, and no more parts than a pickle of {self.budget} bytes "
                "holds unshared")
        self.tuples[id(t)] = (t, depth, count)  # (holding t: its id stays its own)

    dispatch: ClassVar[dict[int, Any]] = dict(_Unpickler.dispatch)
    for _op in (pickle.TUPLE, pickle.TUPLE1, pickle.TUPLE2, pickle.TUPLE3):
        dispatch[_op[0]] = (lambda load: lambda self: (load(self), self._tuple_checked()))(
            dispatch[_op[0]])
    del _op


def dry_run(data: bytes, where: str) -> None:
    """Raise ``pickle.UnpicklingError`` unless ``data`` (a torch.save file's ``data.pkl``) is safe
    for torch's weights-only unpickler, which hashes every key it meets, in C (notes/08, Trust)."""
    _DryRun(data, where).load()


def load_metadata(data: bytes, where: str):
    """Unpickle ``data`` (the file ``where``) with nothing but ``ALLOWED``, else raise
    ``UntrustedCheckpointError`` (pickle's own error for a non-pickle)."""
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
