"""What is checked on disk before a byte of data is read: ``.metadata``, the fit, the files.

Every check runs before any collective that moves data, and none allocates more than the files
hold (``safe_pickle.py``'s second note): ``read_metadata`` (``_malformed``: what DCP relies on),
``check_fits`` (this model's), ``check_files`` (regular files, not truncated). Messages never print
a ``repr`` of what a file built. notes/08-checkpoints.md, "Trust", "Loading what is not there".
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import stat

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                   Metadata, MetadataIndex, StorageMeta,
                                                   TensorProperties, TensorStorageMetadata)

from zero.checkpoint import safe_pickle

_PATH_PARTS = 64  # a key's path is a state dict's nesting: DCP's are a few levels deep


def read_metadata(ckpt: str) -> tuple[Metadata, str]:
    """``.metadata``, read without running code and checked; and a SHA-256 the ranks compare."""
    file = os.path.join(ckpt, ".metadata")
    with os.fdopen(open_regular(file, ckpt), "rb") as f:  # (no FIFO blocks us)
        data = f.read()
    try:
        meta = safe_pickle.load_metadata(data, file)
    except safe_pickle.UntrustedCheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 (any unpickling failure means the same)
        raise RuntimeError(f"{file} is corrupt ({type(e).__name__}: {str(e)[:200]}); load an "
                           "earlier checkpoint") from None
    if isinstance(meta, Metadata) and not meta.planner_data:
        raise ValueError(f"{ckpt} was not saved as a nested state dict {{'model': ..., 'optim': ...}}")
    try:
        problem = _malformed(meta)
    except (AttributeError, TypeError, RecursionError) as e:  # a field missing, a wrong type
        problem = f"{type(e).__name__}: {str(e)[:200]}"
    if problem:
        raise RuntimeError(f"{file} is corrupt: {problem}; load an earlier checkpoint")
    return meta, hashlib.sha256(data).hexdigest()


def open_regular(file: str, ckpt: str) -> int:
    """``file`` opened without blocking (a FIFO cannot hang it), refused unless a regular file
    (symlinks followed), checked on the open file (nothing can be swapped in between the check and the read)."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise vanished(ckpt) if not os.path.isdir(ckpt) else FileNotFoundError(
            f"{file} is missing: the checkpoint is incomplete; load an earlier one") from None
    if error := _not_regular(os.fstat(fd), file):
        os.close(fd)
        raise error
    return fd


def vanished(ckpt: str) -> FileNotFoundError:
    """The error for a version deleted while this rank read it."""
    return FileNotFoundError(
        f"{ckpt} no longer exists: it was deleted while it was being read, most likely by a "
        f"zero.save into {os.path.dirname(ckpt) or '.'}, which keeps only its last versions. "
        "Load again; or save with keep=2 or more, so that a reader of the previous version has "
        "the time of a whole save to finish")


def _not_regular(st: os.stat_result, where: str) -> RuntimeError | None:
    """The error for ``where``, unless ``st`` is a regular file's."""
    if stat.S_ISREG(st.st_mode):
        return None
    kinds = [(stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")]
    kind = next((name for test, name in kinds if test(st.st_mode)), "a special file")
    return RuntimeError(f"{where} is {kind}, not a regular file: a checkpoint's files are plain "
                        "files (reading this one could block forever); load another")


def _malformed(meta) -> str | None:
    """What in ``meta`` is not as DCP writes it, or None (notes/08, "Trust")."""
    if not isinstance(meta, Metadata):
        return f"it holds a {type(meta).__name__}, not DCP's Metadata"
    sdm, paths, stored = meta.state_dict_metadata, meta.planner_data, meta.storage_data
    if not (isinstance(sdm, dict) and isinstance(paths, dict) and isinstance(stored, dict)
            and isinstance(meta.storage_meta, (StorageMeta, type(None)))
            and isinstance(meta.version, (str, type(None)))):
        return "its fields have the wrong types"
    if problem := _paths_problem(sdm, paths):
        return problem
    records: dict[str, list] = {}
    for index, where in stored.items():
        if problem := _record_problem(index, where, sdm):
            return problem
        records.setdefault(where.relative_path, []).append((where.offset, where.length, index.fqn))
    for file, spans in records.items():
        spans.sort()
        for (o1, n1, k1), (o2, _, k2) in zip(spans, spans[1:]):
            if o1 + n1 > o2:
                return f"in {file}, the data of {k1} and of {k2} overlap"
    for key, m in sdm.items():
        if isinstance(m, BytesStorageMetadata):
            if MetadataIndex(key) not in stored:
                return f"{key} has no stored data"
            continue
        if not (isinstance(m, TensorStorageMetadata) and isinstance(m.properties, TensorProperties)
                and isinstance(m.properties.dtype, torch.dtype) and isinstance(m.size, torch.Size)
                and len(m.size) <= _PATH_PARTS and isinstance(m.chunks, list)):
            return f"{key} is described by a {type(m).__name__}, not a tensor's or bytes' metadata"
        if problem := _chunks_problem(key, m, stored):
            return problem
    return None


def _paths_problem(sdm: dict, paths: dict) -> str | None:
    """Each key the dotted join of its path, and the paths one tree (no leaf inside another)."""
    kinds: dict[tuple, str] = {}
    for key in sdm:
        path = paths.get(key) if isinstance(key, str) else None
        if not (isinstance(path, tuple) and 0 < len(path) <= _PATH_PARTS
                and all(type(p) in (str, int) for p in path)):
            return "a key of state_dict_metadata has no path in planner_data"
        if ".".join(map(str, path)) != key:
            return f"the key {key} does not match its path in planner_data"
        if any(type(p) is int and not 0 <= p < len(sdm) for p in path):  # a list's index
            return f"the path of {key} holds a list index beyond the checkpoint's entries"
        for i in range(1, len(path) + 1):
            kind = "leaf" if i == len(path) else "list" if type(path[i]) is int else "dict"
            if kinds.setdefault(path[:i], kind) != kind:
                return f"the path of {key} conflicts with another key's"
    return None


def _record_problem(index, where, sdm: dict) -> str | None:
    if not (isinstance(index, MetadataIndex) and isinstance(index.fqn, str)
            and isinstance(index.offset, (torch.Size, type(None)))):
        return f"storage_data has a key of type {type(index).__name__}"
    if index.fqn not in sdm:
        return f"storage_data has a record of {index.fqn}, which state_dict_metadata lacks"
    if not (isinstance(where, _StorageInfo) and _ints(where.offset, where.length)
            and isinstance(where.relative_path, str)):
        return f"the record of {index.fqn} is a {type(where).__name__} of the wrong fields"
    if where.transform_descriptors:  # a DCP extension's record (compressed): not plain bytes
        return (f"the record of {index.fqn} is transformed by a DCP extension, which zero.load "
                "does not read (it cannot bound what a transformed record holds); save without one")
    if where.relative_path in ("", ".", "..") or re.search(r"[/\\\0]", where.relative_path):
        return f"{index.fqn} is stored outside the checkpoint directory"
    return None


def _ints(*values) -> bool:
    return all(type(v) is int and v >= 0 for v in values)


def _chunks_problem(key: str, m: TensorStorageMetadata, stored: dict) -> str | None:
    """The chunks lie inside the tensor, disjoint and covering it, each with its record."""
    boxes = []
    for c in m.chunks:
        if not (isinstance(c, ChunkStorageMetadata) and isinstance(c.offsets, torch.Size)
                and isinstance(c.sizes, torch.Size) and len(c.offsets) == len(c.sizes) == len(m.size)
                and _ints(*c.offsets, *c.sizes)
                and all(o + n <= d for o, n, d in zip(c.offsets, c.sizes, m.size))):
            return f"{key} {tuple(m.size)} has a chunk outside it"
        where = stored.get(MetadataIndex(key, c.offsets))
        need = math.prod(c.sizes) * m.properties.dtype.itemsize
        if where is None:
            return f"{key}'s chunk at {tuple(c.offsets)} has no stored data"
        if where.length < need:
            return f"{key}'s chunk at {tuple(c.offsets)} needs {need} bytes, its record holds {where.length}"
        if need:
            boxes.append((tuple(c.offsets), tuple(c.sizes)))
    if pair := _overlapping(boxes):
        return f"the chunks of {key} at {pair[0]} and {pair[1]} overlap"
    covered = sum(math.prod(s) for _, s in boxes)
    if covered != math.prod(m.size):  # disjoint, inside: they cover it iff the counts add up
        return f"the chunks of {key} {tuple(m.size)} hold {covered} of its {math.prod(m.size)} elements"
    return None


def _overlapping(boxes: list[tuple[tuple, tuple]]) -> tuple | None:
    """Two boxes of ``boxes`` that intersect, or None (a sweep along dim 0)."""
    boxes = sorted(boxes)
    open_: list = []
    for offsets, sizes in boxes:
        start = offsets[0] if offsets else 0
        open_ = [(o, s) for o, s in open_ if not o or o[0] + s[0] > start]
        for o, s in open_:
            if all(a < b + m and b < a + n for a, n, b, m in zip(offsets, sizes, o, s)):
                return o, offsets
        open_.append((offsets, sizes))
    return None


def check_fits(ckpt: str, meta: Metadata, shapes: dict, with_optim: bool) -> dict:
    """Raise unless the checkpoint fits the model; returns ``{param: [elementwise state keys]}``."""
    md = meta.state_dict_metadata
    if not any(k.startswith("model.") for k in md) and any(k in shapes for k in md):
        # torchtitan's layout: keys its own state-dict converters choose (llama3's wqkv saved
        # as wq, wk, wv), the optimizer flattened under "optimizer".
        top = few(sorted(k for k in md if k in shapes))
        raise ValueError(
            f"checkpoint {ckpt} holds the model's entries at the top level ({top}), the "
            "layout torchtitan's CheckpointManager writes, not zero.save's (FSDP2's "
            "{'model': ..., 'optim': ...}); zero.load does not translate it. Resume it with "
            "torchtitan's CheckpointManager on the model sharded by zero.fully_shard, which "
            "loads it as it would into FSDP2")
    if odd := [k for k in md if k.startswith("model.") and meta.planner_data[k] != ("model", k[6:])]:
        raise RuntimeError(f"{ckpt}/.metadata is corrupt: {few(odd)} are not model entries as "
                           "DCP writes them, ('model', name); load an earlier checkpoint")
    size = {k: tuple(v.size) if isinstance(v, TensorStorageMetadata) else "bytes"
            for k, v in md.items()}
    want = {f"model.{k}": tuple(s) for k, s in shapes.items()}
    missing = [f"{k} {s}" for k, s in want.items() if k not in md]
    wrong = [f"{k}: checkpoint {size[k]}, model {s}" for k, s in want.items()
             if k in md and size[k] != s]
    extra = [k for k in md if k.startswith("model.") and k not in want]
    elementwise: dict = {}
    states = [(k, meta.planner_data[k]) for k in md
              if with_optim and meta.planner_data[k][:2] == ("optim", "state")]
    if with_optim and not any(k.startswith("optim.") for k in md):
        missing.append("optim (no optimizer state: pass optimizer=None to load the model only)")
    for k, (_, _, *rest) in states:
        name, *key = rest or [None]
        if not isinstance(name, str) or f"model.{name}" not in want:
            extra.append(k)
        elif (isinstance(size[k], tuple) and size[k] == tuple(shapes[name]) and len(key) == 1
              and isinstance(key[0], str)):
            elementwise.setdefault(name, []).append(key[0])
        elif isinstance(size[k], tuple) and len(size[k]) and len(shapes[name]):
            wrong.append(f"{k}: checkpoint {size[k]}, parameter {tuple(shapes[name])}")
    # A 0-d parameter's elementwise state is 0-d, like its step: the other parameters tell which.
    nd = {key for name, ks in elementwise.items() if len(shapes[name]) for key in ks}
    for name, ks in elementwise.items():
        if len(shapes[name]) == 0:
            ks[:] = [key for key in ks if key in nd]
    problems = [(missing, "missing from the checkpoint"), (wrong, "different shapes"),
                (extra, "in the checkpoint but not in the model")]
    if any(found for found, _ in problems):
        lines = [f"  {what}: {few(found)}" for found, what in problems if found]
        raise ValueError(f"checkpoint {ckpt} does not fit this model:\n" + "\n".join(lines) +
                         "\nWas it saved from another model or configuration? (The world size and "
                         "stage may differ; the parameters' names and shapes may not.)")
    check_files(ckpt, meta)
    return elementwise


def check_files(ckpt: str, meta: Metadata) -> None:
    """Every file ``.metadata`` names is a regular file holding every byte it points at."""
    ends: dict[str, list] = {}
    for index, where in meta.storage_data.items():
        ends.setdefault(where.relative_path, []).append((where.offset + where.length, index.fqn))
    short = []
    for name, needs in sorted(ends.items()):
        try:
            st = os.stat(os.path.join(ckpt, name))  # (follows symlinks: what a read opens)
        except FileNotFoundError:
            if not os.path.isdir(ckpt):
                raise vanished(ckpt) from None
            st = None
        if st is not None and (error := _not_regular(st, f"checkpoint {ckpt}: {name}")):
            raise error
        have = st.st_size if st is not None else -1
        if lacking := sorted({fqn for end, fqn in needs if have < end}):
            short.append(f"{name} ({'missing' if have < 0 else f'{have} bytes'}) lacks the "
                         f"data of {few(lacking)}")
    if short:
        raise RuntimeError(
            f"checkpoint {ckpt} is truncated: " + "; ".join(short) +
            ". It was cut short (a crash, a full disk, an unfinished copy): load an earlier one")


def few(items: list, n: int = 8) -> str:
    return "; ".join(items[:n]) + (f" (and {len(items) - n} more)" if len(items) > n else "")
