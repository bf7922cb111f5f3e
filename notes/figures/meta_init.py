"""Meta-device initialisation on 2 gloo ranks: what it equals, and what it holds while it runs.

    python notes/figures/meta_init.py > notes/figures/meta_init.txt

The model is tests/zerolab/test_scale.py's (GPT, 8 blocks, dim 64, vocab 64, seq 16), stage 3, with
GPT-2's init (zerolab.models.gpt_init). Part 1 compares zero.init_parameters with "build on the
CPU, call gpt_init on every module in model.modules() order, then shard", and with two ways of
getting it wrong. Part 2 follows the bytes a rank holds beyond its shards, module by module.
"""

import torch

import zero
from zerolab.launch import run_ranks
from zerolab.trackers import PeakMemTracker
from zerolab.models import GPT, GPTConfig, gpt_init

WORLD_SIZE, STAGE, SEED = 2, 3, 7
CONFIG = GPTConfig(layers=8, dim=64, vocab=64, seq=16)


def full_then_shard(order):
    model = GPT(CONFIG)
    torch.manual_seed(SEED)
    for mod in order(list(model.modules())):
        gpt_init(mod)
    for unit in model.units():
        zero.shard(unit, stage=STAGE)
    return zero.full_state_dict(model)


def meta_then_init(init_fn=gpt_init, trace=None):
    with torch.device("meta"):
        model = GPT(CONFIG)
    for unit in model.units():
        zero.shard(unit, stage=STAGE)
    torch.manual_seed(SEED)
    zero.init_parameters(model, init_fn if trace is None else trace(model, init_fn))
    return model


def differing(a, b):
    return [k for k in a if not torch.equal(a[k], b[k])]


def one_rank(rank, n):
    reference = full_then_shard(lambda mods: mods)
    ours = zero.full_state_dict(meta_then_init())
    reversed_order = full_then_shard(lambda mods: mods[::-1])

    model = GPT(CONFIG)
    torch.manual_seed(SEED)
    for mod in model.modules():
        if mod is not model.head:  # skip the tied head: tok_emb's own draw survives
            gpt_init(mod)
    for unit in model.units():
        zero.shard(unit, stage=STAGE)
    skipped = zero.full_state_dict(model)

    # Part 2: the bytes beyond the shards, at each init_fn call and at the peak.
    rows, mt = [], PeakMemTracker()
    def trace(model, init_fn):
        names = {m: name or "(GPT itself)" for name, m in model.named_modules()}
        def traced(mod):
            now = mt.get_tracker_snapshot()[torch.device("cpu")]["Total"]
            rows.append((names[mod], now))
            init_fn(mod)
        return traced
    with torch.device("meta"):
        model = GPT(CONFIG)
    for unit in model.units():
        zero.shard(unit, stage=STAGE)
    units = zero.units_of(model)
    mt.track_external(*[u.sharded for u in units])
    shards = mt.get_tracker_snapshot()[torch.device("cpu")]["Total"]
    torch.manual_seed(SEED)
    with mt:
        zero.init_parameters(model, trace(model, gpt_init))
    peak = mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    return {
        "keys": list(reference) == list(ours), "n": len(reference),
        "ours": differing(reference, ours),
        "reversed": differing(reference, reversed_order), "skipped": differing(reference, skipped),
        "rows": [(name, now - shards) for name, now in rows], "peak": peak - shards,
        "shards": shards, "root": 4 * units[0].layout.padded_numel,
        "block": 4 * units[1].layout.padded_numel,
        "full": 4 * sum(u.layout.padded_numel for u in units),
    }


def main():
    out = run_ranks(one_rank, WORLD_SIZE)
    r = out[0]
    print(f"GPT {CONFIG}, stage {STAGE}, N = {WORLD_SIZE}, init_fn = gpt_init, seed {SEED}\n")
    print("Part 1: full_state_dict after each way of initialising, against the reference")
    print("  reference: build on the CPU, gpt_init every module in model.modules() order, shard")
    print(f"  zero.init_parameters (meta, shard, then init): same keys {r['keys']}, "
          f"tensors that differ: {len(r['ours'])}")
    print(f"  the reference in reversed module order: tensors that differ: {len(r['reversed'])} "
          f"of {r['n']} ({', '.join(r['reversed'][:3])}, ...)")
    print(f"  the reference without the head's re-draw of the tied weight: differ: {r['skipped']}")
    agree = all(o["ours"] == [] for o in out)
    print(f"  (every rank's full_state_dict agrees with its reference: {agree})\n")

    root, block = r["root"], r["block"]
    def alive(b):  # which full buffers make up b bytes
        for has_root in (0, 1):
            for k in range(3):
                if b == has_root * root + k * block:
                    return " + ".join(["root"] * has_root + [f"{k} block"] * (k > 0)) or "nothing"
        return "?"
    print(f"Part 2: bytes rank 0 holds beyond its shards ({r['shards']} B) while init runs")
    print(f"  one unit's full fp32 buffer: root {root} B, block {block} B; "
          f"the whole model {r['full']} B")
    print(f"  {'init_fn(module)':<22} {'bytes beyond shards':>20}  = full buffers alive")
    shown = ("blocks.0", "blocks.1", "blocks.7", "blocks.7.out")
    for name, b in r["rows"]:
        if not name.startswith("blocks.") or name.startswith("blocks.0") or name in shown:
            print(f"  {name:<22} {b:>20}  = {alive(b)}")
        elif name == "blocks.2":
            print(f"  {'... (blocks 1-7 alike)':<22}")
    print(f"  peak during init_parameters: {r['peak']} B = "
          f"{'root + one block' if r['peak'] == root + block else '?'} "
          f"= {r['peak'] / r['full']:.1%} of the whole model")


if __name__ == "__main__":
    main()
