"""How far the global gradient norm of zero.clip_grad_norm_ (and FSDP2's) is from DDP's.

    python notes/figures/clip_norm.py > notes/figures/clip_norm.txt

Part 1 measures the norm only: max_norm is so large that nothing is clipped (the clip
coefficient is exactly 1), so every system keeps bitwise equal gradients at world size 2 and
the norms are compared on the very same numbers, step after step. Part 2 clips for real
(max_norm 0.05, the 2-norm): once a norm differs by an ulp, the steps differ too.
"""

import warnings

import torch

from zerolab.launch import run_ranks
from zerolab.models import GPT, UnevenMLP
from zerolab.systems import System

WORLD_SIZE, STEPS, OPT = 2, 20, "sgd"
MODELS = {"gpt": GPT, "mlp": UnevenMLP}
KINDS = ["ddp", "fsdp2", "zero1", "zero2", "zero3"]
warnings.filterwarnings("ignore")


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many float32 values lie between a and b (both positive)."""
    return abs(a.float().view(torch.int32).item() - b.float().view(torch.int32).item())


def norms(rank, n, model, norm_type, max_norm, steps, kinds=KINDS):
    torch.manual_seed(0)
    base = MODELS[model]()
    systems = [System(k, base, OPT) for k in kinds]
    out = {k: [] for k in kinds}
    params = {}
    for s in range(steps):
        for sys_ in systems:
            out[sys_.kind].append(sys_.step(rank, s, clip=(max_norm, norm_type))[1].clone())
    for sys_ in systems:
        params[sys_.kind] = sys_.full_params()
    return out, params


def rel_params(a, b):
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in a)


def main():
    print(f"world size {WORLD_SIZE}, {OPT.upper()}; each cell: steps whose norm differs from "
          f"DDP's / {STEPS}, the largest difference in ulps, the largest relative difference\n")
    print("Part 1: the norm on identical gradients (max_norm 1e9: no clipping)\n")
    print(f"{'model':<5} {'norm':<4} " + " ".join(f"{k:>24}" for k in KINDS[1:]))
    for model in MODELS:
        for norm_type in (2.0, float("inf")):
            out, params = run_ranks(norms, WORLD_SIZE, model, norm_type, 1e9, STEPS)[0]
            assert all(rel_params(params[k], params["ddp"]) == 0 for k in KINDS), "not bitwise"
            cells = []
            for k in KINDS[1:]:
                pairs = list(zip(out[k], out["ddp"]))
                differ = sum(not torch.equal(a, b) for a, b in pairs)
                worst_ulps = max(ulps(a, b) for a, b in pairs)
                worst_rel = max(abs((a - b) / b).item() for a, b in pairs)
                cells.append(f"{differ:>2}/{STEPS} {worst_ulps} ulp {worst_rel:.1e}")
            print(f"{model:<5} {norm_type:<4} " + " ".join(f"{c:>24}" for c in cells))
    out, _ = run_ranks(norms, 1, "gpt", 2.0, 1e9, STEPS, ["ddp", "zero3"])[0]
    differ = sum(not torch.equal(a, b) for a, b in zip(out["zero3"], out["ddp"]))
    print(f"control, world size 1 (every piece a whole parameter, nothing to sum over ranks): "
          f"gpt 2-norm, zero3 differs from DDP at {differ}/{STEPS} steps")
    print("\n(Parameters stayed bitwise equal to DDP's in every Part 1 run: the norms were "
          "compared on identical gradients.)")
    print(f"\nPart 2: clipping at max_norm 0.05 (2-norm), 5 steps: max relative difference of "
          "the parameters from DDP's\n")
    print(f"{'model':<5} " + " ".join(f"{k:>8}" for k in KINDS[1:]))
    for model in MODELS:
        out, params = run_ranks(norms, WORLD_SIZE, model, 2.0, 0.05, 5)[0]
        diffs = [rel_params(params[k], params["ddp"]) for k in KINDS[1:]]
        print(f"{model:<5} " + " ".join(f"{d:>8.1e}" for d in diffs))


if __name__ == "__main__":
    main()
