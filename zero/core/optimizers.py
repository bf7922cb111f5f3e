"""What zero knows of torch's optimizers: which ones may step pieces of parameters.

A layout gives each rank's optimizer pieces of parameters (``flat``: 1-D runs; ``rows``: some
of each parameter's rows) or whole parameters (``whole``). An optimizer that updates each
element on its own computes on a piece exactly what it computes on the whole tensor; one that
reads a parameter as a whole does not. These tables are read by the step hooks
(``zero/surface/attach.py``) and by disk offload (``zero/features/disk_offload.py``), which steps the
optimizer unit by unit and may do so only for an elementwise one.
"""

from __future__ import annotations

# Every state of these is per element (or a scalar): a step over any subset of the
# parameters computes, parameter by parameter, what one step over all of them computes.
ELEMENTWISE = {"SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop", "Adagrad",
               "Adadelta", "ASGD"}

# Optimizers that read a parameter as a whole: on a piece of it (flat) or on some of its rows
# (rows) they compute something else, silently.
WHOLE_TENSOR = {"Adafactor": "its factored second moment is per row and column of a matrix",
                "Muon": "it orthogonalises the update of each whole matrix"}

# LBFGS reads all parameters as one vector and takes dot products over it: on any rank's
# share of them it is wrong under every layout.
NO_LAYOUT = {"LBFGS": "it takes dot products over all parameters as one vector, and each rank "
                      "holds only its share"}
