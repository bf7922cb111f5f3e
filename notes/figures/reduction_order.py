"""World sizes 2, 3 and 4: how far ours, DDP and FSDP2 drift apart, with SGD and AdamW.

    python notes/figures/reduction_order.py > notes/figures/reduction_order.txt

Part 1 is tests/core/test_equality.py's ``_reduction_order_bound`` (same models, seed, data,
SGD with momentum, 5 steps, the same max_relative_difference) with FSDP2 vs DDP added.
Part 2 runs AdamW at world size 3 and finds the element that drifts most. Part 3 compares
ours with FSDP1 (``FullyShardedDataParallel``, flat parameters like ours) on the same units.
"""

import os
import sys
import warnings

import copy

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from compare import MODELS, System, max_relative_difference, run_and_compare  # noqa: E402

import zero  # noqa: E402
from zerolab.launch import run_ranks  # noqa: E402

STEPS = 5
KINDS = ("ddp", "fsdp2", "zero1", "zero2", "zero3")
PAIRS = [("zero1", "ddp"), ("zero2", "ddp"), ("zero3", "ddp"), ("zero1", "fsdp2"),
         ("zero2", "fsdp2"), ("zero3", "fsdp2"), ("fsdp2", "ddp")]
warnings.filterwarnings("ignore")


def bound(rank, n, model):
    torch.manual_seed(0)
    base = MODELS[model]()
    systems = [System(k, base, "sgd") for k in KINDS]
    worst = {}

    def check(step, systems, outs):
        full = {s.kind: s.full_params() for s in systems}
        for a, b in PAIRS:
            worst[(a, b)] = max(worst.get((a, b), 0.0), max_relative_difference(full[a], full[b]))

    run_and_compare(rank, systems, STEPS, check)
    return worst


def full_grads(system):
    """Every parameter's whole gradient (ours: gathered from the ranks' pieces)."""
    if system.kind == "ddp":
        return {n: p.grad.clone() for n, p in system.model.module.named_parameters()}
    mine = {}
    for name, p in system.model.named_parameters():
        piece = zero.piece_of(p)
        if piece is not None and p.grad is not None:
            mine[name] = (piece.param_offset, p.grad.clone())
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    out = {}
    for name, p in system.base.named_parameters():
        g = torch.zeros(p.numel())
        for d in every:
            if name in d:
                offset, piece = d[name]
                g[offset : offset + piece.numel()] = piece
        out[name] = g.view(p.shape)
    return out


def adamw(rank, n):
    torch.manual_seed(0)
    base = MODELS["gpt"]()
    systems = [System(k, base, "adamw") for k in ("ddp", "zero3", "fsdp2")]
    log = []
    for step in range(STEPS):
        grads = {}
        for s in systems:  # System.step, split to read the gradients before opt.step
            x, y = base.batch(4, torch.Generator().manual_seed(1000 * step + 10 * rank))
            base.loss(s.model(x), y).backward()
            if s.kind != "fsdp2":
                grads[s.kind] = full_grads(s)
            s.opt.step()
            s.opt.zero_grad()
        full = {s.kind: s.full_params() for s in systems}
        ddp, ours = full["ddp"], full["zero3"]
        name = max(ddp, key=lambda k: ((ddp[k] - ours[k]).abs().max() / ddp[k].abs().max()).item())
        i = (ddp[name] - ours[name]).abs().reshape(-1).argmax().item()
        log.append({
            "grads zero3 vs ddp": max_relative_difference(grads["zero3"], grads["ddp"]),
            "params zero3 vs ddp": max_relative_difference(ours, ddp),
            "params fsdp2 vs ddp": max_relative_difference(full["fsdp2"], ddp),
            "worst": (name, i, ddp[name].reshape(-1)[i].item(), ours[name].reshape(-1)[i].item(),
                      grads["ddp"][name].reshape(-1)[i].item(),
                      grads["zero3"][name].reshape(-1)[i].item(),
                      grads["ddp"][name].abs().max().item()),
        })
    return log


def fsdp1(rank, n):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    base = MODELS["gpt"]()
    ours = System("zero3", base, "sgd")
    model = copy.deepcopy(base)
    wrap = dict(device_id=torch.device("cpu"), use_orig_params=False)  # CPU/gloo, no alignment
    for i, block in enumerate(model.blocks):  # the same units: each block, then the root
        model.blocks[i] = FSDP(block, **wrap)
    model = FSDP(model, **wrap)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)  # as make_optimizer("sgd")
    worst = 0.0
    for step in range(STEPS):
        ours.step(rank, step)
        x, y = base.batch(4, torch.Generator().manual_seed(1000 * step + 10 * rank))
        base.loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        with FSDP.summon_full_params(model):
            theirs = {k.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
                      for k, p in model.named_parameters()}
        mine = ours.full_params()
        worst = max(worst, max_relative_difference(mine, {k: theirs[k] for k in mine}))
    return worst


def main():
    print(f"Part 1: SGD (momentum 0.9), {STEPS} steps; max over steps and parameters of "
          "max|a - b| / max|b|\n")
    print(f"{'model':<5} {'N':>2}  " + "  ".join(f"{a + ' vs ' + b:>15}" for a, b in PAIRS))
    for n in (2, 3, 4):
        for model in ("gpt", "mlp"):
            worst = run_ranks(bound, n, model, timeout=300)[0]
            print(f"{model:<5} {n:>2}  " + "  ".join(f"{worst[p]:>15.2e}" for p in PAIRS))

    print(f"\nPart 2: AdamW (lr 1e-2), gpt, N = 3, after each step\n")
    print(f"{'step':>4} {'grads zero3 vs ddp':>19} {'params zero3 vs ddp':>20} "
          f"{'params fsdp2 vs ddp':>20}   the element that drifts most (DDP | ours)")
    for step, row in enumerate(run_ranks(adamw, 3, timeout=300)[0]):
        name, i, pd, po, gd, go, gmax = row["worst"]
        print(f"{step:>4} {row['grads zero3 vs ddp']:>19.2e} {row['params zero3 vs ddp']:>20.2e} "
              f"{row['params fsdp2 vs ddp']:>20.2e}   {name}[{i}]: param {pd:.6f} | {po:.6f}, "
              f"its grad {gd:.2e} | {go:.2e} (largest |grad| in it {gmax:.1e})")

    print(f"\nPart 3: ours (zero3) vs FSDP1 (flat parameters, use_orig_params=False), gpt, SGD, "
          f"{STEPS} steps\n")
    for n in (2, 3, 4):
        print(f"N = {n}: max relative difference {run_ranks(fsdp1, n, timeout=300)[0]:.2e}")


if __name__ == "__main__":
    main()
