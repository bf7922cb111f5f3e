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

import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "road"))
import common  # noqa: E402  (notes/road/common.py)

from zerolab.launch import run_ranks  # noqa: E402


def load(path: str):
    """The module in ``path`` (an exercise file, started or solved)."""
    spec = importlib.util.spec_from_file_location(f"exercise_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def watch(units, ledger) -> dict:
    """After each backward: where each gradient shard lives, and the ledger with its times."""
    r = dist.get_rank()
    return dict(
        slots=[(u.name, u.shard.grad.untyped_storage().nbytes(), u.shard.grad.storage_offset(),
                u.layout.padded_numel * u.shard.element_size(), r * u.layout.shard_numel)
               for u in units],
        records=[(x.op, x.unit, x.phase, x.time, x.done) for x in ledger.records
                 if x.op != "agree"])  # (agreements: check mode only)


def observe(rank: int, n: int, paths: dict) -> dict:
    """Train each file's ``shard`` beside DDP, watching every backward ({name: report})."""
    return common.train(rank, n, {name: load(p).shard for name, p in paths.items()}, watch)


# ---- what each exercise asks; each returns what is still wrong (nothing: done) ----------

def in_place(r: dict) -> list[str]:
    for step in r["watched"]:
        for unit, nbytes, offset, full_bytes, slot in step["slots"]:
            if nbytes != full_bytes or offset != slot:
                return [f"{unit}'s gradient shard lives in a storage of {nbytes} bytes at offset "
                        f"{offset}; it should be its slot of the full gradient: {full_bytes} "
                        f"bytes, offset {slot} (shard.grad = full_grad[r*S:(r+1)*S])"]
    return []


def root_kept(r: dict) -> list[str]:
    gathered = [unit for op, unit, phase, _ in r["ledger"] if (op, phase) == ("all_gather",
                                                                              "backward")]
    blocks = [f"blocks.{k}" for k in range(common.BLOCKS)]
    if "root" in gathered:
        return ["the ledger shows 'all_gather root backward': the root was freed after its forward "
                "and gathered again for its backward; keep it instead"]
    if sorted(gathered) != blocks:
        return [f"backward gathered {gathered}: every block must still be freed after its forward "
                f"and gathered again ({blocks})"]
    if r["full_bytes"]:
        return [f"{r['full_bytes']} bytes of full parameters are left after the step: the root "
                "must still be freed once its backward is done"]
    return []


def two_ahead(r: dict) -> list[str]:
    for k, (_, ahead) in enumerate(r["probes"]):
        want = min(2, common.BLOCKS - 1 - k)
        if ahead != want:
            return [f"as blocks.{k} starts its forward, {ahead} later block(s) are being gathered; "
                    f"two ahead means {want}"]
    gathers = [unit for op, unit, phase, _ in r["ledger"] if (op, phase) == ("all_gather",
                                                                             "forward")]
    if sorted(gathers) != sorted(set(gathers)):
        return [f"forward gathered a unit twice: {gathers}"]
    return []


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


CHECKS = {1: in_place, 2: root_kept, 3: two_ahead, 4: reduce_in_flight}


def verdicts(paths: dict[str, tuple[int, str]]) -> dict[str, list[str]]:
    """{name: what is wrong} for each (exercise number, file) in ``paths``, on every rank."""
    reports = run_ranks(observe, 2, {name: path for name, (_, path) in paths.items()})
    out = {}
    for name, (number, _) in paths.items():
        wrong = []  # per rank
        for per_rank in reports:
            r = per_rank[name]
            same = not r["diffs"] and r["losses"] == r["ddp_losses"]
            bits = [] if same else [f"not the same bits as DDP's: {(r['diffs'] or ['losses'])[0]}"]
            wrong.append(bits + CHECKS[number](r))
        if any(w != wrong[0] for w in wrong):  # the ranks differ: say which is which
            wrong = [[f"rank {rank}: {w}" for w in ws] for rank, ws in enumerate(wrong)]
        out[name] = list(dict.fromkeys(w for ws in wrong for w in ws))
    return out


def main(argv: list[str]) -> int:
    if not argv or not argv[0].isdigit() or int(argv[0]) not in CHECKS:
        print(__doc__.strip().splitlines()[0], f"(N in {sorted(CHECKS)})")
        return 2
    number = int(argv[0])
    path = argv[1] if len(argv) > 1 else glob.glob(os.path.join(HERE, f"{number}_*.py"))[0]
    wrong = verdicts({"yours": (number, path)})["yours"]
    print(f"exercise {number} ({os.path.relpath(path)}): " + ("done" if not wrong else "not yet"))
    for w in wrong:
        print("  " + w)
    return 0 if not wrong else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
