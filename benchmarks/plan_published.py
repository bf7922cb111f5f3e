"""The plan's time held against published FSDP training runs it was not built from.

    python benchmarks/plan_published.py              # 40 runs, ~4 min on 2 CPUs
    python benchmarks/plan_published.py --only 13b   # the rows whose name holds "13b"

Each row is a run someone published: its model, GPUs, local batch, sequence, activation
checkpointing and tokens/s a GPU, quoted from its source. The plan runs the same step
(``python -m zerolab plan``, the ``fsdp2`` row: every published run here shards fully, FSDP1's
FULL_SHARD or FSDP2) on the preset of that hardware, with nothing fitted: the constants of
``zerolab/clusters.py`` come from vendors, NCCL and microbenchmarks, none from these runs.

The sources:

- torchtitan, ``benchmarks/llama3_h100_202412_torchtitan.md`` (Tables 1 and 3): Llama 3.1 8B,
  FSDP2, bf16 with fp32 reduction, selective activation checkpointing, local batch 2 of 8,192
  tokens, H100 96 GB at 500 W: 5,762 tokens/s a GPU on 8 GPUs, 5,605 on 128.
  github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md
- torchtitan, ``docs/performance.md``: FSDP2 on 64 A100 80 GB, Llama 3 8B (batch 1, selective
  op AC: 2,973) and 70B (batch 1, full AC: 331) at Llama 3's sequence of 8,192, Llama 2 13B
  (batch 2, no AC: 2,162; selective op AC: 1,904) and 70B (batch 2, full AC: 353) at Llama 2's
  4,096. github.com/pytorch/torchtitan/blob/main/docs/performance.md
- MosaicML's llm-foundry, ``scripts/train/benchmarking/README.md``, tables "H100 80GB BF16",
  "A100 80GB with 1600 Gbps node-node interconnect (RoCE)" and "A100 40GB with 1600 Gbps
  node-node interconnect (RoCE)": MPT models, FSDP1 FULL_SHARD, sequences of 2,048 (and
  three of 4,096 to 32,768 on 8 GPUs, where attention's share grows), the micro-batch,
  gradient accumulation and activation checkpointing of each row.
  github.com/mosaicml/llm-foundry/blob/main/scripts/train/benchmarking/README.md
- The same README's "H100 80GB BF16 (Large Scale, >= 128 GPUs)" table, added in January 2024
  (llm-foundry commit 5e85bd62d, with its ``sweep.py``): MPT 1B to 70B on 128, 256 and 512
  H100s, newer software than the table above: flash-attn 2.4.2 (``attn_impl: flash``,
  ``pip install .[gpu-flash2]``), mixed precision PURE, ``limit_all_gathers``,
  ``forward_prefetch``, ``backward_prefetch`` BACKWARD_PRE, no gradient accumulation; the 1B
  and 3B shard with SHARD_GRAD_OP (ZeRO-2: the plan's ``fsdp2-noreshard`` row), the rest
  FULL_SHARD. The rows at 128 and 512 GPUs are planned (names ending "2024").

How each is planned, and what differs:

- Llama 2 is built by transformers from its shapes (``llama2`` below); torchtitan's own
  Llama 2 has the same shapes. Its A100s' network is not stated: the DGX A100's is assumed.
- MPT is a GPT of pre-norm blocks with a 4x GELU MLP and a tied 50,368-token embedding; the
  plan builds ``zerolab.models.GPT`` of the same width, depth and heads (``mpt`` below; its
  parameter count within 0.5% of the table's NumParams). MPT has no biases and no learned
  positions (ALiBi): the GPT here has both, a few tenths of a percent of the FLOPs.
- The plan times one micro-batch and one optimizer step. A row with gradient accumulation
  runs several micro-batches an optimizer step; FSDP1's FULL_SHARD gathers and reduces at
  every one of them, so only the optimizer step is shared: the plan is pessimistic there by
  its optimizer step over the accumulation (under 2% on these rows).
- llm-foundry's "PURE" mixed precision (the A100 40 GB table) reduces in bf16; the plan
  reduces in fp32 (``--mixed-precision``): twice the reduce-scatter bytes, mostly hidden.
- MPT attends with ``attn_impl: triton`` (the yamls, and ``submit_benchmarks.py``'s default):
  FlashAttention in Triton, on the pre-MLIR Triton compiler (``triton-pre-mlir``, llm-foundry
  v0.3.0's ``setup.py``; the kernel's own header: "only been tested on A100"). The plan runs
  these rows with ``--attention-kernel triton``: FlashAttention-2's paper (section 4.1) measured
  it 1.3-1.5x slower forward and about 2x slower backward than FlashAttention-2.
- What ran (llm-foundry's own ``h100new.md``, the same rows with their image; ``sweep.sh``):
  torch 2.1 nightly of 2023-08-27 with CUDA 12.1 (``mosaicml/pytorch:2.1.0_cu121-nightly
  20230827``), llm-foundry v0.3.0, Composer 0.16 (FSDP1: ``backward_prefetch`` BACKWARD_POST,
  ``limit_all_gathers``, no ``torch.compile``), mixed precision DEFAULT: Composer's of that time
  (March to October 2023) gathers in bf16 and leaves ``reduce_dtype`` unset, so FSDP1 reduces in
  bf16 too; the plan reduces in fp32 (mostly hidden: the exposed column).
- llm-foundry does not say its H100s' network; the ``dgx-h100`` preset (8 x 400 Gb/s a node)
  is assumed. Its A100 tables say 1,600 Gb/s a node: the DGX A100 presets' 8 x 200 Gb/s.

The targets (issue 48): every run within 25% in tokens/s a GPU, every trend over GPU count
(the same model and micro-batch on more GPUs) within 10 points.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import report  # noqa: E402

TITAN = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 and 3"
TITAN_A100 = "torchtitan docs/performance.md, 64 A100 80GB, FSDP2"
FOUNDRY = "llm-foundry scripts/train/benchmarking/README.md"
MPT = {"1b": (2048, 24, 16), "3b": (2560, 32, 20), "7b": (4096, 32, 32), "13b": (5120, 40, 40),
       "30b": (7168, 48, 56), "70b": (8192, 80, 64)}  # llm-foundry's yamls: d_model, layers, heads


def mpt(size: str, seq: int = 2048):
    """MPT of ``size`` as the plan's GPT: its width, depth, heads, vocabulary, ``seq``."""
    from zerolab.models import GPT, GPTConfig

    dim, layers, heads = MPT[size]
    return GPT(GPTConfig(vocab=50368, seq=seq, dim=dim, layers=layers, heads=heads))


def llama2(dim: int, hidden: int, layers: int, heads: int, kv_heads: int):
    """Llama 2 of these shapes, as transformers builds it (vocabulary 32,000, 4,096 positions)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=dim, intermediate_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads,
                         vocab_size=32000, max_position_embeddings=4096, use_cache=False)
    return LlamaForCausalLM(config)


def llama2_13b():
    return llama2(5120, 13824, 40, 40, 40)


def llama2_70b():
    return llama2(8192, 28672, 80, 64, 8)


def mpt_1b():
    return mpt("1b")


def mpt_3b():
    return mpt("3b")


def mpt_7b():
    return mpt("7b")


def mpt_13b():
    return mpt("13b")


def mpt_30b():
    return mpt("30b")


def mpt_70b():
    return mpt("70b")


def mpt_7b_8k():
    return mpt("7b", 8192)


def mpt_7b_32k():
    return mpt("7b", 32768)


def mpt_13b_4k():
    return mpt("13b", 4096)


# name, model, preset, GPUs, micro-batch, seq, activation checkpointing, published tokens/s a
# GPU, source (table: the row's other columns, quoted)
RUNS = [
    ("llama3.1-8b h100 x8", "torchtitan:llama3:8B", "h100-96gb", 8, 2, 8192, "selective", 5762,
     f"{TITAN}: 8 GPUs, FSDP, local batch 2, 8,192 tokens"),
    ("llama3.1-8b h100 x128", "torchtitan:llama3:8B", "h100-96gb", 128, 2, 8192, "selective",
     5605, f"{TITAN}: 128 GPUs"),
    ("llama3-8b a100-80 x64", "torchtitan:llama3:8B", "dgx-a100-80gb", 64, 1, 8192, "selective",
     2973, f"{TITAN_A100}: Llama 3 8B, batch 1, selective op AC (seq 8,192, Llama 3's default)"),
    ("llama3-70b a100-80 x64", "torchtitan:llama3:70B", "dgx-a100-80gb", 64, 1, 8192, "full", 331,
     f"{TITAN_A100}: Llama 3 70B, batch 1, full AC"),
    ("llama2-13b a100-80 x64", "plan_published:llama2_13b", "dgx-a100-80gb", 64, 2, 4096, None,
     2162, f"{TITAN_A100}: Llama 2 13B, batch 2, no AC (seq 4,096, Llama 2's default)"),
    ("llama2-13b a100-80 x64 sac", "plan_published:llama2_13b", "dgx-a100-80gb", 64, 2, 4096,
     "selective", 1904, f"{TITAN_A100}: Llama 2 13B, batch 2, selective op AC"),
    ("llama2-70b a100-80 x64", "plan_published:llama2_70b", "dgx-a100-80gb", 64, 2, 4096, "full",
     353, f"{TITAN_A100}: Llama 2 70B, batch 2, full AC"),
    ("mpt-3b h100 x32", "plan_published:mpt_3b", "dgx-h100", 32, 6, 2048, None, 23021,
     f"{FOUNDRY}, H100 80GB BF16: 3b, 2048, 32 GPUs, MicroBatchSize 6, GradAccum 3, no AC"),
    ("mpt-3b h100 x64", "plan_published:mpt_3b", "dgx-h100", 64, 6, 2048, None, 22525,
     f"{FOUNDRY}, H100 80GB BF16: 3b, 2048, 64 GPUs, MicroBatchSize 6, GradAccum 3, no AC"),
    ("mpt-7b h100 x8", "plan_published:mpt_7b", "dgx-h100", 8, 6, 2048, None, 10643,
     f"{FOUNDRY}, H100 80GB BF16: 7b, 2048, 8 GPUs, MicroBatchSize 6, GradAccum 1, no AC"),
    ("mpt-13b h100 x8", "plan_published:mpt_13b", "dgx-h100", 8, 2, 2048, None, 4792,
     f"{FOUNDRY}, H100 80GB BF16: 13b, 2048, 8 GPUs, MicroBatchSize 2, GradAccum 1, no AC"),
    ("mpt-13b h100 x64", "plan_published:mpt_13b", "dgx-h100", 64, 2, 2048, None, 4800,
     f"{FOUNDRY}, H100 80GB BF16: 13b, 2048, 64 GPUs, MicroBatchSize 2, GradAccum 1, no AC"),
    ("mpt-1b h100 x8", "plan_published:mpt_1b", "dgx-h100", 8, 14, 2048, None, 45455,
     f"{FOUNDRY}, H100 80GB BF16: 1b, 2048, 8 GPUs, MicroBatchSize 14, GradAccum 1, no AC"),
    ("mpt-30b h100 x32", "plan_published:mpt_30b", "dgx-h100", 32, 14, 2048, "full", 2308,
     f"{FOUNDRY}, H100 80GB BF16: 30b, 2048, 32 GPUs, MicroBatchSize 14, GradAccum 3, AC"),
    # longer sequences (activation checkpointing, 8 GPUs): attention's share grows with them
    ("mpt-13b-4k h100 x8", "plan_published:mpt_13b_4k", "dgx-h100", 8, 10, 4096, "full", 4717,
     f"{FOUNDRY}, H100 80GB BF16: 13b, 4096, 8 GPUs, MicroBatchSize 10, GradAccum 3, AC"),
    ("mpt-7b-8k h100 x8", "plan_published:mpt_7b_8k", "dgx-h100", 8, 8, 8192, "full", 6935,
     f"{FOUNDRY}, H100 80GB BF16: 7b, 8192, 8 GPUs, MicroBatchSize 8, GradAccum 2, AC"),
    ("mpt-7b-32k h100 x8", "plan_published:mpt_7b_32k", "dgx-h100", 8, 2, 32768, "full", 3318,
     f"{FOUNDRY}, H100 80GB BF16: 7b, 32768, 8 GPUs, MicroBatchSize 2, GradAccum 2, AC"),
    ("mpt-70b h100 x64", "plan_published:mpt_70b", "dgx-h100", 64, 8, 2048, "full", 1039,
     f"{FOUNDRY}, H100 80GB BF16: 70b, 2048, 64 GPUs, MicroBatchSize 8, GradAccum 4, AC"),
    ("mpt-7b a100-80 x8", "plan_published:mpt_7b", "dgx-a100-80gb", 8, 6, 2048, None, 4641,
     f"{FOUNDRY}, A100 80GB: 7b, 2048, 8 GPUs, MicroBatchSize 6, GradAccum 2, no AC"),
    ("mpt-13b a100-80 x8", "plan_published:mpt_13b", "dgx-a100-80gb", 8, 2, 2048, None, 2262,
     f"{FOUNDRY}, A100 80GB: 13b, 2048, 8 GPUs, MicroBatchSize 2, GradAccum 3, no AC"),
    ("mpt-13b-4k a100-80 x8", "plan_published:mpt_13b_4k", "dgx-a100-80gb", 8, 10, 4096, "full",
     2060, f"{FOUNDRY}, A100 80GB: 13b, 4096, 8 GPUs, MicroBatchSize 10, GradAccum 3, AC"),
    ("mpt-7b-8k a100-80 x8", "plan_published:mpt_7b_8k", "dgx-a100-80gb", 8, 8, 8192, "full", 3206,
     f"{FOUNDRY}, A100 80GB: 7b, 8192, 8 GPUs, MicroBatchSize 8, GradAccum 2, AC"),
    ("mpt-7b-32k a100-80 x8", "plan_published:mpt_7b_32k", "dgx-a100-80gb", 8, 2, 32768, "full",
     1672, f"{FOUNDRY}, A100 80GB: 7b, 32768, 8 GPUs, MicroBatchSize 2, GradAccum 2, AC"),
    ("mpt-7b a100-40 x32", "plan_published:mpt_7b", "dgx-a100-40gb", 32, 18, 2048, "full", 3725,
     f"{FOUNDRY}, A100 40GB: 7b, 2048, 32 GPUs, MicroBatchSize 18, GradAccum 1, AC, PURE"),
    ("mpt-7b a100-40 x128", "plan_published:mpt_7b", "dgx-a100-40gb", 128, 18, 2048, "full", 3623,
     f"{FOUNDRY}, A100 40GB: 7b, 2048, 128 GPUs, MicroBatchSize 18, GradAccum 1, AC, PURE"),
    ("mpt-13b a100-40 x64", "plan_published:mpt_13b", "dgx-a100-40gb", 64, 16, 2048, "full",
     1976, f"{FOUNDRY}, A100 40GB: 13b, 2048, 64 GPUs, MicroBatchSize 16, GradAccum 1, AC, PURE"),
    ("mpt-13b a100-40 x128", "plan_published:mpt_13b", "dgx-a100-40gb", 128, 16, 2048, "full",
     1972, f"{FOUNDRY}, A100 40GB: 13b, 2048, 128 GPUs, MicroBatchSize 16, GradAccum 1, AC, PURE"),
    ("mpt-70b a100-40 x128", "plan_published:mpt_70b", "dgx-a100-40gb", 128, 4, 2048, "full", 376,
     f"{FOUNDRY}, A100 40GB: 70b, 2048, 128 GPUs, MicroBatchSize 4, GradAccum 1, AC, PURE"),
]
LARGE = f"{FOUNDRY}, H100 80GB BF16 (Large Scale, >= 128 GPUs)"
# name, size, GPUs, micro-batch, AC, published tokens/s a GPU, sharding strategy
_LARGE_SCALE = [("70b", 128, 8, True, 1058, "FULL_SHARD"), ("70b", 512, 8, True, 1007, "FULL_SHARD"),
                ("30b", 128, 8, True, 2199, "FULL_SHARD"), ("30b", 512, 8, True, 2115, "FULL_SHARD"),
                ("13b", 128, 16, True, 5080, "FULL_SHARD"),
                ("13b", 512, 16, True, 4952, "FULL_SHARD"),
                ("7b", 128, 6, False, 10475, "FULL_SHARD"), ("7b", 512, 6, False, 9670, "FULL_SHARD"),
                ("3b", 128, 8, False, 23422, "SHARD_GRAD_OP"),
                ("3b", 512, 8, False, 21664, "SHARD_GRAD_OP"),
                ("1b", 128, 12, False, 44123, "SHARD_GRAD_OP"),
                ("1b", 512, 12, False, 39837, "SHARD_GRAD_OP")]
RUNS += [(f"mpt-{size} h100 x{n} 2024", f"plan_published:mpt_{size}", "dgx-h100", n, mb, 2048,
          "full" if ac else None, pub,
          f"{LARGE}: {size}, 2048, {n} GPUs, MicroBatchSize {mb}, GradAccum 1, "
          f"{'AC' if ac else 'no AC'}, {strategy}")
         for size, n, mb, ac, pub, strategy in _LARGE_SCALE]
ZERO2 = {f"mpt-{size} h100 x{n} 2024" for size, n, *_, strategy in _LARGE_SCALE
         if strategy == "SHARD_GRAD_OP"}  # FSDP1's ZeRO-2: FSDP2 without resharding after forward
# the same model and micro-batch on more GPUs: (fewer, more); and the same model and tokens a
# micro-batch (65,536) at a 4x longer sequence, on the same GPUs (attention's share grows)
TRENDS = [("llama3.1-8b h100 x8", "llama3.1-8b h100 x128"), ("mpt-3b h100 x32", "mpt-3b h100 x64"),
          ("mpt-13b h100 x8", "mpt-13b h100 x64"), ("mpt-7b a100-40 x32", "mpt-7b a100-40 x128"),
          ("mpt-13b a100-40 x64", "mpt-13b a100-40 x128"),
          ("mpt-7b-8k h100 x8", "mpt-7b-32k h100 x8"),
          ("mpt-7b-8k a100-80 x8", "mpt-7b-32k a100-80 x8"),
          *[(f"mpt-{size} h100 x128 2024", f"mpt-{size} h100 x512 2024")
            for size in ("70b", "30b", "13b", "7b", "3b", "1b")]]


def predict(run) -> dict:
    """The plan's fsdp2 row for one published run."""
    from zerolab.plan import predict as plan_predict

    name, model, cluster, n, batch, seq, ac, *_ = run
    # MPT's attn_impl: triton in 2023's tables; flash-attn 2 in the large-scale one (see above)
    attention = "triton" if "mpt_" in model and not name.endswith("2024") else None
    system = "fsdp2-noreshard" if name in ZERO2 else "fsdp2"
    return plan_predict(model, [system], n, batch, seq, mixed_precision=True, cluster=cluster,
                        checkpoint=ac or False, attention=attention)[0]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=None, help="the runs whose name holds this (default: all)")
    p.add_argument("--out", default=None,
                   help="default benchmarks/results/<date>-<machine>-plan-published.md")
    args = p.parse_args(argv)
    runs = [r for r in RUNS if args.only is None or args.only in r[0]]
    rows, lines = {}, []
    for run in runs:
        start = time.monotonic()
        rows[run[0]] = predict(run)
        print(f"{run[0]}: {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    lines = ["| run | preset | GPUs | batch x seq | AC | tokens/s a GPU: published | plan | "
             "plan / published | plan's MFU | exposed comm s | source |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    ratios = []
    for name, _, cluster, n, batch, seq, ac, published, source in runs:
        r = rows[name]
        ratio = r["tokens_per_s_per_gpu"] / published
        ratios.append(ratio)
        lines.append(f"| {name} | {cluster} | {n} | {batch} x {seq} | {ac or 'none'} | "
                     f"{published:,} | {r['tokens_per_s_per_gpu']:,.0f} | {ratio:.3f} | "
                     f"{100 * r['mfu']:.1f}% | {r['exposed_comm_s']:.3f} | {source} |")
    trend_lines = ["| trend | published | plan | points apart |", "|---|---|---|---|"]
    apart = []
    published = {r[0]: r[7] for r in runs}
    for a, b in TRENDS:
        if a not in rows or b not in rows:
            continue
        pub = published[b] / published[a] - 1
        plan = rows[b]["tokens_per_s_per_gpu"] / rows[a]["tokens_per_s_per_gpu"] - 1
        apart.append(abs(plan - pub))
        to = b.split()[2] if a.split()[0] == b.split()[0] else b.split()[0]
        trend_lines.append(f"| {a} -> {to} | {100 * pub:+.1f}% | "
                           f"{100 * plan:+.1f}% | {100 * abs(plan - pub):.1f} |")
    within = sum(abs(x - 1) <= 0.25 for x in ratios)
    date = datetime.date.today().isoformat()
    text = "\n".join([
        f"# The plan's time against published FSDP runs, {date}", "",
        f"- machine: {report.machine()} ({report.cpu_name()}); the plan's figures do not "
        f"depend on it", f"- torch {torch.__version__}",
        f"- command: `python benchmarks/plan_published.py {' '.join(argv or sys.argv[1:])}`",
        "- each run: `python -m zerolab plan --model MODEL --cluster PRESET --world-size N "
        "--batch B --seq S --mixed-precision [--activation-checkpointing AC] --systems fsdp2 "
        "(MPT of 2023: --attention-kernel triton; SHARD_GRAD_OP: --systems fsdp2-noreshard)`",
        "", f"Within 25%: {within} of {len(ratios)} runs; plan / published from "
        f"{min(ratios):.2f} to {max(ratios):.2f}. Trends within 10 points: "
        f"{sum(x <= 0.10 for x in apart)} of {len(apart)}.", "", *lines, "", *trend_lines, ""])
    print(text)
    out = args.out or os.path.join(HERE, "results",
                                   f"{date}-{report.machine()}-plan-published.md")
    with open(out, "w") as f:
        f.write(text)
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
