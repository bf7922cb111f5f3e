"""What zero knows of torch's optimizers: which ones may step pieces of parameters
(notes/16-layouts.md, "Optimizers that read a whole tensor")."""

from __future__ import annotations

# Every state of these is per element (or a scalar): a step on a piece is exact.
ELEMENTWISE = {"SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop", "Adagrad",
               "Adadelta", "ASGD"}

# Optimizers that read a parameter whole: on a piece or some rows they compute something else.
WHOLE_TENSOR = {"Adafactor": "its factored second moment is per row and column of a matrix",
                "Muon": "it orthogonalises the update of each whole matrix"}

# LBFGS's dot products span all parameters: wrong under every layout.
NO_LAYOUT = {"LBFGS": "it takes dot products over all parameters as one vector, and each rank "
                      "holds only its share"}
