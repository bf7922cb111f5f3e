"""The floating-point facts behind equality with DDP, counted on random float32 numbers.

    python notes/figures/fp_arithmetic.py > notes/figures/fp_arithmetic.txt

DDP scales each gradient by 1/N, then sums over ranks; we (and FSDP2) sum, then divide by N
(gloo's AVG). For N = 2 both give the same bits; for N = 3 they need not, and neither does
the order in which three numbers are added.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from zerolab.launch import run_ranks

COUNT = 10_000_000
gen = torch.Generator().manual_seed(0)


def randn():
    return torch.randn(COUNT, generator=gen)


def wide():
    """Random float32, either sign, exponents 2^-125 to 2^126: halving one, or adding two,
    stays in the normal range (no underflow, no overflow)."""
    sign = torch.randint(0, 2, (COUNT,), generator=gen, dtype=torch.int32) << 31
    exponent = torch.randint(2, 254, (COUNT,), generator=gen, dtype=torch.int32) << 23
    mantissa = torch.randint(0, 1 << 23, (COUNT,), generator=gen, dtype=torch.int32)
    return (sign | exponent | mantissa).view(torch.float32)


def differ(x, y) -> str:
    n = (x != y).sum().item()
    return f"{n:>9} of {COUNT} ({n / COUNT:.2%})"


def ddp_scaling(rank, n):
    """Which does DDP compute: all_reduce(g * (1/N)) or all_reduce(g) / N?"""
    torch.manual_seed(0)
    layer = nn.Linear(50, 40, bias=False)
    plain = layer.weight.detach().clone().requires_grad_()
    x = torch.randn(8, 50, generator=torch.Generator().manual_seed(rank))
    ddp = DDP(layer)  # keep it alive: its reducer does the all-reduce in backward
    ddp(x).pow(2).sum().backward()
    (x @ plain.T).pow(2).sum().backward()  # this rank's own gradient, unreduced
    pre = plain.grad * (1.0 / n)
    dist.all_reduce(pre)
    post = plain.grad.clone()
    dist.all_reduce(post)
    post /= n
    return torch.equal(layer.weight.grad, pre), torch.equal(layer.weight.grad, post)


def main():
    print("N = 2: DDP's  a*(1/2) + b*(1/2)   vs   ours (a + b) / 2")
    for name, draw in (("randn", randn), ("exponents 2^-125..2^126", wide)):
        a, b = draw(), draw()
        print(f"  {name:<24} differ in {differ(a * 0.5 + b * 0.5, (a + b) / 2)}")
        print(f"  {'':<24} a + b vs b + a: {differ(a + b, b + a)}; "
              f"x * 0.5 vs x / 2: {differ(a * 0.5, a / 2)}")
    tiny = torch.tensor([2.0**-149])  # the smallest subnormal: halving it is not exact
    ddp, ours = tiny * 0.5 + tiny * 0.5, (tiny + tiny) / 2
    print(f"  underflow: a = b = 2^-149: DDP gives {ddp.item():.3g}, ours {ours.item():.3g}")

    print("\nN = 3 (randn)")
    a, b, c = randn(), randn(), randn()
    third = torch.tensor(1.0 / 3.0, dtype=torch.float32)
    print(f"  x * fl(1/3) vs x / 3:                      differ in {differ(a * third, a / 3)}")
    print(f"  (a + b) + c vs (b + c) + a:                differ in {differ((a + b) + c, (b + c) + a)}")
    print(f"  DDP's a/3-style sum vs ours ((a+b)+c)/3:   differ in "
          f"{differ((a * third + b * third) + c * third, ((a + b) + c) / 3)}")
    d = ((a * third + b * third) + c * third) - ((a + b) + c) / 3
    rel = (d.abs() / (((a + b) + c) / 3).abs().clamp_min(1e-30))
    print(f"  ... median relative difference where they differ: {rel[d != 0].median().item():.2e}")

    print("\nDDP (one 40x50 Linear, gloo): its gradient equals, bitwise,")
    for n in (2, 3):
        pre, post = run_ranks(ddp_scaling, n)[0]
        print(f"  N = {n}: all_reduce(g * (1/N)): {pre};  all_reduce(g) / N: {post}")


if __name__ == "__main__":
    main()
