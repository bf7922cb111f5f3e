"""The plan's step time: a simulated step priced on a GPU and its collectives overlapped.

``zerolab/plan.py`` simulates one step and hands over, for each piece of it (the forward and
the backward of the root and of each block, then the optimizer step: ``overlap.py``'s
pieces), the operators it ran, and each collective with the unit it served and the phase it
ran in. Here:

1. each piece's operators are priced by the roofline of the preset's GPU
   (``zerolab/roofline.py``): its compute time;
2. each collective is priced on the links (``zerolab/cost.py``) and filed under its unit as
   a gather for the forward, a gather for the backward, or a reduction of the gradient;
3. ``zerolab/overlap.py`` plays the pieces and the collectives together as the system's
   schedule runs them, the computation slowed while a collective runs beside it: the step
   time, and the communication the computation did not hide.

``explain`` prices the same step with the roofline's effects (``roofline.EFFECTS``) added one
at a time, from every operator at the rated peak and bandwidth: what each effect adds to the
step, in that order, and the exposed communication on top: ``--explain``'s lines. With
measured matmul rates (``--matmul-rates``, ``zerolab/measured.py``) the effect ``measured``
comes after ``waves``: what the measured rates change from the MAMF-and-tiles ones.

DDP runs no collective in the simulation (its reducer cannot run on fake tensors); its
all-reduces are its buckets over the gradients, each complete when the last of its
parameters' gradients is (``buckets``).
"""

from __future__ import annotations

from zerolab import overlap
from zerolab.cost import Call, record_time
from zerolab.measured import coverage
# (EFFECTS: benchmarks/compare_stages.py reads it here, as steptime.EFFECTS)
from zerolab.roofline import EFFECTS, MEASURED, Roofline, effects_for  # noqa: F401

GATHERS = ("all_gather", "broadcast", "h2d", "read")  # what a unit needs before it computes
DDP_BUCKETS = (1 << 20, 25 << 20)  # DDP's first bucket, then every other (bucket_cap_mb=25)


def piece_keys(depth: int) -> list[tuple]:
    """The ``_Segments`` keys of the pieces, in ``overlap.py``'s order."""
    return [("forward", "head"), *(("forward", j) for j in range(depth)), ("forward", "tail"),
            ("backward", "head"), *(("backward", j) for j in reversed(range(depth))),
            ("backward", "tail"), ("step", "all")]


def unit_key(name: str, block_names: list[str]):
    """"root", a block's index, or the name itself (a unit that is neither)."""
    if name in ("", "root", "inner"):
        return "root"
    for j, b in enumerate(block_names):
        if name in (b, f"inner.{b}"):
            return j
    return name


def comm_by_unit(calls, block_names: list[str], cluster) -> dict:
    """{unit: overlap.Comm} from (unit name, phase, record) triples, priced on ``cluster``."""
    out: dict = {}
    for name, phase, r in calls:
        key = unit_key(name, block_names)
        c = out.setdefault(key, {"gather_forward": 0.0, "gather_backward": 0.0, "reduce": 0.0})
        if r.op in GATHERS:  # (ours gathers stages 1 and 2 "after the step", as forward starts)
            c["gather_backward" if phase == "backward" else "gather_forward"] += \
                record_time(r, cluster)
        else:
            c["reduce"] += record_time(r, cluster)
    return {k: overlap.Comm(**v) for k, v in out.items()}


def buckets(grads, depth: int, n: int, cluster) -> list[tuple[int, float]]:
    """DDP's all-reduces: ``grads`` is (the piece key where a parameter's gradient is formed,
    its fp32 bytes) in parameter order; buckets fill in reverse order (1 MiB, then 25 MiB),
    and each is ready after the last of its pieces in backward."""
    index = {k: i for i, k in enumerate(piece_keys(depth))}
    out, fill, ready, cap = [], 0, 0, DDP_BUCKETS[0]
    for key, nbytes in reversed(grads):
        fill, ready = fill + nbytes, max(ready, index[key])
        if fill >= cap:
            out.append((ready, fill))
            fill, ready, cap = 0, 0, DDP_BUCKETS[1]
    if fill:
        out.append((ready, fill))
    # (the bytes a rank sends, not rounded to whole bytes: a time, extended along the blocks)
    return [(piece, record_time(Call("all_reduce", b, 2 * b * (n - 1) / n, "world", n), cluster))
            for piece, b in out]


def step_time(run: dict, kind: str, preset, mixed_precision: bool, scale: float = 1.0,
              effects=None) -> dict:
    """The step of one simulated run on ``preset`` with the roofline's ``effects`` (None:
    all of them, ``effects_for`` the preset's GPU): its seconds, compute, exposed
    communication, compute by kind of operator, and all communication one after another;
    with measured matmul rates, the matmul FLOPs and how many of them were measured."""
    effects = effects_for(preset.device) if effects is None else effects
    roof = Roofline(preset.device, scale, preset.cluster.host_memory_gbs, frozenset(effects))
    depth = run["depth"]
    keys = piece_keys(depth)
    priced = {k: roof.time(run["ops"].get(k, [])) for k in keys}
    pieces = [priced[k]["total"] for k in keys]
    units = comm_by_unit(run["calls"], run["block_names"], preset.cluster)
    start = sum(record_time(r, preset.cluster) for r in run["exposed_start"])
    end = sum(record_time(r, preset.cluster) for r in run["exposed_end"])
    ddp = (buckets(run["grads"], depth, run["world_size"], preset.cluster)
           if kind == "ddp" else ())
    tasks = overlap.tasks_for(kind, depth, units, mixed_precision, start, end, ddp)
    slowdown = preset.device.comm_slowdown if "contention" in effects else 0.0
    out: dict = overlap.run(pieces, tasks, slowdown)
    out["comm_s"] = sum(t.seconds for t in tasks)
    out["compute_s_by_kind"] = {kind_: sum(priced[k][kind_] for k in keys)
                                for kind_ in ("matmul", "attention", "memory", "host")}
    rates = preset.device.matmul_rates
    if rates is not None and MEASURED in effects:
        out["matmul_flops_measured"], out["matmul_flops"] = coverage(
            (op for k in keys for op in run["ops"].get(k, [])), rates)
    return out


def explain(run: dict, kind: str, preset, mixed_precision: bool, scale: float = 1.0) -> dict:
    """Seconds of the step by cause: "rated" (every operator at the rated peak and
    bandwidth), then what each effect of ``effects_for`` the GPU adds, in order, and "exposed"
    (the communication left exposed with every effect on). They sum to the step."""
    out, before = {}, 0.0
    effects = effects_for(preset.device)
    for i in range(len(effects) + 1):
        t = step_time(run, kind, preset, mixed_precision, scale, effects[:i])
        busy = t["step_s"] - t["exposed_comm_s"]  # computing, slowed by contention
        out["rated" if i == 0 else effects[i - 1]] = busy - before
        before = busy
    out["exposed"] = t["exposed_comm_s"]
    return out
