"""How ``load`` and ``export`` have DCP read a checkpoint: as data only, only as written, and
only from the version they resolved.

``dcp.load`` with its defaults unpickles ``.metadata`` and the values stored as bytes with no
allow-list, opens every file by its path as it reads it, and never checks torch.save's CRC-32s
(notes/08-checkpoints.md, "Trust", "Loading beside a save", "Loading what is not there").
``Reader`` hands DCP the checked ``.metadata``, opens each data file once and verifies every
record first; ``Planner`` loads values stored as bytes as data only (``_unplain``).
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from zero.checkpoint import safe_pickle, validate
from zero.checkpoint.validate import open_regular
from zero.checkpoint.safe_pickle import ADVICE, UntrustedCheckpointError

_DEPTH = 32  # a value stored as bytes: an option (a float, a tuple, a list of names)


class Reader(FileSystemReader):
    """DCP's file reader over one version's files, each opened once; records verified first."""

    def __init__(self, ckpt: str, metadata: Metadata):
        super().__init__(ckpt)
        self.ckpt, self.metadata = ckpt, metadata
        self.fs = _OpenFiles(self)
        self.fds: dict[str, int] = {}
        self.verified: set = set()

    def prepare(self, indices) -> None:
        """Open the files holding ``indices`` (storage_data keys) and verify each record."""
        for index in indices:
            if index not in self.verified:
                self._verify(index)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def fd(self, name: str) -> int:
        if name not in self.fds:
            self.fds[name] = open_regular(os.path.join(self.ckpt, name), self.ckpt)
        return self.fds[name]

    def read_metadata(self, *args, **kwargs) -> Metadata:
        self.metadata.storage_meta = self.metadata.storage_meta or StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id  # as FileSystemReader does
        return self.metadata

    def read_data(self, plan, planner):
        self.prepare({item.storage_index for item in plan.items})  # (prepared: nothing left)
        return super().read_data(plan, planner)

    def _verify(self, index) -> None:
        """A record's zip entries match their CRC-32s (0: none written), its pickle is safe for
        torch's unpickler, and a tensor's record holds what ``.metadata`` says."""
        where = self.metadata.storage_data[index]
        window = _Window(self.fd(where.relative_path), where.offset, where.length)
        try:
            with zipfile.ZipFile(window) as z:
                infos = z.infolist()
                for info in infos:
                    if info.compress_type != zipfile.ZIP_STORED:  # torch never compresses
                        raise zipfile.BadZipFile(f"{info.filename} is compressed")
                    if info.CRC:
                        with z.open(info) as entry:  # raises at the end if the CRC differs
                            while entry.read(1 << 24):
                                pass
                names = [info.filename for info in infos]
                if len(set(names)) < len(names):  # which one would torch read?
                    raise zipfile.BadZipFile("it names an entry twice")
                prefix = names[0].split("/")[0] if names else ""  # torch's archive name
                safe_pickle.dry_run(z.read(f"{prefix}/data.pkl"), where.relative_path)
            md = self.metadata.state_dict_metadata[index.fqn]
            if isinstance(md, TensorStorageMetadata):
                _check_tensor(window, infos, md, index.offset)
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, KeyError, TypeError,
                pickle.UnpicklingError, RuntimeError) as e:
            detail = str(e)[:300] if isinstance(e, zipfile.BadZipFile) else f"{type(e).__name__}: {str(e)[:300]}"
            raise RuntimeError(f"checkpoint {self.ckpt}: the bytes of {index.fqn} in "
                               f"{where.relative_path} are damaged ({detail}); load an earlier "
                               "checkpoint") from None
        self.verified.add(index)


def _check_tensor(window, infos, md: TensorStorageMetadata, offsets) -> None:
    """The record holds one tensor of the chunk's dtype and shape, its storage all there."""
    window.seek(0)
    t = torch.load(io.BufferedReader(window), map_location="meta", weights_only=True)
    sizes = next(c.sizes for c in md.chunks if c.offsets == offsets)
    if type(t) is not torch.Tensor or t.dtype != md.properties.dtype or t.shape != sizes:
        what = f"a {t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else f"a {type(t).__name__}"
        raise ValueError(f"it holds {what} where .metadata says a {md.properties.dtype} "
                         f"{tuple(sizes)}")
    data = [i for i in infos if i.filename.partition("/")[2].startswith("data/")]
    if len(data) != 1 or data[0].file_size != t.untyped_storage().nbytes():
        raise ValueError("its storage is not the one record its tensor reads")


class _OpenFiles(FileSystem):
    """What DCP's file reader opens: the reader's open file of that name, never the path."""

    def __init__(self, reader: Reader):
        self.reader = reader

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        with os.fdopen(os.dup(self.reader.fd(Path(path).name)), "rb") as f:
            yield f


class _Window(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of an open file, as a file of their own (``pread``)."""

    def __init__(self, fd: int, offset: int, length: int):
        self.fd, self.offset, self.length, self.pos = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = min(max((0, self.pos, self.length)[whence] + pos, 0), self.length)
        return self.pos

    def readinto(self, buffer) -> int:
        data = os.pread(self.fd, min(len(buffer), self.length - self.pos), self.offset + self.pos)
        memoryview(buffer)[: len(data)] = data
        self.pos += len(data)
        return len(data)


class Planner(DefaultLoadPlanner):
    """DCP's load planner, except that a value stored as bytes is loaded as data only."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        assert self.metadata is not None  # (set by DCP before it loads anything)
        where = f"{fqn} (in {self.metadata.storage_data[read_item.storage_index].relative_path})"
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:  # torch's allow-list refused it
            raise UntrustedCheckpointError(f"{where} is not plain data ({_reason(e)}): {ADVICE}") from None
        except Exception as e:  # noqa: BLE001 (a torch.save file cut or garbled)
            raise RuntimeError(f"{where} is corrupt ({type(e).__name__}: {str(e)[:300]})") from None
        if problem := _unplain(obj):
            raise RuntimeError(f"{where} is corrupt: it {problem}; load an earlier checkpoint")
        if self.flatten_state_dict:  # what DefaultLoadPlanner.load_bytes does with it
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _unplain(obj) -> str | None:
    """Why a value stored as bytes is more than plain data (notes/08, "Trust"), or None."""
    todo, seen = [(obj, 0)], set()
    while todo:
        o, depth = todo.pop()
        if isinstance(o, (str, bytes, int, float, complex, type(None), torch.dtype, torch.device)):
            continue
        if depth >= _DEPTH:
            return f"nests deeper than {_DEPTH} levels"
        if id(o) in seen:
            return "holds one part twice"
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            if o.numel() * o.element_size() > o.untyped_storage().nbytes():
                return (f"holds a view of {o.numel():,} elements on a storage of "
                        f"{o.untyped_storage().nbytes():,} bytes")
        elif isinstance(o, dict):
            todo += [(x, depth + 1) for kv in o.items() for x in kv]
        elif isinstance(o, (list, tuple, set, frozenset)):
            todo += [(x, depth + 1) for x in o]
    return None


def _reason(e: Exception) -> str:
    """What torch's weights-only loader refused, without its advice (here, not the fix)."""
    skip = ("Weights only load failed", "Please file an issue", "Check the documentation")
    lines = [line.strip().split(". Please")[0] for line in str(e).splitlines()]
    return "; ".join(line for line in lines if line and not line.startswith(skip)) or type(e).__name__


def template(meta: Metadata, wanted: Callable[[tuple], bool], start: dict | None = None,
             device=None) -> dict:
    """What ``read`` fills: an empty tensor per ``wanted`` entry (None: bytes), into ``start``."""
    out: dict = {} if start is None else start
    for key, md in meta.state_dict_metadata.items():
        path = meta.planner_data[key]
        if wanted(path):
            set_element(out, path, torch.empty(md.size, dtype=md.properties.dtype, device=device)
                        if isinstance(md, TensorStorageMetadata) else None)
    return out


def read_model(ckpt: str) -> dict:
    """Every "model" entry of ``ckpt``, whole, on the CPU (``export``), checked as ``load`` does."""
    meta, _ = validate.read_metadata(ckpt)
    tops = sorted({str(path[0]) for path in meta.planner_data.values()})
    if "model" not in tops:  # (an error, not an empty file)
        raise ValueError(
            f"{ckpt} holds no 'model' entry (its top-level keys: {validate.few(tops)}): export "
            "writes the model that zero.save and FSDP2 users save as dcp.save({'model': ..., "
            "'optim': ...}). Save the model's state dict under the key 'model'")
    validate.check_files(ckpt, meta)
    found = Reader(ckpt, meta)
    try:
        found.prepare([i for i in meta.storage_data if meta.planner_data[i.fqn][0] == "model"])
        whole = template(meta, lambda path: path[0] == "model", device="cpu")
        read(whole, found, alone=True)
    finally:
        found.close()
    return whole["model"]


def read(template: dict, reader: Reader, alone: bool = False) -> None:
    """``dcp.load`` into ``template`` through ``reader`` and ``Planner``; DCP's failures (every
    rank's) as one error. ``alone``: no collective (``export``; a unit's verified chunks)."""
    try:
        with warnings.catch_warnings():  # "assuming ... a single process": yes, on purpose
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(template, storage_reader=reader, planner=Planner(), no_dist=alone)
    except CheckpointException as e:
        failures = [exc for exc, _ in e.failures.values()]
        if refused := [f for f in failures if isinstance(f, UntrustedCheckpointError)]:
            raise UntrustedCheckpointError(f"checkpoint {reader.ckpt}: {refused[0]}") from None
        if gone := [f for f in failures if isinstance(f, FileNotFoundError)]:
            raise FileNotFoundError(str(gone[0])) from None
        lines = [f"rank {r}: {type(exc).__name__}: {exc}" for r, (exc, _) in e.failures.items()]
        raise RuntimeError(f"reading {reader.ckpt} failed; its data files are corrupt: " +
                           "; ".join(lines)) from None
