"""When a step's collectives run, and how much of them the computation hides.

A GPU runs a step on two queues: the compute stream runs the kernels in program order, and
the network runs the collectives one after another, in the order they were issued (one
NCCL communicator: its kernels queue). The CPU issues both far ahead of the GPU, so a
collective starts as soon as the network is free and what it waits for has happened, and
a kernel starts as soon as the one before it ended and what it needs has arrived. The step
is cut into *pieces* of computation, in order:

    forward:  root (embeddings...), block 0, ..., block L-1, root (final norm, head, loss)
    backward: root (loss, head),    block L-1, ..., block 0, root (embeddings)
    step:     the optimizer

and each collective is a ``Task``: it may start once a piece has started (or ended), and a
piece waits for it. The schedules, as each system's code sets them:

- **a gather is prefetched under the previous unit's compute.** FSDP2 all-gathers a unit in
  its pre-forward hook, which the CPU reaches while the GPU still computes the unit before;
  the gather waits only for the previous gather's copy-out, at that unit's start
  (``_fsdp_param_group.py``: ``all_gather_state``). Ours prefetches the next unit when one
  starts its forward (``zero/core/schedule.py``: ``forward_started``): the same overlap. In
  backward each unit's pre-backward starts the gather of the unit before it, and the root's
  backward (the loss and the head) starts the last block's, in FSDP2's post-forward order:
  ours and FSDP2's alike.
- **a reduce-scatter runs under the next unit's backward.** A unit's reduce-scatter is
  issued in its post-backward, when its gradient is complete, and waited for in the
  post-backward of the next unit to finish backward, just before that unit issues its own:
  FSDP2's ``reduce_scatter_max_input_buffers = 1``, and ours at stages 2 and 3 (its
  ``reduce_scatter_depth``, FSDP2's ``set_reduce_scatter_max_input_buffers``: ``depth``
  reductions in flight, each waited that many units later). Stage 1 lets every reduction
  fly and waits at the end of backward (in mixed precision it starts them there: its bf16
  gradients are reduced through an fp32 copy, after backward). Under this model ours and
  FSDP2's expose the same communication.
- **stages 1 and 2 gather every unit after the step**, all issued when the next forward
  starts; each unit's forward waits for its own.
- **DDP** all-reduces a bucket once every gradient in it is ready (its buckets: 1 MiB, then
  25 MiB, in reverse order of the parameters), and waits at the end of backward.
- every system waits for all its collectives before the optimizer step.

The model keeps one collective at a time on a rank's links. While one is in flight, the
computation beside it runs ``slowdown`` slower (NCCL's kernels take SMs and memory bandwidth
from it; the presets take the measured mean, ``zerolab/clusters.py``). Collectives of a unit
that is neither the root nor a block (units by a wrap policy) are not overlapped: they run
after backward, exposed.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Task:
    """One collective (or several issued together): ``seconds`` on the network, which may
    start once piece ``after[1]`` has started ("start") or ended ("end"), None: at once;
    piece ``before`` waits for it to end (None: the last piece, the optimizer step)."""

    seconds: float
    after: tuple[str, int] | None
    before: int | None = None


def _stretch(begin: float, work: float, busy: list[tuple[float, float]], slowdown: float) -> float:
    """When ``work`` seconds of compute started at ``begin`` end, running ``1 + slowdown``
    times slower wherever an interval of ``busy`` (the network's, sorted) covers it."""
    t = begin
    for lo, hi in busy:
        if hi <= t or work <= 0:
            continue
        if lo > t:  # free until the collective starts
            step = min(work, lo - t)
            t, work = t + step, work - step
            if work <= 0:
                break
        span = hi - t  # beside the collective: (1 + slowdown) seconds a second of work
        step = min(work, span / (1 + slowdown))
        t, work = t + step * (1 + slowdown), work - step
    return t + work


def run(pieces: list[float], tasks: list[Task], slowdown: float = 0.0) -> dict[str, float]:
    """Play the step: ``pieces``, compute seconds in program order (the optimizer step last),
    and ``tasks`` on the network in the order of their start points, the compute running
    ``1 + slowdown`` times slower while a task is on the network. Returns the step's seconds,
    the computation's (alone), what contention added to it, and the communication the
    computation did not hide."""
    last = len(pieces) - 1
    order = sorted(range(len(tasks)), key=lambda i: (
        (-1, 0) if tasks[i].after is None else
        (tasks[i].after[1], 0 if tasks[i].after[0] == "start" else 1), i))
    start, end = {}, {}
    done = [None] * len(tasks)
    busy: list[tuple[float, float]] = []  # the network's intervals, in order
    net, nxt = 0.0, 0

    def known(t: Task):
        if t.after is None:
            return 0.0
        return (start if t.after[0] == "start" else end).get(t.after[1])

    def launch():
        nonlocal net, nxt
        while nxt < len(order) and known(tasks[order[nxt]]) is not None:
            t = tasks[order[nxt]]
            begin = max(net, known(t))
            net = begin + t.seconds
            if t.seconds > 0:
                busy.append((begin, net))
            done[order[nxt]] = net
            nxt += 1

    clock, stretched = 0.0, 0.0
    for k, seconds in enumerate(pieces):
        launch()
        waits = [done[i] for i, t in enumerate(tasks)
                 if (last if t.before is None else min(t.before, last)) == k]
        assert all(w is not None for w in waits), "a piece waits for a task not yet issued"
        start[k] = max([clock, *waits])
        launch()  # (a task that can start in this piece is on the network before it ends)
        end[k] = clock = _stretch(start[k], seconds, busy, slowdown) if slowdown else \
            start[k] + seconds
        stretched += clock - start[k] - seconds
        launch()
    compute = sum(pieces)
    return {"step_s": clock, "compute_s": compute, "contention_s": stretched,
            "exposed_comm_s": clock - compute - stretched}


@dataclass(frozen=True)
class Comm:
    """One unit's collectives, in seconds: what its forward needs gathered, what its backward
    needs gathered, and what reduces its gradient."""

    gather_forward: float = 0.0
    gather_backward: float = 0.0
    reduce: float = 0.0


def pieces_of(blocks: int) -> dict:
    """The pieces' indices for a model of ``blocks`` blocks (see the module docstring)."""
    L = blocks
    return {"forward head": 0, "forward": lambda j: 1 + j, "forward tail": L + 1,
            "backward head": L + 2, "backward": lambda j: L + 3 + (L - 1 - j),
            "backward tail": 2 * L + 3, "step": 2 * L + 4}


def tasks_for(kind: str, blocks: int, units: dict, mixed_precision: bool,
              start: float = 0.0, end: float = 0.0, buckets=(), depth: int = 1) -> list[Task]:
    """The tasks of system ``kind`` (the plan's names) for a model of ``blocks`` blocks.

    Args:
        units: {"root" or a block's index or any other name: Comm}.
        start: seconds exposed before the forward (DDP's buffer broadcast, our agreement).
        end: seconds exposed after backward (our used-parameter flags).
        buckets: DDP: (the piece after which a bucket is complete, its seconds), in order.
        depth: reduce-scatters in flight at stages 2 and 3 (FSDP2's
            ``reduce_scatter_max_input_buffers``, our ``reduce_scatter_depth``).
    """
    at = pieces_of(blocks)
    fsdp2, stage = kind.startswith("fsdp2"), (None if kind == "ddp" else
                                              3 if kind.startswith(("zero3", "fsdp2")) else
                                              int(kind[4]))
    if kind == "fsdp2-noreshard":
        stage = 2
    tasks = [Task(start, None, at["forward head"])] if start else []

    def first_forward(u):
        return at["forward head"] if u == "root" else at["forward"](u)

    def last_backward(u):
        return at["backward tail"] if u == "root" else at["backward"](u)

    def first_backward(u):
        return at["backward head"] if u == "root" else at["backward"](u)

    order = ["root", *range(blocks)]  # forward order of the units that gather
    for i, u in enumerate(order):
        c = units.get(u, Comm())
        if c.gather_forward:
            if stage in (1, 2) and not fsdp2:  # ours: every unit gathered as forward starts
                tasks.append(Task(c.gather_forward, None, first_forward(u)))
            else:  # prefetched: once the unit before it starts computing
                prev = None if i == 0 else ("start", first_forward(order[i - 1]))
                tasks.append(Task(c.gather_forward, prev, first_forward(u)))
    for u in reversed(order):  # backward order
        c = units.get(u, Comm())
        if c.gather_backward:
            if u == "root":
                after = ("end", at["forward tail"])
            elif u == blocks - 1:  # the root's backward prefetches it (FSDP2's order, ours)
                after = ("start", at["backward head"])
            else:
                after = ("start", at["backward"](u + 1))
            tasks.append(Task(c.gather_backward, after, first_backward(u)))
        if c.reduce:
            done = last_backward(u)
            if kind == "ddp":
                continue
            if stage == 1:  # every reduction in flight at once, waited at the end of backward
                after = ("end", at["backward tail"]) if mixed_precision else ("end", done)
                tasks.append(Task(c.reduce, after, None))
            elif u == "root":
                tasks.append(Task(c.reduce, ("end", done), None))
            else:  # waited when the depth-th unit after it issues its own, at the end of its
                tasks.append(Task(c.reduce, ("end", done), done + 1 + depth))  # backward
    for piece, seconds in buckets:  # DDP
        tasks.append(Task(seconds, ("end", piece), None))
    others = sum(c.gather_forward + c.gather_backward + c.reduce for u, c in units.items()
                 if u != "root" and not isinstance(u, int))
    if others:  # units that are not the blocks: after backward, exposed
        tasks.append(Task(others, ("end", at["backward tail"]), None))
    if end:
        tasks.append(Task(end, ("end", at["backward tail"]), None))
    return tasks
