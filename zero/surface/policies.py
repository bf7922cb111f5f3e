"""The policies ``zero.shard`` takes by name: ``MixedPrecision`` and the layouts (``LAYOUTS``).

``MixedPrecision`` is FSDP2's ``MixedPrecisionPolicy``: cast to ``param_dtype`` before the
all-gather, to ``reduce_dtype`` before the reduce-scatter; the fp32 shard stays the master copy
(notes/18-edge-cases.md, "Mixed precision").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zero.api import Layout
from zero.core.flat import FlatLayout
from zero.core.rows import RowsLayout
from zero.core.whole import WholeLayout

# Who holds which element (notes/16-layouts.md): FSDP1's and DeepSpeed's, FSDP2's, whole ones.
LAYOUTS: dict[str, type[Layout]] = {"flat": FlatLayout, "rows": RowsLayout, "whole": WholeLayout}


def layout_class(layout: str | type) -> type[Layout]:
    """``LAYOUTS[name]``, or a layout class given as it is."""
    if isinstance(layout, str):
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {sorted(LAYOUTS)}, got {layout!r}")
        return LAYOUTS[layout]
    if isinstance(layout, type):  # (zero.shard checks it against zero/api.py's Layout)
        return layout
    raise TypeError(f"layout must be a name in {sorted(LAYOUTS)} or a layout class "
                    f"(zero/api.py's Layout), got {layout!r}")


@dataclass(frozen=True)
class MixedPrecision:
    """FSDP2's ``MixedPrecisionPolicy``, field for field (``from_torch`` converts one).

    Args:
        param_dtype: dtype of the gathered parameters and of the computation (None: as stored).
        reduce_dtype: dtype of the gradient reduce-scatter (None: ``param_dtype``).
        output_dtype: dtype the unit's floating outputs are cast to (None: as computed).
        cast_forward_inputs: cast the unit's floating inputs to ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    @classmethod
    def from_torch(cls, policy) -> "MixedPrecision":
        """The same policy from torch's ``MixedPrecisionPolicy`` (or a ``MixedPrecision``)."""
        if isinstance(policy, cls):
            return policy
        return cls(policy.param_dtype, policy.reduce_dtype, policy.output_dtype,
                   policy.cast_forward_inputs)
