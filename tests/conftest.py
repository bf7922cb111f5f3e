"""Shared test setup.

Ranks are forked from this process (tests/harness.py), so whatever is imported here is
imported once for the whole session instead of once per rank. DDP and FSDP2 import
``torch._dynamo`` lazily (about 1 s each time), hence the imports below.
"""

import os
import sys
import warnings

import torch
import torch._dynamo  # noqa: F401  (DDP's lazy import, paid once here)
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.optim  # noqa: F401  (ZeroRedundancyOptimizer: its functional optimizers, 0.4 s)
import torch.nn.parallel  # noqa: F401

sys.path.insert(0, os.path.dirname(__file__))

# Some tests run torch in this process (the notes' figure scripts) before others fork ranks
# from it. A forked child whose parent has started OpenMP worker threads hangs at its first
# parallel region (libgomp is not fork-safe), so this process computes on one thread; the
# ranks choose their own (zerolab/launch.py).
torch.set_num_threads(1)

# Check mode (zero/comm/agree.py): every collective is preceded by an agreement, so ranks that take
# different paths raise at once, naming what each was doing, instead of hanging the test.
os.environ.setdefault("ZERO_CHECK", "1")
os.environ.setdefault("ZERO_TIMEOUT", "30")  # tests import harness and compare directly

# The suite samples its larger matrices (every model x optimizer, every world size, both entry
# points) to stay within a few minutes on two cores; ZERO_FULL=1 runs every case, marked
# ``@pytest.mark.full`` or built from ``sample(full, every)``.
FULL = os.environ.get("ZERO_FULL") == "1"


def sample(cases: list, every: list | None = None) -> list:
    """``cases`` by default; with ZERO_FULL=1 also the rest of ``every`` (as full-marked params)."""
    import pytest

    rest = [c for c in (every or []) if c not in cases]
    return [*cases, *(pytest.param(*(c if isinstance(c, tuple) else (c,)), marks=pytest.mark.full)
                      for c in rest)]


def pytest_collection_modifyitems(config, items):
    if FULL:
        return
    import pytest

    skip = pytest.mark.skip(reason="in the full matrix: ZERO_FULL=1 pytest runs it")
    for item in items:
        if item.get_closest_marker("full"):
            item.add_marker(skip)


# DDP's C++ reducer warns on stderr when find_unused_parameters finds none; not our concern.
warnings.filterwarnings("ignore", message=".*find_unused_parameters.*")
