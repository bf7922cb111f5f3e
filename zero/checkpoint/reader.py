"""How ``load`` and ``export`` have DCP read a checkpoint: as data only, and only as written.

``dcp.load`` with its defaults would, on every rank, unpickle ``.metadata`` again with plain
``pickle`` and load the values it stored as bytes (an optimizer's ``lr``, ``betas``, its
params' names) with ``torch.load(weights_only=False)``: either runs whatever code a crafted
checkpoint holds. And it trusts every byte: torch.save writes each record as a zip whose
entries carry a CRC-32, but ``torch.load`` never checks it, so a flipped bit in a tensor loads
as a wrong number. Here:

- ``Reader`` hands DCP the ``.metadata`` already read with the allow-list
  (``zero/checkpoint/safe_pickle.py``) and checked (``zero/checkpoint/directory.py``), and checks the CRC-32 of
  every record this rank reads, before DCP reads it;
- ``Planner`` loads the values stored as bytes with ``torch.load(weights_only=True)``;
- tensors DCP already loads with ``weights_only=True``.
``read`` runs ``dcp.load`` with both and turns its failures into one clear error.
"""

from __future__ import annotations

import io
import os
import pickle
import zipfile

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from zero.checkpoint.safe_pickle import ADVICE, UntrustedCheckpointError


class Reader(FileSystemReader):
    """DCP's file reader, given the checked metadata; it verifies each record it reads."""

    def __init__(self, ckpt: str, metadata: Metadata):
        super().__init__(ckpt)
        self.metadata = metadata

    def read_metadata(self, *args, **kwargs) -> Metadata:
        self.metadata.storage_meta = self.metadata.storage_meta or StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id  # as FileSystemReader does
        return self.metadata

    def read_data(self, plan, planner):
        for index in {item.storage_index for item in plan.items}:  # each record once
            self._verify(index.fqn, self.storage_data[index])
        return super().read_data(plan, planner)

    def _verify(self, fqn: str, where) -> None:
        """Check a record's zip entries against the CRC-32s torch.save wrote (a CRC of 0:
        written with ``torch.serialization.set_crc32_options(False)``, nothing to check)."""
        if where.transform_descriptors:  # compressed by a DCP extension: not a plain zip
            return
        with open(os.path.join(self.path, where.relative_path), "rb") as f:
            try:
                with zipfile.ZipFile(_Window(f, where.offset, where.length)) as z:
                    for info in z.infolist():
                        if info.compress_type != zipfile.ZIP_STORED:  # torch never compresses
                            raise zipfile.BadZipFile(f"{info.filename} is compressed")
                        if info.CRC:
                            with z.open(info) as entry:  # raises at the end if the CRC differs
                                while entry.read(1 << 24):
                                    pass
            except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
                raise RuntimeError(f"the bytes of {fqn} in {where.relative_path} are damaged "
                                   f"({e}); load an earlier checkpoint") from None


class _Window(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of an open file, as a file of their own."""

    def __init__(self, f, offset: int, length: int):
        self.f, self.offset, self.length, self.pos = f, offset, length, 0

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
        self.f.seek(self.offset + self.pos)
        n = self.f.readinto(memoryview(buffer)[: self.length - self.pos])
        self.pos += n
        return n


class Planner(DefaultLoadPlanner):
    """DCP's load planner, except that a value stored as bytes is loaded as data only."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        where = f"{fqn} (in {self.metadata.storage_data[read_item.storage_index].relative_path})"
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:  # torch's allow-list refused it
            raise UntrustedCheckpointError(f"{where} is not plain data ({_reason(e)}): {ADVICE}") from None
        except Exception as e:  # noqa: BLE001 (a torch.save file cut or garbled)
            raise RuntimeError(f"{where} is corrupt ({type(e).__name__}: {e})") from None
        if self.flatten_state_dict:  # what DefaultLoadPlanner.load_bytes does with it
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _reason(e: Exception) -> str:
    """What torch's weights-only loader refused, without its advice to load with
    ``weights_only=False`` or to allow the global: here, neither is the fix."""
    skip = ("Weights only load failed", "Please file an issue", "Check the documentation")
    lines = [line.strip().split(". Please")[0] for line in str(e).splitlines()]
    return "; ".join(line for line in lines if line and not line.startswith(skip)) or type(e).__name__


def read(template: dict, ckpt: str, metadata: Metadata, no_dist: bool = False) -> None:
    """``dcp.load`` into ``template`` through ``Reader`` and ``Planner``; DCP's failures (it
    gathers every rank's) become one error, the same on every rank."""
    try:
        dcp.load(template, storage_reader=Reader(ckpt, metadata), planner=Planner(),
                 no_dist=no_dist)
    except CheckpointException as e:
        failures = [exc for exc, _ in e.failures.values()]
        if refused := [f for f in failures if isinstance(f, UntrustedCheckpointError)]:
            raise UntrustedCheckpointError(f"checkpoint {ckpt}: {refused[0]}") from None
        lines = [f"rank {r}: {type(exc).__name__}: {exc}" for r, (exc, _) in e.failures.items()]
        raise RuntimeError(f"reading {ckpt} failed; its data files are corrupt: " +
                           "; ".join(lines)) from None
