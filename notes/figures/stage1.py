"""ZeRO-1 measured: memory by category, the order of its collectives, what the optimizer sees.

    python notes/figures/stage1.py > notes/figures/stage1.txt

The model is tests/core/test_memory.py's GPT (8 blocks of dim 64, vocab 64, seq 16; 9 units) on
2 gloo ranks, AdamW, batch 2; rank 0's view after one warm-up step.
Part 1: per-category peaks by zerolab.trackers.ZeroMemTracker, fp32 and bf16/fp32 mixed precision,
beside the paper's formula; in bytes, and in bytes per parameter (per Ψ). The tracker calls
transient what lives only for a while within the step (here: mixed precision's fp32 copy of a
unit's gradient for its reduce-scatter); the last column leaves it out. Part 2: when each collective is issued and waited for, around
the end of backward and the optimizer step (the script wraps Unit's methods to log them; the
library itself records nothing but the ledger). Part 3: what the optimizer holds. Part 4: an
optimizer built before zero.shard.
"""

import time

import torch
from torch.distributed._tools.mem_tracker import _MemRefType as Ref

import zero
from zerolab.launch import run_ranks
from zerolab.memory import model_state_bytes
from zerolab.trackers import MODEL_STATES, ZeroMemTracker
from zerolab.models import GPT, GPTConfig

WORLD_SIZE = 2
CONFIG = GPTConfig(layers=8, dim=64, vocab=64, seq=16)  # tests/core/test_memory.py's model
BF16 = zero.MixedPrecision(torch.bfloat16, torch.float32)


def build(mp=None, config=CONFIG):
    torch.manual_seed(0)
    model = GPT(config)
    for unit in model.units():
        zero.shard(unit, stage=1, mp_policy=mp)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def step(model, opt, rank, i):
    x, y = model.batch(2, torch.Generator().manual_seed(10 * i + rank))
    model.loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


# ---- Part 1: memory ------------------------------------------------------------------------

def memory(rank, n, mp):
    model, opt = build(BF16 if mp else None)
    step(model, opt, rank, 0)  # the optimizer state exists from here on
    with ZeroMemTracker(model, opt) as mt:
        step(model, opt, rank, 1)
    units = zero.units_of(model)
    peaks = mt.category_peaks[torch.device("cpu")]
    return {"psi": sum(u.layout.numel for u in units),
            "padded": sum(u.layout.padded_numel for u in units),
            "peak": {"param": peaks[Ref.PARAM], "grad": peaks[Ref.GRAD], "opt": peaks[Ref.OPT],
                     "states": peaks[MODEL_STATES], "transient": mt.transient_peak},
            "kept": {"param": mt.state_peaks[Ref.PARAM], "grad": mt.state_peaks[Ref.GRAD],
                     "opt": mt.state_peaks[Ref.OPT], "states": mt.model_states_peak,
                     "transient": None},
            "grad_dtype": str(units[1].config.reduce_dtype)}


# ---- Part 2: the order of events -------------------------------------------------------------

def events(rank, n, mp):
    log = []  # (time, what)
    model, opt = build(BF16 if mp else None)
    step(model, opt, rank, 0)
    for u in zero.units_of(model):
        u.modules[0].register_forward_pre_hook(
            lambda m, a, u=u: log.append((time.perf_counter(), f"forward computes        {u.name}")))
    x, y = model.batch(2, torch.Generator().manual_seed(10 + rank))
    with zero.Ledger() as ledger:
        loss = model.loss(model(x), y)
        log.append((time.perf_counter(), "backward starts"))
        loss.backward()
        log.append((time.perf_counter(), "backward returns"))
        opt.step()
        log.append((time.perf_counter(), "opt.step() returns"))
        opt.zero_grad()
        x, y = model.batch(2, torch.Generator().manual_seed(20 + rank))
        model(x)  # the next forward: where the all-gathers are waited for
    for r in ledger.records:  # the ledger's issue times: every collective of the step
        where = f"{r.unit} ({r.phase})" if r.unit else "(the ranks agree on what comes next)"
        log.append((r.time, f"{(r.op.replace('_', '-') + ' issued'):<23} {where}"))
        if r.done is not None and r.op in ("all_gather", "reduce_scatter"):  # wait() returned
            log.append((r.done, f"{(r.op.replace('_', '-') + ' done'):<23} {r.unit}"))
    log.sort()
    t0 = next(t for t, what in log if what == "backward starts")
    return [(1e3 * (t - t0), what) for t, what in log if t >= t0]


# ---- Part 3 and 4: the optimizer ---------------------------------------------------------------

def optimizer_view(rank, n):
    model, opt = build(config=GPTConfig())  # the small GPT: 2 blocks of dim 32
    step(model, opt, rank, 0)
    units = zero.units_of(model)
    block = units[1]
    rows = []
    for name, p in list(model.named_parameters())[2:14]:  # blocks.0, in flat order
        st = opt.state.get(p, {})
        rows.append((name, tuple(p.shape), tuple(st["exp_avg"].shape) if "exp_avg" in st else None))
    inside = all(u.sharded.untyped_storage().data_ptr() == u.unsharded.untyped_storage().data_ptr()
                 for u in units)
    state = sum(t.numel() for s in opt.state.values() for k, t in s.items() if k != "step")
    return {"rows": rows, "unit": block.name, "shard_numel": block.layout.shard_numel,
            "inside": inside, "state": state,
            "shards": sum(u.layout.shard_numel for u in units),
            "psi": sum(u.layout.numel for u in units)}


def built_too_early(rank, n):
    torch.manual_seed(0)
    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # before sharding: the mistake
    for unit in model.units():
        zero.shard(unit, stage=1)
    x, y = model.batch(2, torch.Generator().manual_seed(rank))
    model.loss(model(x), y).backward()
    try:
        opt.step()
    except RuntimeError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def main():
    print(f"GPT {CONFIG} on N = {WORLD_SIZE} gloo ranks, stage 1, AdamW; rank 0\n")
    print("Part 1: per-rank peaks by category (ZeroMemTracker), one step after a warm-up\n")
    for mp in (False, True):
        m = run_ranks(memory, WORLD_SIZE, mp)[0]
        psi, n = m["psi"], WORLD_SIZE
        print(("bf16 params / fp32 reduce" if mp else "fp32") + f": Ψ = {psi} (padded {m['padded']})")
        print(f"  {'bytes (bytes per Ψ)':<20} {'peak at any instant':>24} "
              f"{'peak without transients':>26}")
        for key, label in (("param", "parameters"), ("grad", "gradients"), ("opt", "optimizer state"),
                           ("states", "model states"), ("transient", "transient")):
            cells = [f"{v[key]:>9} ({v[key] / psi:6.3f})" if v[key] is not None else ""
                     for v in (m["peak"], m["kept"])]
            print(f"  {label:<20} {cells[0]:>24} {cells[1]:>26}".rstrip())
        formula = model_state_bytes(psi, n, stage=1, mixed_precision=mp)
        ddp = model_state_bytes(psi, n, stage=0, mixed_precision=mp)
        k = "(2 + 2) Ψ + 12 Ψ / N" if mp else "(4 + 4) Ψ + 8 Ψ / N"
        print(f"  paper: {k} = {formula:.0f} bytes = {formula / psi:.3f} bytes/Ψ"
              f" (DDP: {ddp:.0f} = {ddp / psi:.0f} bytes/Ψ)\n")

    for mp in (False, True):
        print("Part 2: the collectives around one step, " +
              ("bf16 params / fp32 reduce (a cast before each reduce-scatter)" if mp
               else "fp32 (no cast)") + "; ms since backward starts\n")
        rows = run_ranks(events, WORLD_SIZE, mp)[0]
        for t, what in rows:
            if what.startswith("forward computes") and "root" not in what and "blocks.0" not in what:
                continue  # the next forward: its first two units are enough
            print(f"  {t:8.2f}  {what}")
        print()

    print("Part 3: what the optimizer holds (the small GPT: 2 blocks of dim 32, rank 0 and 1)\n")
    views = run_ranks(optimizer_view, WORLD_SIZE)
    for rank, v in enumerate(views):
        print(f"rank {rank}: {v['unit']}'s parameters in the optimizer (shard_numel "
              f"{v['shard_numel']}); name, param shape, exp_avg shape")
        for name, shape, state in v["rows"]:
            print(f"  {name:<22} {str(shape):<9} {state}")
        print(f"  optimizer state elements (exp_avg + exp_avg_sq): {v['state']} = 2 x {v['state'] // 2}"
              f"; this rank's shards: {v['shards']} of Ψ = {v['psi']}")
        print(f"  every unit's shard lives inside its full buffer (same storage): {v['inside']}\n")

    print("Part 4: an optimizer built before zero.shard\n")
    print("  " + run_ranks(built_too_early, WORLD_SIZE)[0])


if __name__ == "__main__":
    main()
