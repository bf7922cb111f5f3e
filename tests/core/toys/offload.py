"""An offload policy written from zero/api.py alone: the optimizer state on the host, the
parameters and gradients on the device.

Between steps each of the units' optimizer state tensors lives on ``host``; for the step it
is brought to the parameter's device and taken back after (what ZeRO-Offload does with the
whole step, here only with the state). On a CPU-only machine host and device are the same
memory, but the copies still happen: ``held`` records what the policy keeps between steps.
"""

import contextlib

import torch


class HostOptimizerState:
    """``zero/api.py``'s ``OffloadPolicy``."""

    on_device = True  # the shards stay on the compute device (inside the full buffer, 1/2)

    def __init__(self, host: str = "cpu"):
        self.host = torch.device(host)
        self.held: dict = {}  # id(param) -> {key: the host tensor kept between steps}

    def home(self, compute):
        return compute

    def pinned(self, compute):
        return False

    def check(self, layout):
        pass  # every layout

    def to_device(self, shard, device, unit, phase):
        return shard

    def to_host(self, shard, unit, keep=False):
        return shard if keep else shard.clone()  # the gradient stays where the step runs

    def _states(self, optimizer, units):
        for p in (p for u in units for p in u.params):
            yield p, optimizer.state.get(p, {})

    def before_step(self, optimizer, units, args, kwargs):
        for p, state in self._states(optimizer, units):
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim():
                    state[key] = value.to(p.device, copy=True)
        return None  # the optimizer steps as usual

    def after_step(self, optimizer, units):
        for p, state in self._states(optimizer, units):
            kept = self.held[id(p)] = {}
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim():
                    state[key] = kept[key] = value.to(self.host, copy=True)

    def resident(self, optimizer, units):
        return contextlib.nullcontext()  # the state is in memory, on the host
