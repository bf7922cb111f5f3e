"""zero: ZeRO stages 1, 2 and 3, written from scratch on torch.distributed collectives.

New to ZeRO? Read ``minimal`` first: the whole idea in one file. Then the package, one folder a
role, read bottom-up: a file imports only from its own folder and the ones listed before it
(``benchmarks/shape.py`` counts the exceptions: none).

- ``api`` every seam, as a protocol: ``Layout``, ``CommPolicy``, ``OffloadPolicy``,
  ``Schedule``, ``Backend`` (notes/15 says which idea goes through which); it imports nothing
  of zero;
- ``comm/`` the collectives: ``backend`` (the one place torch.distributed is called:
  ``TorchBackend``), ``context`` (a root's ``CommContext``), ``ledger`` (every collective
  recorded), ``waits`` (every wait bounded), ``agree`` (ranks that diverge raise),
  ``collectives``, ``objects``, ``flat_collectives`` (how a unit's flat buffers cross the ranks);
- ``core/`` the mechanism: ``state`` (a unit's states, its iteration, its controls),
  ``flat``, ``rows`` and ``whole`` (the three layouts), ``stage`` (the policy table and every
  rule derived from it), ``config`` (a unit's frozen policies and its mesh: HSDP, hpZ),
  ``tree``, ``param`` (one original parameter), ``grads`` (a unit's gradient), ``unit`` (the
  parameter group: unshard / reshard; ``held()``), ``registry`` (who owns what),
  ``schedule`` (prefetch and the order of reductions), ``guards`` and ``saved_tensors``
  (what stands between a user and a silent wrong result), ``same_model`` (the ranks agree on
  the model), ``optimizers`` (which of torch's optimizers step pieces), ``root`` (what the
  root does for all units), ``hooks`` (the life of a unit in one iteration);
- ``checkpoint/`` sharded checkpoints, read as data only (``validate``, ``safe_pickle``); it
  asks the offload policies for the optimizer state (``resident``) and imports no feature;
- ``features/`` each one object behind a seam: ``offload`` (``OnDevice``, ``CPUOffload``),
  ``disk_offload`` and ``disk_files`` (the optimizer state in files), ``quantized`` and
  ``quantized_gradients`` (ZeRO++'s qwZ and qgZ), ``logging_backend``, ``wrap`` (FSDP1's
  auto-wrap policies and strategies);
- ``surface/`` what a user calls: ``shard`` (the entry point), ``fsdp2`` (``fully_shard``),
  ``policies`` (``MixedPrecision``, the layouts by name), ``controls`` (FSDP2's control
  surface), ``clip``, ``full_state`` (full state dicts), ``meta_init``, ``grad_scaler``, and
  ``attach`` (zero's hooks on the optimizers and modules it serves);
- ``__main__`` the command line (``python -m zero export``).
"""

from zero.checkpoint import load, save
from zero.surface.clip import clip_grad_norm_
from zero.comm import CollectiveTimeout, Disagreement, Ledger
from zero.features.quantized import QuantizedWeights
from zero.features.quantized_gradients import QuantizedGradients
from zero.surface.controls import (
    reshard,
    set_modules_to_backward_prefetch,
    set_modules_to_forward_prefetch,
    set_requires_gradient_sync,
    set_reshard_after_backward,
    set_reshard_after_forward,
    unshard,
)
from zero.features.disk_offload import DiskOffload
from zero.surface.fsdp2 import fully_shard
from zero.surface.grad_scaler import ShardedGradScaler
from zero.surface.meta_init import init_parameters
from zero.features.offload import CPUOffload
from zero.surface.policies import MixedPrecision
from zero.surface.shard import no_sync, piece_of, shard, unit_of, units_of, units_on
from zero.surface.full_state import full_state_dict, load_full_state_dict

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
