"""torchtitan trains on ``zero.fully_shard`` unchanged, bitwise equal to FSDP2.

    python benchmarks/torchtitan_example.py                       # llama3, stages 1-3, fp32
    python benchmarks/torchtitan_example.py --stage 3 --precision bf16 --ac full none
    python benchmarks/torchtitan_example.py --model deepseek_v3 --stage 3
    python benchmarks/torchtitan_example.py --tied --accumulate 2 --reshard never
    python benchmarks/torchtitan_example.py --resume              # CheckpointManager round trip
    python benchmarks/torchtitan_example.py --tp 2                # tensor parallel 2 x FSDP 2

Each configuration trains twice on the same 2 gloo ranks, from the same seed and the same
random tokens: once with torchtitan as it is (FSDP2), once with the one name
``torchtitan.distributed.fsdp.fully_shard`` bound to ``zero.fully_shard`` (at ``--stage``);
then it prints, step by step, whether the losses and every parameter are bitwise equal, and
how many reduce-scatters each ran per step.

What runs is torchtitan's (0.3.0): the debug flavour's own ``Trainer.Config``
(``llama3_debugmodel()``, ``deepseek_v3_debugmodel()``), the model built on the meta device,
its parallelize function (activation checkpointing, then ``apply_fsdp_to_decoder``: one
``fully_shard`` per block, one for ``[norm, lm_head]``, one for the root, then
``set_gradient_divide_factor(1.0)`` on every ``FSDPModule``), ``to_empty`` and
``init_weights``, its default loss (``ChunkedLossWrapper``: ``lm_head`` kept gathered and
unsynced across the chunks when it is an ``FSDPModule``), its ``OptimizersContainer`` and
``LRSchedulersContainer``, ``Trainer.train_step`` itself (the global token count, forward,
loss and backward, its ``clip_grad_norm_``, the optimizer and scheduler steps) and its
``CheckpointManager``.

What this script does itself, because ``Trainer.__init__`` cannot run offline on a CPU
(it builds a tokenizer and a dataset from files, and a CUDA memory monitor):
- it tells torchtitan the device is "cpu" (without a GPU it assumes "cuda");
- it feeds random tokens through a small Stateful dataloader (no tokenizer, no dataset);
- it builds the trainer's parts in ``Trainer.__init__``'s order (``build_trainer``) on a
  ``Trainer`` made without ``__init__``, and reads the loss and the gradient norm where
  ``train_step`` hands them to its metrics processor;
- the SPMD backend is "partial_dtensor" (torchtitan's default, "spmd_types", does not run
  on torch 2.13's FSDP2 either: see ``trainer_config``);
- attention is SDPA (flex attention needs ``torch.compile``), the optimizer the for-loop
  one, and FSDP2 sums on the wire (``set_force_sum_reduction_for_comms``: gloo has no
  PREMUL_SUM; torchtitan's divide factor 1.0 asks for it on GPUs).
With ``--tp 2`` torchtitan's own tensor parallelism (its plan: column- and row-wise
linears, sequence-parallel norms, a parallel embedding) runs on a (dp, tp) = (2, 2) mesh of
4 ranks, and ``fully_shard`` shards each block over "dp": the parameters are 2-D DTensors,
FSDP2's and zero's alike (``zero/core/placement.py``).
Tiny: the flavour's first 2 layers (deepseek_v3's: a dense block, then an MoE block),
sequence 64, batch 2 per rank, 3 steps; a few seconds a configuration.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys
import tempfile
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import zero  # noqa: E402
from zerolab.launch import run_ranks  # noqa: E402

SEQ, BATCH, LAYERS, STEPS = 64, 2, 2, 3


def use_cpu() -> None:
    """torchtitan picks its device at import (``tools/utils.py``: "cuda" when none is
    found); these are the modules that copied the name."""
    import torchtitan.components.metrics
    import torchtitan.distributed.parallel_dims
    import torchtitan.distributed.utils
    import torchtitan.models.common.token_dispatcher
    import torchtitan.tools.profiler
    import torchtitan.tools.utils
    for module in (torchtitan.tools.utils, torchtitan.distributed.utils,
                   torchtitan.distributed.parallel_dims, torchtitan.components.metrics,
                   torchtitan.models.common.token_dispatcher, torchtitan.tools.profiler):
        if hasattr(module, "device_type"):
            module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = torch.cpu


class RandomTokens:
    """``local_batch`` rows of ``seq`` random tokens a step, different on every rank;
    Stateful, so the checkpointer saves where it is."""

    def __init__(self, vocab: int, rank: int, seed: int = 0):
        self.vocab, self.rank, self.seed, self.step = vocab, rank, seed, 0

    def __iter__(self):
        while True:
            g = torch.Generator().manual_seed(self.seed * 1000 + self.step * 10 + self.rank)
            tokens = torch.randint(self.vocab, (BATCH, SEQ + 1), generator=g)
            self.step += 1
            yield {"input": tokens[:, :-1]}, tokens[:, 1:]

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


class Recorder:
    """Where ``Trainer.train_step`` reports (its ``metrics_processor``): keeps the loss and
    the gradient norm of each step."""

    def __init__(self):
        self.losses, self.grad_norms = [], []

    def should_log(self, step: int) -> bool:
        return True

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        self.losses.append(global_avg_loss)
        self.grad_norms.append(grad_norm)


@dataclass(frozen=True)
class Case:
    """One configuration. The defaults are the debug flavour's own (selective AC, bf16
    compute with fp32 reduction is torchtitan's default precision; fp32 here by default)."""

    model: str = "llama3"           # or "deepseek_v3" (a dense block, then an MoE block)
    stage: int = 3                  # zero's stage; FSDP2 is always FSDP2
    precision: str = "fp32"         # or "bf16": MixedPrecisionPolicy(bf16, fp32)
    ac: str = "selective"           # or "full", "none"
    reshard: str = "default"        # parallelism.fsdp_reshard_after_forward: or "never"
    accumulate: int = 1             # micro-batches a step (training.global_batch_size)
    tied: bool = False              # enable_weight_tying: [tok_embeddings, norm, lm_head]
    replicate: bool = False         # HSDP: a 2x1 (dp_replicate, fsdp) mesh
    offload: bool = False           # training.enable_cpu_offload: CPUOffloadPolicy()
    tp: int = 1                     # tensor_parallel_degree: 2 runs on 4 ranks, (dp, tp) 2x2

    def __str__(self):
        extras = [f"reshard {self.reshard}"] if self.reshard != "default" else []
        extras += [f"{self.accumulate} micro-batches"] if self.accumulate > 1 else []
        extras += ["tied embeddings"] if self.tied else []
        extras += ["HSDP 2x1"] if self.replicate else []
        extras += ["CPU offload"] if self.offload else []
        extras += [f"tensor parallel {self.tp} x data parallel 2"] if self.tp > 1 else []
        return ", ".join([self.model, f"stage {self.stage}", self.precision, f"AC {self.ac}",
                          "chunked loss"] + extras)


def trainer_config(case: Case, folder: str | None = None):
    """The debug flavour's own Trainer.Config, made tiny and offline; checkpoints in
    ``folder`` if given."""
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.models.common.attention import ScaledDotProductAttention
    if case.model == "llama3":
        from torchtitan.models.llama3.config_registry import llama3_debugmodel as flavour
    else:
        from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel as flavour
    config = flavour()
    spec = config.model_spec.model
    spec.layers = spec.layers[:LAYERS]
    spec.enable_weight_tying = case.tied
    for layer in spec.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.training.seq_len, config.training.local_batch_size = SEQ, BATCH
    config.training.global_batch_size = BATCH * 2 * case.accumulate
    config.training.steps = STEPS
    config.training.mixed_precision_param = "bfloat16" if case.precision == "bf16" else "float32"
    config.training.disable_cuda_graphs = True
    config.training.enable_cpu_offload = case.offload
    config.optimizer.implementation = "for-loop"
    config.compile.enable = False
    config.activation_checkpoint = {"none": None, "full": FullAC.Config(),
                                    "selective": SelectiveAC.Config()}[case.ac]
    config.validator.enable = False
    # 0.3.0's default, "spmd_types", hands fully_shard plain tensors with dp_mesh_dims set,
    # which torch 2.13's own FSDP2 refuses ("When dp_mesh_dims is provided, all parameters
    # must be DTensors on the full SPMD mesh"); "partial_dtensor" is the path that runs.
    config.parallelism.spmd_backend = "partial_dtensor"
    config.parallelism.fsdp_reshard_after_forward = case.reshard
    config.parallelism.tensor_parallel_degree = case.tp
    if case.replicate:
        config.parallelism.data_parallel_replicate_degree = 2
        config.parallelism.data_parallel_shard_degree = 1
    config.debug.seed = 0
    config.checkpoint.enable = folder is not None
    if folder is not None:
        config.checkpoint.folder, config.checkpoint.interval = "checkpoint", 1
        config.checkpoint.last_save_model_only = False
    config.dump_folder = folder or tempfile.gettempdir()
    return config


def build_trainer(config, world_size: int):
    """``Trainer.__init__``'s steps (torchtitan/trainer.py), in its order, on a Trainer made
    without it: parallel dims, determinism, the meta model, parallelize, to_empty and
    init_weights, the loss and its lm_head, optimizers, schedulers, checkpointer."""
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.trainer import Trainer

    trainer = Trainer.__new__(Trainer)
    trainer.config = config
    trainer.device = torch.device("cpu")
    trainer.parallel_dims = parallel_dims = ParallelDims.from_config(config.parallelism,
                                                                     world_size)
    dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
    dist_utils.set_determinism(parallel_dims, trainer.device, config.debug,
                               distinct_seed_mesh_dims=["pp"])
    spec = config.model_spec
    spec.model.update_from_config(config=config)
    trainer.model_config = spec.model
    with torch.device("meta"):
        model = spec.model.build()
    trainer.loss_fn = config.loss.build(compile_config=config.compile)
    batch_degree = parallel_dims.get_mesh("batch").size() if parallel_dims.dp_enabled else 1
    trainer.gradient_accumulation_steps = config.training.global_batch_size // (
        config.training.local_batch_size * batch_degree)
    trainer.num_pipeline_parallel_microbatches = 1
    model = spec.parallelize_fn(model, parallel_dims=parallel_dims, training=config.training,
                                parallelism=config.parallelism, compile_config=config.compile,
                                ac_config=config.activation_checkpoint,
                                dump_folder=config.dump_folder)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    trainer.model_parts = [model]
    trainer.loss_fn.set_lm_head(model.lm_head)
    model._skip_lm_head = True
    trainer.optimizers = config.optimizer.build(model_parts=trainer.model_parts)
    if spec.post_optimizer_build_fn is not None:
        spec.post_optimizer_build_fn(trainer.optimizers, trainer.model_parts, parallel_dims)
    trainer.lr_schedulers = config.lr_scheduler.build(optimizers=trainer.optimizers,
                                                      training_steps=config.training.steps)
    trainer.metrics_processor = Recorder()
    trainer.step, trainer.ntokens_seen = 0, 0
    # (one batch per data-parallel rank: the tensor-parallel ranks of one share it; tp is
    # the innermost dim of torchtitan's mesh)
    trainer.dataloader = RandomTokens(spec.model.vocab_size,
                                      dist.get_rank() // config.parallelism.tensor_parallel_degree)
    trainer.checkpointer = config.checkpoint.build(
        dataloader=trainer.dataloader, model_parts=trainer.model_parts,
        optimizers=trainer.optimizers, lr_schedulers=trainer.lr_schedulers,
        states={"train_state": trainer}, sd_adapter=None, base_folder=config.dump_folder)
    trainer.train_context = dist_utils.get_spmd_context(parallel_dims=parallel_dims)
    trainer.fwd_bwd_fn = trainer._forward_backward_body
    return trainer


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    def real(t):  # RoPE's cache is complex
        return torch.view_as_real(t) if t.is_complex() else t.float()
    return max((real(a[k]) - real(b[k])).abs().max().item() for k in a)


@contextlib.contextmanager
def fully_shard_is(fn):
    """Bind torchtitan's one ``fully_shard`` name (torchtitan/distributed/fsdp.py) to ``fn``."""
    import torchtitan.distributed.fsdp as titan_fsdp
    saved = titan_fsdp.fully_shard
    titan_fsdp.fully_shard = fn
    try:
        yield
    finally:
        titan_fsdp.fully_shard = saved


def zero_at(stage: int):
    def fully_shard(*args, **kwargs):
        return zero.fully_shard(*args, stage=stage, **kwargs)
    return fully_shard


class ReduceScatters:
    """Counts reduce-scatters while active, by caller: FSDP2 calls ``torch.distributed``'s
    (``reduce_scatter_single``, ``reduce_scatter_tensor``), zero its one seam
    (``zero.comm.backend.TorchBackend.reduce_scatter``, which calls torch's in turn: a call
    inside zero's counts as zero's only)."""

    def __init__(self):
        from zero.comm.backend import TorchBackend
        self.count = {"torch": 0, "zero": 0}
        self.inside = 0  # zero's calls under way
        self.sites = [("torch", dist, n) for n in ("reduce_scatter_single",
                                                   "reduce_scatter_tensor")
                      if hasattr(dist, n)] + [("zero", TorchBackend, "reduce_scatter")]

    @contextlib.contextmanager
    def counting(self):
        saved = [(who, owner, name, getattr(owner, name)) for who, owner, name in self.sites]

        def counted(who, f):
            def call(*args, **kwargs):
                if who == "zero" or not self.inside:
                    self.count[who] += 1
                self.inside += who == "zero"
                try:
                    return f(*args, **kwargs)
                finally:
                    self.inside -= who == "zero"
            return call
        for who, owner, name, f in saved:
            setattr(owner, name, counted(who, f))
        try:
            yield
        finally:
            for _, owner, name, f in saved:
                setattr(owner, name, f)


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, whole, and every buffer (deepseek's expert bias moves too)."""
    from torch.distributed.tensor import DTensor
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    return {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
            for n, t in tensors}


def start(config, world_size: int, fully_shard=None):
    """A trainer on FSDP2 (``fully_shard=None``) or on what ``fully_shard`` names."""
    import torchtitan.distributed.fsdp as titan_fsdp
    with fully_shard_is(fully_shard or titan_fsdp.fully_shard):
        trainer = build_trainer(config, world_size)
    if fully_shard is None:  # FSDP2 on gloo: sums on the wire (no PREMUL_SUM)
        for m in trainer.model_parts[0].modules():
            if isinstance(m, torch.distributed.fsdp.FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
    return trainer


def run(trainer, steps: int, after=None) -> list[dict]:
    """``steps`` calls of torchtitan's ``train_step``; the reduce-scatters of each."""
    counter, counts = ReduceScatters(), []
    data = iter(trainer.dataloader)
    for _ in range(steps):
        trainer.step += 1
        before = dict(counter.count)
        with counter.counting():
            trainer.train_step(data)
        counts.append({k: counter.count[k] - before[k] for k in before})
        if after is not None:
            after(trainer)
    return counts


def train(config, world_size: int, fully_shard=None, steps=STEPS, after=None):
    trainer = start(config, world_size, fully_shard)
    return trainer, run(trainer, steps, after)


def record(config, world_size: int, fully_shard=None):
    """Train on FSDP2 or zero: what the metrics saw, the reduce-scatters, the parameters,
    after each step."""
    params = []
    trainer, rs = train(copy.deepcopy(config), world_size, fully_shard,
                        after=lambda t: params.append(full_params(t.model_parts[0])))
    return trainer.metrics_processor, rs, params


def compare(cases: list[Case], world_size: int) -> list[list[dict]]:
    """FSDP2 once, then zero at each case's stage (the cases differ in their stage only), on
    the same ranks from the same seed: for each case, one row a step."""
    assert len({replace(c, stage=0) for c in cases}) == 1, cases
    # FSDP2's CPUOffloadPolicy pins host memory, which needs an accelerator: on a CPU-only
    # machine zero's offload is compared with FSDP2 without it (offload must not change a bit).
    ref, ref_rs, ref_p = record(trainer_config(replace(cases[0], offload=False)), world_size)
    tables = []
    for case in cases:
        ours, ours_rs, ours_p = record(trainer_config(case), world_size, zero_at(case.stage))
        tables.append([dict(
            step=s + 1, loss_ref=ref.losses[s], loss_ours=ours.losses[s],
            loss_equal=ref.losses[s] == ours.losses[s],
            norm_equal=ref.grad_norms[s] == ours.grad_norms[s],
            params_equal=all(torch.equal(ref_p[s][k], ours_p[s][k]) for k in ref_p[s]),
            max_diff=max_diff(ref_p[s], ours_p[s]),
            rs_ref=ref_rs[s]["torch"] + ref_rs[s]["zero"],
            rs_ours=ours_rs[s]["zero"], rs_torch_in_ours=ours_rs[s]["torch"])
            for s in range(STEPS)])
    return tables


def resume(case: Case, world_size: int, folder: str, saver: str = "zero",
           loader: str = "zero") -> dict:
    """torchtitan's CheckpointManager: the ``saver`` trains 2 steps, saves, trains step 3; a
    fresh model on the ``loader`` (initialised from another seed) loads step 2 and trains
    step 3: its loss and parameters should be the uninterrupted run's, bit for bit."""
    sharders = {"fsdp2": None, "zero": zero_at(case.stage)}
    config = trainer_config(case, folder)
    whole = start(copy.deepcopy(config), world_size, sharders[saver])
    run(whole, 2)
    whole.checkpointer.save(2)
    run(whole, 1)
    want = full_params(whole.model_parts[0])
    config.debug.seed = 1
    fresh = start(config, world_size, sharders[loader])
    before = full_params(fresh.model_parts[0])
    fresh.checkpointer.load(step=2)
    resumed_at = fresh.step
    run(fresh, 1)
    got = full_params(fresh.model_parts[0])
    for t in (whole, fresh):
        t.checkpointer.close()
    return dict(saver=saver, loader=loader, resumed_at=resumed_at,
                fresh_differed=any(not torch.equal(before[k], want[k]) for k in want),
                loss_whole=whole.metrics_processor.losses[-1],
                loss_resumed=fresh.metrics_processor.losses[-1],
                loss_equal=whole.metrics_processor.losses[-1]
                == fresh.metrics_processor.losses[-1],
                params_equal=all(torch.equal(want[k], got[k]) for k in want),
                max_diff=max_diff(want, got))


def work(rank: int, world_size: int, jobs: list[tuple]) -> list:
    """Every job in one set of ranks (torchtitan imported once): ("compare", [cases]) gives
    a table for each case, ("resume", case, folder, saver, loader) one resume row."""
    quiet()
    use_cpu()
    return [compare(job[1], world_size) if job[0] == "compare"
            else resume(job[1], world_size, *job[2:]) for job in jobs]


def quiet() -> None:
    """torchtitan logs every step and the DTensor RNG warns on CPU: keep the table readable."""
    import logging
    import warnings
    from torchtitan.tools.logging import logger
    logger.setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*may not have complete support on cpu")
    warnings.filterwarnings("ignore", message="To get the last learning rate")
    warnings.filterwarnings("ignore", message="CPU Autocast only supports")


def table(case: Case, rows: list[dict]) -> str:
    lines = [f"{case}" + (" (FSDP2 without offload: it needs an accelerator to pin memory)"
                          if case.offload else ""),
             "| step | loss FSDP2 | loss zero | loss equal | grad norm equal | params equal "
             "| max diff | reduce-scatters FSDP2 | reduce-scatters zero |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ours = str(r["rs_ours"]) + (f" (+{r['rs_torch_in_ours']} torch's)"
                                    if r["rs_torch_in_ours"] else "")
        lines.append(f"| {r['step']} | {r['loss_ref']:.6f} | {r['loss_ours']:.6f} | "
                     f"{r['loss_equal']} | {r['norm_equal']} | {r['params_equal']} | "
                     f"{r['max_diff']:.1e} | {r['rs_ref']} | {ours} |")
    return "\n".join(lines)


def bitwise(rows: list[dict]) -> bool:
    """Losses, gradient norms and parameters equal at every step, and no FSDP2 inside."""
    return all(r["loss_equal"] and r["norm_equal"] and r["params_equal"]
               and not r["rs_torch_in_ours"] for r in rows)


def resume_table(case: Case, results: list[dict]) -> str:
    lines = [f"CheckpointManager save after step 2 -> resume a fresh model, step 3 ({case})",
             "| saved by | resumed by | resumed at step | fresh init differed | loss step 3 "
             "| loss resumed | loss equal | params equal | max diff |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['saver']} | {r['loader']} | {r['resumed_at']} | "
                     f"{r['fresh_differed']} | {r['loss_whole']:.6f} | {r['loss_resumed']:.6f} | "
                     f"{r['loss_equal']} | {r['params_equal']} | {r['max_diff']:.1e} |")
    return "\n".join(lines)


def resumed_bitwise(r: dict) -> bool:
    return r["resumed_at"] == 2 and r["fresh_differed"] and r["loss_equal"] and r["params_equal"]


def machine(ranks: int = 2) -> str:
    import datetime
    import platform
    from importlib.metadata import version
    return (f"{datetime.date.today()}, {platform.machine()}, {os.cpu_count()} CPU cores, "
            f"torch {torch.__version__}, torchtitan {version('torchtitan')}, gloo, {ranks} ranks")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["llama3", "deepseek_v3"], default="llama3")
    parser.add_argument("--stage", type=int, choices=[1, 2, 3], nargs="+", default=[1, 2, 3])
    parser.add_argument("--precision", choices=["fp32", "bf16"], nargs="+", default=["fp32"])
    parser.add_argument("--ac", choices=["none", "full", "selective"], nargs="+",
                        default=["selective"])
    parser.add_argument("--reshard", choices=["default", "never"], default="default",
                        help="parallelism.fsdp_reshard_after_forward")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches a step")
    parser.add_argument("--tied", action="store_true", help="enable_weight_tying")
    parser.add_argument("--replicate", action="store_true", help="HSDP on a 2x1 mesh")
    parser.add_argument("--tp", type=int, choices=[1, 2], default=1,
                        help="tensor_parallel_degree (2: 4 ranks, data parallel 2)")
    parser.add_argument("--offload", action="store_true",
                        help="training.enable_cpu_offload (FSDP2's reference without it)")
    parser.add_argument("--resume", action="store_true",
                        help="CheckpointManager save -> resume instead (zero and FSDP2 "
                        "saving and resuming each other's checkpoints)")
    args = parser.parse_args()
    import torchtitan.trainer  # noqa: F401  (once, before the ranks fork: it takes seconds)
    cases = [Case(args.model, s, p, a, args.reshard, args.accumulate, args.tied,
                  args.replicate, args.offload, args.tp)
             for s in args.stage for p in args.precision for a in args.ac]
    with tempfile.TemporaryDirectory(prefix="zero-titan-") as tmp:
        if args.resume:
            pairs = [("zero", "zero"), ("fsdp2", "zero"), ("zero", "fsdp2")]
            jobs = [("resume", c, os.path.join(tmp, f"{i}-{a}-{b}"), a, b)
                    for i, c in enumerate(cases) for a, b in pairs]
        else:  # one FSDP2 run for the stages of each precision and AC mode
            groups: dict[Case, list[Case]] = {}
            for c in cases:
                groups.setdefault(replace(c, stage=0), []).append(c)
            jobs = [("compare", g) for g in groups.values()]
            cases = [c for g in groups.values() for c in g]
        results = run_ranks(work, 2 * args.tp, jobs, timeout=120 * len(cases))[0]
    print(machine(2 * args.tp))
    if args.resume:
        for i, case in enumerate(cases):
            rows = results[3 * i:3 * i + 3]
            print(f"\n{resume_table(case, rows)}\n"
                  f"resumed bitwise: {all(resumed_bitwise(r) for r in rows)}")
        return
    for case, rows in zip(cases, [t for tables in results for t in tables]):
        print(f"\n{table(case, rows)}\nbitwise equal to FSDP2: {bitwise(rows)}")


if __name__ == "__main__":
    main()
