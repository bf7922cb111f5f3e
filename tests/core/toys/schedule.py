"""A schedule written from zero/api.py alone: FSDP2's explicit prefetch lists.

FSDP2's ``set_modules_to_forward_prefetch(block, [later blocks])`` and
``set_modules_to_backward_prefetch(block, [earlier blocks])``, as one object: while a module's
unit computes its forward (its backward), the units of the modules listed for it are gathered.
"""


class ExplicitPrefetch:
    """``zero/api.py``'s ``Schedule``.

    Args:
        forward, backward: {module: [modules to gather while it computes]}.
    """

    def __init__(self, forward: dict, backward: dict):
        self.forward, self.backward = forward, backward

    def _units(self, modules, order):
        return [u for m in modules for u in order.units if m in u.modules]

    def forward_prefetch(self, unit, order):
        return self._units(self.forward.get(unit.modules[0], []), order)

    def backward_prefetch(self, unit, order):
        return self._units(self.backward.get(unit.modules[0], []), order)
