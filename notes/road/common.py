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
from torch.multiprocessing.reductions import StorageWeakRef

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
    alive = Alive(units)
    opt = make_optimizer("adamw", list(model.named_parameters()))  # the same as DDP's
    ledgers, probes, peak, seen = [], [], {}, {}
    for k, block in enumerate(model.blocks):  # runs after the unit's own pre-forward hook
        block.register_forward_pre_hook(partial(_probe, alive, k, ledgers, probes))
    model.register_forward_hook(lambda *_: seen.update(  # after the units' own hooks
        full_after_forward=[u.name for u in units if alive.full(u)], lost=alive.lost()))
    losses, diffs, watched = [], [], []
    for s in range(STEPS):
        x, y = base.batch(4, torch.Generator().manual_seed(1000 * s + 10 * rank))
        probes.clear()
        peak.clear()
        with comm.Ledger(on_record=partial(_sample, alive, peak)) as ledger:
            ledgers.append(ledger)
            loss = base.loss(model(x), y)
            loss.backward()
            grad_bytes = alive.held()[1]
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
        full_bytes=sum(alive.full(u) for u in units), lost_after_step=alive.lost(),
        grad_bytes=grad_bytes, peak=dict(peak),  # the last step's
        probes=list(probes), watched=watched, **seen)  # probes: the last step's, block by block


class Alive:
    """The bytes of full parameters this rank really holds: every storage a unit's modules
    computed with, whatever still names it.

    A name is not the bytes. ``unit.full = None`` drops one reference, but the views the unit
    handed its modules, and the ones autograd saved of them for backward, still hold the
    storage, and with it every byte. So we look at storages, not names: each one that a unit's
    modules (or ``unit.full``) ever used is remembered by a weak reference, which keeps nothing
    alive, and counts for as long as something else keeps it, with the bytes it has now (0
    once resized to 0)."""

    def __init__(self, units):
        self.units, self.seen = units, {u.name: {} for u in units}  # {name: {key: weak ref}}

    def note(self) -> None:
        """Remember the storages each unit's modules and its ``full`` use now."""
        for u in self.units:
            refs = self.seen[u.name]
            for t in [getattr(m, a, None) for m, a, _ in u.uses] + [getattr(u, "full", None)]:
                if isinstance(t, torch.Tensor):
                    key = t.untyped_storage()._cdata
                    if key not in refs or refs[key].expired():  # (a new storage, an old address)
                        refs[key] = StorageWeakRef(t.untyped_storage())

    def storages(self, unit) -> dict[int, int]:
        """{storage: bytes it has now} of the unit's full parameters alive (in DDP, the shard)."""
        self.note()
        refs = self.seen[unit.name]
        for key in [k for k, r in refs.items() if r.expired()]:
            del refs[key]
        return {k: torch.UntypedStorage._new_with_weak_ptr(r.cdata).nbytes()
                for k, r in refs.items()}

    def full(self, unit) -> int:
        """Bytes of the unit's full parameters alive now (0: it holds only its shard)."""
        return sum(self.storages(unit).values())

    def lost(self) -> dict[str, int]:
        """{unit: bytes} of full parameters alive that ``unit.full`` does not name: storage
        that a dropped reference did not free."""
        out = {}
        for u in self.units:
            full = getattr(u, "full", None)
            named = full.untyped_storage()._cdata if isinstance(full, torch.Tensor) else None
            nbytes = sum(b for k, b in self.storages(u).items() if k != named)
            if nbytes:
                out[u.name] = nbytes
        return out

    def held(self, reading: int = 0) -> tuple[int, int]:
        """Bytes of parameters and of gradients this rank holds now, each storage counted once.

        ``reading``: the bytes of a full gradient that no unit keeps but autograd still holds
        (the input of a reduce-scatter about to start)."""
        params, grads = {}, {}

        def add(out, t) -> None:
            if isinstance(t, torch.Tensor):
                out[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()

        for u in self.units:
            params.update(self.storages(u))
            add(params, u.shard)
            add(grads, getattr(u, "full_grad", None))
            add(grads, u.shard.grad)
        return sum(params.values()), sum(grads.values()) + reading


def _sample(alive, peak, record) -> None:
    """As each collective is recorded, before it runs: the shards still have their bytes (a
    collective handed a freed one may crash the process), and in backward, the most bytes
    held yet."""
    for u in alive.units:
        if u.shard.untyped_storage().nbytes() < u.shard.numel() * u.shard.element_size():
            raise RuntimeError(f"{u.name}'s shard, the slice this rank owns and the optimizer "
                               f"steps, has {u.shard.untyped_storage().nbytes()} bytes left: "
                               f"something freed a buffer this rank must keep")
    if record.phase != "backward":
        return
    unit = next((u for u in alive.units if u.name == record.unit), None)
    kept = unit is not None and getattr(unit, "full_grad", None) is not None
    reading = record.buffer_bytes if record.op == "reduce_scatter" and not kept else 0
    params, grads = alive.held(reading)
    peak["params"] = max(peak.get("params", 0), params)
    peak["grads"] = max(peak.get("grads", 0), grads)


def _probe(alive, k, ledgers, probes, module, args) -> None:
    """As block k starts its forward: how many units hold full parameters (bytes alive, not
    names), and for how many blocks after it an all-gather was already issued (a prefetch)."""
    held = sum(alive.full(u) > 0 for u in alive.units)
    later = {u.name for u in alive.units[k + 1 : -1]}  # units: the blocks in order, the root last
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
