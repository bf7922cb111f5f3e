"""Loading a checkpoint never runs code (zero/checkpoint/safe_pickle.py), and whatever is wrong with a
checkpoint, every rank raises a clear error (never a crash, a hang, or a wrong load).

Every poison here would create a sentinel file if it ran; every test checks that none appears.
The checkpoints are real: written by ``zero.save`` and by FSDP2 (``dcp.save`` of
``get_state_dict``), then tampered with as an attacker, or a failing disk, would.
"""

import collections
import copy
import copyreg
import io
import os
import pickle
import resource
import shutil
import subprocess
import sys
import struct
import tempfile
import time
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as md
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.state_dict import get_state_dict

import zero
import zero.checkpoint
from compare import MODELS, System
from harness import RankError, RankTimeout, run_main, run_ranks
from zero.checkpoint.safe_pickle import ALLOWED, UntrustedCheckpointError, load_metadata

CLEAR = {"RuntimeError", "ValueError", "FileNotFoundError", "UntrustedCheckpointError"}


class Run:
    """Unpickling this runs ``how(command)``: what an attacker puts in a checkpoint."""

    def __init__(self, sentinel, how=os.system):
        self.how, self.command = how, f"touch {sentinel}"

    def __reduce__(self):
        if self.how is exec:
            return exec, (f"open({self.command.split()[1]!r}, 'w')",)
        if self.how is os.system:
            return os.system, (self.command,)
        return self.how, (self.command.split(),)  # subprocess.call(["touch", ...])


def _system(kind, seed=0):
    torch.manual_seed(seed)
    return System(kind, MODELS["mlp"](), "adamw")


def _save(rank, n, root):
    """One AdamW step, then the same model saved by us and by FSDP2 (GPT and UnevenMLP)."""
    for model in ("gpt", "mlp"):
        torch.manual_seed(0)
        z, f = System("zero3", MODELS[model](), "adamw"), System("fsdp2", MODELS[model](), "sgd")
        z.step(rank, 0)
        f.step(rank, 0)
        zero.save(os.path.join(root, f"zero-{model}"), z.model, z.opt)
        msd, osd = get_state_dict(f.model, f.opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, f"fsdp2-{model}"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("saved"))
    run_ranks(_save, 2, root)
    return {name: os.path.join(root, name, "latest" if name.startswith("zero") else "")
            for name in ("zero-gpt", "zero-mlp", "fsdp2-gpt", "fsdp2-mlp")}


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def _rewrite_metadata(ckpt, change):
    """Change the real Metadata and write it back as DCP does: only allowed classes in it."""
    with open(os.path.join(ckpt, ".metadata"), "rb") as f:
        meta = pickle.load(f)  # our own file, just written: trusted
    change(meta)
    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        pickle.dump(meta, f)


def _point_at(ckpt, key, payload):
    """Append ``payload`` to a data file and make ``key``'s record point at it."""
    def change(meta):
        where = next(w for i, w in meta.storage_data.items() if i.fqn == key)
        file = os.path.join(ckpt, where.relative_path)
        where.offset, where.length = os.path.getsize(file), len(payload)
        with open(file, "ab") as f:
            f.write(payload)
    _rewrite_metadata(ckpt, change)


def _saved(obj) -> bytes:
    """``obj`` as DCP stores a value as bytes: a torch.save file."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _try_load(rank, n, paths):
    """zero.load on every rank (``paths[rank]``); return what it raised, and how fast."""
    s, start = _system("zero3", seed=1), time.monotonic()
    try:
        zero.load(paths[rank], s.model, s.opt)
        return "loaded", "", time.monotonic() - start
    except Exception as e:  # noqa: BLE001 (the test looks at what it is)
        return type(e).__name__, str(e), time.monotonic() - start


def _export(ckpt, out):
    return run_main(["export", ckpt, out])  # forked: code run by a load could not reach pytest


# ---- the attack, and the same in a data file ---------------------------------------


def test_poisoned_metadata_is_refused_on_every_rank_and_by_export_and_runs_nothing(saved, tmp_path):
    sentinel = tmp_path / "SENTINEL"
    ckpt = _copy(saved["zero-mlp"], tmp_path / "ckpt")
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(Run(sentinel)))
    # rank 1 alone sees the poison (a node-local copy): rank 0 must not wait for it forever
    for paths in [(ckpt, ckpt), (saved["zero-mlp"], ckpt)]:
        got = run_ranks(_try_load, 2, paths, timeout=30)
        print(f"rank 0 sees {paths[0]}:", got[0][:2])
        assert [kind for kind, _, _ in got] == ["UntrustedCheckpointError"] * 2
        assert all("posix.system" in msg and "Do not trust this checkpoint" in msg for _, msg, _ in got)
        assert max(t for _, _, t in got) < 5
    done = _export(ckpt, str(tmp_path / "out.pt"))
    print(done.stderr)
    assert done.returncode == 1 and "posix.system" in done.stderr and "Do not trust" in done.stderr
    assert not sentinel.exists() and not (tmp_path / "out.pt").exists()


def test_a_poisoned_value_in_a_data_file_is_refused_and_runs_nothing(saved, tmp_path):
    """DCP loads the values it stores as bytes (an optimizer's lr) with torch.load(weights_only
    =False): a .metadata made only of allowed classes can point one at a pickle of our own."""
    sentinel = tmp_path / "SENTINEL"
    ckpt = _copy(saved["zero-mlp"], tmp_path / "ckpt")
    _point_at(ckpt, "optim.param_groups.0.lr", _saved(Run(sentinel)))
    got = run_ranks(_try_load, 2, (ckpt, ckpt), timeout=30)
    print(got[0][:2])
    assert [kind for kind, _, _ in got] == ["UntrustedCheckpointError"] * 2
    assert "optim.param_groups.0.lr" in got[0][1] and "posix.system" in got[0][1]
    # export reads only the model: give the model a value stored as bytes, poisoned
    def extra(meta):
        meta.state_dict_metadata["model.note"] = md.BytesStorageMetadata()
        meta.planner_data["model.note"] = ("model", "note")
        lr = next(i for i in meta.storage_data if i.fqn == "optim.param_groups.0.lr")
        meta.storage_data[md.MetadataIndex("model.note")] = copy.copy(meta.storage_data[lr])
    _rewrite_metadata(ckpt, extra)
    _point_at(ckpt, "model.note", _saved(Run(sentinel)))
    done = _export(ckpt, str(tmp_path / "out.pt"))
    assert done.returncode == 1 and "model.note" in done.stderr and "Do not trust" in done.stderr
    assert not sentinel.exists()


# ---- the allow-list ------------------------------------------------------------------------


def test_the_allow_list_is_what_real_checkpoints_hold(saved):
    """zero.save's and FSDP2's .metadata use exactly these globals; the safe reader gives
    what pickle gives. (ALLOWED adds every other dtype and the paths of other systems.)"""
    used = collections.Counter()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            used[module, name] += 1
            return super().find_class(module, name)

    for name, ckpt in saved.items():
        data = open(os.path.join(ckpt, ".metadata"), "rb").read()
        assert load_metadata(data, name) == Recording(io.BytesIO(data)).load()
    for (module, name), count in sorted(used.items()):
        print(f"{module}.{name}: {count}")
    metadata_classes = {("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")}
    assert set(used) == metadata_classes | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
        ("torch", "float32"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath")}
    assert set(used) <= set(ALLOWED)


# ---- what else a pickle can do -------------------------------------------------------------


def _tricks(sentinel):
    cmd = f"touch {sentinel}".encode()
    return {
        "os.system": b"cos\nsystem\n(S'" + cmd + b"'\ntR.",  # GLOBAL + REDUCE, protocol 0
        "posix.system": pickle.dumps(Run(sentinel)),  # STACK_GLOBAL, protocol 4
        "builtins.exec": pickle.dumps(Run(sentinel, exec)),
        "subprocess.call": pickle.dumps(Run(sentinel, subprocess.call)),
        "os.popen": b"(S'" + cmd + b"'\nios\npopen\n.",  # INST
        "builtins.eval": b"(cbuiltins\neval\nS'1'\no.",  # OBJ
        "builtins.getattr": b"cbuiltins\ngetattr\n(ctorch\nSize\nS'__init__'\ntR.",
        "copyreg._reconstructor": b"ccopyreg\n_reconstructor\n.",
        "torch.load": b"ctorch\nload\n.",
        "torch.distributed.checkpoint.metadata.os": b"ctorch.distributed.checkpoint.metadata\nos\n.",
        "persistent id": b"Pabc\n.",
    }


def test_pickle_tricks_are_refused_by_name_and_run_nothing(tmp_path):
    sentinel = tmp_path / "SENTINEL"
    for name, data in _tricks(sentinel).items():
        with pytest.raises(UntrustedCheckpointError, match="Do not trust this checkpoint") as info:
            load_metadata(data, "ckpt/.metadata")
        assert name in str(info.value), (name, str(info.value))
    # a copyreg extension code names its global through find_class too
    copyreg.add_extension("os", "system", 0xF0)
    try:
        with pytest.raises(UntrustedCheckpointError, match="os.system"):
            load_metadata(b"\x80\x02\x82\xf0X\x04\x00\x00\x00trueR.", "ckpt/.metadata")
    finally:
        copyreg.remove_extension("os", "system", 0xF0)
    # BUILD with a slot state on an allowed class, or on an enum member, would change it for
    # the whole process: refused, and undone
    meta = b"\x8c%torch.distributed.checkpoint.metadata\x94"
    cls = b"\x80\x04" + meta + b"\x8c\x0bStorageMeta\x93"
    with pytest.raises(UntrustedCheckpointError, match="StorageMeta"):
        load_metadata(cls + b"N}\x8c\x04evil\x8c\x03yess\x86b.", "ckpt/.metadata")
    assert not hasattr(md.StorageMeta, "evil")
    member = b"\x80\x04" + meta + b"\x8c\x14_MEM_FORMAT_ENCODING\x93K\x00\x85R"
    with pytest.raises(UntrustedCheckpointError, match="TORCH_CONTIGUOUS_FORMAT"):
        load_metadata(member + b"}\x8c\x07_value_K\x07sb.", "ckpt/.metadata")
    assert md._MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT.value == 0
    # the allowed callables, given nonsense: an error, never anything else
    for data in [b"ctorch\nSize\n(S'x'\ntR.", member[:-4] + b"S'A'\nS'B C'\n\x86R.",
                 b"ctorch.serialization\n_get_layout\n(S'os'\ntR."]:
        with pytest.raises((TypeError, ValueError, KeyError)):
            load_metadata(data, "ckpt/.metadata")
    assert not sentinel.exists()


# ---- a flipped bit in a tensor ------------------------------------------------------------


def _payloads(ckpt) -> dict[str, list[tuple[int, int]]]:
    """Where each tensor's raw bytes lie in the data files: the "data/0" entry of the zip that
    torch.save writes for each record."""
    meta = pickle.load(open(os.path.join(ckpt, ".metadata"), "rb"))  # pristine: trusted
    spans: dict = {}
    for index, where in meta.storage_data.items():
        if isinstance(meta.state_dict_metadata[index.fqn], md.TensorStorageMetadata):
            with open(os.path.join(ckpt, where.relative_path), "rb") as f:
                f.seek(where.offset)
                raw = f.read(where.length)
            for info in zipfile.ZipFile(io.BytesIO(raw)).infolist():
                if info.filename.endswith("/data/0"):
                    h = info.header_offset
                    name, extra = struct.unpack("<HH", raw[h + 26 : h + 30])
                    start = where.offset + h + 30 + name + extra
                    spans.setdefault(where.relative_path, []).append((start, start + info.file_size))
    return spans


def test_a_flipped_bit_in_a_tensor_is_caught_by_its_crc(saved, tmp_path):
    """torch.load never checks the CRC-32 that torch.save writes; zero.load does."""
    ckpt = _copy(saved["zero-mlp"], tmp_path / "ckpt")
    file, spans = next(iter(_payloads(ckpt).items()))
    with open(os.path.join(ckpt, file), "r+b") as f:
        lo, hi = spans[0]
        f.seek((lo + hi) // 2)
        byte = f.read(1)[0]
        f.seek((lo + hi) // 2)
        f.write(bytes([byte ^ 0x01]))
    got = run_ranks(_try_load, 2, (ckpt, ckpt), timeout=30)
    print(got[0][:2])
    assert [kind for kind, _, _ in got] == ["RuntimeError"] * 2
    assert f"in {file} are damaged (Bad CRC-32" in got[0][1]


# ---- fuzzing: whatever the damage, a clear error or a correct load -------------------------

FILES = (".metadata", "__0_0.distcp", "__1_0.distcp")
KINDS_OF_PICKLE = ["data", "tricks", "dcp objects"]


def _other_pickle(draw_kind, data, sentinel) -> bytes:
    """A pickle of something that is not this checkpoint's: random data, an attack, or DCP's
    own classes holding the wrong things."""
    if draw_kind == "tricks":
        return data.draw(st.sampled_from(sorted(_tricks(sentinel).items())))[1]
    if draw_kind == "dcp objects":
        return pickle.dumps(data.draw(st.sampled_from([
            torch.Size([3, 2]), md.StorageMeta(), torch.float32,
            md.Metadata({"model.x": md.BytesStorageMetadata()}, planner_data={"model.x": ("model", "x")}),
            md.Metadata({"model.x": md.TensorStorageMetadata(md.TensorProperties(), torch.Size([2**40]), [])},
                        planner_data={"model.x": ("model", "x")}, storage_data={}),
            md.Metadata({}, planner_data={"a": ("a",)}, storage_data={"x": 1})])))
    leaves = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6)
    tree = st.recursive(leaves, lambda c: st.lists(c, max_size=3) | st.dictionaries(
        st.text(max_size=3), c, max_size=3), max_leaves=8)
    return pickle.dumps(data.draw(tree))


def _corrupt(ckpt, data, sentinel, byte_records) -> str:
    """Damage one file of ``ckpt`` as ``data`` draws; returns what was done."""
    how = data.draw(st.sampled_from(["truncate", "flip", "bytes", "pickle", "record"]))
    file = data.draw(st.sampled_from(FILES)) if how != "record" else None
    if how == "record":  # a value stored as bytes, overwritten in place (.metadata untouched)
        key, (file, offset) = data.draw(st.sampled_from(sorted(byte_records.items())))
        payload = _other_pickle(data.draw(st.sampled_from(KINDS_OF_PICKLE)), data, sentinel)
        with open(os.path.join(ckpt, file), "r+b") as f:
            f.seek(offset)
            f.write(payload)
        return f"record {key} in {file}"
    path = os.path.join(ckpt, file)
    raw = bytearray(open(path, "rb").read())
    at = lambda fraction: min(int(fraction * len(raw)), len(raw) - 1)  # noqa: E731
    fraction = st.floats(0, 1, exclude_max=True)
    if how == "truncate":
        raw = raw[: at(data.draw(fraction))]
    elif how == "flip":
        for where, bit in data.draw(st.lists(st.tuples(fraction, st.integers(0, 7)), min_size=1, max_size=4)):
            raw[at(where)] ^= 1 << bit
    elif how == "bytes":
        start, junk = at(data.draw(fraction)), data.draw(st.binary(min_size=1, max_size=64))
        raw[start : start + len(junk)] = junk
    else:
        raw = _other_pickle(data.draw(st.sampled_from(KINDS_OF_PICKLE)), data, sentinel)
    with open(path, "wb") as f:
        f.write(raw)
    return f"{how} {file}"


def _address_space() -> int:
    """This process's virtual memory size in bytes (Linux's /proc/self/statm)."""
    return int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


SLACK = 64 << 20  # what Python, torch and DCP need beyond the files and the shards


def _limit_address_space(extra: int) -> None:
    """From now on, this process may grow by ``extra`` bytes only: an allocation past that
    raises MemoryError (which no test accepts), instead of taking the machine's memory."""
    resource.setrlimit(resource.RLIMIT_AS, (_address_space() + extra,
                                            resource.getrlimit(resource.RLIMIT_AS)[1]))


def _files_size(ckpt) -> int:
    return sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt))


def _load_and_export(rank, n, ckpt):
    """At world size 1: zero.load, then export; what each gave. Both run under an address
    space limit of the files' size and the model's size (a fresh model, and the exported
    copy), plus ``SLACK``: running out of it, even caught and reported, is "MemoryError",
    which no test accepts."""
    out = []
    s = _system("zero3", seed=1)
    model = 4 * sum(p.numel() for p in s.model.parameters())
    _limit_address_space(_files_size(ckpt) + 3 * model + SLACK)
    for what in ("load", "export"):
        try:
            if what == "load":
                zero.load(ckpt, s.model, s.opt)
                out.append(("loaded", (s.full_params(), s.opt.state_dict())))
            else:
                out.append(("loaded", zero.checkpoint.export(ckpt, ckpt + ".pt")))
        except Exception as e:  # noqa: BLE001 (judged by the caller)
            kind = "MemoryError" if "MemoryError" in f"{type(e).__name__}: {e}" else type(e).__name__
            out.append((kind, str(e)))
    return out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


@pytest.mark.full  # 10 s; tests/checkpoint/test_checkpoint_fuzz.py runs a few probes, its script thousands
def test_fuzzed_checkpoints_give_a_clear_error_or_a_correct_load(saved, tmp_path):
    """Truncations, bit flips, random bytes and pickles of other objects (random data, attacks,
    DCP's classes holding nonsense) in .metadata and in the data files. Each example loads in
    a fresh forked rank, so a crash in C++ or a hang fails the test instead of killing it."""
    pristine = saved["zero-mlp"]
    meta = pickle.load(open(os.path.join(pristine, ".metadata"), "rb"))
    byte_records = {i.fqn: (w.relative_path, w.offset) for i, w in meta.storage_data.items()
                    if isinstance(meta.state_dict_metadata[i.fqn], md.BytesStorageMetadata)}
    expected = run_ranks(_load_and_export, 1, _copy(pristine, tmp_path / "pristine"))[0]
    assert [kind for kind, _ in expected] == ["loaded", "loaded"]
    sentinel = tmp_path / "SENTINEL"
    tally: collections.Counter = collections.Counter()
    start = time.monotonic()

    @settings(max_examples=60, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def one(data):
        ckpt = _copy(pristine, tempfile.mkdtemp(dir=tmp_path) + "/ckpt")
        what = _corrupt(ckpt, data, sentinel, byte_records)
        try:
            got = run_ranks(_load_and_export, 1, ckpt, timeout=30)[0]
        except (RankError, RankTimeout) as e:
            raise AssertionError(f"{what}: the loading process crashed or hung:\n{e}") from None
        assert not sentinel.exists(), f"{what}: the checkpoint ran code"
        for path, (kind, value), (_, want) in zip(("load", "export"), got, expected):
            if kind == "loaded":
                assert _same(value, want), f"{what}: {path} loaded other values than were saved"
                tally[path, "correct load"] += 1
            else:
                assert kind in CLEAR and ckpt in value, f"{what}: {path}: {kind}: {value}"
                tally[path, kind] += 1
        shutil.rmtree(os.path.dirname(ckpt))

    one()
    print(f"{sum(tally.values()) // 2} examples in {time.monotonic() - start:.1f} s")
    for (path, outcome), count in sorted(tally.items()):
        print(f"  {path:6s} {outcome}: {count}")
    assert tally["load", "UntrustedCheckpointError"] > 0 and tally["load", "correct load"] > 0


def _damaged(root, sentinel, saved):
    """A few damaged checkpoints, each with which ranks see it."""
    def copy(name):
        return _copy(saved["zero-mlp"], os.path.join(root, name))
    cases = {}
    ckpt = copy("truncated")
    os.truncate(os.path.join(ckpt, "__1_0.distcp"), 1000)
    cases["truncated data file, rank 1 only"] = (saved["zero-mlp"], ckpt)
    ckpt = copy("flipped")
    raw = bytearray(open(os.path.join(ckpt, ".metadata"), "rb").read())
    raw[len(raw) // 2] ^= 0x40
    open(os.path.join(ckpt, ".metadata"), "wb").write(raw)
    cases["a bit flipped in .metadata"] = (ckpt, ckpt)
    ckpt = copy("poisoned-record")
    _point_at(ckpt, "optim.param_groups.0.betas", _saved(Run(sentinel, subprocess.call)))
    cases["a poisoned value in a data file"] = (ckpt, ckpt)
    ckpt = copy("other-save")
    _rewrite_metadata(ckpt, lambda meta: setattr(meta.storage_meta, "save_id", "another"))
    cases["another save of the same model, rank 1 only"] = (saved["zero-mlp"], ckpt)
    return cases


def test_damaged_checkpoints_raise_the_same_error_on_every_rank(saved, tmp_path):
    sentinel = tmp_path / "SENTINEL"
    for what, paths in _damaged(str(tmp_path), sentinel, saved).items():
        got = run_ranks(_try_load, 2, paths, timeout=30)
        print(f"{what}: {got[0][0]} in {max(t for _, _, t in got):.2f} s: {got[0][1][:100]}")
        assert got[0][0] in CLEAR and got[0][0] == got[1][0], (what, got)
        assert max(t for _, _, t in got) < 5
    assert not sentinel.exists()


# ---- memory in proportion to the file -----------------------------------------------------

TINY = {  # .metadata files of a few bytes that ask the C unpickler for gigabytes
    "LONG_BINPUT 2**31": b"\x80\x04N" + b"r" + struct.pack("<I", 2**31 - 1) + b".",
    "PUT 10**9": b"Np1000000000\n.",
    "BINBYTES8 2**40": b"\x80\x04\x8e" + struct.pack("<Q", 2**40) + b"abc.",
    "BYTEARRAY8 2**40": b"\x80\x05\x96" + struct.pack("<Q", 2**40) + b"abc.",
}
MEASURED = {  # the same, asking for 256 MiB: allowed, and measured
    "LONG_BINPUT 2**24": b"\x80\x04N" + b"r" + struct.pack("<I", 2**24) + b".",
    "BINBYTES8 2**28": b"\x80\x04\x8e" + struct.pack("<Q", 2**28) + b"abc.",
}


def _read_tiny(rank, n, root, limited):
    """zero.load of each tiny .metadata, under an address-space limit (``TINY``) or not
    (``MEASURED``): its error, and the peak of Python's allocations meanwhile (tracemalloc,
    which sees the unpickler's memo and strings)."""
    import tracemalloc

    s = _system("zero3")
    out = {}
    if limited:
        _limit_address_space(SLACK)
    for name, data in (TINY if limited else MEASURED).items():
        ckpt = os.path.join(root, name.replace(" ", "-"))
        os.makedirs(ckpt)
        open(os.path.join(ckpt, ".metadata"), "wb").write(data)
        tracemalloc.start()
        try:
            zero.load(ckpt, s.model, s.opt)
            out[name] = ("loaded", "", 0)
        except BaseException as e:  # noqa: BLE001 (MemoryError included: the test says so)
            out[name] = (type(e).__name__, str(e), tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    return out


def test_a_tiny_metadata_cannot_ask_for_gigabytes(tmp_path):
    """The C unpickler grows its memo to any index a PUT names, 16 bytes a slot (32 GiB for
    9 bytes), and allocates a counted string before reading it: ours keeps a dict, and reads
    what the file holds. Under a limit nothing may run out of memory; unlimited, Python's
    peak while reading a few bytes must stay under 1 MiB."""
    got = {**run_ranks(_read_tiny, 1, str(tmp_path / "limited"), True)[0],
           **run_ranks(_read_tiny, 1, str(tmp_path / "measured"), False)[0]}
    for name, (kind, message, peak) in got.items():
        print(f"{name}: {kind}, Python's peak {peak:,} B: {message[-90:]}")
        assert kind == "RuntimeError" and ".metadata is corrupt" in message, (name, kind, message)
        assert "MemoryError" not in message and peak < 1 << 20, (name, peak, message)


# ---- what .metadata says must be what the files hold ----------------------------------------


def _try_load_gpt(rank, n, paths):
    """zero.load of GPT (stage 3, AdamW) on every rank: what it raised, and how fast."""
    torch.manual_seed(1)
    s, start = System("zero3", MODELS["gpt"](), "adamw"), time.monotonic()
    try:
        zero.load(paths[rank], s.model, s.opt)
        return "loaded", "", time.monotonic() - start
    except Exception as e:  # noqa: BLE001 (the test looks at what it is)
        return type(e).__name__, str(e), time.monotonic() - start


def _export_in_child(rank, n, ckpt, out):
    try:
        zero.checkpoint.export(ckpt, out)
        return "exported", ""
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)


def _refused_everywhere(ckpt, load, what, tmp_path, timeout=30):
    """zero.load on 2 ranks and export (in a child: a hang must fail, not stop the suite)
    both raise a RuntimeError saying ``what``, at once; nothing exported."""
    got = run_ranks(load, 2, (ckpt, ckpt), timeout=timeout)
    print(got[0][:2])
    assert [kind for kind, _, _ in got] == ["RuntimeError"] * 2, got
    assert all(what in message for _, message, _ in got), got
    assert max(t for _, _, t in got) < 5
    out = str(tmp_path / "out.pt")
    kind, message = run_ranks(_export_in_child, 1, ckpt, out, timeout=timeout)[0]
    assert kind == "RuntimeError" and what in message, (kind, message)
    assert not os.path.exists(out)


def test_overlapping_chunks_are_refused(saved, tmp_path):
    """A chunk listed twice adds up to the right count, and leaves rows no chunk writes: DCP
    loads them as whatever the empty buffer held (torch's dcp.load does too)."""
    ckpt = _copy(saved["zero-gpt"], tmp_path / "ckpt")
    def twice(meta):  # (32,), stored as rows [0, 16) and [16, 32): now [0, 16) twice
        chunks = meta.state_dict_metadata["model.blocks.0.ln1.weight"].chunks
        chunks[1] = copy.deepcopy(chunks[0])
    _rewrite_metadata(ckpt, twice)
    _refused_everywhere(ckpt, _try_load_gpt, "the chunks of model.blocks.0.ln1.weight at (0,) "
                        "and (0,) overlap", tmp_path)


def test_a_fifo_for_a_data_file_is_refused_before_it_is_opened(saved, tmp_path):
    """Opening a FIFO blocks until someone writes to it: forever, on every rank."""
    fifo = _copy(saved["zero-mlp"], tmp_path / "fifo")
    os.remove(os.path.join(fifo, "__1_0.distcp"))
    os.mkfifo(os.path.join(fifo, "__1_0.distcp"))
    _refused_everywhere(fifo, _try_load, "__1_0.distcp is a FIFO, not a regular file", tmp_path, 20)
    link = _copy(saved["zero-mlp"], tmp_path / "link")  # a symlink to one, followed
    os.remove(os.path.join(link, "__0_0.distcp"))
    os.symlink(os.path.join(fifo, "__1_0.distcp"), os.path.join(link, "__0_0.distcp"))
    _refused_everywhere(link, _try_load, "__0_0.distcp is a FIFO, not a regular file", tmp_path, 20)
    meta = _copy(saved["zero-mlp"], tmp_path / "meta")  # .metadata itself
    os.remove(os.path.join(meta, ".metadata"))
    os.mkfifo(os.path.join(meta, ".metadata"))
    _refused_everywhere(meta, _try_load, ".metadata is a FIFO, not a regular file", tmp_path, 20)
    # swapped for a FIFO after the checks, as the data is read: read from the file checked
    swapped = _copy(saved["zero-mlp"], tmp_path / "swapped")
    want = run_ranks(_load_as_a_fifo_replaces, 2, saved["zero-mlp"], False)
    got = run_ranks(_load_as_a_fifo_replaces, 2, swapped, True, timeout=20)
    assert all(isinstance(g, dict) for g in got), got
    assert all(_same(g, w) for g, w in zip(got, want))


def _load_as_a_fifo_replaces(rank, n, ckpt, swap):
    """zero.load's values, or its error; rank 0 replaces a data file by a FIFO once the
    reading starts (if ``swap``)."""
    import torch.distributed as dist
    import zero.checkpoint.reader as reader

    original = reader.Reader.read_data
    def read_data(self, *args):
        if swap and not os.path.exists(os.path.join(ckpt, "swapped")):
            dist.barrier()
            if rank == 0:
                os.remove(os.path.join(ckpt, "__1_0.distcp"))
                os.mkfifo(os.path.join(ckpt, "__1_0.distcp"))
                open(os.path.join(ckpt, "swapped"), "w").close()
            dist.barrier()
        return original(self, *args)
    reader.Reader.read_data = read_data
    s = _system("zero3", seed=1)
    try:
        zero.load(ckpt, s.model, s.opt)
    except Exception as e:  # noqa: BLE001 (the test looks at it)
        return f"{type(e).__name__}: {e}"
    return s.full_params()


def test_a_record_whose_dtype_is_not_what_metadata_says_is_refused(saved, tmp_path):
    """DCP copies a record into a template of .metadata's dtype: a float32 record under a
    float16 entry would load, and export, as float16, silently."""
    ckpt = _copy(saved["zero-mlp"], tmp_path / "ckpt")
    _rewrite_metadata(ckpt, lambda meta: setattr(
        meta.state_dict_metadata["model.inp.weight"].properties, "dtype", torch.float16))
    _refused_everywhere(ckpt, _try_load, "where .metadata says a torch.float16", tmp_path)


def test_a_key_that_is_not_its_path_is_refused(saved, tmp_path):
    """A flipped bit in a path's first part ("model" -> "modem") moved a parameter out of the
    model: export wrote a file without it, and exited 0."""
    ckpt = _copy(saved["zero-mlp"], tmp_path / "ckpt")
    _rewrite_metadata(ckpt, lambda meta: meta.planner_data.__setitem__(
        "model.out.bias", ("modem", "out.bias")))
    _refused_everywhere(ckpt, _try_load, "the key model.out.bias does not match its path", tmp_path)


# ---- what a value stored as bytes may be ------------------------------------------------------


def _torch_save_of_pickle(pkl: bytes) -> bytes:
    """A torch.save file whose data.pkl is ``pkl`` (a pickle no Python object pickles to)."""
    source = zipfile.ZipFile(io.BytesIO(_saved(None)))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for info in source.infolist():
            z.writestr(info, pkl if info.filename.endswith("data.pkl") else source.read(info))
    return out.getvalue()


NESTED = 10_000  # deeper than the recursion limit: a deep copy or a repr of it fails
SHARED = b"N" + b"q\x00h\x00\x86" * 60  # t = (t, t), 60 times: 2**60 parts, to hash or to print
BAD_VALUES = {
    # a list of lists, NESTED deep: the optimizer's load_state_dict deep-copies it (RecursionError)
    "optim.param_groups.0.betas": (_torch_save_of_pickle(
        b"\x80\x02" + b"]" * NESTED + b"a" * (NESTED - 1) + b"."), "nests deeper than 32 levels"),
    # the names of a group's parameters, as a number (TypeError: 'int' object is not iterable)
    "optim.param_groups.0.params": (_saved(5), "param group 0's params are not a list of "
                                               "parameter names"),
    # 4 bytes on disk that view 2**34 elements: the first step would materialise 64 GiB
    "optim.param_groups.0.lr": (_saved(torch.zeros(()).expand(2**34)),
                                "holds a view of 17,179,869,184 elements on a storage of 4 bytes"),
    # a dict keyed by SHARED: torch's weights-only unpickler hashes it for ever
    "optim.param_groups.0.eps": (_torch_save_of_pickle(b"\x80\x02}" + SHARED + b"K\x01s."),
                                 "no more parts than a pickle of"),
}


def _try_loads(rank, n, cases):
    """``_try_load`` of each of ``cases`` (name: path), in one group of ranks."""
    return {name: _try_load(rank, n, (path, path)) for name, path in cases.items()}


def test_values_stored_as_bytes_are_plain_data_or_refused_by_name(saved, tmp_path):
    paths = {}
    for key, (payload, _) in BAD_VALUES.items():
        paths[key] = _copy(saved["zero-mlp"], tmp_path / key)
        _point_at(paths[key], key, payload)
    got = run_ranks(_try_loads, 2, paths, timeout=60)
    for key, (_, what) in BAD_VALUES.items():
        print(key, got[0][key][:2])
        assert [g[key][0] for g in got] == ["RuntimeError"] * 2, (key, got)
        assert all(what in g[key][1] and key in g[key][1] for g in got), (key, got)


# ---- nested pickles in .metadata --------------------------------------------------------------

META = b"\x80\x04\x8c%torch.distributed.checkpoint.metadata\x94\x8c\x08Metadata\x93"
DEEP_METADATA = {
    # a list NESTED deep where a tensor's metadata belongs (its repr: RecursionError)
    "nested value": (META + b"(}\x8c\x07model.x" + b"]" * NESTED + b"a" * (NESTED - 1)
                     + b"s}\x8c\x07model.x(\x8c\x05model\x8c\x01xts}t" + b"R.",
                     "model.x is described by a list"),
    # a key of 2**60 parts, 305 bytes: hashing it never ends
    "shared key": (META + b"(}" + SHARED + b"Ns}\x8c\x01x\x8c\x01x\x85s}t" + b"R.",
                   "as a key that is not a small"),
}


def test_deeply_nested_metadata_is_refused_by_name(tmp_path):
    paths = {}
    for name, (data, _) in DEEP_METADATA.items():
        paths[name] = str(tmp_path / name.replace(" ", "-"))
        os.makedirs(paths[name])
        open(os.path.join(paths[name], ".metadata"), "wb").write(data)
    got = run_ranks(_try_loads, 2, paths, timeout=60)
    for name, (_, what) in DEEP_METADATA.items():
        print(name, got[0][name][:2])
        assert [g[name][0] for g in got] == ["RuntimeError"] * 2, (name, got)
        assert all(".metadata is corrupt" in g[name][1] and what in g[name][1] for g in got), got