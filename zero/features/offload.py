"""CPU offload (ZeRO-Offload, FSDP2's ``CPUOffloadPolicy``): the shards live on the host.

ZeRO-3 leaves each rank 16Ψ/N bytes of model states; ZeRO-Offload (Ren et al., "ZeRO-Offload:
Democratizing Billion-Scale Model Training", USENIX ATC 2021) moves the largest part of them,
the fp32 master shards, their gradients and the optimizer state, to the host, and runs the
optimizer step there. What stays on the accelerator is what computes: a unit's gathered
parameters and its gradient while it is being formed. Per step and unit, the shard crosses
to the device for each all-gather (host -> device, its master dtype, as FSDP2 copies it), and
the reduced gradient shard comes back (device -> host, the reduce dtype)::

    host:    sharded (fp32) ---h2d---> device: slot of the full buffer -> all-gather -> compute
    host:    reduced shard <---d2h--- device: full gradient -> reduce-scatter (in place)
    host:    opt.step() on the host shards and their state

The mechanism asks this policy (the ``OffloadPolicy`` of ``zero/api.py``) where the shard is
allocated and how a tensor crosses (``zero/core/unit.py``, ``zero/core/grads.py``: each
crossing a ledger record, ``h2d`` or ``d2h``, with its bytes and no bytes sent over the
network); the optimizer's step hook asks it for its part of the step (``before_step``: none
here, disk offload's is all of it) and a checkpoint for the state in memory (``resident``).
No offload is a policy too, ``OnDevice``, so the mechanism never asks whether there is one.
On a machine without an accelerator host and device are the same memory: the copies still
happen and are counted, and training is bitwise the same as without offload
(tests/features/test_offload.py).
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
    """A policy under which the optimizer steps as usual, its state always in memory
    (``OnDevice``; ``CPUOffload``, on the host shards). Disk offload steps the units itself
    (``zero/features/disk_offload.py``)."""

    def before_step(self, optimizer, units: list, args: tuple, kwargs: dict):
        """This policy's part of ``opt.step()`` over ``units``: none."""
        return None

    def after_step(self, optimizer, units: list) -> None:
        """This policy's part after ``opt.step()``: none."""
        return None

    def resident(self, optimizer, units: list):
        """The optimizer state of ``units`` in memory for a checkpoint: it always is."""
        return contextlib.nullcontext()


@dataclass(frozen=True)
class OnDevice(_StepsAsUsual):
    """No offload (the default): the shards, their gradients and the optimizer state live on
    the compute device, and nothing crosses to the host."""

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
        """A reduced gradient shard where the optimizer steps: the view itself if ``keep``
        (stage 1 keeps the full gradient anyway), else a copy (which frees the full one)."""
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
        """Raise if this policy cannot serve units of ``layout`` (a ``zero.surface.policies`` layout)."""

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
    """``OnDevice()`` for None and for torch's ``OffloadPolicy`` (no offload), ``CPUOffload``
    for torch's ``CPUOffloadPolicy``; anything else as it is: ``zero.shard`` then checks it
    against ``zero/api.py``'s ``OffloadPolicy``, whatever its class."""
    if policy is None or type(policy) is OffloadPolicy:
        return OnDevice()
    if isinstance(policy, CPUOffloadPolicy):
        return CPUOffload(pin_memory=policy.pin_memory)
    return policy
