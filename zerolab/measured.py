"""Measured matmuls: the plan's matmuls at the rates a GPU measured for their own shapes.

The roofline (``zerolab/roofline.py``) prices a matmul at the best-shape maximum a GPU was
measured to reach (MAMF), less its tiles' and waves' quantization. What the same GPU reaches on
*this* step's shapes and layouts, under sustained load, its clocks held under the power limit,
no source gives: it has to be measured. ``benchmarks/matmul_rates.py`` times, on the GPU at
hand, every distinct matmul the plan's own simulation of the step runs, and writes a JSON file;
``python -m zerolab plan --matmul-rates FILE`` reads it here:

- ``count``: the operators of a simulated step with their counts (``zerolab.plan.step_ops``
  counts a whole step of a model of alike blocks, run at 3 and 4 blocks and extended to its
  depth, as the plan does);
- ``Shape``: a matmul as it is measured and looked up: (batch, m, n, k), dtype, layout;
- ``load``: a rates file held to the plan it is given to (the same model, the same dtype; a
  dry run, which measured nothing, refused), as a ``MatmulRates``: the roofline asks it for
  each matmul's rate, and a shape it lacks keeps the MAMF-and-tiles rate (the plan says how
  much of the step's matmul FLOPs that leaves).

Nothing here is fitted: a rate is what the file measured for that shape, or the model's own.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
from dataclasses import dataclass

from zerolab.planmodel import PlanError
from zerolab.roofline import Op

FORMAT = "zerolab-matmul-rates/1"  # the files benchmarks/matmul_rates.py writes


@dataclass(frozen=True, order=True)
class Shape:
    """A matmul as timed: ``batch`` products of (m x k) by (k x n), in ``dtype`` ("bf16", or
    "fp32" run on TF32 tensor cores), operands read as ``layout`` says ("NT": b transposed)."""

    batch: int
    m: int
    n: int
    k: int
    dtype: str
    layout: str

    def label(self) -> str:
        lead = f"{self.batch} x " if self.batch > 1 else ""
        return f"{lead}{self.m} x {self.n} x {self.k}"

    @property
    def flops(self) -> float:
        return 2.0 * self.batch * self.m * self.n * self.k


def shape_of(op: Op) -> Shape | None:
    """The shape of a matmul ``Op`` (its k from its FLOPs, 2 x batch x m x n x k); None for
    another kind of op, or a matmul whose shape the roofline does not read (grouped)."""
    if op.kind != "matmul" or not op.shape[1] or not op.shape[2]:
        return None
    b, m, n = op.shape
    return Shape(b, m, n, round(op.flops / (2.0 * b * m * n)),
                 "bf16" if op.low_precision else "fp32", op.layout or "NN")


def count(run: dict) -> collections.Counter:
    """{(phase, op): how many times} in one simulated run ("forward", "backward", "step")."""
    out: collections.Counter = collections.Counter()
    for (phase, _), ops in run["ops"].items():
        for op in ops:
            out[(phase, op)] += 1
    return out


def model_id(spec: str) -> str:
    """What makes two ``--model`` values the same model: a config file by its content (the
    same config.json anywhere), anything else as written."""
    path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
    if os.path.isfile(path):
        try:
            with open(path) as f:
                text = json.dumps(json.load(f), sort_keys=True)
        except (OSError, ValueError, RecursionError):
            return spec
        return "config sha256 " + hashlib.sha256(text.encode()).hexdigest()[:16]
    return spec


def command(spec: str, batch: int, seq: int, mixed_precision: bool,
            checkpoint: str | None = None) -> str:
    """The measuring command for this plan's matmuls (on a GPU)."""
    ac = f" --activation-checkpointing {checkpoint}" if checkpoint else ""
    mp = " --mixed-precision" if mixed_precision else ""
    return (f"python benchmarks/matmul_rates.py --model {spec} --batch {batch} --seq {seq}"
            f"{mp}{ac} --out FILE.json")


@dataclass(frozen=True, eq=False)
class MatmulRates:
    """Measured TFLOPS by ``Shape``, and where they came from (device, date, versions)."""

    rates: dict
    source: str
    device: str
    path: str

    def tflops(self, op: Op) -> float | None:
        """The measured rate of ``op``'s shape; None where it was not measured."""
        shape = shape_of(op)
        return None if shape is None else self.rates.get(shape)


def load(path: str, spec: str, batch: int, seq: int, mixed_precision: bool,
         checkpoint: str | None = None) -> MatmulRates:
    """The rates file at ``path``, held to the plan of ``spec`` in that precision; a
    ``PlanError`` naming the fix when it cannot serve."""
    fix = command(spec, batch, seq, mixed_precision, checkpoint)
    where = f"--matmul-rates {path}"
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise PlanError(f"{where}: not a readable JSON file ({e}); write one on a GPU with "
                        f"{fix}") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise PlanError(f"{where}: not a file of benchmarks/matmul_rates.py (no \"format\": "
                        f"\"{FORMAT}\"); write one on a GPU with {fix}")
    if not raw.get("measured"):
        raise PlanError(f"{where}: a dry run (no CUDA device where it ran): it measured "
                        f"nothing; run it on a GPU: {fix}")
    if raw.get("model_id") != model_id(spec):
        raise PlanError(f"{where}: measured for the model {raw.get('model')}, not {spec}; "
                        f"measure this model's matmuls on a GPU: {fix}")
    theirs = "bf16" if raw.get("mixed_precision") else "fp32 (TF32)"
    ours = "bf16" if mixed_precision else "fp32 (TF32)"
    if bool(raw.get("mixed_precision")) != mixed_precision:
        flag = "add --mixed-precision" if raw.get("mixed_precision") else \
            "leave out --mixed-precision"
        raise PlanError(f"{where}: its matmuls were measured in {theirs}, this plan's run in "
                        f"{ours}; {flag} to plan in the file's precision, or measure in this "
                        f"one on a GPU: {fix}")
    rates = {}
    try:
        for row in raw["matmuls"]:
            if row.get("measured_tflops"):
                shape = Shape(*(int(row[k]) for k in ("batch", "m", "n", "k")),
                              str(row["dtype"]), str(row["layout"]))
                rates[shape] = float(row["measured_tflops"])
    except (KeyError, TypeError, ValueError) as e:
        raise PlanError(f"{where}: a matmul row without its shape or rate ({e!r}); write the "
                        f"file again with {fix}") from None
    versions = f"torch {raw.get('torch')}, CUDA {raw.get('cuda')}"
    source = f"{raw.get('device')}, {raw.get('date')}, {versions}; {path}"
    return MatmulRates(rates, source, str(raw.get("device")), path)


def coverage(ops, rates: MatmulRates) -> tuple[float, float]:
    """(matmul FLOPs at a measured rate, all matmul FLOPs) of ``ops``."""
    measured = total = 0.0
    for op in ops:
        if op.kind == "matmul":
            total += op.flops
            if rates.tflops(op):
                measured += op.flops
    return measured, total
