"""A backend written from zero/api.py alone: torch.distributed, counting what it moves.

Each collective is torch.distributed's own; ``counts`` says how many of each op went through
this object, so a test can see that every collective of a model does.
"""

import collections

import torch
import torch.distributed as dist

_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX}


class CountingBackend:
    """``zero/api.py``'s ``Backend``."""

    def __init__(self):
        self.counts: collections.Counter = collections.Counter()

    def __repr__(self):
        return "CountingBackend()"  # (the same on every rank)

    def rank(self, group=None):
        return dist.get_rank(group)

    def world_size(self, group=None):
        return dist.get_world_size(group)

    def name(self, group=None):
        return dist.get_backend(group)

    def world(self):
        return dist.group.WORLD

    def global_rank(self, group, group_rank):
        return dist.get_global_rank(group, group_rank) if group is not None else group_rank

    def default_device(self, group=None):
        return torch.device("cpu")  # (gloo)

    def bounded_wait(self, group, op):
        return "thread"  # a helper thread waits, with ZERO_TIMEOUT: right for any op

    def all_gather(self, output, input, group, async_op):
        self.counts["all_gather"] += 1
        return dist.all_gather_into_tensor(output, input, group=group, async_op=async_op)

    def reduce_scatter(self, output, input, op, group, async_op):
        self.counts["reduce_scatter"] += 1
        return dist.reduce_scatter_tensor(output, input, op=_OPS[op], group=group,
                                          async_op=async_op)

    def all_to_all(self, output, input, group, async_op):
        self.counts["all_to_all"] += 1
        return dist.all_to_all_single(output, input, group=group, async_op=async_op)

    def all_reduce(self, tensor, op, group, async_op):
        self.counts["all_reduce"] += 1
        return dist.all_reduce(tensor, op=_OPS[op], group=group, async_op=async_op)

    def broadcast(self, tensor, src, group, async_op):
        self.counts["broadcast"] += 1
        return dist.broadcast(tensor, src=self.global_rank(group, src), group=group,
                              async_op=async_op)
