"""The checkpoint directory: versions, the atomic flip of ``latest``, and checking what is on disk.

[Note: atomic commit]
    ckpt/v000002/        one complete DCP checkpoint: .metadata + one file per rank
    ckpt/v000003/        being written, or left behind by a crash: nothing points at it
    ckpt/latest -> v000003   a relative symlink, flipped by one os.replace once all is written
DCP writes ``.metadata`` only after every rank has written its data, and we flip ``latest``
only after that, so a crash at any moment leaves ``latest`` at a complete checkpoint.
``load`` and FSDP2 users read ``ckpt/latest``; any plain DCP directory loads too.

Checks happen before any byte is read or any collective runs: a missing or corrupt
``.metadata``, one that asks for more than data (``zero/checkpoint/safe_pickle.py``: refused, not run), one
whose chunks do not tile their tensors or whose records overlap or point outside the directory,
a data file shorter than ``.metadata`` says (truncated), or keys and shapes that differ from
the model's (another model). ``load`` then has the ranks agree on the outcome.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import shutil

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                   Metadata, MetadataIndex, StorageMeta,
                                                   TensorProperties, TensorStorageMetadata)

from zero.checkpoint import safe_pickle


def next_version(path: str) -> str:
    """The next ``v<number>`` name, past every existing one (even a crashed attempt's)."""
    if os.path.exists(os.path.join(path, ".metadata")):
        raise ValueError(f"{path} holds a plain DCP checkpoint (it has a .metadata): zero.save "
                         "keeps its versions in a directory of their own; choose another path")
    os.makedirs(path, exist_ok=True)
    taken = [int(d[1:]) for d in os.listdir(path) if re.fullmatch(r"v\d+", d)]
    return f"v{max(taken, default=0) + 1:06d}"


def commit(path: str, version: str) -> None:
    """Flip ``latest`` to ``version`` atomically, then delete every other version."""
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
    for d in os.listdir(path):  # older versions and crashed attempts
        if re.fullmatch(r"v\d+", d) and d != version:
            shutil.rmtree(os.path.join(path, d), ignore_errors=True)


def resolve(path: str) -> str:
    """The DCP directory to read: ``path`` itself, or the version ``path/latest`` names."""
    for candidate in (path, os.path.join(path, "latest")):
        if os.path.isfile(os.path.join(candidate, ".metadata")):
            return candidate
    raise FileNotFoundError(
        f"no checkpoint at {path}: neither {path}/.metadata (a DCP checkpoint) nor "
        f"{path}/latest (written by zero.save) exists")


def read_metadata(ckpt: str) -> tuple[Metadata, str]:
    """``.metadata``, read without running code and checked for everything DCP relies on; and
    a fingerprint of its bytes (ranks compare it: they must read the same checkpoint)."""
    file = os.path.join(ckpt, ".metadata")
    with open(file, "rb") as f:
        data = f.read()
    try:
        meta = safe_pickle.load_metadata(data, file)
    except safe_pickle.UntrustedCheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 (any unpickling failure means the same)
        raise RuntimeError(f"{file} is corrupt ({type(e).__name__}: {e}); load an earlier "
                           "checkpoint") from e
    if isinstance(meta, Metadata) and not meta.planner_data:
        raise ValueError(f"{ckpt} was not saved as a nested state dict {{'model': ..., 'optim': ...}}")
    try:
        problem = _malformed(meta)
    except (AttributeError, TypeError) as e:  # an object lacks a field, or holds a wrong type
        problem = f"{type(e).__name__}: {e}"
    if problem:
        raise RuntimeError(f"{file} is corrupt: {problem}; load an earlier checkpoint")
    return meta, hashlib.sha256(data).hexdigest()


def _malformed(meta) -> str | None:
    """What in ``meta`` is not as DCP writes it, or None. Types first (a pickle of the wrong
    objects); then each tensor's chunks lie inside it and add up to it (overlaps between them
    are not looked for), each with a stored record big enough for its elements, in a plain
    file name, no two records overlapping: so what a load allocates cannot outgrow the files,
    and nothing is read from outside the checkpoint directory."""
    if not isinstance(meta, Metadata):
        return f"it holds a {type(meta).__name__}, not DCP's Metadata"
    sdm, paths, stored = meta.state_dict_metadata, meta.planner_data, meta.storage_data
    if not (isinstance(sdm, dict) and isinstance(paths, dict) and isinstance(stored, dict)
            and isinstance(meta.storage_meta, (StorageMeta, type(None)))
            and isinstance(meta.version, (str, type(None)))):
        return "its fields have the wrong types"
    records: dict[str, list] = {}
    for index, where in stored.items():
        if not (isinstance(index, MetadataIndex) and isinstance(where, _StorageInfo)
                and _ints(where.offset, where.length) and isinstance(where.relative_path, str)):
            return f"storage_data holds {index!r}: {where!r}"
        if where.relative_path in ("", ".", "..") or re.search(r"[/\\\0]", where.relative_path):
            return f"{index.fqn} is stored in {where.relative_path!r}, outside the checkpoint directory"
        records.setdefault(where.relative_path, []).append((where.offset, where.length, index.fqn))
    for file, spans in records.items():
        spans.sort()
        for (o1, n1, k1), (o2, _, k2) in zip(spans, spans[1:]):
            if o1 + n1 > o2:
                return f"in {file}, the data of {k1} and of {k2} overlap"
    for key, m in sdm.items():
        path = paths.get(key)
        if not (isinstance(key, str) and isinstance(path, tuple) and path
                and all(isinstance(p, (str, int)) for p in path)):
            return f"{key!r} has no path in planner_data"
        if isinstance(m, BytesStorageMetadata):
            if MetadataIndex(key) not in stored:
                return f"{key} has no stored data"
            continue
        if not (isinstance(m, TensorStorageMetadata) and isinstance(m.properties, TensorProperties)
                and isinstance(m.properties.dtype, torch.dtype) and isinstance(m.size, torch.Size)
                and isinstance(m.chunks, list)):
            return f"{key} is described by {m!r}"
        if problem := _chunks_problem(key, m, stored):
            return problem
    return None


def _ints(*values) -> bool:
    return all(isinstance(v, int) and v >= 0 for v in values)


def _chunks_problem(key: str, m: TensorStorageMetadata, stored: dict) -> str | None:
    covered = 0
    for c in m.chunks:
        if not (isinstance(c, ChunkStorageMetadata) and isinstance(c.offsets, torch.Size)
                and isinstance(c.sizes, torch.Size) and len(c.offsets) == len(c.sizes) == len(m.size)
                and _ints(*c.offsets, *c.sizes)
                and all(o + n <= d for o, n, d in zip(c.offsets, c.sizes, m.size))):
            return f"{key} {tuple(m.size)} has a chunk {c!r} outside it"
        where = stored.get(MetadataIndex(key, c.offsets))
        need = math.prod(c.sizes) * m.properties.dtype.itemsize
        if where is None:
            return f"{key}'s chunk at {tuple(c.offsets)} has no stored data"
        if not where.transform_descriptors and where.length < need:  # (compressed: can be less)
            return f"{key}'s chunk at {tuple(c.offsets)} needs {need} bytes, its record holds {where.length}"
        covered += math.prod(c.sizes)
    if covered != math.prod(m.size):
        return f"the chunks of {key} {tuple(m.size)} hold {covered} of its {math.prod(m.size)} elements"
    return None


def check_fits(ckpt: str, meta: Metadata, shapes: dict, with_optim: bool) -> dict:
    """Raise, naming keys and shapes, unless the checkpoint is complete and fits the model.

    Returns ``{param name: [elementwise optimizer state keys]}`` (state shaped like the param).
    """
    md = meta.state_dict_metadata
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
    for k, (_, _, name, *key) in states:
        if f"model.{name}" not in want:
            extra.append(k)
        elif isinstance(size[k], tuple) and size[k] == tuple(shapes[name]) and len(key) == 1:
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
        lines = [f"  {what}: {_few(found)}" for found, what in problems if found]
        raise ValueError(f"checkpoint {ckpt} does not fit this model:\n" + "\n".join(lines) +
                         "\nWas it saved from another model or configuration? (The world size and "
                         "stage may differ; the parameters' names and shapes may not.)")
    check_files(ckpt, meta)
    return elementwise


def check_has_model(ckpt: str, meta: Metadata) -> None:
    """``export`` writes what is under "model": a checkpoint without one is an error, not an
    empty file."""
    tops = sorted({str(path[0]) for path in meta.planner_data.values()})
    if "model" not in tops:
        raise ValueError(
            f"{ckpt} holds no 'model' entry (its top-level keys: {_few(tops)}): export writes "
            "the model that zero.save and FSDP2 users save as dcp.save({'model': ..., "
            "'optim': ...}). Save the model's state dict under the key 'model'")


def check_files(ckpt: str, meta: Metadata) -> None:
    """Every byte ``.metadata`` points at must exist: a truncated file names its keys."""
    short: dict[str, list[str]] = {}
    for index, where in meta.storage_data.items():
        file = os.path.join(ckpt, where.relative_path)
        have = os.path.getsize(file) if os.path.exists(file) else -1
        if have < where.offset + where.length:
            short.setdefault(f"{where.relative_path} ({'missing' if have < 0 else f'{have} bytes'})",
                             []).append(index.fqn)
    if short:
        raise RuntimeError(
            f"checkpoint {ckpt} is truncated: " + "; ".join(
                f"{f} lacks the data of {_few(sorted(set(keys)))}" for f, keys in short.items()) +
            ". It was cut short (a crash, a full disk, an unfinished copy): load an earlier one")


def _few(items: list, n: int = 8) -> str:
    return "; ".join(items[:n]) + (f" (and {len(items) - n} more)" if len(items) > n else "")


def plain_template(meta: Metadata, tops: set[str], device) -> dict:
    """Every entry under ``tops``: an empty whole tensor, or None for a pickled value."""
    template: dict = {}
    for key, md in meta.state_dict_metadata.items():
        path = meta.planner_data[key]
        if path[0] in tops:
            value = (torch.empty(md.size, dtype=md.properties.dtype, device=device)
                     if isinstance(md, TensorStorageMetadata) else None)
            set_element(template, path, value)
    return template
