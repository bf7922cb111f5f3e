"""The mechanism: a unit, its gradient, its hooks, the schedule and the root (see zero/__init__.py)."""
