"""One original parameter of a unit: where the module uses it, and the piece that replaces it.

FSDP2's ``FSDPParam``. ``use`` swaps the module between ``sharded`` (the piece the optimizer
steps) and views into the gathered buffer; a ``form`` (``zero/core/placement.py``,
``zero/features/all_gather_extension.py``) may compute with something else (``unsharded``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from zero import api


class AsIs:
    """The form of a plain parameter: the module computes with its view into the full buffer."""

    sends = False  # (the unit sends its rows, as every plain parameter's)

    def unsharded(self, view: torch.Tensor) -> torch.Tensor:
        return view

    def free(self) -> None:
        """Nothing besides the unit's full buffer to free when it reshards."""


AS_IS = AsIs()


class Strided:
    """A non-contiguous parameter's form (``nn.Parameter(w.t())``): a copy in its own strides,
    as some kernels round by strides (DDP's bits), kept as long as the iteration's views."""

    sends = False

    def __init__(self, stride: tuple[int, ...]):
        self.stride = stride

    def unsharded(self, view: torch.Tensor) -> torch.Tensor:
        out = torch.empty_strided(view.shape, self.stride, dtype=view.dtype, device=view.device)
        return out.copy_(view)

    def free(self) -> None:
        """The copy goes with the iteration's views (autograd may still hold it)."""


class ShardedParam:
    """The unit's parameter ``index`` (``unit.params[index]``), of full ``shape``, used at
    ``locations`` (module, attribute name); ``sharded``: this rank's piece (an ``nn.Parameter``
    the unit made); ``stride``: the original's strides where not contiguous (``Strided`` form)."""

    def __init__(self, index: int, shape: torch.Size, locations: list, sharded: nn.Parameter,
                 offset: int = 0, stride: tuple[int, ...] | None = None):
        self.index, self.shape, self.locations = index, shape, locations
        self.sharded = sharded
        self._offset = offset  # where this rank's piece starts in the flattened parameter
        self.form: api.ParamForm = AS_IS if stride is None else Strided(stride)

    def unsharded(self, view: torch.Tensor) -> torch.Tensor:
        """What the module computes with (FSDP2's unsharded parameter): the view, or its form's."""
        return self.form.unsharded(view)

    def free_unsharded(self) -> None:
        """The unit reshards: whatever the form holds besides the full buffer goes too."""
        self.form.free()

    def use(self, tensor: torch.Tensor) -> None:
        """Put ``tensor`` wherever the module uses the parameter."""
        for mod, attr in self.locations:
            mod._parameters[attr] = tensor

    def use_sharded(self) -> None:
        self.use(self.sharded)

    def take_slots(self, other: "ShardedParam", slots: list) -> None:
        """``slots`` of ``other`` hold this parameter now (a tie made after sharding)."""
        other.locations = [loc for loc in other.locations if loc not in slots]
        self.locations = self.locations + [loc for loc in slots if loc not in self.locations]

    def adopt(self, new: torch.Tensor, piece: torch.Tensor, exposed: torch.Tensor,
              unit: str) -> nn.Parameter:
        """Take ``new``'s values into ``piece``; return it as the sharded parameter."""
        local = new.to_local() if isinstance(new, DTensor) else new
        # (a DTensor's full shape; the unit's own is its local one under tensor parallel)
        shape = exposed.shape if isinstance(exposed, DTensor) else self.shape
        if (new.shape != shape or new.dtype != piece.dtype or local.is_meta
                or local.device != piece.device):
            raise RuntimeError(
                f"a parameter of unit {unit} was replaced after zero.shard by a tensor of shape "
                f"{tuple(new.shape)}, {new.dtype} on {local.device}; the unit shards "
                f"{tuple(shape)}, {piece.dtype} on {piece.device}. Load values of the "
                "parameter's own shape, dtype and device (load_state_dict(sd, assign=True) "
                "with the model's own DTensors, or copy_ into the parameters), or convert the "
                "model before zero.shard")
        mine = isinstance(exposed, DTensor)
        if isinstance(new, DTensor) != mine or (isinstance(new, DTensor) and isinstance(
                exposed, DTensor) and (new.placements != exposed.placements
                                       or new.device_mesh != exposed.device_mesh)):
            raise RuntimeError(
                f"a parameter of unit {unit} was replaced after zero.shard by "
                f"{'a DTensor' if isinstance(new, DTensor) else 'a plain tensor'} "
                f"{getattr(new, 'placements', '')}, but the unit shows its parameters as "
                f"{'DTensors ' + str(getattr(exposed, 'placements', '')) if mine else 'plain pieces'}: load "
                "the model's own kind (its state_dict()'s)")
        with torch.no_grad():
            source = local.reshape(-1) if mine else new.detach().reshape(-1)
            if mine:  # this rank's rows are the whole local tensor
                piece.copy_(source[: piece.numel()])
            else:  # the full parameter: our piece of it
                start = piece.numel() and self._offset
                piece.copy_(source[start : start + piece.numel()])
        if not isinstance(new, nn.Parameter):
            new = nn.Parameter(new, requires_grad=self.sharded.requires_grad)
        if isinstance(exposed, DTensor):  # (FSDP2 re-points its local tensor the same way)
            setattr(new, "_local_tensor", exposed.to_local())
        else:
            new.data = exposed
        self.sharded = new
        return new

    def accumulate_grad(self, grad: torch.Tensor | None) -> None:
        """Add this rank's piece to ``sharded.grad``, then run its post-accumulate-grad hooks as
        FSDP2 does (autograd never reaches ``sharded``; torchtune's ``optimizer_in_bwd``), with
        ``grad`` None too (layout "whole", not the owner): on every rank, as ``opt.step()``."""
        p = self.sharded
        if grad is not None:
            p.grad = grad if p.grad is None else p.grad.add_(grad)
        for hook in (getattr(p, "_post_accumulate_grad_hooks", None) or {}).values():
            hook(p)
