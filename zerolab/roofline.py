"""What each operator of a step costs on a GPU: its FLOPs, the bytes it moves, and a roofline.

The plan runs a step on fake CPU tensors; ``OpCosts``, a dispatch mode, sees every operator
pass and keeps three numbers for each: its kind, its FLOPs, and the bytes it reads and
writes. ``Roofline`` then prices them on a device:

- a **matmul** (``mm``, ``addmm``, ``bmm``, a grouped expert matmul...) takes
  ``max(FLOPs / achievable rate, bytes / achieved bandwidth)``: compute-bound when large,
  memory-bound when thin (a roofline by shape);
- **attention** (``scaled_dot_product_attention``'s kernels) takes FLOPs at the attention
  kernel's own measured efficiency (FlashAttention-2's, for the presets). Its FLOPs are
  counted here, because torch's flop counter has no formula for the CPU kernel the fake ranks
  dispatch to: ``4 x batch x heads x seq_q x seq_k x head_dim`` forward (QKᵀ and AV, 2 FLOPs
  a multiply-add), halved when causal (flash attention skips the tiles above the diagonal,
  and the GPU does not do that work), and 2.5 times that backward (dQ, dK, dV, dP, and the
  scores recomputed: FlashAttention-2's backward);
- every other operator is **memory-bound**: its bytes (inputs read, outputs written) over the
  memory bandwidth a kernel achieves. A view moves nothing; an embedding lookup reads the
  rows it returns, not its table.

Compute as a GPU achieves it is the rated peak less a series of named effects
(``EFFECTS``), each with its source in ``zerolab/clusters.py`` and each of which
``Roofline(effects=...)`` can leave out, so that ``python -m zerolab plan --explain`` can say
what each costs:

- ``mamf``: a matmul reaches at most the *maximum achievable matmul FLOPS* measured at its
  best shape on that GPU, not the rated peak;
- ``waves``: tile and wave quantization by shape: cuBLAS splits the output into tiles of
  256 x 128 and runs them in waves of one tile an SM; a partial tile or a last partial wave
  costs as much as a full one (NVIDIA, "Matrix Multiplication Background User's Guide");
- ``attention``: attention at its kernel's measured share of the peak (FlashAttention-2's);
- ``kernel``: the attention kernel the run really used, where it is not FlashAttention-2
  (``ATTENTION_KERNELS``: MosaicML's MPT runs used FlashAttention in Triton, slower forward and
  backward by the ratios FlashAttention-2's paper measured);
- ``hbm``: memory-bound operators at the bandwidth a streaming kernel measures, not the rated;
- ``launch``: no kernel takes less than its launch (eager mode launches every operator);
- ``power``: the clocks a power limit allows, where the preset's source says the GPUs ran
  under one;
- ``contention``: compute slowed while a collective runs beside it (NCCL's kernels take SMs
  and memory bandwidth): applied by ``zerolab/overlap.py`` to the time a collective is in
  flight.

One more effect is the user's, not a source's: ``measured`` (``--matmul-rates FILE``), the
rates a GPU measured for the step's own matmul shapes (``benchmarks/matmul_rates.py``,
``zerolab/measured.py``). Where a shape was measured, its rate replaces the best-shape maximum
by tiles and waves; ``effects_for`` puts it after ``waves`` when the device carries such rates.

FLOPs of matmuls come from torch's own ``torch.utils.flop_counter`` formulas. What this
does not know: fusion (``torch.compile`` would merge the memory-bound operators), the L2
cache (a small operator's bytes may never reach HBM), and the CPU's own dispatch time when it
falls behind the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten

# scaled_dot_product_attention's kernels: op -> (is backward, where is_causal is, its name)
_ATTENTION = {}
for _name, _causal in (("_scaled_dot_product_flash_attention_for_cpu", "is_causal"),
                       ("_scaled_dot_product_flash_attention", "is_causal"),
                       ("_scaled_dot_product_efficient_attention", "is_causal"),
                       ("_scaled_dot_product_cudnn_attention", "is_causal")):
    for _suffix, _back in (("", False), ("_backward", True)):
        _op = getattr(aten, _name + _suffix, None)
        if _op is not None:
            _ATTENTION[_op.default] = _back
_GATHERS = {aten.embedding.default, aten.index_select.default, aten.gather.default,
            aten.index.Tensor}  # read the rows they return, not the whole source
_FREE = {aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default,
         aten.new_empty_strided.default, aten.empty_like.default, aten.resize_.default,
         aten.set_.source_Storage, aten.set_.source_Storage_storage_offset,
         aten._local_scalar_dense.default, aten.lift_fresh.default,
         aten._unsafe_view.default}  # allocate, look, or alias only
_BACKWARD_FACTOR = 2.5  # FlashAttention-2's backward: 4 matmuls and the scores' recompute


@dataclass(frozen=True)
class Op:
    """One operator as the roofline reads it."""

    kind: str  # "matmul", "attention", "memory", or "host": an op on the host's memory
    flops: float
    bytes: int
    low_precision: bool  # bf16/fp16 inputs (else fp32: TF32 tensor cores for matmuls)
    dense_flops: float = 0.0  # attention's FLOPs as if not causal (how model FLOPs count them)
    shape: tuple[int, int, int] = (0, 0, 0)  # a matmul's (batch, rows, columns) of output
    backward: bool = False  # an attention kernel's backward (its own efficiency)
    layout: str = ""  # a matmul's operands as read: "NN", "NT", "TN", "TT" (T: transposed)


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def _nbytes(tensors) -> int:
    """Bytes of distinct tensors (an argument passed twice is read once)."""
    seen, total = set(), 0
    for t in tensors:
        key = (id(t.untyped_storage()) if not t.is_meta else id(t), t.storage_offset(),
               tuple(t.shape))
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def attention_flops(query, key, causal: bool, backward: bool) -> float:
    """FLOPs of one attention kernel: query (B, H, Sq, D), key (B, Hk, Sk, D)."""
    b, h, sq, d = query.shape
    sk = key.shape[-2]
    flops = 4.0 * b * h * sq * sk * d
    if causal:
        flops /= 2
    return flops * (_BACKWARD_FACTOR if backward else 1.0)


def _attention(func, args, kwargs) -> tuple[float, float]:
    """(its FLOPs, the forward's FLOPs as if not causal: model FLOPs' convention)."""
    backward = _ATTENTION[func]
    names = [a.name for a in func._schema.arguments]
    values = dict(zip(names, args)) | (kwargs or {})
    q, k = (values["query"], values["key"])
    flops = attention_flops(q, k, bool(values.get("is_causal", False)), backward)
    return flops, 0.0 if backward else attention_flops(q, k, False, False)


def _grouped_mm_flops(args) -> float:
    """``_grouped_mm(a, b, offs)``: each row of ``a`` meets one group's slice of ``b`` (tokens
    (T, K) by experts (E, K, N), or the weight gradient, groups along the contraction): every
    element of ``a`` is multiplied by a row of N, so 2 x numel(a) x N in every layout."""
    return 2.0 * args[0].numel() * args[1].shape[-1]


_SHAPED = {"mm": (0, 1), "addmm": (1, 2), "bmm": (0, 1), "baddbmm": (1, 2)}  # (a, b) args


def matmul_shape(func, args) -> tuple[int, int, int]:
    """A matmul's output as (batch, rows, columns), for tile and wave quantization; zeros for
    the operators whose shape is not read here."""
    where = _SHAPED.get(func._overloadpacket.__name__)
    if where is None:
        return (0, 0, 0)
    a, b = args[where[0]], args[where[1]]
    batch = a.shape[0] if a.dim() == 3 else 1
    return (int(batch), int(a.shape[-2]), int(b.shape[-1]))


def matmul_layout(func, args) -> str:
    """Whether each operand of a matmul is read transposed ("T": its last dimension is not
    the contiguous one), as cuBLAS picks its kernel by: "NN", "NT", "TN" or "TT"."""
    where = _SHAPED.get(func._overloadpacket.__name__)
    if where is None:
        return ""
    return "".join("T" if t.dim() >= 2 and t.stride(-1) != 1 and t.shape[-1] > 1 else "N"
                   for t in (args[where[0]], args[where[1]]))


def cost_of(func, args, kwargs, out, host: torch.device | None = None) -> Op | None:
    """What one operator costs (None for a view or an allocation, which move nothing); an
    operator on ``host`` tensors (CPU offload's optimizer step) moves host memory."""
    if func in _FREE or getattr(func, "is_view", False):
        return None
    inputs = list(_tensors(args)) + list(_tensors(kwargs))
    outputs = list(_tensors(out))
    if not outputs:
        if not str(func).startswith("aten._foreach_") or not args:
            return None  # (prim.device and the like: no data moves)
        outputs = list(_tensors(args[0]))  # an in-place foreach op writes its first list
    low = any(t.dtype in (torch.bfloat16, torch.float16) for t in inputs if t.is_floating_point())
    if host is not None and any(t.device == host for t in inputs + outputs):
        return Op("host", 0.0, _nbytes(inputs) + _nbytes(outputs), low)
    if func in _ATTENTION:
        moved = _nbytes(inputs) + _nbytes(outputs)
        flops, dense = _attention(func, args, kwargs)
        return Op("attention", flops, moved, low, dense, backward=_ATTENTION[func])
    packet = func._overloadpacket
    if packet in flop_registry:
        flops = float(flop_registry[packet](*args, **(kwargs or {}), out_val=out))
        return Op("matmul", flops, _nbytes(inputs) + _nbytes(outputs), low, flops,
                  matmul_shape(func, args), layout=matmul_layout(func, args))
    if packet is getattr(aten, "_grouped_mm", None):
        flops = _grouped_mm_flops(args)
        return Op("matmul", flops, _nbytes(inputs) + _nbytes(outputs), low, flops)
    if func in _GATHERS:
        index = [t for t in inputs if not t.is_floating_point()]
        return Op("memory", 0.0, 2 * _nbytes(outputs) + _nbytes(index), low)
    return Op("memory", 0.0, _nbytes(inputs) + _nbytes(outputs), low)


class OpCosts(TorchDispatchMode):
    """``with OpCosts() as oc: step()``: ``oc.ops``, every operator's ``Op`` in order, and
    ``oc.labels``: the ``record_function`` names open when each collective passed (FSDP2
    names its unit there). Collectives are not ops here (``zerolab.measure`` counts them)."""

    def __init__(self, host: torch.device | None = None):
        super().__init__()
        self.host = host
        self.ops: list[Op] = []
        self.labels: list[str] = []  # the open record_function names, innermost last

    def take(self) -> list[Op]:
        """The ops since the last ``take`` (a piece of the step)."""
        out, self.ops = self.ops, []
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor first turns its op into plain ops
        if func is torch.ops.profiler._record_function_enter_new.default:
            self.labels.append(args[0])
        elif func._overloadpacket is torch.ops.profiler._record_function_exit:
            if self.labels:
                self.labels.pop()
        out = func(*args, **(kwargs or {}))
        if getattr(func, "namespace", None) in ("c10d", "_c10d_functional", "profiler"):
            return out
        op = cost_of(func, args, kwargs, out, self.host)
        if op is not None:
            self.ops.append(op)
        return out


EFFECTS = ("mamf", "waves", "attention", "kernel", "hbm", "launch", "power", "contention")
MEASURED = "measured"  # the user's measured matmul rates (--matmul-rates), after "waves"
# An attention kernel's throughput over FlashAttention-2's, (forward, backward). "triton":
# FlashAttention in Triton (HazyResearch's flash_attn_triton.py, the kernel of MPT's
# attn_impl: triton): FlashAttention-2 is 1.3-1.5x faster forward and about 2x faster backward
# (Dao, "FlashAttention-2", 2023, section 4.1; the plan takes 1.4 and 2).
ATTENTION_KERNELS = {"flash2": (1.0, 1.0), "triton": (1 / 1.4, 1 / 2.0)}
TILE = (256, 128)  # cuBLAS's output tile for large half-precision GEMMs (NVIDIA's matmul guide)


@dataclass(frozen=True)
class Device:
    """What one GPU can do: rated peaks, and what a kernel reaches of them (each figure's
    source is named beside the preset, ``zerolab/clusters.py``)."""

    name: str
    tflops_bf16: float  # dense, rated
    tflops_fp32: float  # dense TF32 tensor cores, rated
    memory_tbs: float  # HBM bandwidth, rated (TB/s)
    matmul_efficiency: float  # maximum achievable matmul throughput / rated peak, measured
    attention_efficiency: float  # the attention kernel's throughput / rated peak, measured
    sms: int = 132  # streaming multiprocessors (a wave is one tile on each)
    memory_efficiency: float = 1.0  # a streaming kernel's bandwidth / rated, measured
    launch_us: float = 0.0  # the least a kernel takes in eager mode
    attention_kernel: str = "flash2"  # ATTENTION_KERNELS: the kernel the run used
    clock_factor: float = 1.0  # the peak under the run's power limit / rated
    comm_slowdown: float = 0.0  # compute's slowdown while a collective runs
    # the rates a GPU measured for the step's matmul shapes (zerolab.measured.MatmulRates):
    # ``tflops(op)``, None for a shape it did not measure; None: no measurement given
    matmul_rates: object = None


def effects_for(device: Device) -> tuple[str, ...]:
    """The effects that price ops on ``device``, in ``--explain``'s order: ``EFFECTS``, and
    ``MEASURED`` after ``waves`` where the device carries measured matmul rates."""
    if device.matmul_rates is None:
        return EFFECTS
    i = EFFECTS.index("waves") + 1
    return EFFECTS[:i] + (MEASURED,) + EFFECTS[i:]


def wave_efficiency(shape: tuple[int, int, int], sms: int) -> float:
    """The share of a matmul's tiles, and of its last wave, that is real work: output
    (batch, rows, columns) in tiles of ``TILE``, one tile an SM a wave."""
    batch, m, n = shape
    if not m or not n:
        return 1.0
    tiles = batch * -(-m // TILE[0]) * -(-n // TILE[1])
    waves = -(-tiles // sms)
    return batch * m * n / (waves * sms * TILE[0] * TILE[1])


@dataclass(frozen=True)
class Roofline:
    """Prices ops on ``device`` with ``effects`` (``EFFECTS``: all by default); ``scale``
    multiplies every achievable rate (your own measurement: the plan's compute time over the
    compute time you measured); host ops at ``host_gbs`` of host memory bandwidth."""

    device: Device
    scale: float = 1.0
    host_gbs: float = 77.0
    effects: frozenset = frozenset(EFFECTS)

    def seconds(self, op: Op) -> float:
        d, on = self.device, self.effects
        peak = (d.tflops_bf16 if op.low_precision else d.tflops_fp32) * 1e12 * self.scale
        if "power" in on:
            peak *= d.clock_factor
        bandwidth = d.memory_tbs * 1e12 * self.scale
        if "hbm" in on:
            bandwidth *= d.memory_efficiency
        memory = op.bytes / bandwidth
        floor = d.launch_us * 1e-6 if "launch" in on else 0.0
        if op.kind == "matmul":
            measured = (d.matmul_rates.tflops(op) if MEASURED in on and d.matmul_rates
                        else None)
            if measured:  # the measured rate in place of the maximum by tiles and waves
                rate = measured * 1e12 * self.scale * (d.clock_factor if "power" in on else 1.0)
            else:
                rate = peak * (d.matmul_efficiency if "mamf" in on else 1.0)
                if "waves" in on:
                    rate *= wave_efficiency(op.shape, d.sms)
            return max(op.flops / rate, memory, floor)
        if op.kind == "attention":
            rate = peak * (d.attention_efficiency if "attention" in on else 1.0)
            if "kernel" in on:  # the run's own kernel, against FlashAttention-2
                rate *= ATTENTION_KERNELS[d.attention_kernel][op.backward]
            return max(op.flops / rate, memory, floor)
        if op.kind == "host":
            return op.bytes / (self.host_gbs * 1e9)
        return max(memory, floor)

    def time(self, ops) -> dict[str, float]:
        """Seconds by kind ("matmul", "attention", "memory") and in total."""
        out = {"matmul": 0.0, "attention": 0.0, "memory": 0.0, "host": 0.0}
        for op in ops:
            out[op.kind] += self.seconds(op)
        out["total"] = sum(out.values())
        return out

def flops(ops) -> float:
    """The FLOPs the GPU runs: recompute included, causal attention's masked half left out."""
    return sum(op.flops for op in ops)


def model_flops(forward_ops) -> float:
    """Model FLOPs, the convention of MFU (PaLM's, torchtitan's): 3 x the forward's matmuls and
    attention, attention counted whole (not causal), recompute not counted."""
    return 3 * sum(op.dense_flops for op in forward_ops)
