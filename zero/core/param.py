"""One original parameter of a unit: where the module uses it, and the piece that replaces it.

FSDP2 calls this ``FSDPParam``. A unit (``zero/core/unit.py``) holds one per parameter it
shards; each knows

- which of the unit's parameters it is (``index``: its place in the layout) and its shape;
- every (module, attribute) that uses it (a tied weight has several);
- its sharded form: ``sharded``, an ``nn.Parameter`` of this rank's piece of the unit's shard,
  shown as the layout shows it (1-D for ``flat``, a ``Shard(0)`` DTensor for ``rows``, the
  whole shape on its owner for ``whole``). It keeps the original's name in the module, and
  is what the optimizer steps.

Putting a tensor in the module's slots (``use``) is how a unit switches its module between
the sharded parameters (between iterations) and views into the gathered buffer (while it
computes). What the module computes with is the view itself, unless the parameter brings a
``form`` of its own (``unsharded``): a DTensor on its tensor-parallel mesh
(``zero/core/placement.py``), or what its tensor subclass builds from the all-gather
(``zero/features/all_gather_extension.py``). ``accumulate_grad`` is where the parameter's
reduced gradient arrives.
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
    """The form of a parameter that is not contiguous (a transposed ``nn.Parameter(w.t())``):
    the module computes with a copy in the parameter's own strides, its gradient going to the
    view. A view into the flat buffer is contiguous, and some kernels pick their path (and
    round) by strides, so this is what keeps such a model bit for bit DDP's. The copy is made
    with the iteration's views and lives as long as they do (one parameter's bytes, kept
    through stage 3's reshard: the values backward reads are the ones forward read)."""

    sends = False

    def __init__(self, stride: tuple[int, ...]):
        self.stride = stride

    def unsharded(self, view: torch.Tensor) -> torch.Tensor:
        out = torch.empty_strided(view.shape, self.stride, dtype=view.dtype, device=view.device)
        return out.copy_(view)

    def free(self) -> None:
        """The copy goes with the iteration's views (autograd may still hold it)."""


class ShardedParam:
    """Args:
    index: the parameter's place among its unit's (``unit.params[index]``).
    shape: its full shape.
    locations: every (module, attribute name) that uses it.
    sharded: this rank's piece of it, as an ``nn.Parameter`` (made by the unit).
    stride: the original's strides where it was not contiguous (its ``Strided`` form).
    """

    def __init__(self, index: int, shape: torch.Size, locations: list, sharded: nn.Parameter,
                 offset: int = 0, stride: tuple[int, ...] | None = None):
        self.index, self.shape, self.locations = index, shape, locations
        self.sharded = sharded
        self._offset = offset  # where this rank's piece starts in the flattened parameter
        # what the module computes with, made of its view (``unsharded``)
        self.form: api.ParamForm = AS_IS if stride is None else Strided(stride)

    def unsharded(self, view: torch.Tensor) -> torch.Tensor:
        """What the module computes with, given this parameter's view into the unit's full
        buffer (FSDP2's unsharded parameter): the view, or the parameter's own form of it."""
        return self.form.unsharded(view)

    def free_unsharded(self) -> None:
        """The unit reshards: whatever the form holds besides the full buffer goes too."""
        self.form.free()

    def use(self, tensor: torch.Tensor) -> None:
        """Put ``tensor`` wherever the module uses the parameter (a plain tensor: a view into
        the gathered buffer, through which autograd reaches the unit's flat leaf)."""
        for mod, attr in self.locations:
            mod._parameters[attr] = tensor

    def use_sharded(self) -> None:
        self.use(self.sharded)

    def take_slots(self, other: "ShardedParam", slots: list) -> None:
        """``slots`` of ``other`` now hold this parameter (a tie made after sharding): they
        become this parameter's, as a tie made before sharding is one parameter in several
        places (``zero/core/adoption.py``). ``other`` keeps the rest of its slots, if any;
        with none left, its piece of the shard is unused."""
        other.locations = [loc for loc in other.locations if loc not in slots]
        self.locations = self.locations + [loc for loc in slots if loc not in self.locations]

    def adopt(self, new: torch.Tensor, piece: torch.Tensor, exposed: torch.Tensor,
              unit: str) -> nn.Parameter:
        """``new`` replaced this parameter in the module: take its values into ``piece`` (this
        rank's part of the unit's shard) and make it the sharded parameter, its data the piece
        as the layout shows it (``exposed``). Returns the sharded parameter."""
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
        """This rank's piece of the reduced gradient: into ``sharded.grad`` (added to what is
        there), then the parameter's post-accumulate-grad hooks, with the sharded parameter,
        as FSDP2 runs them after its reduce-scatter. Autograd never reaches ``sharded`` (the
        module computes with views of the unit's flat buffer), so it never runs them itself;
        an optimizer stepped in such a hook (torchtune's ``optimizer_in_bwd``) would
        otherwise train nothing. ``grad`` None: this rank holds none of the parameter (layout
        "whole"); the hooks run all the same, on every rank, with ``.grad`` as it is (None
        unless set before), as ``opt.step()`` runs on every rank: a step in the hook then
        marks the unit stepped on every rank, and the next forward agrees."""
        p = self.sharded
        if grad is None:
            pass
        elif p.grad is None:
            p.grad = grad
        else:
            p.grad += grad
        for hook in (getattr(p, "_post_accumulate_grad_hooks", None) or {}).values():
            hook(p)
