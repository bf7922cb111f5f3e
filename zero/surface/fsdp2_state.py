"""What torch's own functions read of an FSDP2 module's state, answered from zero's units.

``register_fsdp_forward_method`` (the HF Trainer's ``generate``) and ``share_comm_ctx`` read it;
anything else (``FSDPMemTracker``'s reads) is refused by name (notes/15, "The FSDP2 internals
zero answers", says what each reads and what answers it).
"""

from __future__ import annotations

import sys

from zero.core import hooks, registry


class FSDPStateView:
    """``module._get_fsdp_state()`` for a module ``zero.fully_shard`` sharded."""

    def __init__(self, module):
        self._units = registry.units_on(module)

    @property
    def _comm_ctx(self):
        """The root's ``CommContext``: every collective of the model goes through it."""
        return self._units[0].root.context

    @_comm_ctx.setter
    def _comm_ctx(self, context) -> None:
        for unit in self._units:
            _share(unit, context)

    @property
    def _fsdp_param_groups(self) -> list:
        return [_ParamGroupView(u) for u in self._units]

    def _pre_forward(self, module, args, kwargs):
        frame = sys._getframe(1)  # torch's wrapper around the method: running until it returns
        for unit in self._units:
            args, kwargs = hooks.pre_forward_method(unit, module, args, kwargs, frame)
        return args, kwargs

    def _post_forward(self, module, args, output):
        frame = sys._getframe(1)
        for unit in self._units:
            output = hooks.post_forward_method(unit, module, args, output, frame)
        return output

    def __getattr__(self, name: str):
        raise NotImplementedError(
            f"FSDP2's state.{name}: a model sharded by zero.fully_shard has no FSDP2 state for "
            "torch's internals to read (FSDPMemTracker reads it): measure zero's memory with "
            "zerolab.trackers.ZeroMemTracker, and its collectives with zero.Ledger")


class _ParamGroupView:
    """One of ``_fsdp_param_groups``: a unit, whose ``comm_ctx`` is its root's context."""

    def __init__(self, unit):
        self._unit = unit

    @property
    def comm_ctx(self):
        return self._unit.root.context

    @comm_ctx.setter
    def comm_ctx(self, context) -> None:
        _share(self._unit, context)


def _share(unit, context) -> None:
    """``unit``'s root issues its collectives through ``context`` from now on."""
    if unit.root.context is not context:
        unit.root.share_context(context)
