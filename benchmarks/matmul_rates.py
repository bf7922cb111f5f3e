"""How fast this GPU runs the plan's own matmuls, and memory-bound operators of their sizes.

    # on a GPU, ~2 minutes on an H100 (torchtitan's Llama 3.1 8B run, as plan_anchors.py plans it):
    python benchmarks/matmul_rates.py --model torchtitan:llama3:8B --batch 2 --seq 8192 \\
        --mixed-precision --activation-checkpointing selective --cluster h100-96gb --out r.json
    python -m zerolab plan --model torchtitan:llama3:8B ... --matmul-rates r.json --explain
    # where the GPU's machine lacks torchtitan: a dry run here, its shapes measured there
    python benchmarks/matmul_rates.py --model ... --out dry.json   # no CUDA: lists, measures nothing
    python benchmarks/matmul_rates.py --shapes dry.json --out r.json   # on the GPU: torch alone

The plan prices a matmul at the GPU's best-shape maximum (MAMF, 794 of an H100's 989 TFLOPS)
less its tiles' and waves' quantization (``zerolab/roofline.py``). This script takes the step
from the plan's own simulation (``zerolab.plan.step_ops``: FSDP2's step, counted) and lists
every distinct matmul, (batch, m, n, k), dtype and layout, with how often forward and backward
run it, and the memory-bound operators by size (powers of two). With CUDA it then measures,
under sustained load:

- first ``--warmup-s`` (10) seconds of an 8192-cube bf16 matmul, so that the clocks settle where
  the power limit holds them; then the shapes back to back, the GPU never idle for long;
- each matmul: ``torch.mm`` / ``torch.bmm`` on operands laid out as the step reads them, timed by
  CUDA events in 5 windows (about ``--seconds-per-shape`` in all), the median window;
- each memory size: a streaming copy that reads and writes the operators' bytes (GB/s);
- operands rotated among copies where one set would sit in the L2 cache;
- the SM clock and power every 0.25 s (``torch.cuda.clock_rate``/``power_draw``, which need
  pynvml; else ``nvidia-smi``).

It writes FILE.json (device, torch and CUDA versions, date, each shape's TFLOPS, the step-
weighted average, the GB/s) and FILE.md, each beside the plan's rates; ``python -m zerolab plan
--matmul-rates FILE.json`` prices the measured shapes at their measured rates. Without CUDA it
is a dry run: the shapes and the plan's rates, nothing measured (the plan refuses its file).
Attention (FlashAttention's kernels) is not measured here.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from zerolab import measured, plan  # noqa: E402
from zerolab.clusters import PRESETS, preset  # noqa: E402
from zerolab.roofline import Roofline  # noqa: E402

WINDOWS = 5  # timed windows a shape; the median is kept


def enumerate_step(args) -> tuple[list[dict], list[dict]]:
    """The step's matmuls by shape and memory-bound operators by size, with the plan's rates
    on ``--cluster``'s GPU (every effect of the roofline: what the plan charges)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ops = plan.step_ops(args.model, args.batch, args.seq, args.mixed_precision,
                                args.activation_checkpointing, args.world_size)
    roof = Roofline(preset(args.cluster).device)
    mm, mem = {}, {}
    for (phase, op), n in ops.items():
        shape = measured.shape_of(op)
        if shape is not None:
            row = mm.setdefault(shape, {"forward": 0, "backward": 0, "flops": 0.0, "s": 0.0})
            row["forward" if phase == "forward" else "backward"] += n
            row["flops"], row["s"] = row["flops"] + n * op.flops, row["s"] + n * roof.seconds(op)
        elif op.kind == "memory" and op.bytes:
            row = mem.setdefault(op.bytes.bit_length(), {"bytes": 0, "ops": 0, "total": 0,
                                                         "s": 0.0})
            row["bytes"] = max(row["bytes"], op.bytes)  # the bucket's largest stands for it
            row["ops"], row["total"] = row["ops"] + n, row["total"] + n * op.bytes
            row["s"] += n * roof.seconds(op)
    matmuls = [{**vars(s), "forward": r["forward"], "backward": r["backward"],
                "gflop": s.flops / 1e9, "plan_tflops": r["flops"] / r["s"] / 1e12,
                "measured_tflops": None, "sm_mhz": None} for s, r in sorted(mm.items())]
    memory = [{"bytes": r["bytes"], "ops": r["ops"], "total_bytes": r["total"],
               "plan_gbs": r["total"] / r["s"] / 1e9, "measured_gbs": None}
              for _, r in sorted(mem.items())]
    return matmuls, memory


class Clocks(threading.Thread):
    """The SM clock (MHz) and power (W), sampled every 0.25 s, each with its time."""

    def __init__(self):
        super().__init__(daemon=True)
        self.samples, self.stop = [], threading.Event()
        self.read = self._pick()

    def _pick(self):
        try:
            torch.cuda.clock_rate(), torch.cuda.power_draw()
            return lambda: (float(torch.cuda.clock_rate()), torch.cuda.power_draw() / 1e3)
        except Exception:  # noqa: BLE001 (no pynvml: nvidia-smi, or nothing)
            pass
        query = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,"
                 "nounits", "-i", str(torch.cuda.current_device())]
        try:
            subprocess.run(query, capture_output=True, check=True, timeout=5)
        except (OSError, subprocess.SubprocessError):
            return None
        return lambda: tuple(float(x) for x in subprocess.run(
            query, capture_output=True, text=True, timeout=5).stdout.split(","))

    def run(self):
        while self.read and not self.stop.wait(0.25):
            try:
                self.samples.append((time.monotonic(), *self.read()))
            except Exception:  # noqa: BLE001 (a failed sample is skipped)
                pass

    def between(self, t0: float, t1: float, i: int = 1) -> float | None:
        got = [s[i] for s in self.samples if t0 <= s[0] <= t1]
        return statistics.median(got) if got else None

    def summary(self, i: int) -> dict | None:
        got = [s[i] for s in self.samples]
        return {"min": min(got), "median": statistics.median(got), "max": max(got)} \
            if got else None


class _HostEvent:
    """``torch.cuda.Event``'s three calls on the host clock, for ``--cpu-check``."""

    def record(self):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, other) -> float:
        return (other.t - self.t) * 1e3


def _timed(fn, seconds: float, device: str) -> float:
    """Seconds a call of ``fn``, the median of WINDOWS windows of CUDA-event timing."""
    event = (lambda: torch.cuda.Event(enable_timing=True)) if device == "cuda" else _HostEvent
    start, end = event(), event()
    fn()
    start.record()
    for _ in range(3):
        fn()
    end.record()
    end.synchronize()
    reps = max(1, int(seconds / WINDOWS / max(start.elapsed_time(end) / 3e3, 1e-6)))
    out = []
    for _ in range(WINDOWS):
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3 / reps)
    return statistics.median(out)


def _copies(nbytes: int, device: str) -> int:
    """Operand sets to rotate among so that they do not sit in the L2 cache (twice its size)."""
    l2 = (getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
          if device == "cuda" else 50 << 20)
    return max(1, min(16, math.ceil(2 * l2 / max(nbytes, 1))))


def _operand(batch, rows, cols, transposed, dtype, device):
    """A (batch, rows, cols) operand, stored transposed where the step reads it so."""
    t = (torch.randn(batch, cols, rows, dtype=dtype, device=device).transpose(-1, -2)
         if transposed else torch.randn(batch, rows, cols, dtype=dtype, device=device))
    return t if batch > 1 else t[0]


def measure(matmuls, memory, args, clocks: Clocks | None, device: str = "cuda") -> None:
    """Each row's measured rate, on ``device`` ("cpu": ``--cpu-check``, the code alone)."""
    torch.set_float32_matmul_precision("high")  # the plan's fp32 matmuls are TF32's
    side = 8192 if device == "cuda" else 64
    a = torch.randn(side, side, dtype=torch.bfloat16, device=device)
    end = time.monotonic() + args.warmup_s
    while time.monotonic() < end:  # sustained load: the clocks settle under the power limit
        for _ in range(20):
            a @ a
        torch.cuda.synchronize() if device == "cuda" else None
    del a
    for row in matmuls:
        dtype = torch.bfloat16 if row["dtype"] == "bf16" else torch.float32
        b, m, n, k, lay = row["batch"], row["m"], row["n"], row["k"], row["layout"]
        size = (m * k + k * n) * b * dtype.itemsize
        sets = [(_operand(b, m, k, lay[0] == "T", dtype, device),
                 _operand(b, k, n, lay[1] == "T", dtype, device))
                for _ in range(_copies(size, device))]
        out = torch.empty(*((b,) if b > 1 else ()), m, n, dtype=dtype, device=device)
        mm, turn = (torch.bmm if b > 1 else torch.mm), [0]

        def call():
            x, y = sets[turn[0] % len(sets)]
            turn[0] += 1
            mm(x, y, out=out)

        t0 = time.monotonic()
        seconds = _timed(call, args.seconds_per_shape, device)
        row["measured_tflops"] = row["gflop"] * 1e9 / seconds / 1e12
        row["sm_mhz"] = clocks.between(t0, time.monotonic()) if clocks else None
        del sets, out
    for row in memory:
        half = max(1, row["bytes"] // 4)  # bf16 elements: read half the bytes, write half
        pairs = [(torch.empty(half, dtype=torch.bfloat16, device=device),
                  torch.empty(half, dtype=torch.bfloat16, device=device))
                 for _ in range(_copies(row["bytes"], device))]
        turn = [0]

        def copy():
            src, dst = pairs[turn[0] % len(pairs)]
            turn[0] += 1
            dst.copy_(src)

        row["measured_gbs"] = 4 * half / _timed(copy, args.seconds_per_shape / 4, device) / 1e9
        del pairs
    torch.cuda.empty_cache() if device == "cuda" else None


def weighted(matmuls, memory) -> dict:
    """The step's own averages: matmul FLOPs over their seconds, memory bytes over theirs."""
    flops = sum(r["gflop"] * (r["forward"] + r["backward"]) for r in matmuls)
    total = sum(r["total_bytes"] for r in memory)

    def over(rows, key, weight):
        if not rows or any(r[key] is None for r in rows):
            return None
        return sum(weight(r) for r in rows) / sum(weight(r) / r[key] for r in rows)

    count = lambda r: r["gflop"] * (r["forward"] + r["backward"])  # noqa: E731
    return {"plan_tflops": over(matmuls, "plan_tflops", count),
            "measured_tflops": over(matmuls, "measured_tflops", count),
            "plan_gbs": over(memory, "plan_gbs", lambda r: r["total_bytes"]),
            "measured_gbs": over(memory, "measured_gbs", lambda r: r["total_bytes"]),
            "matmul_gflop": flops, "memory_bytes": total}


def _f(x, fmt="{:.4g}") -> str:
    return "-" if x is None else fmt.format(x)


def summary(res: dict) -> str:
    w, dry = res["weighted"], not res["measured"]
    flops = w["matmul_gflop"] or 1.0
    out = [f"# Matmul rates: {res['model']}, batch {res['batch']} x seq {res['seq']}, "
           f"{'bf16' if res['mixed_precision'] else 'fp32 (TF32)'}, {res['date']}", "",
           f"- device: {res['device']}; torch {res['torch']}, CUDA {res['cuda']}",
           f"- the plan's rates: --cluster {res['cluster']} ({res['plan_device']}), every effect "
           f"of zerolab/roofline.py (MAMF by tiles and waves, launches, power limit)",
           "- " + (("CPU CHECK: the measuring code run on the CPU, its figures a CPU's; "
                    "nothing measured on a GPU" if res.get("cpu_check") else
                    "DRY RUN: no CUDA device here, nothing measured; run it on a GPU for the "
                    "measured columns") if dry else
                   f"measured after {res['warmup_s']:g} s of warm-up; SM clock MHz "
                   f"{json.dumps(res['sm_clock_mhz'])}, power W {json.dumps(res['power_w'])}"),
           "", "| shape m x n x k | dtype | layout | forward | backward | GFLOP a call | "
           "share of matmul FLOPs | plan TFLOPS | measured TFLOPS | measured / plan | SM MHz |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["matmuls"]:
        s = measured.Shape(*(r[k] for k in ("batch", "m", "n", "k", "dtype", "layout")))
        ratio = r["measured_tflops"] / r["plan_tflops"] if r["measured_tflops"] else None
        share = r["gflop"] * (r["forward"] + r["backward"]) / flops
        out.append(f"| {s.label()} | {r['dtype']} | {r['layout']} | {r['forward']} | "
                   f"{r['backward']} | {r['gflop']:.1f} | {100 * share:.1f}% | "
                   f"{r['plan_tflops']:.4g} | {_f(r['measured_tflops'])} | "
                   f"{_f(ratio, '{:.3f}')} | {_f(r['sm_mhz'], '{:.0f}')} |")
    ratio = (w["measured_tflops"] / w["plan_tflops"]) if w["measured_tflops"] else None
    out += [f"| step-weighted | | | {sum(r['forward'] for r in res['matmuls'])} | "
            f"{sum(r['backward'] for r in res['matmuls'])} | {flops:.0f} in all | 100% | "
            f"{_f(w['plan_tflops'])} | {_f(w['measured_tflops'])} | {_f(ratio, '{:.3f}')} | |",
            "", "Memory-bound operators by size (a streaming copy of the bucket's largest):", "",
            "| bytes | operators | share of their bytes | plan GB/s | measured GB/s |",
            "|---|---|---|---|---|"]
    total = w["memory_bytes"] or 1
    for r in res["memory"]:
        out.append(f"| {r['bytes']:,} | {r['ops']} | {100 * r['total_bytes'] / total:.1f}% | "
                   f"{r['plan_gbs']:.4g} | {_f(r['measured_gbs'])} |")
    out += [f"| byte-weighted | {sum(r['ops'] for r in res['memory'])} | 100% | "
            f"{_f(w['plan_gbs'])} | {_f(w['measured_gbs'])} |", ""]
    if not dry:
        out.append(f"Use it: python -m zerolab plan --model {res['model']} ... --matmul-rates "
                   f"{res['out']} --explain")
    return "\n".join(out)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="as python -m zerolab plan takes it (required without "
                                   "--shapes)")
    p.add_argument("--batch", type=int, default=1, help="sequences a rank (default: %(default)s)")
    p.add_argument("--seq", type=int, default=2048, help="tokens a sequence (default: %(default)s)")
    p.add_argument("--mixed-precision", action="store_true", help="bf16 compute (default: fp32)")
    p.add_argument("--activation-checkpointing", nargs="?", const="full", default=None,
                   choices=("full", "selective"), help="as the plan's (default: none)")
    p.add_argument("--world-size", type=int, default=8, help="ranks simulated (the shapes do "
                   "not depend on it) (default: %(default)s)")
    p.add_argument("--cluster", choices=sorted(PRESETS), default="dgx-h100",
                   help="whose GPU the plan's rates are for (default: %(default)s)")
    p.add_argument("--shapes", default=None, metavar="FILE.json",
                   help="measure the shapes a dry run listed (no model is built)")
    p.add_argument("--warmup-s", type=float, default=10.0, help="default: %(default)s")
    p.add_argument("--seconds-per-shape", type=float, default=1.5, help="default: %(default)s")
    p.add_argument("--dry-run", action="store_true", help="list only, even with CUDA")
    p.add_argument("--cpu-check", action="store_true",
                   help="without CUDA, run the measuring code on the CPU (a test of the script: "
                        "its figures are a CPU's, and the plan refuses the file)")
    p.add_argument("--out", default=None, help="FILE.json (and FILE.md beside it) (default: "
                   "benchmarks/results/<date>-<device>-matmul-rates.json)")
    args = p.parse_args(argv)
    if args.shapes:
        with open(args.shapes) as f:
            res = json.load(f)
        for k in ("model", "batch", "seq", "mixed_precision", "activation_checkpointing",
                  "cluster", "world_size"):
            setattr(args, k, res[k])
    elif not args.model:
        p.error("--model is required (or --shapes FILE.json)")
    else:
        try:
            matmuls, memory = enumerate_step(args)
        except measured.PlanError as e:
            p.exit(2, f"error: {e}\n")
        res = {"format": measured.FORMAT, "model": args.model,
               "model_id": measured.model_id(args.model), "batch": args.batch, "seq": args.seq,
               "mixed_precision": args.mixed_precision,
               "activation_checkpointing": args.activation_checkpointing,
               "world_size": args.world_size, "cluster": args.cluster,
               "plan_device": preset(args.cluster).device.name,
               "matmuls": matmuls, "memory": memory}
    gpu = torch.cuda.is_available() and not args.dry_run
    res.update(measured=gpu, date=datetime.date.today().isoformat(), torch=torch.__version__,
               cuda=torch.version.cuda, warmup_s=args.warmup_s if gpu else 0,
               device=torch.cuda.get_device_name(0) if gpu else "none (dry run)",
               sm_clock_mhz=None, power_w=None)
    if gpu:
        clocks = Clocks()
        clocks.start()
        measure(res["matmuls"], res["memory"], args, clocks)
        clocks.stop.set()
        res.update(sm_clock_mhz=clocks.summary(1), power_w=clocks.summary(2))
    elif args.cpu_check:
        measure(res["matmuls"], res["memory"], args, None, "cpu")
        res.update(device="cpu (--cpu-check: the code checked, no GPU measured)",
                   cpu_check=True)
    res["weighted"] = weighted(res["matmuls"], res["memory"])
    name = res["device"].replace(" ", "-") if gpu else "dry-run"
    out = args.out or os.path.join(HERE, "results", f"{res['date']}-{name}-matmul-rates.json")
    res["out"] = out
    text = summary(res)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.splitext(out)[0] + ".md", "w") as f:
        f.write(text + "\n")
    print(text)
    print(f"wrote {out}", file=sys.stderr)
    return res


if __name__ == "__main__":
    main()
