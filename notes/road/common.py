"""What every step of the road shares: the model, the data, torch's DDP as the reference, and
the report. Each step defines ``shard(model, blocks)`` and ends with ``common.main(shard, ...)``.

Two local CPU ranks (forked, gloo) train a GPT of 4 blocks for 3 AdamW steps with the step's
``shard`` and with ``DistributedDataParallel``, each rank on its own data, and rank 0 reports
the losses, whether the parameters are the same bits as DDP's after every step, and what one
step cost: the collectives in the ledger (``zero/comm/collectives.py``) and the optimizer state.
"""

import copy
import os
import sys
from collections import Counter
from functools import partial

import torch

from zero import comm
from zerolab.launch import run_ranks
from zerolab.models import GPT, GPTConfig
from zerolab.systems import System, make_optimizer

STEPS = 3
BLOCKS = 4


def full_parameters(model, units) -> dict[str, torch.Tensor]:
    """Every parameter, whole, by its original name, read from the units' shards."""
    names = {m: n for n, m in model.named_modules()}
    out = {}
    for u in units:
        full = u.shard.detach()
        if full.numel() < u.layout.padded_numel:  # a shard: gather it
            full = u.shard.new_empty(u.layout.padded_numel)
            comm.all_gather(full, u.shard.detach())  # (S,) per rank -> (N*S,)
        views = u.layout.views(full)
        for mod, attr, i in u.uses:
            out[f"{names[mod]}.{attr}".lstrip(".")] = views[i].clone()
    return out


def train(rank: int, n: int, shards: dict, watch=None) -> dict:
    """Train torch's DDP, then each of ``shards`` ({name: shard function}); report on each.

    ``watch(units, ledger)``, if given, is called after every backward (the exercises' checks
    look there); what it returns is reported, step by step.
    """
    torch.manual_seed(0)
    base = GPT(GPTConfig(layers=BLOCKS))
    ddp = System("ddp", base)
    ddp_losses, ddp_params = [], []
    for s in range(STEPS):  # the data depends only on (rank, step): System.step's
        ddp_losses.append(ddp.step(rank, s)[0][0].item())
        ddp_params.append(ddp.full_params())
    reports = {}
    for name, shard in shards.items():
        try:
            reports[name] = _train_one(base, shard, rank, n, ddp_losses, ddp_params, watch)
        except Exception as e:  # an exercise half done: say what broke (every rank breaks alike)
            reports[name] = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0]}")
    return reports


def _train_one(base, shard, rank, n, ddp_losses, ddp_params, watch) -> dict:
    """Train a copy of ``base`` with ``shard`` beside DDP's results; what one step showed."""
    model = copy.deepcopy(base)
    units = shard(model, model.blocks)
    opt = make_optimizer("adamw", list(model.named_parameters()))  # the same as DDP's
    ledgers, probes, peak = [], [], {}
    for k, block in enumerate(model.blocks):  # runs after the unit's own pre-forward hook
        block.register_forward_pre_hook(partial(_probe, units, k, ledgers, probes))
    losses, diffs, watched = [], [], []
    for s in range(STEPS):
        x, y = base.batch(4, torch.Generator().manual_seed(1000 * s + 10 * rank))
        probes.clear()
        peak.clear()
        with comm.Ledger(on_record=partial(_sample, units, peak)) as ledger:
            ledgers.append(ledger)
            loss = base.loss(model(x), y)
            loss.backward()
            grad_bytes = held(units)[1]
            if watch is not None:
                watched.append(watch(units, ledger))
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
        mine = full_parameters(model, units)
        diffs += [f"step {s}: {k} differs" for k, v in ddp_params[s].items()
                  if not torch.equal(v, mine.get(k, v + 1))]
    state = [t for st in opt.state.values() for t in st.values() if t.dim() > 0]
    return dict(
        losses=losses, ddp_losses=ddp_losses, diffs=diffs, units=len(units),
        ledger=[(r.op, r.unit, r.phase, r.sent_bytes) for r in ledger.records
                if r.op != "agree"],  # the last step (agreements: check mode only)
        psi=sum(p.numel() for p in base.parameters()), world_size=n,
        optimizer_bytes=sum(t.nbytes for t in state),
        full_bytes=sum(u.full.untyped_storage().nbytes() for u in units),
        grad_bytes=grad_bytes, peak=dict(peak),  # the last step's
        probes=list(probes), watched=watched)  # probes: the last step's, block by block


def held(units, reading: int = 0) -> tuple[int, int]:
    """Bytes of parameters and of gradients this rank holds now, each storage counted once.

    ``reading``: the bytes of a full gradient that no unit keeps but autograd still holds
    (the input of a reduce-scatter about to start)."""
    seen = set()

    def size(t) -> int:
        if t is None or t.untyped_storage().nbytes() == 0 or t.untyped_storage().data_ptr() in seen:
            return 0
        seen.add(t.untyped_storage().data_ptr())
        return t.untyped_storage().nbytes()

    params = sum(size(u.full) + size(u.shard) for u in units)
    grads = sum(size(getattr(u, "full_grad", None)) + size(u.shard.grad) for u in units)
    return params, grads + reading


def _sample(units, peak, record) -> None:
    """As each backward collective is recorded (before it runs): the largest bytes held yet."""
    if record.phase != "backward":
        return
    unit = next((u for u in units if u.name == record.unit), None)
    kept = unit is not None and getattr(unit, "full_grad", None) is not None
    reading = record.buffer_bytes if record.op == "reduce_scatter" and not kept else 0
    params, grads = held(units, reading)
    peak["params"] = max(peak.get("params", 0), params)
    peak["grads"] = max(peak.get("grads", 0), grads)


def _probe(units, k, ledgers, probes, module, args) -> None:
    """As block k starts its forward: how many units hold full parameters, and for how many
    blocks after it an all-gather was already issued (a prefetch)."""
    held = sum(u.full is not None and u.full.untyped_storage().nbytes() > 0 for u in units)
    later = {u.name for u in units[k + 1 : -1]}  # units: the blocks in order, then the root
    issued = {r.unit for r in ledgers[-1].records if r.op == "all_gather" and r.phase == "forward"}
    probes.append((held, len(issued & later)))


SHORT = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR"}


def report(title: str, r: dict) -> str:
    """What a step prints: losses beside DDP's, the check, one step's collectives and memory."""
    psi, n = r["psi"], r["world_size"]
    lines = [f"{title}: GPT with {BLOCKS} blocks, Ψ = {psi} parameters, {n} ranks (gloo)",
             "step  loss on rank 0       torch DDP's   (torch's default init: only the equality "
             "matters)"]
    for s, (a, b) in enumerate(zip(r["losses"], r["ddp_losses"])):
        lines.append(f"{s:4}  {a!r:19}  {b!r}")
    same = not r["diffs"] and r["losses"] == r["ddp_losses"]
    lines.append("losses and parameters bitwise equal to torch DDP's after every step: "
                 + ("yes" if same else "NO: " + "; ".join(r["diffs"][:3])))
    lines.append("\none step on rank 0, from the ledger (AG all-gather, RS reduce-scatter, "
                 "AR all-reduce), in issue order:")
    for phase in ("forward", "backward"):
        done = [f"{SHORT[op]} {unit}" for op, unit, ph, _ in r["ledger"] if ph == phase]
        lines.append(f"  {phase:9} " + (", ".join(done) or "-"))
    ring = 4 * psi * (n - 1) / n  # R: what one all-gather of every parameter sends per rank
    sent = Counter()
    for op, _, _, nbytes in r["ledger"]:
        sent[SHORT[op]] += nbytes / ring
    lines.append("  sent      " + ", ".join(f"{op} {v:.3f}R" for op, v in sent.items())
                 + f"; total {sum(sent.values()):.3f}R (R = 4 bytes × Ψ × (N-1)/N = {ring:.0f} B)")
    per = lambda nbytes: f"{nbytes / psi:.2f}"  # noqa: E731
    lines.append("memory, per rank, in bytes per parameter (one full fp32 copy of the model is 4):")
    lines.append(f"  during backward, at most: parameters {per(r['peak']['params'])}, gradients "
                 f"{per(r['peak']['grads'])}")
    lines.append(f"  after backward: gradients {per(r['grad_bytes'])}; after the step: optimizer "
                 f"state {per(r['optimizer_bytes'])}, full parameters kept {per(r['full_bytes'])}")
    held, ahead = (max(p[i] for p in r["probes"]) for i in (0, 1))
    lines.append(f"  as a block starts its forward: at most {held} of {r['units']} units hold full "
                 f"parameters, {ahead} later block(s) already being gathered")
    return "\n".join(lines)


def main(shard, path: str) -> None:
    """Run one step of the road on 2 local ranks and print its report; exit 1 if it is not DDP."""
    name = os.path.basename(path)
    r = run_ranks(train, 2, {name: shard})[0][name]
    if "error" in r:
        sys.exit(f"{name}: training raised {r['error']}")
    print(report(name, r))
    sys.exit(0 if not r["diffs"] and r["losses"] == r["ddp_losses"] else 1)
