"""Python objects between ranks, for rare, small metadata (error reports, checkpoint checks).

torch's ``all_gather_object`` waits without a bound; this one is two bounded all-gathers
(``zero/comm/waits.py``), not in the ledger (as torch's was not): it carries no training data.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

from zero.comm import waits


def all_gather_object(obj: Any, group, ctx) -> list[Any]:
    device = ctx.default_device(group)
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    n = ctx.world_size(group)
    # (1,) per rank -> (N,): each rank's pickle size
    sizes = torch.empty(n, dtype=torch.int64, device=device)
    _gather(sizes, torch.tensor([data.numel()], device=device), group, "object sizes", ctx)
    longest = int(sizes.max())
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    mine[: data.numel()] = data
    # (L,) per rank -> (N*L,): every rank's pickle
    every = torch.empty(n * longest, dtype=torch.uint8, device=device)
    _gather(every, mine, group, "objects", ctx)
    rows = every.view(n, longest).cpu()
    return [pickle.loads(rows[r, : int(sizes[r])].numpy().tobytes()) for r in range(n)]


def _gather(out: torch.Tensor, mine: torch.Tensor, group, what: str, ctx) -> None:
    work = ctx.backend.all_gather(out, mine, group, async_op=True)
    waits.wait(work, ctx.issued(f"all_gather of {what}", group), group, ctx, always=True)
