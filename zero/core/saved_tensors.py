"""The guard: backward never reads the memory of a unit's freed parameters.

A saved-tensor hook notes each tensor saved from a stage-3 unit's storage; unpacking one while
the unit is freed raises (notes/12-model-code.md, "The guard").
"""

from __future__ import annotations

import torch
from torch._C._autograd import (  # type: ignore[attr-defined]
    _pop_saved_tensors_default_hooks, _push_saved_tensors_default_hooks,
    _saved_tensors_hooks_is_enabled, _top_saved_tensors_default_hooks)

from zero.core import guards


def storage_key(t: torch.Tensor) -> int:
    """Identifies a tensor's storage; it survives ``resize_`` (free and re-gather)."""
    return t.untyped_storage()._cdata


class _Saved:
    """A tensor autograd saved from a freeable unit's storage, with its unit."""

    __slots__ = ("tensor", "unit")

    def __init__(self, tensor: torch.Tensor, unit):
        self.tensor, self.unit = tensor, unit


class Guard:
    """One per root: active from the first guarded unit's pre-forward to its post-forward."""

    def __init__(self, units: list):
        self._units = {u.storage_key(): u for u in units}
        self._depth = 0  # guarded units currently inside their forward
        self._pushed = False

    def enter(self) -> None:
        self._depth += 1
        if self._depth == 1 and _saved_tensors_hooks_is_enabled():
            if _top_saved_tensors_default_hooks(False) is None:  # no model hooks to respect
                _push_saved_tensors_default_hooks(self._pack, self._unpack)
                self._pushed = True

    def exit(self) -> None:
        self._depth = max(self._depth - 1, 0)
        if self._depth == 0:
            self.reset()

    def reset(self) -> None:
        """Take the hooks off (also after a forward that raised and never reached exit)."""
        top = _top_saved_tensors_default_hooks(False)
        if self._pushed and top is not None and top[0] == self._pack:
            _pop_saved_tensors_default_hooks()
        self._pushed, self._depth = False, 0

    def _pack(self, t: torch.Tensor):
        unit = self._units.get(storage_key(t)) if t.layout == torch.strided else None
        return t if unit is None else _Saved(t, unit)

    def _unpack(self, saved):
        if isinstance(saved, _Saved):
            guards.freed_in_backward(saved.unit)
            return saved.tensor
        return saved
