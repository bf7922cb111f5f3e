"""Fuzzing a real ``.metadata``: single-bit flips and structured mutations, each loaded in a
fresh process under an address-space limit (tests/checkpoint/test_checkpoint_security.py's probe).

    python tests/checkpoint/test_checkpoint_fuzz.py 2000 500    # flips, mutations; a table of outcomes

Each probe runs ``zero.load`` (world size 1) and ``export`` on the damaged checkpoint. Allowed:
a load bitwise equal to the undamaged one, or an error of a known type that names the
checkpoint. Counted as failures: any other load (silent and wrong), any other error, running
out of the address space (the files' size, the model's, and ``SLACK``), a crash, a hang.

The structured mutations damage what .metadata says (sizes, offsets, records, paths, dtypes,
chunks); they do not relabel one valid checkpoint as another (two records of the same shape
swapped load as each other: a checkpoint's numbers are what it says they are, "Trust" in
notes/08-checkpoints.md).
"""

import collections
import copy
import os
import pickle
import random
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed.checkpoint.metadata as md

import zero

from harness import RankError, RankTimeout, run_ranks
from test_checkpoint_security import CLEAR, _load_and_export, _same, _system


def _flip(raw: bytes, rng: random.Random) -> tuple[str, bytes]:
    at, bit = rng.randrange(len(raw)), rng.randrange(8)
    out = bytearray(raw)
    out[at] ^= 1 << bit
    return f"flip byte {at} bit {bit}", bytes(out)


def _chunk(meta, rng):
    key = rng.choice(sorted(k for k, m in meta.state_dict_metadata.items()
                            if isinstance(m, md.TensorStorageMetadata) and m.chunks))
    return key, meta.state_dict_metadata[key]


def _record(meta, rng):
    index = rng.choice(sorted(meta.storage_data, key=lambda i: (i.fqn, tuple(i.offset or ()))))
    return index, meta.storage_data[index]


BIG = [0, 1, -1, 2**31, 2**40, 2**63 - 1]


def _number(value: int, rng) -> int:
    return rng.choice([value + 1, value - 1, value * 2, value // 2, *BIG])


def _mutate(meta, rng) -> str:
    """Damage ``meta`` in one way; says how."""
    kind = rng.choice(["chunk offset", "chunk size", "chunk twice", "chunk dropped",
                       "tensor size", "dtype", "record offset", "record length",
                       "record file", "record dropped", "record transformed", "path head",
                       "path index", "path longer", "key dropped", "bytes for a tensor"])
    if kind.startswith("chunk") or kind in ("tensor size", "dtype", "bytes for a tensor"):
        key, m = _chunk(meta, rng)
        c = rng.randrange(len(m.chunks))
        dim = rng.randrange(max(1, len(m.size)))
        if kind == "chunk offset" and m.size:
            offsets = list(m.chunks[c].offsets)
            offsets[dim] = max(0, _number(offsets[dim], rng))
            m.chunks[c].offsets = torch.Size(offsets)
        elif kind == "chunk size" and m.size:
            sizes = list(m.chunks[c].sizes)
            sizes[dim] = max(0, _number(sizes[dim], rng))
            m.chunks[c].sizes = torch.Size(sizes)
        elif kind == "chunk twice":
            m.chunks[rng.randrange(len(m.chunks))] = copy.deepcopy(m.chunks[c])
        elif kind == "chunk dropped":
            del m.chunks[c]
        elif kind == "tensor size" and m.size:
            size = list(m.size)
            size[dim] = max(0, _number(size[dim], rng))
            m.size = torch.Size(size)
        elif kind == "dtype":
            m.properties.dtype = rng.choice([torch.float16, torch.bfloat16, torch.float64,
                                             torch.int32, torch.bool, torch.uint8])
        else:  # "bytes for a tensor"
            meta.state_dict_metadata[key] = md.BytesStorageMetadata()
        return f"{kind} of {key}"
    if kind.startswith("record"):
        index, where = _record(meta, rng)
        if kind == "record offset":
            where.offset = max(0, _number(where.offset, rng))
        elif kind == "record length":
            where.length = max(0, _number(where.length, rng))
        elif kind == "record file":
            where.relative_path = rng.choice(["__0_0.distcp", "__1_0.distcp", "__2_0.distcp",
                                              "../__0_0.distcp", "", ".metadata"])
        elif kind == "record dropped":
            del meta.storage_data[index]
        else:
            where.transform_descriptors = ["zstd"]
        return f"{kind} of {index.fqn}"
    key = rng.choice(sorted(meta.planner_data))
    path = list(meta.planner_data[key])
    if kind == "path head":
        path[0] = rng.choice(["modem", "optim", "model", "x"])
    elif kind == "path index":
        path[-1] = _number(len(meta.state_dict_metadata), rng)
    elif kind == "path longer":
        path.append(rng.choice(["x", 0, 2**40]))
    else:  # "key dropped"
        del meta.state_dict_metadata[key]
        return f"{kind}: {key}"
    meta.planner_data[key] = tuple(path)
    return f"{kind} of {key}"


def _probe(pristine: str, metadata: bytes, work: str, expected) -> str:
    """Load and export ``pristine`` with ``metadata`` as its .metadata; the outcome."""
    ckpt = os.path.join(work, "ckpt")
    shutil.rmtree(ckpt, ignore_errors=True)
    shutil.copytree(pristine, ckpt)
    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        f.write(metadata)
    try:
        got = run_ranks(_load_and_export, 1, ckpt, timeout=60)[0]
    except RankTimeout:
        return "hang"
    except RankError as e:
        return f"crash: {str(e)[-200:]}"
    outcomes = []
    for path, (kind, value), (_, want) in zip(("load", "export"), got, expected):
        if kind == "loaded":
            outcomes.append("correct load" if _same(value, want) else "WRONG LOAD")
        elif kind in CLEAR and ckpt in value:
            outcomes.append(kind)
        else:
            outcomes.append(f"UNCLEAR {kind}: {value[:200]}")
    return " / ".join(outcomes)


def _save(rank, n, root):
    """UnevenMLP, stage 3, one AdamW step, saved (the checkpoint the security tests fuzz)."""
    s = _system("zero3")
    s.step(rank, 0)
    zero.save(root, s.model, s.opt)


def fuzz(root: str, flips: int, mutations: int, seed: int = 0) -> collections.Counter:
    """Save UnevenMLP (AdamW, 2 ranks), then probe ``flips`` random single-bit flips and
    ``mutations`` structured mutations of its .metadata; the outcomes counted."""
    run_ranks(_save, 2, os.path.join(root, "zero-mlp"))
    pristine = os.path.join(root, "zero-mlp", "latest")
    work = tempfile.mkdtemp(dir=root)
    expected = run_ranks(_load_and_export, 1, pristine)[0]
    assert [kind for kind, _ in expected] == ["loaded", "loaded"], expected
    raw = open(os.path.join(pristine, ".metadata"), "rb").read()
    rng, tally = random.Random(seed), collections.Counter()
    for i in range(flips + mutations):
        if i < flips:
            what, data = _flip(raw, rng)
        else:
            meta = pickle.loads(raw)  # (our own file: trusted)
            what, data = _mutate(meta, rng), None
            data = pickle.dumps(meta)
        outcome = _probe(pristine, data, work, expected)
        tally["flip" if i < flips else "mutation", outcome] += 1
        if any(bad in outcome for bad in ("WRONG", "UNCLEAR", "crash", "hang", "MemoryError")):
            print(f"  {what}: {outcome}", flush=True)
    return tally


def test_a_few_flips_and_mutations(tmp_path):
    """The runner itself, on a few probes (the measured run is the script's)."""
    tally = fuzz(str(tmp_path), 3, 5, seed=1)
    bad = {k: n for k, n in tally.items()
           if any(w in k[1] for w in ("WRONG", "UNCLEAR", "crash", "hang", "MemoryError"))}
    assert not bad, bad


if __name__ == "__main__":
    torch.set_num_threads(1)  # (the ranks are forked from here: see tests/conftest.py)
    flips, mutations = (int(a) for a in sys.argv[1:3]) if len(sys.argv) > 2 else (2000, 500)
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as root:
        tally = fuzz(root, flips, mutations)
    print(f"{flips} flips and {mutations} mutations of .metadata in {time.monotonic() - start:.0f} s, "
          f"torch {torch.__version__}; outcomes (zero.load / export):")
    for (kind, outcome), count in sorted(tally.items()):
        print(f"  {kind:8s} {count:5d}  {outcome}")
