"""Every rank must shard the same model: the same structure, and the same values.

The ranks agree on each unit's description, then compare a fingerprint of its values
(``check_same_values``) or take rank 0's (``sync_module_states=True``, FSDP1's name):
notes/08-checkpoints.md, "Weights loaded before sharding".
"""

from __future__ import annotations


import re
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from zero import comm
from zero.comm.context import CommContext

AGREED = ("the same model (same structure, shapes, dtypes, requires_grad) and call zero.shard "
          "in the same order, with the same arguments, on every rank")


def values(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor behind ``t``: a DTensor's local one; a subclass's inner one."""
    if isinstance(t, DTensor):
        t = t._local_tensor
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        t = getattr(t, names[0])
    return t


def check_same_description(desc: list, group, ctx: CommContext) -> None:
    """Agree on ``desc``; raise naming the first difference, on every rank, if they differ."""
    try:
        comm.agree(f"shard {desc}", group=group, error=ValueError, ctx=ctx,
                   fix=f"Ranks shard different modules: build {AGREED}")
    except ValueError as e:  # every rank is here: name what differs first, then the rest
        raise ValueError(f"Ranks shard different modules: {first_difference(desc, group, ctx)}. "
                         f"Build {AGREED}. (In full: {e})") from None


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # Python's default repr: where it lives


def describe(policy, depth: int = 2) -> str:
    """A policy in words the ranks can compare (no address, which differs on every rank)."""
    kind = type(policy)
    if kind.__repr__ is object.__repr__ and hasattr(policy, "__dict__") and depth > 0:
        fields = ", ".join(f"{k}={describe(v, depth - 1)}" for k, v in sorted(vars(policy).items()))
        return f"{kind.__module__}.{kind.__qualname__}({fields})"
    return _ADDRESS.sub("", repr(policy))


_FIELDS = ["the modules' classes", "stage", "mp_policy", "reshard_after_forward",
           "broadcast_buffers", "ignored_params"]


def first_difference(desc: list, group, ctx: CommContext) -> str:
    """The first entry of the ranks' ``zero.shard`` descriptions that differs, in words."""
    every = comm.all_gather_object(desc, group=group, ctx=ctx)
    for k in range(max(len(d) for d in every)):
        items: list[Any] = [d[k] if k < len(d) else None for d in every]
        if all(item == items[0] for item in items):
            continue
        if k < len(_FIELDS):
            return f"{_FIELDS[k]} differs: " + "; ".join(
                f"rank {r}: {item!r}" for r, item in enumerate(items))
        if all(isinstance(item, tuple) and len(item) == 3 and item[0] == "policy"
               for item in items):  # a policy's parameters
            return f"{items[0][1]} differs: " + "; ".join(
                f"rank {r}: {item[2]!r}" for r, item in enumerate(items))
        if all(isinstance(item, tuple) and len(item) == 4 for item in items):  # a parameter
            said = [f"rank {r}: {name!r} {tuple(shape)} {dtype}"
                    f"{'' if rg else ' (frozen)'}" for r, (name, shape, dtype, rg) in
                    enumerate(items)]
            return f"parameter #{k - len(_FIELDS)} differs: " + "; ".join(said)
        return "; ".join(f"rank {r}: {item!r}" for r, item in enumerate(items))
    return "their descriptions differ"


_SAMPLES = 64  # elements of each parameter in the fingerprint of its values
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # bits by itemsize


def fingerprint(names) -> torch.Tensor:
    """(P,) int64: per parameter, an exact weighted sum of the bits of up to ``_SAMPLES`` values."""
    sums = []
    for _, p in names:
        flat = values(p).detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // _SAMPLES)][:_SAMPLES]
        bits = sample.view(_INTS[sample.element_size()]).to(torch.int64)
        weights = torch.arange(1, len(bits) + 1, dtype=torch.int64, device=bits.device)
        sums.append((bits * weights).sum())
    return torch.stack(sums)


def check_same_values(names, group, ctx: CommContext) -> None:
    """Raise on every rank, naming the parameters, unless every rank holds the same values."""
    n = ctx.world_size(group)
    if not names or n == 1 or ctx.simulated(group):
        return
    mine = fingerprint(names)
    every = mine.new_empty(n * len(mine))
    # (P,) per rank -> (N*P,): each rank's fingerprint of each parameter
    comm.all_gather(every, mine, group=group, unit="", phase="init", ctx=ctx)
    rows = every.view(n, -1)
    differ = [name for (name, _), d in zip(names, (rows != rows[0]).any(0).tolist()) if d]
    if differ:  # (every rank gathered the same rows: every rank raises)
        raise ValueError(
            f"the ranks hold different values of {len(differ)} of this unit's {len(names)} "
            f"parameters ({', '.join(differ[:4])}{', ...' if len(differ) > 4 else ''}): were "
            "the weights loaded on rank 0 only? Each rank would train its own half. Load them "
            "on every rank before zero.shard, or pass zero.shard(..., sync_module_states=True) "
            "to copy rank 0's, or shard on the meta device and load after (zero.load)")


def take_rank0_values(modules, params, group, ctx: CommContext) -> None:
    """``sync_module_states``: rank 0's ``params`` and buffers everywhere, a broadcast per dtype."""
    if any(p.is_meta for p in params):
        raise ValueError("sync_module_states=True copies rank 0's values, but the module is "
                         "on the meta device: it has none yet; use zero.init_parameters or "
                         "zero.load after sharding instead")
    tensors = [p.detach() for p in params] + [b for m in modules for b in m.buffers()]
    for dtype in sorted({t.dtype for t in tensors}, key=str):
        same = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.reshape(-1) for t in same])
        # (numel,) rank 0's -> every rank's, in place
        comm.broadcast(flat, src=0, group=group, unit="", phase="init", ctx=ctx)
        with torch.no_grad():
            for t, part in zip(same, flat.split([t.numel() for t in same])):
                t.copy_(part.view_as(t))
