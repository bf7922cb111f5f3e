"""A gradient scaler for sharded gradients (fp16 training), like FSDP2's ``ShardedGradScaler``."""

from __future__ import annotations

import torch

from zero import comm


class ShardedGradScaler(torch.amp.GradScaler):
    """An overflow shows on the rank whose shard holds it, and torch's plain GradScaler would
    skip the step there alone; this one agrees on ``found_inf`` across ranks (a maximum).

    Args:
        device, init_scale, growth_factor, backoff_factor, growth_interval, enabled: as
            ``torch.amp.GradScaler``.
        group: the process group the model is sharded over (default: the world).
    """

    def __init__(self, device: str = "cpu", init_scale: float = 2.0**16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True, group=None):
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval,
                         enabled=enabled)
        self.group = group

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        super().unscale_(optimizer)
        if not self._enabled:
            return
        for found_inf in self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
            comm.all_reduce(found_inf, op="max", group=self.group, unit="scaler", phase="step")
