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
    root = {0} if stage == 3 else set()
    for i in reversed(range(len(units))):  # backward, unit by unit, last first
        done = sum(shard[j] for j in range(i + 1, len(units)))  # shards of the later units
        later = i + 1 < len(units)
        if later:  # unit i starts: unit i + 1's reduce-scatter ends, its shard is copied out
            # (gathered: i, and those unit i + 1 prefetched with it; i + 1 was freed)
            gathered = root | set(behind(order, i + 1)) if stage == 3 else set()
            grads = done - shard[i + 1] + units[i + 1] + shard[i + 1]
            if i == 0:  # the root's backward began first, at its output: it waits at its end,
                grads += units[0]  # with its own full gradient formed
            worst = max(worst, 4 * grads + 4 * sum(units[j] for j in gathered))
        gathered = root | {i, *behind(order, i)} if stage == 3 else set()  # i and its prefetched
        worst = max(worst, 4 * (done + units[i]) + 4 * sum(units[j] for j in gathered))
    at_rest = params + 4 * sum(shard) + optim  # the gradient shards, after backward
    peak = max(at_rest, params + worst + optim)
    return {"at_rest": at_rest, "in_flight": peak - at_rest, "peak": peak}
