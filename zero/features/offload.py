"""CPU offload (ZeRO-Offload, FSDP2's ``CPUOffloadPolicy``): the shards live on the host.

ZeRO-Offload (Ren et al., USENIX ATC 2021) moves the fp32 master shards, their gradients and
the optimizer state to the host, and steps there; the device keeps what computes::

    host:    sharded (fp32) ---h2d---> device: slot of the full buffer -> all-gather -> compute
    host:    reduced shard <---d2h--- device: full gradient -> reduce-scatter (in place)
    host:    opt.step() on the host shards and their state

The mechanism asks the policy (``zero/api.py``'s ``OffloadPolicy``) where the shard lives and
how a tensor crosses; no offload is a policy too, ``OnDevice``. notes/17-family.md, "CPU offload".
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

from zero import api
from zero.comm import ledger


class _StepsAsUsual:
    """A policy under which the optimizer steps as usual, its state always in memory."""

    def before_step(self, optimizer, units: list, args: tuple, kwargs: dict):
        """This policy's part of ``opt.step()`` over ``units``: none."""

    def after_step(self, optimizer, units: list) -> None:
        """This policy's part after ``opt.step()``: none."""

    def resident(self, optimizer, units: list):
        """The optimizer state of ``units`` in memory for a checkpoint: it always is."""
        return contextlib.nullcontext()


@dataclass(frozen=True)
class OnDevice(_StepsAsUsual):
    """No offload (the default): everything on the compute device, nothing crosses."""

    on_device: ClassVar[bool] = True  # the shard may live inside the full buffer (stages 1/2)

    def home(self, compute: torch.device) -> torch.device:
        return compute

    def check(self, layout: type[api.Layout]) -> None:
        """Every layout is served."""

    def pinned(self, compute: torch.device) -> bool:
        return False

    def to_device(self, shard: torch.Tensor, device: torch.device, unit: str, phase: str):
        return shard  # (it is there)

    def to_host(self, shard: torch.Tensor, unit: str, keep: bool = False) -> torch.Tensor:
        """A reduced gradient shard: the view if ``keep`` (stage 1), else a copy."""
        return shard if keep else shard.clone()


@dataclass(frozen=True)
class CPUOffload(_StepsAsUsual):
    """Args:
    pin_memory: allocate the host shards in pinned memory when the compute device is an
        accelerator (faster, asynchronous copies), as FSDP2's ``CPUOffloadPolicy`` does.
    """

    pin_memory: bool = True
    on_device: ClassVar[bool] = False  # the shard lives on the host, apart from the buffer

    def home(self, compute: torch.device) -> torch.device:
        """Where the shards live."""
        return torch.device("cpu")

    def check(self, layout: type[api.Layout]) -> None:
        """Raise if this policy cannot serve units of ``layout``."""

    def pinned(self, compute: torch.device) -> bool:
        return self.pin_memory and compute.type != "cpu"

    def to_device(self, shard: torch.Tensor, device: torch.device, unit: str, phase: str):
        """The shard, on the compute device, for an all-gather (host -> device)."""
        ledger.record_copy("h2d", shard, unit, phase)
        return shard.to(device, non_blocking=shard.is_pinned())

    def to_host(self, shard: torch.Tensor, unit: str, keep: bool = False) -> torch.Tensor:
        """A reduced gradient shard, copied to the host (device -> host), kept or not."""
        ledger.record_copy("d2h", shard, unit, "backward")
        host = torch.empty(shard.shape, dtype=shard.dtype, device="cpu",
                           pin_memory=self.pinned(shard.device))
        return host.copy_(shard)


def offload_from_torch(policy):
    """zero's policy for torch's (None: ``OnDevice()``); anything else as it is (checked later)."""
    if policy is None or type(policy) is OffloadPolicy:
        return OnDevice()
    if isinstance(policy, CPUOffloadPolicy):
        return CPUOffload(pin_memory=policy.pin_memory)
    return policy
