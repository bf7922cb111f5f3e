"""Loads racing saves: a job that saves again and again, and another that loads ``latest``
meanwhile (an evaluation job beside training). Every load must read one version whole, or
raise naming why; none may mix two.

Every value the saving job writes in version k is k (parameters, optimizer state, its step),
so a load that mixed two versions shows two numbers. The suite runs ``LOADS`` loads;
``python tests/checkpoint/test_checkpoint_races.py 100`` runs more and prints the outcomes.
"""

import collections
import multiprocessing as mp
import os
import sys
import time

import torch
import torch.distributed as dist

import zero
from compare import DIM, Net, System, Tanh
from harness import run_ranks

LOADS = 10


def _system(seed=0):
    torch.manual_seed(seed)
    return System("zero3", Net([Tanh(), Tanh()]), "adamw")


def _fill(s, k: float) -> None:
    """Version k: every parameter, every optimizer state tensor (and step) equal to k."""
    with torch.no_grad():
        for p in s.model.parameters():
            p.fill_(k)
        for state in s.opt.state.values():
            for v in state.values():
                v.fill_(k)


def _saver(rank, n, root, stop, keep):
    s = _system()
    s.step(rank, 0)  # the optimizer has its state
    k = 0
    while True:
        done = torch.tensor([os.path.exists(stop)])
        dist.broadcast(done, 0)  # (both ranks stop after the same save)
        if done.item():
            return k
        k += 1
        _fill(s, float(k))
        zero.save(root, s.model, s.opt, **({"keep": keep} if keep != 1 else {}))


def _values(s) -> set[float]:
    found = {v.item() for p in s.model.parameters() for v in p.detach().reshape(-1)[:1]}
    for state in s.opt.state.values():
        found |= {v.reshape(-1)[0].item() for v in state.values() if v.numel()}
    return found


def _loader(rank, n, root, loads, stop):
    """``loads`` loads of ``root`` while the other job saves; each one's outcome."""
    s = _system(seed=1)
    s.step(rank, 0)
    while not os.path.lexists(os.path.join(root, "latest")):
        time.sleep(0.01)
    outcomes = []
    for _ in range(loads):
        try:
            zero.load(root, s.model, s.opt)
            seen = sorted(set().union(*[v for v in zero.comm.all_gather_object(_values(s))]))
            outcomes.append("one version" if len(seen) == 1 else f"mixed {seen}")
        except Exception as e:  # noqa: BLE001 (counted by kind)
            outcomes.append(_kind(e))
    if rank == 0:
        open(stop, "w").close()
    return outcomes


def _kind(e: Exception) -> str:
    message = str(e)
    if isinstance(e, FileNotFoundError) and "deleted while it was being read" in message:
        return "FileNotFoundError: deleted as it was read"
    if "the ranks read different checkpoints" in message:
        return "RuntimeError: the ranks read different versions"
    return f"{type(e).__name__}: {message[:300]}"


def _saving_job(root, stop, keep, results):
    results.put(run_ranks(_saver, 2, root, stop, keep, timeout=600)[0])


def race(root: str, loads: int, keep: int = 1):
    """Run the two jobs; the load outcomes counted, and how many saves ran meanwhile."""
    stop, ctx = os.path.join(os.path.dirname(root), "stop"), mp.get_context("fork")
    results = ctx.Queue()
    saving = ctx.Process(target=_saving_job, args=(root, stop, keep, results))
    saving.start()
    try:
        outcomes = run_ranks(_loader, 2, root, loads, stop, timeout=600)
    finally:
        open(stop, "w").close()
        saves = results.get(timeout=120)
        saving.join(30)
    return collections.Counter(o for rank in outcomes for o in rank), saves


def test_loads_racing_saves_read_one_version_or_say_why(tmp_path):
    counts, saves = race(str(tmp_path / "ckpt"), LOADS)
    print(f"{LOADS} loads on 2 ranks beside {saves} saves (keep=1): {dict(counts)}")
    allowed = {"one version", "FileNotFoundError: deleted as it was read",
               "RuntimeError: the ranks read different versions"}
    assert set(counts) <= allowed, counts
    assert counts["one version"] > 0 and saves > 1


if __name__ == "__main__":
    import tempfile

    torch.set_num_threads(1)  # (the ranks are forked from here: see tests/conftest.py)
    loads = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    for keep in (1, 2):
        with tempfile.TemporaryDirectory() as tmp:
            start = time.monotonic()
            counts, saves = race(os.path.join(tmp, "ckpt"), loads, keep)
            print(f"keep={keep}: {loads} loads on 2 ranks beside {saves} saves, "
                  f"{time.monotonic() - start:.1f} s")
            for outcome, count in sorted(counts.items()):
                print(f"  {count:4d} rank-loads  {outcome}")
