"""An emulated GPU cluster on the CPU: every system's collectives timed on a preset's links,
with a GPU's stream semantics, on one virtual clock per rank.

On a GPU a collective issued on a side stream runs in the background and the computing stream
blocks only where it waits for it (an event, a stream, a ``Work``). On the CPU, torch's stand-ins
for streams and events do nothing (``torch.cpu.Stream``: FSDP2's ``device_handle`` there, and
zero's ``Streams`` through ``torch.get_device_module``) and gloo's collectives take the CPU's own
time. Here each rank *records* what its step does, and the record is *played* on a network:

1. ``Recorder`` (installed in a rank for a run, restored after) replaces ``torch.cpu.Stream``,
   ``Event``, ``stream`` and ``current_stream`` with stand-ins that log what a GPU would be told
   (``record_event``, ``wait_stream``, ``wait_event``), and wraps the ``torch.distributed``
   collectives that DDP's Python comm hook, ``ZeroRedundancyOptimizer``, FSDP2 and zero call:
   each real gloo collective runs at once, to completion (the data is the plain run's, bit for
   bit), its own CPU time is left out of compute, and it is logged with the stream it was issued
   on, its bytes (ring accounting, as ``zerolab.measure``) and its group. ``Work.wait()`` is
   logged where it is called. Between two such events the process's CPU time is compute, on the
   stream current then (a copy-in under ``with stream(copy_in)`` runs on that side stream).
   A future handed to a comm hook (DDP's) is waited for at the end of backward, as DDP's reducer
   does in C++: logged from an autograd final callback.
2. ``play(log, network)`` runs the log as a GPU would: the computing stream advances by its
   compute; a collective starts once its stream's earlier work and the host's issue are done and
   its group's link is free (one NCCL communicator: collectives on one group run one after
   another, as the plan's ``zerolab/overlap.py`` has it), and lasts latency plus bytes over the
   link (``zerolab/cost.py``, the plan's presets) times the **dilation**: this CPU's compute time
   for the step over the GPU's from the roofline, so that communication : compute is the GPU's.
   A blocking collective on a side stream holds that stream, not the computing one; a wait on
   the computing stream advances it to the awaited finish, and the advance is exposed
   communication of that collective's kind.

Playing a record is a pure function: one run, played on several presets, gives each preset's
figures (and the same run played twice gives the same numbers). The clock is the process's CPU
time, not the wall: another process on these shared cores does not stretch a rank's compute.
What it cannot stand in for (notes/10-overlap.md): a GPU's kernels slowed by NCCL's sharing the
SMs and memory bandwidth, launch overhead, a CPU that runs ahead of the GPU (here the host *is*
the computing stream, so a collective is issued when the computation reaches it), and the other
ranks' lateness (each rank plays its own log; ranks run the same program, so a rank's issue
time stands in for the latest rank's).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from zero.comm import host_side
from zerolab.cost import Call, Cluster, record_time

COMPUTE = 0  # the computing stream's id in a log
# the collectives wrapped, by name: (which argument is the full buffer, ring factor)
_WRAPPED = {"all_gather_single": ("output_tensor", 0, 1), "reduce_scatter_single": ("input", 1, 1),
            "all_reduce": ("tensor", 0, 2), "broadcast": ("tensor", 0, 1),
            "all_to_all_single": ("input", 1, 1)}
_KIND = {"all_gather_single": "all_gather", "reduce_scatter_single": "reduce_scatter",
         "all_reduce": "all_reduce", "broadcast": "broadcast", "all_to_all_single": "all_to_all"}
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all")


# ---- the network: a preset's links, dilated ------------------------------------------------


@dataclass(frozen=True)
class Network:
    """A preset's links (``zerolab/cost.py``'s ``Cluster``, priced as the plan prices them) and
    the dilation factor: CPU seconds of compute per GPU second, which multiplies every
    collective's GPU duration."""

    name: str
    cluster: Cluster
    dilation: float = 1.0

    def seconds(self, op: str, buffer_bytes: float, sent_bytes: float,
                ranks: tuple[int, ...]) -> float:
        """One collective on the emulated (dilated) clock: ``zerolab.cost.record_time`` of it,
        its group named by the nodes its ranks sit on (consecutive ranks a node)."""
        n = len(ranks)
        nodes = len({r // self.cluster.ranks_per_node for r in ranks})
        group = "intra-node" if nodes == 1 else "inter-node" if nodes == n else "world"
        return self.dilation * record_time(Call(op, buffer_bytes, sent_bytes, group, n),
                                           self.cluster)


def network(spec: str, world_size: int, dilation: float = 1.0) -> Network:
    """``NAME`` (a ``zerolab.clusters`` preset; ranks fill its nodes, as torchrun places them) or
    ``NAME:K-nodes`` (the ranks spread evenly over K of its nodes, each GPU with its own share of
    the node's NICs: every flat group's ring crosses the network)."""
    from zerolab.clusters import PRESETS

    name, _, nodes = spec.partition(":")
    if name not in PRESETS:
        raise ValueError(f"unknown network {name!r}: one of {', '.join(PRESETS)}")
    cluster = PRESETS[name].cluster
    if nodes:
        k = int(nodes.removesuffix("-nodes"))
        if k < 1 or world_size % k or world_size // k > cluster.ranks_per_node:
            raise ValueError(f"{spec}: {world_size} ranks do not fill {k} nodes of "
                             f"{cluster.ranks_per_node} evenly")
        per = world_size // k  # a node's GPUs that the run uses, each with its NICs
        fields = {"ranks_per_node": per}
        if getattr(cluster, "nics_per_node", 0):
            fields["nics_per_node"] = max(1, cluster.nics_per_node * per // cluster.ranks_per_node)
        cluster = replace(cluster, name=f"{cluster.name}; {per} GPU(s) a node on {k} nodes",
                          **fields)
    return Network(spec, cluster, dilation)


# ---- recording a step: stand-ins for the CPU's streams and events, wrapped collectives -----


class _State:
    """The recorder's state in this process (one recorder at a time)."""

    def __init__(self, clock, gpu_clock=None):
        self.clock, self.gpu_clock = clock, gpu_clock
        self.log: list | None = None  # the step being recorded, or None
        self.last = self.last_gpu = 0.0
        self.ids = 0
        self.current: Stream | None = None
        self.inside = 0  # > 0 while a real collective runs (a wrapped one calling another)
        self.pending: list[int] = []  # futures handed out this backward (DDP's hooks)
        self.callback_queued = False
        self.lock = threading.RLock()

    def new_id(self) -> int:
        self.ids += 1
        return self.ids

    def tick(self) -> None:
        """Charge the compute since the last event to the stream current during it: this CPU's
        seconds, and the GPU's by the roofline (0 without one)."""
        now = self.clock()
        gpu = self.gpu_clock() if self.gpu_clock is not None else 0.0
        if self.log is not None:
            dt, dg = now - self.last, gpu - self.last_gpu
            if dt > 0 or dg > 0:
                self.log.append(("run", self.current.id if self.current else COMPUTE, dt, dg))
        self.last, self.last_gpu = now, gpu

    def resume(self) -> None:
        """After real communication: its CPU time is not compute."""
        self.last = self.clock()

    def note(self, *entry) -> None:
        if self.log is not None:
            self.log.append(entry)


_state: _State | None = None


class Stream(torch.cpu.Stream):
    """``torch.cpu.Stream`` under emulation: it logs what a GPU stream would be told."""

    def __init__(self, priority: int = 0, **kwargs) -> None:
        super().__init__()
        self.id = _state.new_id() if _state else -1
        self.priority = priority

    def __repr__(self) -> str:
        return f"emulated Stream {self.id}"

    def wait_stream(self, stream) -> None:
        _log("wait_stream", self, stream)

    def wait_event(self, event) -> None:
        if event is not None:
            _log("wait_event", self, event)

    def record_event(self, event=None):
        event = event if event is not None else Event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        _log("wait_stream", _compute(), self)

    def query(self) -> bool:
        return True


class Event(torch.cpu.Event):
    """``torch.cpu.Event`` under emulation: recorded on a stream, waited for by another."""

    def __init__(self, *args, **kwargs) -> None:
        self.id = _state.new_id() if _state else -1

    def record(self, stream=None) -> None:
        _log("record", stream if stream is not None else current_stream(), self)

    def wait(self, stream=None) -> None:
        _log("wait_event", stream if stream is not None else current_stream(), self)

    def synchronize(self) -> None:
        _log("wait_event", _compute(), self)

    def query(self) -> bool:
        return True


def _compute() -> Stream:
    return _state.compute if _state else torch.cpu.current_stream()


def current_stream(device=None):
    return _state.current if _state and _state.current is not None else _compute()


@contextlib.contextmanager
def stream(s):
    """``torch.cpu.stream(s)`` under emulation: what runs inside runs on ``s``."""
    if s is None or _state is None:
        yield
        return
    _state.tick()
    before, _state.current = _state.current, s
    try:
        yield
    finally:
        _state.tick()
        _state.current = before


def _log(what: str, a, b) -> None:
    if _state is None or _state.log is None:
        return
    with _state.lock:
        _state.tick()
        _state.note(what, _sid(a), getattr(b, "id", -1))


def _sid(s) -> int:
    return getattr(s, "id", COMPUTE) if s is not None and s is not _state.compute else COMPUTE


class Work(dist.Work):
    """A collective that already ran (the real one, to completion); ``wait()`` tells the
    emulation where the stream current then waits for its emulated finish."""

    def __init__(self, wid: int, real) -> None:
        super().__init__()
        self.wid, self.real = wid, real

    def wait(self, timeout=None) -> bool:
        if _state is not None and _state.log is not None:
            with _state.lock:
                _state.tick()
                _state.note("wait_work", _sid(current_stream()), self.wid)
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None

    def result(self):
        return self.real.result() if self.real is not None else []

    def get_future(self):
        # A comm hook's future (DDP's): the reducer waits for it in C++ when backward ends.
        if _state is not None and _state.log is not None:
            _state.pending.append(self.wid)
            if not _state.callback_queued:
                try:
                    torch.autograd.Variable._execution_engine.queue_callback(_end_of_backward)
                    _state.callback_queued = True
                except RuntimeError:  # not inside a backward: waited where it is waited
                    pass
        if self.real is not None:
            return self.real.get_future()
        fut = torch.futures.Future()
        fut.set_result([])
        return fut


def _end_of_backward() -> None:
    """DDP's finalize waits for every bucket's future: the computing stream waits for them."""
    if _state is None:
        return
    with _state.lock:
        _state.tick()
        for wid in _state.pending:
            _state.note("wait_work", COMPUTE, wid)
        _state.pending, _state.callback_queued = [], False


def _group_ranks(group) -> tuple[int, ...]:
    group = group if group is not None else c10d._get_default_group()
    return tuple(dist.get_process_group_ranks(group))


def _wrap(name: str, real):
    arg, position, factor = _WRAPPED[name]
    op = _KIND[name]

    def collective(*args, **kwargs):
        st = _state
        if st is None or st.log is None or st.inside:
            return real(*args, **kwargs)
        async_op = kwargs.get("async_op", False)
        buffer = kwargs.get(arg, args[position] if len(args) > position else None)
        group = kwargs.get("group")
        if group is None and name == "all_reduce" and len(args) > 2:
            group = args[2]
        ranks = _group_ranks(group)
        n = len(ranks)
        nbytes = buffer.numel() * buffer.element_size()
        sent = nbytes * factor * (n - 1) / max(n, 1)
        with st.lock:
            st.tick()
            st.inside += 1
            try:  # the real collective, to completion: its CPU time is not compute
                out = real(*args, **kwargs)
                if async_op and out is not None:
                    out.wait()
            finally:
                st.inside -= 1
                st.resume()
            wid = st.new_id()
            if host_side():  # host metadata (zero's agreement, used flags): off the device
                st.note("host", wid, op, nbytes, sent, ranks)
            else:
                st.note("issue", wid, _sid(current_stream()), op, nbytes, sent, ranks,
                        bool(async_op))
        return Work(wid, out) if async_op else out

    collective.__wrapped__ = real
    collective.__name__ = name
    return collective


def process_cpu_time() -> float:
    """This process's CPU seconds (every thread's; the ranks compute on one)."""
    return time.process_time()


class Kernels(TorchDispatchMode):
    """The clock that counts only operators: the CPU seconds spent inside each aten operator
    (a GPU's kernels), not in the Python around them (the host's work, which on a GPU runs
    ahead of the kernels it queues), nor in the collectives. ``total`` is the clock."""

    def __init__(self, device=None) -> None:
        super().__init__()
        self.total = 0.0
        self.gpu = 0.0  # the same operators priced on ``device`` by the plan's roofline
        self.roofline = None
        if device is not None:
            from zerolab.roofline import Roofline

            self.roofline = Roofline(device)

    def __call__(self) -> float:
        return self.total

    def gpu_seconds(self) -> float:
        return self.gpu

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor first turns its op into plain ops
        t0 = time.process_time()
        out = func(*args, **(kwargs or {}))
        if getattr(func, "namespace", None) not in ("c10d", "_c10d_functional", "profiler") and \
                not (_state is not None and _state.inside) and not host_side():  # (the host's)
            self.total += time.process_time() - t0
            if self.roofline is not None:
                from zerolab.roofline import cost_of

                op = cost_of(func, args, kwargs, out)
                if op is not None:
                    self.gpu += self.roofline.seconds(op)
        return out


CLOCKS = ("kernels", "process")  # this CPU's; with a ``device``, the roofline's is logged too


class Recorder:
    """``with Recorder() as rec:`` for a whole run (build the model inside it, so that its
    streams are the emulated ones); ``with rec.step() as log:`` around each step to record.

    Args:
        clock: "kernels" (the default: compute is the CPU time inside aten operators, as a
            GPU's stream runs only kernels) or "process" (all of the process's CPU time between
            two events, the host's Python included).
    """

    def __init__(self, clock: str = "kernels", device=None):
        if clock not in CLOCKS:
            raise ValueError(f"clock {clock!r}: one of {CLOCKS}")
        self.kernels = Kernels(device) if clock == "kernels" or device is not None else None
        self.clock = self.kernels if clock == "kernels" else process_cpu_time
        self.gpu_clock = self.kernels.gpu_seconds if device is not None else None
        self._saved: list = []

    def __enter__(self) -> "Recorder":
        global _state
        if _state is not None:
            raise RuntimeError("an emulation Recorder is already installed in this process")
        _state = _State(self.clock, self.gpu_clock)
        _state.compute = Stream()
        _state.compute.id = COMPUTE
        patches = [(torch.cpu, "Stream", Stream), (torch.cpu, "Event", Event),
                   (torch.cpu, "stream", stream), (torch.cpu, "current_stream", current_stream)]
        for name in _WRAPPED:
            for module in (dist, c10d):
                if hasattr(module, name):
                    patches.append((module, name, _wrap(name, getattr(module, name))))
        for module, name, value in patches:
            self._saved.append((module, name, getattr(module, name)))
            setattr(module, name, value)
        return self

    def __exit__(self, *exc) -> None:
        global _state
        for module, name, value in reversed(self._saved):
            setattr(module, name, value)
        self._saved = []
        _state = None

    @contextlib.contextmanager
    def step(self):
        """Record what runs inside: the list it yields is filled with the step's log."""
        log: list = []
        st = _state
        assert st is not None, "step() outside the Recorder"
        st.log, st.pending, st.callback_queued = log, [], False
        st.current = None
        st.last = self.clock()
        st.last_gpu = self.gpu_clock() if self.gpu_clock is not None else 0.0
        try:
            with self.kernels if self.kernels is not None else contextlib.nullcontext():
                yield log
        finally:
            st.tick()
            st.note("sync")
            st.log = None


# ---- playing a log on a network ----------------------------------------------------------


@dataclass
class Played:
    """One step played on a network: times in emulated seconds (the CPU's scale: divide by
    the network's dilation for a GPU's)."""

    step_s: float = 0.0
    compute_s: float = 0.0
    side_compute_s: float = 0.0  # compute run on side streams (copy-in...), in the background
    exposed: Counter = field(default_factory=Counter)  # by collective kind
    comm: Counter = field(default_factory=Counter)  # each collective's duration, by kind
    host: Counter = field(default_factory=Counter)  # host metadata's collectives, by kind
    spans: list = field(default_factory=list)  # (track, name, start, end)

    @property
    def exposed_s(self) -> float:
        """Exposed communication (not the waits for side streams' own compute, "copy")."""
        return sum(v for k, v in self.exposed.items() if k != "copy")

    @property
    def comm_s(self) -> float:
        return sum(self.comm.values())

    @property
    def overlap(self) -> float:
        """The fraction of communication time the computation hid."""
        return 1.0 - self.exposed_s / self.comm_s if self.comm_s else 1.0


def play(log: list, net: Network, clock: str = "cpu") -> Played:
    """Run one step's log as a GPU runs it (the module docstring, 2.): compute by this CPU's
    clock ("cpu", dilated collectives) or by the roofline's ("roofline": GPU seconds, to be
    played with a dilation of 1)."""
    at_ = 2 if clock == "cpu" else 3
    out = Played()
    now = 0.0  # the computing stream's clock (it is the host too: it issues everything)
    free: dict[int, float] = {}  # side stream -> when its queued work ends
    why: dict[int, str] = {}  # side stream -> the collective kind its last wait or run was
    events: dict[int, tuple[float, str]] = {}
    works: dict[int, tuple[float, str]] = {}
    links: dict[tuple, float] = {}  # group -> when its link is free

    def at(s: int) -> tuple[float, str]:
        return (now, "copy") if s == COMPUTE else (free.get(s, 0.0), why.get(s, "copy"))

    def wait(s: int, t: float, kind: str) -> None:
        nonlocal now
        if s == COMPUTE:
            if t > now:
                out.exposed[kind] += t - now
                out.spans.append(("compute", f"wait {kind}", now, t))
                now = t
        elif t > free.get(s, 0.0):
            free[s], why[s] = t, kind

    for entry in log:
        what = entry[0]
        if what == "run":
            s, dt = entry[1], (entry[at_] if len(entry) > at_ else 0.0)
            if s == COMPUTE:
                out.spans.append(("compute", "compute", now, now + dt))
                now += dt
                out.compute_s += dt
            else:  # (the host runs ahead: a side stream starts when its own waits allow)
                start = free.get(s, 0.0)
                free[s] = start + dt
                out.side_compute_s += dt
                out.spans.append((f"stream {s}", "compute", start, start + dt))
        elif what == "issue":
            _, wid, s, op, nbytes, sent, ranks, async_op = entry
            seconds = net.seconds(op, nbytes, sent, ranks)
            start = max(at(s)[0], links.get(ranks, 0.0))
            finish = links[ranks] = start + seconds
            works[wid] = (finish, op)
            out.comm[op] += seconds
            track = f"stream {s}" if s != COMPUTE else "comm (issued on compute)"
            out.spans.append((track, op, start, finish))
            if not async_op:
                wait(s, finish, op)
        elif what == "host":  # (its waits find no work: the host, taken ahead, pays them)
            _, wid, op, nbytes, sent, ranks = entry
            out.host[op] += net.seconds(op, nbytes, sent, ranks)
        elif what == "record":
            _, s, e = entry
            events[e] = at(s)
        elif what == "wait_event":
            _, s, e = entry
            if e in events:
                wait(s, *events[e])
        elif what == "wait_stream":
            _, s, other = entry
            if other != s:
                wait(s, *at(other))
        elif what == "wait_work":
            _, s, wid = entry
            if wid in works:
                wait(s, *works[wid])
        elif what == "sync":  # the end of the step: everything queued has finished
            for s in list(free):
                wait(COMPUTE, *at(s))
            for t in links.values():
                wait(COMPUTE, t, "other")
    out.step_s = now
    return out


def stream_names(log: list) -> dict[int, str]:
    """A name for each side stream of a log: the collectives it ran ("all_gather"), or "copy"."""
    ops: dict[int, list] = {}
    for entry in log:
        if entry[0] == "issue" and entry[2] != COMPUTE:
            ops.setdefault(entry[2], [])
            if entry[3] not in ops[entry[2]]:
                ops[entry[2]].append(entry[3])
        elif entry[0] == "run" and entry[1] != COMPUTE:
            ops.setdefault(entry[1], [])
    return {s: "+".join(o) + " stream" if o else "side stream (copies)" for s, o in ops.items()}


def _merged(spans: list) -> list:
    """Spans with each run of back-to-back spans of one name on one track made one."""
    out: list = []
    last: dict = {}  # track -> index in out of its last span
    for track, label, start, end in spans:
        i = last.get(track)
        if i is not None and out[i][1] == label == "compute" and out[i][3] == start:
            out[i] = (track, label, out[i][2], end)
            continue
        last[track] = len(out)
        out.append((track, label, start, end))
    return out


def chrome_trace(steps: list[tuple[str, list, Played, float]]) -> dict:
    """A Chrome / Perfetto trace of played steps: one process per (name, log, played, dilation),
    a thread per stream (the computing stream first). Times in GPU microseconds (the emulated
    clock over the dilation)."""
    out: list[dict] = []
    for pid, (name, log, played, dilation) in enumerate(steps, start=1):
        names = stream_names(log)
        tids: dict[str, int] = {"compute": 1}
        out.append({"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}})
        for track, label, start, end in _merged(played.spans):
            if track.startswith("stream "):
                track = names.get(int(track.split()[1]), track)
            if track not in tids:
                tids[track] = len(tids) + 1
            out.append({"ph": "X", "pid": pid, "tid": tids[track], "name": label,
                        "cat": "wait" if label.startswith("wait") else label,
                        "ts": round(1e6 * start / dilation, 3),
                        "dur": round(1e6 * (end - start) / dilation, 3)})
        for track, tid in tids.items():
            out.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name",
                        "args": {"name": track}})
            out.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index",
                        "args": {"sort_index": tid}})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


# ---- the dilation factor: this CPU's compute for a step over the GPU's ---------------------


def _plain_step(model, opt, x, y) -> None:
    model.loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def _plain(model: torch.nn.Module, batch: int):
    import copy

    m = copy.deepcopy(model)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    x, y = m.batch(batch, torch.Generator().manual_seed(0))
    _plain_step(m, opt, x, y)  # (the optimizer state exists after the first step)
    return m, opt, x, y


def cpu_step_seconds(model: torch.nn.Module, batch: int, threads: int = 1, steps: int = 3,
                     clock: str = "kernels") -> float:
    """This CPU's compute for one training step of ``model`` on one rank's ``batch`` (forward,
    backward, AdamW; no communication), on ``threads`` threads as a rank computes: the median
    of ``steps`` steps on the emulation's ``clock`` (``Recorder``'s)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        m, opt, x, y = _plain(model, batch)
        times = []
        for _ in range(steps):
            kernels = Kernels() if clock == "kernels" else None
            t0 = process_cpu_time()
            with kernels if kernels is not None else contextlib.nullcontext():
                _plain_step(m, opt, x, y)
            times.append(kernels.total if kernels is not None else process_cpu_time() - t0)
    finally:
        torch.set_num_threads(before)
    return sorted(times)[len(times) // 2]


def gpu_step_seconds(model: torch.nn.Module, batch: int, device, low_precision: bool = False
                     ) -> float:
    """The same step's compute on ``device`` (a ``zerolab.roofline.Device``), as the plan
    prices it: each operator by the roofline (``zerolab/roofline.py``). fp32 matmuls at the TF32
    rate; ``low_precision`` prices every operator as bf16."""
    from dataclasses import replace

    from zerolab.roofline import OpCosts, Roofline

    m, opt, x, y = _plain(model, batch)
    with OpCosts() as costs:
        _plain_step(m, opt, x, y)
    ops = [replace(op, low_precision=True) for op in costs.ops] if low_precision else costs.ops
    return Roofline(device).time(ops)["total"]


# ---- a run's figures ------------------------------------------------------------------------


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2 if xs else 0.0


def summarize(logs_by_rank: list[list[list]], net: Network, clock: str = "cpu") -> dict:
    """Each rank's step logs (``logs_by_rank[rank][step]``) played on ``net``: every step lasts
    as long as its slowest rank, whose figures it takes; the median over the steps of each
    figure (emulated seconds). ``trace``: rank 0's (log, played) of the median step."""
    steps = []
    for i in range(min(len(r) for r in logs_by_rank) if logs_by_rank else 0):
        played = [play(r[i], net, clock) for r in logs_by_rank]
        steps.append((max(played, key=lambda p: p.step_s), played[0], logs_by_rank[0][i]))
    if not steps:
        return {}
    kinds = sorted({k for p, _, _ in steps for k in (*p.exposed, *p.comm)})
    mid = sorted(range(len(steps)), key=lambda i: steps[i][0].step_s)[(len(steps) - 1) // 2]
    return {
        "step_s": _median([p.step_s for p, _, _ in steps]),
        "compute_s": _median([p.compute_s for p, _, _ in steps]),
        "side_compute_s": _median([p.side_compute_s for p, _, _ in steps]),
        "exposed": {k: _median([p.exposed.get(k, 0.0) for p, _, _ in steps]) for k in kinds},
        "exposed_s": _median([p.exposed_s for p, _, _ in steps]),
        "comm": {k: _median([p.comm.get(k, 0.0) for p, _, _ in steps]) for k in kinds},
        "comm_s": _median([p.comm_s for p, _, _ in steps]),
        "overlap": _median([p.overlap for p, _, _ in steps]),
        "host": _median([float(sum(p.host.values())) for p, _, _ in steps]),
        "trace": (steps[mid][2], steps[mid][1]),
    }
