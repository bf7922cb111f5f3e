"""The checkpoint directory: versions, the atomic flip of ``latest``, and checking what is on disk.

[Note: atomic commit]
    ckpt/v000002/        one complete DCP checkpoint: .metadata + one file per rank
    ckpt/v000003/        being written, or left behind by a crash: nothing points at it
    ckpt/latest -> v000003   a relative symlink, flipped by one os.replace once all is written
DCP writes ``.metadata`` only after every rank has written its data, and we flip ``latest``
only after that, so a crash at any moment leaves ``latest`` at a complete checkpoint.
``load`` and FSDP2 users read ``ckpt/latest``; any plain DCP directory loads too.

Checks happen before any byte is read or any collective runs, so every rank raises the same
error: a missing or corrupt ``.metadata``, a data file shorter than ``.metadata`` says
(truncated), or keys and shapes that differ from the model's (another model).
"""

from __future__ import annotations

import os
import re
import shutil

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata


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


def read_metadata(ckpt: str) -> Metadata:
    """``.metadata``: every key's full shape and dtype, and where each chunk's bytes are."""
    try:
        meta = FileSystemReader(ckpt).read_metadata()
    except Exception as e:  # noqa: BLE001 (any unpickling failure means the same)
        raise RuntimeError(
            f"{ckpt}/.metadata is corrupt ({type(e).__name__}: {e}); load an earlier "
            "checkpoint") from e
    if not meta.planner_data:
        raise ValueError(f"{ckpt} was not saved as a nested state dict {{'model': ..., 'optim': ...}}")
    return meta


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
