"""FSDP2's gradient-clipping (test_fully_shard_clip_grad_norm_.py) and gradient-scaler
(test_fully_shard_grad_scaler.py) scenarios, ported.

FSDP2 clips with ``torch.nn.utils.clip_grad_norm_`` on DTensor gradients; ours is
``zero.clip_grad_norm_`` (torch's function would see only this rank's pieces). The 1- and
2-norms are sums whose order differs between systems, so, as in torch's test, the norms and the
clipped gradients agree within fp32 tolerance; the inf-norm is a maximum and agrees bitwise
(notes/07-equality.md).
"""

import torch
from torch.amp.grad_scaler import GradScaler, OptState
from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

import zero
from fsdp2_port import ALL, ZERO, Trainer, average_grads, data, mismatches
from harness import run_ranks

INF = float("inf")


def blocks_then_root(model):
    return [*model.layers, model]


def clip(t, max_norm, norm_type):
    if t.kind in ZERO:
        return zero.clip_grad_norm_(t.model, max_norm, norm_type)
    norm = torch.nn.utils.clip_grad_norm_(t.model.parameters(), max_norm, norm_type, foreach=True)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def vector_norm(g, norm_type):
    return torch.linalg.vector_norm(g, norm_type).item()


def _clip(rank, n):
    out = []
    for norm_type in (2.0, 1.0, INF):
        torch.manual_seed(42)
        base = Transformer(ModelArgs(dropout_p=0.0))
        trainers = [Trainer(k, base, blocks_then_root) for k in ("replicate", "fsdp2", *ZERO)]
        inp = data(rank, 0, 3, 16, vocab=8)
        exact = norm_type == INF
        # one clipped step (torch repeats the same check for 10 iterations)
        for t in trainers:
            t.backward(t.model(inp).sum())
        before = {t.kind: t.full_grads() for t in trainers}
        # not vacuous: every gradient is larger than max_norm before clipping
        out += [f"{norm_type}: {k} small" for k, g in before["replicate"].items()
                if vector_norm(g, norm_type) <= 1.0]
        norms = {}
        for t in trainers:
            with zero.Ledger() as ledger:
                norms[t.kind] = clip(t, 1.0, norm_type)
            issued = [r.op for r in ledger.records if r.op != "agree"]
            if t.kind in ZERO and issued != ["all_reduce"]:
                out.append(f"{norm_type}: {t.kind} issued {ledger.records}")
        for kind, norm in norms.items():
            for other in ("replicate", "fsdp2"):
                same = torch.equal(norm, norms[other]) if exact else \
                    torch.allclose(norm, norms[other], rtol=1.3e-6, atol=1e-5)
                if not same:
                    out.append(f"{norm_type}: {kind} norm {norm.item()} vs {other} "
                               f"{norms[other].item()}")
        after = trainers[-1].full_grads()  # clipped: each gradient at most max_norm, changed
        out += [f"{norm_type}: {k} not clipped" for k, g in after.items()
                if vector_norm(g, norm_type) > 1.0 + 1e-5 or torch.equal(g, before["zero3"][k])]
        out += [f"{norm_type}: {line}"
                for line in mismatches(trainers, "clipped", grads=True, exact=exact)]
        for t in trainers:
            t.opt.step()
        out += [f"{norm_type}: {line}" for line in mismatches(trainers, "end", exact=exact)]
    return out


def test_clip_grad_norm():
    # Ports TestClipGradNormWorldSize2.test_clip_grad_norm_1d (norm types 2, 1, inf): the total
    # norm, one all-reduce (FSDP2: one per mesh dimension), every gradient clipped.
    assert run_ranks(_clip, 2) == [[], []]


def _grad_scaler(rank, n, has_inf):
    torch.manual_seed(0)
    base = torch.nn.Sequential(*[torch.nn.Linear(4, 4, bias=False) for _ in range(2)])
    # with an inf there is no reference to compare with: torch's test checks the scaler alone
    kinds = ("fsdp2", *ZERO) if has_inf else ALL
    trainers = [Trainer(k, base, lambda m: [*m, m]) for k in kinds]
    out = []
    for t in trainers:
        scaler = (zero.ShardedGradScaler if t.kind in ZERO else GradScaler)("cpu", init_scale=2.0)
        scaler.scale(t.model(data(rank, 0, 4, 4)).sum()).backward()
        if t.kind == "ref":
            average_grads(t.model)
        first = t.opt.param_groups[0]["params"][0]
        grad = first.grad.to_local() if hasattr(first.grad, "to_local") else first.grad
        if has_inf and rank == 1:
            grad.view(-1)[0] = INF  # on one rank only: the ranks must agree to skip
        scaled, params = grad.clone(), [p.detach().clone() for p in t.model.parameters()]
        scaler.unscale_(t.opt)
        state = scaler._per_optimizer_states[id(t.opt)]
        found = [bool(v.item()) for v in state["found_inf_per_device"].values()]
        if found != [has_inf]:
            out.append(f"{t.kind}: found_inf {found}")
        if state["stage"] != OptState.UNSCALED:
            out.append(f"{t.kind}: not unscaled")
        if not torch.equal(grad, scaled * 0.5):
            out.append(f"{t.kind}: unscaled gradient is not the scaled one times 1/scale")
        scaler.step(t.opt)
        scaler.update()
        if scaler.get_scale() != (1.0 if has_inf else 2.0):  # backed off, or kept
            out.append(f"{t.kind}: scale {scaler.get_scale()}")
        moved = [not torch.equal(a, p) for a, p in zip(params, t.model.parameters())]
        if any(moved) == has_inf:
            out.append(f"{t.kind}: {'stepped despite the inf' if has_inf else 'did not step'}")
    return out + ([] if has_inf else mismatches(trainers, "after the scaled step"))


def test_gradient_scaler():
    # Ports TestFullyShardGradientScaler.test_gradient_scaler (1-D; has_inf False and True).
    # Ours need zero.ShardedGradScaler, which agrees on found_inf across ranks (FSDP2's DTensor
    # gradients do it inside torch's GradScaler): with an inf on one rank, every rank skips.
    assert run_ranks(_grad_scaler, 2, False) == [[], []]
    assert run_ranks(_grad_scaler, 2, True) == [[], []]
