"""zero: ZeRO stages 1, 2 and 3, written from scratch on torch.distributed collectives.

New to ZeRO? Read ``minimal`` first: the whole idea in one file. Then the package, bottom-up,
one layer a folder; no file imports one above it:

- ``api`` every seam, as a protocol: ``Layout``, ``CommPolicy``, ``OffloadPolicy``,
  ``Schedule``, ``Backend`` (notes/15 says which idea goes through which);
- ``comm/`` the collectives: ``backend`` (the one place torch.distributed is called:
  ``TorchBackend``; ``logging_backend`` wraps it), ``context`` (a model's ``CommContext``),
  ``ledger`` (every collective recorded), ``waits`` (every wait bounded), ``agree`` (ranks
  that diverge raise), ``collectives``, ``objects``, ``flat_collectives`` (how a unit's flat
  buffers cross the ranks), ``quantized`` and ``quantized_gradients`` (ZeRO++'s qwZ and qgZ);
- ``core/`` the mechanism: ``state`` (a unit's states, its iteration, its controls),
  ``flat``, ``rows`` and ``whole`` (the three layouts), ``stage`` (the policy table and every
  rule derived from it), ``config`` (a unit's frozen policies and its mesh: HSDP, hpZ),
  ``tree``, ``param`` (one original parameter), ``grads`` (a unit's gradient), ``unit`` (the
  parameter group: unshard / reshard; ``held()``), ``registry`` (who owns what),
  ``schedule`` (prefetch and the order of reductions), ``checks`` and ``saved_tensors``
  (what stands between a user and a silent wrong result), ``root`` (what the root does for
  all units), ``hooks`` (the life of a unit in one iteration);
- ``checkpoint/`` sharded checkpoints, read as data only; it asks the offload policies for
  the optimizer state (``resident``), and imports no feature;
- the public surface, here: ``shard`` (the entry point), ``agreement`` (the ranks agree on
  the model), ``wrap`` (FSDP1's auto-wrap and strategies), ``fsdp2`` (``fully_shard``),
  ``policies`` (``MixedPrecision``, the layouts), ``controls`` (FSDP2's control surface),
  ``clip``, ``state_dict``, ``meta_init``, ``grad_scaler``; and the features behind the
  seams: ``offload`` (``OnDevice``, CPU offload), ``disk_offload`` (the optimizer state in
  files, and its own step), ``optimizers`` (which of torch's optimizers step pieces),
  ``torch_hooks`` (zero's hooks on the optimizers and modules it serves).
"""

from zero.checkpoint import load, save
from zero.clip import clip_grad_norm_
from zero.comm import CollectiveTimeout, Disagreement, Ledger
from zero.comm.quantized import QuantizedWeights
from zero.comm.quantized_gradients import QuantizedGradients
from zero.controls import (
    reshard,
    set_modules_to_backward_prefetch,
    set_modules_to_forward_prefetch,
    set_requires_gradient_sync,
    set_reshard_after_backward,
    set_reshard_after_forward,
    unshard,
)
from zero.disk_offload import DiskOffload
from zero.fsdp2 import fully_shard
from zero.grad_scaler import ShardedGradScaler
from zero.meta_init import init_parameters
from zero.offload import CPUOffload
from zero.policies import MixedPrecision
from zero.shard import no_sync, piece_of, shard, unit_of, units_of, units_on
from zero.state_dict import full_state_dict, load_full_state_dict

__all__ = [
    "CPUOffload",
    "CollectiveTimeout",
    "Disagreement",
    "DiskOffload",
    "Ledger",
    "MixedPrecision",
    "QuantizedGradients",
    "QuantizedWeights",
    "ShardedGradScaler",
    "clip_grad_norm_",
    "full_state_dict",
    "fully_shard",
    "init_parameters",
    "load",
    "load_full_state_dict",
    "no_sync",
    "piece_of",
    "reshard",
    "save",
    "set_modules_to_backward_prefetch",
    "set_modules_to_forward_prefetch",
    "set_requires_gradient_sync",
    "set_reshard_after_backward",
    "set_reshard_after_forward",
    "shard",
    "unit_of",
    "units_of",
    "units_on",
    "unshard",
]
