"""Three facts about the flat parameter that autograd makes matter, each measured.

    python notes/figures/flat_autograd.py > notes/figures/flat_autograd.txt

1. Views made by one ``split`` get their gradient back as one concatenation; views made by
   one slice each cost one full-size buffer per parameter in backward.
2. Refilling the buffer through the autograd leaf trips autograd's version check; through a
   ``.data`` alias (its own version counter) it does not.
3. A stage-3 unit's full buffer has 0 bytes of storage between uses, and the full size only
   while the unit computes.
"""

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import zero
from zero.core.flat import FlatLayout
from zerolab.launch import run_ranks
from zerolab.models import Block, GPTConfig

DIM, WORLD_SIZE = 32, 3


class OpLog(TorchDispatchMode):
    """Record every aten op and the shapes of its outputs."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (list, tuple)) else [out]
        self.ops.append((func.__name__, [tuple(o.shape) for o in outs if isinstance(o, torch.Tensor)]))
        return out


def backward_ops(how: str):
    torch.manual_seed(0)
    block = Block(GPTConfig(dim=DIM))
    names = [n for n, _ in block.named_parameters()]
    params = list(block.parameters())
    layout = FlatLayout([p.shape for p in params], WORLD_SIZE)
    flat = layout.flatten([p.detach() for p in params]).requires_grad_()
    if how == "one split (FlatLayout.views)":
        views = layout.views(flat)
    else:
        views = [flat[o : o + n].view(s)
                 for o, n, s in zip(layout.offsets, layout.numels, layout.shapes)]
    for name, v in zip(names, views):
        mod, attr = name.rsplit(".", 1)
        block.get_submodule(mod)._parameters[attr] = v
    loss = block(torch.randn(2, 16, DIM)).sum()
    with OpLog() as log:
        loss.backward()
    full = [op for op, shapes in log.ops if (layout.padded_numel,) in shapes and op != "detach.default"]
    node = views[0].grad_fn
    chain = type(node).__name__ + " -> " + type(node.next_functions[0][0]).__name__
    print(f"{how}:")
    print(f"  grad_fn of a view: {chain}")
    print(f"  backward ops making a ({layout.padded_numel},) tensor: {len(full)}  "
          f"{dict((op, full.count(op)) for op in sorted(set(full)))}")
    print(f"  flat.grad: {tuple(flat.grad.shape)}, {len(params)} parameters")


def version_check(write_through: str, view_by: str):
    leaf = torch.randn(8, requires_grad=True)  # the unsharded flat parameter
    data = leaf.data  # Unit._unsharded_data: same storage, its own version counter
    w = (leaf.split([6, 2])[0] if view_by == "split" else leaf[:6]).view(2, 3)  # a parameter view
    y = F.linear(torch.randn(5, 3, requires_grad=True), w).sum()  # saves w for backward
    before = data.untyped_storage().data_ptr()
    data.untyped_storage().resize_(0)  # stage 3 frees after forward ...
    data.untyped_storage().resize_(8 * 4)  # ... and refills before backward
    after = data.untyped_storage().data_ptr()
    follows = w.untyped_storage().data_ptr() == after
    with torch.no_grad():
        (leaf if write_through == "leaf" else data).copy_(torch.randn(8))
    try:
        y.backward()
        result = f"backward ok, leaf.grad {tuple(leaf.grad.shape)}"
    except RuntimeError as e:
        result = "RuntimeError: " + str(e).split(".")[0].split(": [")[0]
    print(f"view by {view_by:<5}, refill through {write_through:<4}: versions leaf "
          f"{leaf._version}, alias {data._version}, saved view {w._version} -> {result}")
    return before != after, follows


def storage_sizes(rank, n):
    torch.manual_seed(0)
    block = Block(GPTConfig(dim=DIM))
    zero.shard(block, stage=3)
    unit = zero.units_on(block)[0]
    seen = {"after zero.shard": unit.unsharded.untyped_storage().nbytes()}
    block.register_forward_hook(  # runs before the unit's own post-forward (which frees)
        lambda m, a, o: seen.__setitem__("during forward", unit.unsharded.untyped_storage().nbytes()),
        prepend=True)
    block(torch.randn(2, 16, DIM)).sum().backward()
    seen["after backward"] = unit.unsharded.untyped_storage().nbytes()
    seen["shard (this rank's fp32 slice)"] = unit.sharded.numel() * 4
    return seen


def main():
    print(f"== 1. one split vs one slice per parameter (a GPT block, dim {DIM}, N = {WORLD_SIZE})")
    for how in ("one split (FlatLayout.views)", "one slice per parameter"):
        backward_ops(how)
    print("\n== 2. refilling freed storage that autograd saved")
    moved = [version_check(where, view_by)
             for where, view_by in (("leaf", "split"), ("leaf", "slice"), ("data", "split"))]
    print(f"each time, the refill moved the bytes: {all(m for m, _ in moved)}; "
          f"the saved view follows them: {all(f for _, f in moved)}")
    print(f"\n== 3. storage bytes of a stage-3 unit's full flat buffer (rank 0 of {WORLD_SIZE})")
    for k, v in run_ranks(storage_sizes, WORLD_SIZE)[0].items():
        print(f"  {k:<32} {v:>6} bytes")


if __name__ == "__main__":
    main()
