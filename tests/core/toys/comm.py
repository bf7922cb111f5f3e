"""A comm policy written from zero/api.py alone: stages 1 and 2 with one all-reduce per unit.

The naive ZeRO-1 (DeepSpeed's first one, and DDP's reduction): every rank all-reduces the
whole flat gradient and keeps its own slot of the mean, instead of a reduce-scatter that sends
each rank only its slot. It sends twice the gradient bytes of a reduce-scatter, and at world
size 2 it is bitwise DDP: the mean of two floats does not depend on the collective.
"""


class AllReduceComm:
    """``zero/api.py``'s ``CommPolicy``: gather as usual, reduce by one all-reduce."""

    in_place_ok = True  # the shard may be this rank's slot of the full buffer (stages 1/2)

    def all_gather(self, full, shard, slot, *, in_place, group, unit, phase, ctx):
        if not in_place:
            full[slot].copy_(shard)
        # (N*S,) <- (S,) per rank, our slot of the output is the input
        return ctx.all_gather(full, full[slot], group=group, unit=unit, phase=phase,
                              async_op=True)

    def reduce_scatter(self, grad, slot, *, op, group, unit, phase, ctx):
        # (N*S,) -> (N*S,), the mean on every rank: our slot of it is what a reduce-scatter
        # would have left there
        return ctx.all_reduce(grad, op=op, group=group, unit=unit, phase=phase, async_op=True)

    def all_reduce(self, tensor, *, op, group, unit, phase, ctx):
        ctx.all_reduce(tensor, op=op, group=group, unit=unit, phase=phase)
