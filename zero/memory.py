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

What our stages really hold is measured from the outside, by ``zerolab.trackers``.
"""

from __future__ import annotations


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
