"""Check an exercise:  python notes/exercises/check.py N [FILE]

FILE is your edited copy (default: notes/exercises/N_*.py). The check trains it on 2 local CPU
ranks beside torch's DDP, as every step of the road does (notes/road/common.py), then looks
for what the exercise asks: the parameters must stay the same bits as DDP's, and the property
below must hold. It prints what it found and exits 0 once the exercise is done.
"""

import glob
import importlib.util
import os
import sys
import time

import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "road"))
import common  # noqa: E402  (notes/road/common.py)

from zerolab.launch import RankError, run_ranks  # noqa: E402


def load(path: str):
    """The module in ``path`` (an exercise file, started or solved)."""
    spec = importlib.util.spec_from_file_location(f"exercise_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def watch(units, ledger) -> dict:
    """After each backward: where each gradient shard lives, and the ledger with its times."""
    r, seen = dist.get_rank(), SEEN[id(units)]
    return dict(
        slots=[(u.name, u.shard.grad.untyped_storage().nbytes(), u.shard.grad.storage_offset(),
                u.layout.padded_numel * u.shard.element_size(), r * u.layout.shard_numel)
               for u in units],
        records=[(x.op, x.unit, x.phase, x.time, x.done) for x in ledger.records
                 if x.op != "agree"],  # (agreements: check mode only)
        root_ahead=len({x.unit for x in ledger.records if (x.op, x.phase) == ("all_gather",
                        "forward") and x.unit != units[-1].name and x.time < seen["began"]}))


def observe(rank: int, n: int, paths: dict) -> dict:
    """Train each file's ``shard`` beside DDP, watching every backward ({name: report})."""
    return common.train(rank, n, {name: watched(load(p).shard) for name, p in paths.items()},
                        watch)


SEEN: dict[int, dict] = {}  # id(units): what the model's own hooks saw in the last forward


def watched(shard):
    """``shard``, and a hook on the model, run after the units' own: when the root's forward
    began (after its gathers and prefetches). Which units hold full parameters, the road's
    harness measures itself, in bytes alive (notes/road/common.py, ``Alive``)."""
    def wrapped(model, blocks):
        units = shard(model, blocks)
        seen = SEEN.setdefault(id(units), {})
        model.register_forward_pre_hook(lambda *_: seen.update(began=time.perf_counter()))
        return units
    return wrapped


# ---- what each exercise asks; each returns what is still wrong (nothing: done) ----------

def in_place(r: dict) -> list[str]:
    for step in r["watched"]:
        for unit, nbytes, offset, full_bytes, slot in step["slots"]:
            if nbytes != full_bytes:
                return [f"{unit}'s gradient shard has a storage of its own ({nbytes} bytes): "
                        f"the reduced slice costs memory again; the unit's full gradient, which "
                        f"this rank already holds, is a storage of {full_bytes} bytes"]
            if offset != slot:
                return [f"{unit}'s gradient shard lives in the full gradient, but at element "
                        f"{offset}; this rank's slot of it starts at element {slot} (r·S), "
                        f"where the optimizer's shard of the parameters lies"]
    return []


def root_kept(r: dict) -> list[str]:
    gathered = [unit for op, unit, phase, _ in r["ledger"] if (op, phase) == ("all_gather",
                                                                              "backward")]
    kept = "root" in r["full_after_forward"]
    blocks = [f"blocks.{k}" for k in range(common.BLOCKS)]
    if "root" in gathered and kept:
        return ["the root kept its full parameters after its forward, yet its backward "
                "gathered them again (an all-gather of 'root' in backward): one for nothing"]
    if "root" in gathered:
        return ["the root's full parameters were freed when its forward ended and gathered again "
                "(an all-gather of 'root' in backward) as its backward began, straight after"]
    if sorted(gathered) != blocks:
        return [f"backward gathered {gathered or 'nothing'}: every block must still be freed "
                f"after its forward and gathered again ({', '.join(blocks)})"]
    if r["full_bytes"]:
        return [f"{r['full_bytes']} bytes of full parameters are left after the step: the root "
                "must still be freed once its backward is done"]
    return []


def two_ahead(r: dict) -> list[str]:
    wrong = []
    ahead, want = r["watched"][-1]["root_ahead"], min(2, common.BLOCKS)
    if ahead != want:  # the root starts first: blocks.0 and blocks.1 must be on their way
        wrong.append(f"as the root starts its forward, {ahead} block(s) are being gathered; two "
                     f"ahead means {want} there")
    for k, (_, ahead) in enumerate(r["probes"]):
        want = min(2, common.BLOCKS - 1 - k)
        if ahead != want:
            wrong.append(f"as blocks.{k} starts its forward, {ahead} later block(s) are being "
                         f"gathered; two ahead means {want} there")
            break
    gathers = [unit for op, unit, phase, _ in r["ledger"] if (op, phase) == ("all_gather",
                                                                             "forward")]
    if sorted(gathers) != sorted(set(gathers)):
        wrong.append(f"forward gathered a unit twice: {gathers}")
    return wrong


def reduce_in_flight(r: dict) -> list[str]:
    for step in r["watched"]:
        records = step["records"]
        reduces = [x for x in records if x[0] == "reduce_scatter"]
        if any(done is None for *_, done in reduces):
            return ["a reduce-scatter was never waited for before backward ended"]
        most = max(sum(y[3] <= x[3] < y[4] for y in reduces) for x in reduces)
        if most > 1:
            return [f"{most} reduce-scatters were in flight at once; keep at most one"]
        if not any(x[3] < y[3] < x[4] for x in reduces for y in records):
            return ["every reduce-scatter was over before anything else was issued: nothing "
                    "overlapped with it; start it with async_op=True and wait for it later"]
    return []


def stage3(r: dict) -> list[str]:
    lost = r["lost"] or r["lost_after_step"]  # as the forward ended, or after the step
    if lost:
        unit, nbytes = next(iter(lost.items()))
        return [f"{unit}'s full parameters are still alive ({nbytes} bytes) though the unit "
                f"no longer names them: dropping a reference frees no byte while something "
                f"else holds the storage, and the views its modules computed with hold it, "
                f"as do those autograd saved for backward until that backward has run "
                f"(question 2)"]
    held = max(p[0] for p in r["probes"])
    many = (f"as a block starts its forward, {held} of the {r['units']} units hold full "
            f"parameters; ZeRO-3 holds only the root's and that block's")
    kept = [u for u in r["full_after_forward"] if u != "root"]
    if held > 2 and kept:
        return [f"{many} ({', '.join(kept)} still hold theirs when the model's forward is over)"]
    gathered = {unit for op, unit, phase, _ in r["ledger"] if (op, phase) == ("all_gather",
                                                                             "backward")}
    missing = [f"blocks.{k}" for k in range(common.BLOCKS) if f"blocks.{k}" not in gathered]
    if missing:
        return [f"backward gathered no full parameters for {', '.join(missing)}: its backward "
                f"cannot have read the values its forward used"]
    if r["full_bytes"]:
        return [f"{r['full_bytes']} bytes of full parameters are left after the step: free each "
                f"unit again once backward is done with it"]
    if held > 2:
        return [many]
    return []


CHECKS = {1: in_place, 2: root_kept, 3: two_ahead, 4: reduce_in_flight, 5: stage3}

HINTS = {  # what an error torch raises means, in the terms of the exercise
    "modified inplace": "autograd saw the refill of a tensor whose views it uses: write where "
                        "it does not look",
    "modified by an inplace operation": "autograd saw the refill of a tensor it had saved: "
                                        "write where it does not look",
    "out of bounds for storage of size 0": "something computed with a tensor whose storage "
                                           "was freed (0 bytes) and not filled again",
    "'NoneType' object has no attribute": "a name set to None was read again later",
}


def verdicts(paths: dict[str, tuple[int, str]]) -> dict[str, list[str]]:
    """{name: what is wrong} for each (exercise number, file) in ``paths``, on every rank."""
    try:
        reports = run_ranks(observe, 2, {name: path for name, (_, path) in paths.items()})
    except RankError as e:  # a rank died in C code: no Python error to report
        said = str(e).splitlines()[-1]
        return {name: [f"training crashed ({said}): torch's C code read memory that is gone, "
                       f"most often a tensor whose storage was freed, handed to a collective"]
                for name in paths}
    out = {}
    for name, (number, _) in paths.items():
        wrong = []  # per rank
        for per_rank in reports:
            r = per_rank[name]
            if "error" in r:
                hint = next((h for k, h in HINTS.items() if k in r["error"]), "")
                wrong.append([f"training raised {r['error']}" + (f" ({hint})" if hint else "")])
                continue
            same = not r["diffs"] and r["losses"] == r["ddp_losses"]
            bits = [] if same else [f"not the same bits as DDP's: {(r['diffs'] or ['losses'])[0]}"]
            wrong.append(bits + CHECKS[number](r))
        if any(w != wrong[0] for w in wrong):  # the ranks differ: say which is which
            wrong = [[f"rank {rank}: {w}" for w in ws] for rank, ws in enumerate(wrong)]
        out[name] = list(dict.fromkeys(w for ws in wrong for w in ws))
    return out


def shown(path: str) -> str:
    """``path`` as the learner can find it: relative to here if it lies below, else absolute
    (a copy in /tmp is not ``../../tmp/...``)."""
    rel = os.path.relpath(path)
    return os.path.abspath(path) if rel.startswith("..") else rel


def main(argv: list[str]) -> int:
    if not argv or not argv[0].isdigit() or int(argv[0]) not in CHECKS:
        print(__doc__.strip().splitlines()[0], f"(N in {sorted(CHECKS)})")
        return 2
    number = int(argv[0])
    path = argv[1] if len(argv) > 1 else glob.glob(os.path.join(HERE, f"{number}_*.py"))[0]
    wrong = verdicts({"yours": (number, path)})["yours"]
    print(f"exercise {number} ({shown(path)}): " + ("done" if not wrong else "not yet"))
    for w in wrong:
        print("  " + w)
    return 0 if not wrong else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
