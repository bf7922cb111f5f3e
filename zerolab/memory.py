"""Memory: the ZeRO paper's model-state formulas.

Model states (ZeRO paper, section 3.1 and Figure 1) are parameters, gradients and
optimizer state. With Ψ parameters on N ranks and K bytes of optimizer state per
parameter, each rank holds:

| stage | mixed precision (2-byte params/grads, K = 12) | fp32 Adam (4-byte params/grads, K = 8) |
|-------|-----------------------------------------------|----------------------------------------|
| DDP   | (2 + 2 + K) Ψ                                 | (4 + 4 + K) Ψ                          |
| 1     | (2 + 2) Ψ + K Ψ / N                           | (4 + 4) Ψ + K Ψ / N                    |
| 2     | 2 Ψ + (2 + K) Ψ / N                           | 4 Ψ + (4 + K) Ψ / N                    |
| 3     | (2 + 2 + K) Ψ / N                             | (4 + 4 + K) Ψ / N                      |

In mixed precision K = 12 counts the fp32 master weights (4), momentum (4) and variance
(4); in fp32 the master weights *are* the parameters, so K = 8.

The formula counts what a rank holds at rest. ``schedule`` counts what ours hold at their
worst instant: the same terms, unit by unit, walked through our schedule, plus the named
extras the formula leaves out (padding, AdamW's step counters, and the units in flight: a
stage-3 unit being gathered while another computes, one unit's full gradient while it is
reduce-scattered). What our stages really hold is measured from the outside, by
``zerolab.trackers``; notes/06-comparison.md sets the two side by side.
"""

from __future__ import annotations

from zero.core.schedule import Schedule


def model_state_bytes(psi: float, n: int, stage: int, mixed_precision: bool = True) -> float:
    """Per-rank model-state bytes for Adam under ``stage`` (0 = DDP), per the table above."""
    p, g, k = (2, 2, 12) if mixed_precision else (4, 4, 8)
    params = p * psi / (n if stage >= 3 else 1)
    grads = g * psi / (n if stage >= 2 else 1)
    optim = k * psi / (n if stage >= 1 else 1)
    return params + grads + optim


def traffic_in_psi(stage: int) -> float:
    """Elements each rank sends per step, in units of Ψ (N large): 2Ψ, or 3Ψ for stage 3."""
    return 3.0 if stage == 3 else 2.0


def schedule(units: list[int], stage: int, n: int, tensors: int = 0,
             prefetch: int = 1) -> dict[str, int]:
    """Our model-state bytes per rank at the worst instant of a step (fp32 AdamW).

    Args:
        units: each unit's padded flat numel, in forward order, the root first (it runs
            first in forward and last in backward, and at stage 3 keeps its parameters).
        stage: 1, 2 or 3.
        n: the world size.
        tensors: parameter tensors: AdamW keeps a 4-byte step counter for each piece.
        prefetch: the root's ``zero.shard(..., prefetch=...)``: which units are gathered
            ahead of the one computing is the mechanism's own ``Schedule``'s answer.

    Returns:
        ``{"at_rest": ..., "in_flight": ..., "peak": ...}``: what the paper's formula counts
        (parameters, gradients and optimizer state as the step finds them, on our padded
        sizes), the most that the schedule adds on top, and their sum.
    """
    shard = [p // n for p in units]
    optim = 8 * sum(shard) + 4 * tensors  # exp_avg, exp_avg_sq, and a step per piece
    if stage == 1:  # full parameters and gradients (reduced in place): nothing in flight
        at_rest = 8 * sum(units) + optim
        return {"at_rest": at_rest, "in_flight": 0, "peak": at_rest}
    params = 4 * sum(units) if stage == 2 else 4 * sum(shard)
    order = list(range(len(units)))  # forward order: the root, then the blocks
    ahead, behind = Schedule(prefetch).ahead, Schedule(prefetch).behind
    worst = 0
    for i in order:  # forward: unit i computes while the units ahead of it are gathered
        if stage == 3:
            gathered = {0, i, *ahead(order, i)}  # (the root keeps its parameters)
            worst = max(worst, 4 * sum(units[j] for j in gathered))
    # Backward prefetches in the order forwards ended (the blocks, then the root), and the
    # gradients complete in reverse: the last block's first, the root's (embeddings) last.
    # At each unit's post-backward its full gradient is formed while the reduce-scatter of
    # the unit before it is still in flight with its own (two full gradients); that one
    # ends (its shard copied out beside it), and this one's starts.
    ended = [*order[1:], 0]
    flying, done = None, 0  # the reduction in flight; the shards of those that ended
    for i in [*reversed(order[1:]), 0]:
        gathered = set()
        if stage == 3:  # the root; a block with those it prefetched (the rest were freed)
            gathered = {0} | ({i, *behind(ended, ended.index(i))} if i else set())
        grads = done + units[i] + (units[flying] + shard[flying] if flying is not None else 0)
        worst = max(worst, 4 * grads + 4 * sum(units[j] for j in gathered))
        if flying is not None:
            done += shard[flying]
        flying = i
    if flying is not None:  # the end of backward ends the last one
        worst = max(worst, 4 * (done + units[flying] + shard[flying]) +
                    (4 * units[0] if stage == 3 else 0))
    at_rest = params + 4 * sum(shard) + optim  # the gradient shards, after backward
    peak = max(at_rest, params + worst + optim)
    return {"at_rest": at_rest, "in_flight": peak - at_rest, "peak": peak}
