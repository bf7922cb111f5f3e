"""Agreement: ranks about to take different paths raise instead of hanging.

[Note: agreement] A collective pairs with whatever collective the other ranks issue next, so
ranks that took different paths wait forever, or exchange the wrong unit's data. ``agree(what)``
(one small all-gather) raises on every rank, naming what each was about to do, if they differ.
zero agrees where what follows is decided; with ``ZERO_CHECK=1``, before every collective as
well. Where, and at what cost: notes/13-agreement.md, "Agreeing on what comes next".
"""

from __future__ import annotations

import contextlib
import hashlib
import os

import torch

from zero.comm import ledger, objects, waits
from zero.comm.ledger import on_host


def checking() -> bool:
    """Check mode: agree before every collective (``ZERO_CHECK=1``)."""
    return os.environ.get("ZERO_CHECK", "0") not in ("", "0")


def _fingerprint(what: str) -> int:
    return int.from_bytes(hashlib.blake2b(what.encode(), digest_size=7).digest(), "big")


class Disagreement(RuntimeError):
    """The ranks were about to do different things (``agree``)."""


class AgreementTimeout(Disagreement, waits.CollectiveTimeout):
    """The other ranks never came to an agreement: both a disagreement and a timeout."""


def agree(what: str, *, group=None, device=None, fix: str = "", error=Disagreement,
          ctx) -> None:
    """Every rank of ``group`` says ``what`` it is about to do; ``error`` on all if they differ, or
    if one never joins within ``ZERO_TIMEOUT`` (``fix`` ends its message). ``ctx`` counts the
    agreements; ``device`` is not used (kept for callers written before)."""
    if ctx.alone(group) or ctx.simulated(group):
        return
    group, device = ctx.host(group)  # (on the host: reading the result syncs no device)
    seq = ctx.next_agreement(group)
    n = ctx.world_size(group)
    with on_host():
        mine = torch.tensor([_fingerprint(what), seq], dtype=torch.int64, device=device)
        every = torch.empty(2 * n, dtype=torch.int64, device=device)
    name = ctx.issued(f"agreement #{seq}: {what}", group)
    rec = ledger.record("agree", every, 1.0, group, "", "agree", ctx)
    # (2,) per rank -> (2N,): each rank's fingerprint of what it is about to do, and its count
    with on_host():
        work = ctx.backend.all_gather(every, mine, group=group, async_op=True)
    try:
        waits.wait(work, name, group, ctx, always=True)  # bounded everywhere: read at once
    except waits.CollectiveTimeout as e:
        kind = AgreementTimeout if error is Disagreement else error
        raise kind(f"{e}. {fix}".strip()) from e
    ledger.done(rec)
    rows = every.view(n, 2).tolist()  # (read on the host: no operator on a device)
    if any(row != rows[0] for row in rows):
        said = objects.all_gather_object(f"{what} (agreement #{seq})", group, ctx)
        detail = "; ".join(f"rank {r} is about to {w}" for r, w in enumerate(said))
        raise error(f"the ranks took different paths: {detail}. {fix}".strip())


@contextlib.contextmanager
def raising_together(group=None, device=None, *, ctx):
    """Local checks whose failure on one rank must stop every rank: an exception inside is
    announced as an agreement ("raise ..."), which the other ranks see at their next ``agree``."""
    try:
        yield
    except Exception as e:
        with contextlib.suppress(Disagreement):  # the others differ, of course: say ours
            agree(f"raise {type(e).__name__}: {e}", group=group, device=device, ctx=ctx)
        raise
