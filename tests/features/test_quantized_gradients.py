"""ZeRO++'s qgZ (zero/features/quantized_gradients.py): the gradient reduce-scatter as two 4-bit
all-to-all hops on a (nodes, ranks a node) mesh; four local ranks play two nodes of two.

Lossy by design: the test holds the bound (each element of the reduced shard within the sum
over ranks of its block's largest magnitude / 7, divided by N for the mean, plus fp32
rounding), the bytes on each link to the byte (1/2 byte an element and 4 a block's scale,
within the node and across), and that training follows the exact reduction closely.
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import zero
from compare import GPT, train_steps
from harness import run_ranks
from zero.features.quantized_gradients import QuantizedGradients, pack, unpack
from zerolab.models import GPTConfig

NODES, PER_NODE = 2, 2


def test_two_codes_a_byte_round_trip():
    q = torch.randint(-7, 8, (3, 64), dtype=torch.int8)
    packed = pack(q)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 32)
    assert torch.equal(unpack(packed), q)


def _reduce(rank, n, size, block, op, scale_by_rank):
    mesh = init_device_mesh("cpu", (NODES, PER_NODE))
    policy = QuantizedGradients(mesh, block=block)
    g = torch.Generator().manual_seed(rank)
    # Magnitudes that differ by rank and by block: the bound must hold for each block's own.
    grad = torch.randn(n * size, generator=g) * (1 + rank if scale_by_rank else 1)
    grad[: n * size // 3] *= 100
    every = [torch.empty_like(grad) for _ in range(n)]
    dist.all_gather(every, grad)  # (outside the ledger: the test's own)
    exact = torch.stack(every).double().sum(0)
    slot = slice(rank * size, (rank + 1) * size)
    with zero.Ledger() as ledger:
        policy.reduce_scatter(grad, slot, op=op, group=None, unit="u", phase="backward",
                              ctx=zero.comm.CommContext()).wait()
    got = grad[slot].double()
    want = exact[slot] / (n if op == "avg" else 1)
    # The bound: sum over ranks of the largest magnitude of the element's block (of B in the
    # shard), over 7; / N for the mean; fp32 rounding of the sums on top.
    nb = -(-size // block)
    mine = torch.zeros(n, nb * block, dtype=torch.float64)
    mine[:, :size] = torch.stack(every)[:, slot].double().abs()
    per_block = mine.view(n, nb, block).amax(2).sum(0)  # (nb,)
    bound = (per_block / 7).repeat_interleave(block)[:size] / (n if op == "avg" else 1)
    bound = bound * (1 + 1e-5)  # fp32 rounding of dequantized terms and their sums
    records = [(r.op, r.group, r.dtype, r.buffer_bytes, r.sent_bytes) for r in ledger.records
               if r.op != "agree"]  # (check mode agrees on each collective first)
    return (got - want).abs().max().item(), ((got - want).abs() <= bound).all().item(), records


@pytest.mark.parametrize("size,block,op", [(1024, 128, "avg"), (300, 128, "sum"), (64, 16, "avg")])
def test_the_reduced_shard_is_within_the_bound_and_bytes_are_the_formula(size, block, op):
    n, g = NODES * PER_NODE, PER_NODE
    for worst, within, records in run_ranks(_reduce, n, size, block, op, True):
        assert within, worst
        assert worst > 0  # lossy: it is quantizing
        nb = -(-size // block)
        shard = nb * block // 2 + 4 * nb  # bytes a shard: 1/2 byte an element, 4 a scale
        m = NODES  # one all-to-all a hop: within the node (g ranks), then across (m nodes)
        assert records == [
            ("all_to_all", "intra-node", torch.uint8, n * shard, (g - 1) * n * shard // g),
            ("all_to_all", "inter-node", torch.uint8, m * shard, (m - 1) * shard)]


def _train(rank, n, quantized, steps=3):
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    policy = QuantizedGradients(init_device_mesh("cpu", (NODES, PER_NODE))) if quantized else None
    for unit in model.units():
        zero.shard(unit, stage=3, comm_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return [loss.item() for loss in train_steps(model, opt, rank, steps)[0]]


def test_quantized_gradients_train_within_two_percent_of_exact():
    n = NODES * PER_NODE
    plain, quantized = run_ranks(_train, n, False)[0], run_ranks(_train, n, True)[0]
    assert quantized != plain  # lossy: it is quantizing
    assert all(abs(a - b) / abs(a) < 2e-2 for a, b in zip(plain, quantized)), (plain, quantized)


def _wrong_mesh(rank, n):
    mesh = init_device_mesh("cpu", (NODES, PER_NODE))
    model = GPT(GPTConfig())
    # HSDP: sharded within the node only, but the policy's mesh spans the world.
    zero.shard(model, stage=3, mesh=mesh, comm_policy=QuantizedGradients(mesh))
    x, y = model.batch(4, torch.Generator().manual_seed(rank))
    try:
        model.loss(model(x), y).backward()
    except ValueError as e:
        return str(e)
    return "reduced"


def test_a_mesh_that_is_not_the_shard_group_is_refused():
    for message in run_ranks(_wrong_mesh, NODES * PER_NODE):
        assert "must hold the ranks the unit is sharded over" in message


def _non_finite(rank, n, bad, policy_kind):
    mesh = init_device_mesh("cpu", (NODES, PER_NODE))
    size = 256
    grad = torch.full((n * size,), 2.0 / n)
    if rank == 1:
        grad[3] = bad  # in shard 0, rank 0's
    slot = slice(rank * size, (rank + 1) * size)
    QuantizedGradients(mesh).reduce_scatter(grad, slot, op="sum", group=None, unit="u",
                                            phase="backward", ctx=zero.comm.CommContext()).wait()
    return torch.isfinite(grad[slot]).all().item()


@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_a_non_finite_gradient_stays_non_finite(bad):
    """A loss scaler finds overflow by a non-finite gradient; quantized, inf had become 1."""
    finite = run_ranks(_non_finite, NODES * PER_NODE, bad, "qgz")
    assert finite == [False, True, True, True]  # shard 0 (rank 0's) holds it; no other does


def _outside(rank, n, ranks):
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh("cpu", ranks)
    try:
        QuantizedGradients(mesh)
        said = "accepted"
    except ValueError as e:
        said = str(e)
    torch.distributed.barrier()  # (no rank leaves while another still connects the mesh's groups)
    return said


def test_a_mesh_out_of_rank_order_is_refused_on_every_rank():
    for message in run_ranks(_outside, NODES * PER_NODE, [[0, 1], [3, 2]]):
        assert "in rank order" in message, message


def test_a_rank_outside_the_mesh_is_told_so():
    messages = run_ranks(_outside, NODES * PER_NODE, [[0], [1]])
    assert messages[:2] == ["accepted", "accepted"]
    assert all("is not in QuantizedGradients' mesh" in m for m in messages[2:]), messages
