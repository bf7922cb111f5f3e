"""zero: ZeRO stages 1, 2 and 3, written from scratch on torch.distributed collectives.

New to ZeRO? Read ``minimal.py`` first: the whole idea in one file. Then the package, one folder a
role, read bottom-up: a file imports only from its own folder and those before it. Every file is
named here (``tests/test_maps.py`` holds this list to the tree).

- ``api.py`` every seam, as a protocol (notes/15: which idea goes where), importing nothing of zero;
- ``comm/`` the collectives: ``backend.py`` (the one place torch.distributed is called),
  ``context.py`` (a root's ``CommContext``), ``ledger.py`` (every collective recorded),
  ``waits.py`` (every wait bounded), ``agree.py`` (ranks that diverge raise), ``collectives.py``
  (the same, as functions), ``objects.py`` (Python objects between ranks), ``flat_collectives.py``
  (how a unit's flat buffers cross the ranks);
- ``core/`` the mechanism: ``state.py`` (a unit's states and controls), ``flat.py``, ``rows.py`` and
  ``whole.py`` (the three layouts), ``stage.py`` (the policy table and its rules), ``config.py`` (a
  unit's frozen policies and mesh), ``tree.py`` (structured inputs and outputs), ``placement.py``
  (tensor parallel, ``Shard(dim)``), ``param.py`` (one original parameter), ``grads.py`` (a unit's
  gradient), ``unit.py`` (the parameter group), ``registry.py`` (who owns what), ``schedule.py``
  (prefetch), ``reductions.py`` (the order of reduce-scatters), ``guards.py``, ``saved_tensors.py``
  and ``adoption.py`` (misuse, freed parameters, parameters replaced after sharding),
  ``same_model.py`` (the ranks agree on the model), ``running_stats.py`` (BatchNorm's statistics),
  ``optimizers.py`` (which optimizers step pieces), ``root.py`` (the root's work), ``hooks.py`` (the
  life of a unit in one iteration);
- ``checkpoint/`` sharded checkpoints on DCP in FSDP2's layout: ``dcp.py`` (save), ``loading.py``
  (load), ``directory.py`` (the versions, the atomic flip of ``latest``), ``fsdp2_layout.py``
  (FSDP2's per-parameter chunks), read as data only (``reader.py``, ``validate.py``,
  ``safe_pickle.py``); it imports no feature (it asks the offload policies: ``resident``);
- ``features/`` each one object behind a seam: ``offload.py`` (``OnDevice``, ``CPUOffload``),
  ``disk_offload.py``, ``disk_store.py`` and ``disk_files.py`` (the optimizer state in files),
  ``quantized.py`` and ``quantized_gradients.py`` (ZeRO++'s qwZ and qgZ), ``logging_backend.py``,
  ``all_gather_extension.py`` (FSDP2's ``fsdp_pre_all_gather``), ``custom_collectives.py``
  (FSDP2's custom ``AllGather`` / ``ReduceScatter``), ``wrap.py`` (FSDP1's auto-wrap);
- ``surface/`` what a user calls: ``shard.py`` (the entry point), ``options.py`` (its arguments),
  ``claim.py`` (which parameters a call takes), ``fsdp2.py``, ``fsdp2_module.py`` and
  ``fsdp2_state.py`` (``fully_shard``, its ``FSDPModule`` methods, its state for torch),
  ``policies.py`` (``MixedPrecision``, the layouts by name), ``controls.py`` (FSDP2's controls),
  ``clip.py``, ``full_state.py``, ``meta_init.py``, ``grad_scaler.py``, and ``attach.py``
  (zero's hooks on optimizers and modules);
- ``__main__.py`` the command line (``python -m zero export``)."""

from zero.checkpoint import load, save
from zero.surface.clip import clip_grad_norm_
from zero.comm import CollectiveTimeout, Disagreement, Ledger
from zero.features.quantized import QuantizedWeights
from zero.features.quantized_gradients import QuantizedGradients
from zero.surface.controls import (reshard, set_modules_to_backward_prefetch,
                                   set_modules_to_forward_prefetch, set_requires_gradient_sync,
                                   set_reshard_after_backward, set_reshard_after_forward, unshard)
from zero.features.disk_offload import DiskOffload
from zero.surface.fsdp2 import fully_shard
from zero.surface.grad_scaler import ShardedGradScaler
from zero.surface.meta_init import init_parameters
from zero.features.offload import CPUOffload
from zero.features import logging_backend  # noqa: F401  (zero.features.logging_backend...)
from zero.surface.policies import MixedPrecision
from zero.surface.shard import no_sync, piece_of, shard, unit_of, units_of, units_on
from zero.surface.full_state import full_state_dict, load_full_state_dict

__all__ = [
    "CPUOffload", "CollectiveTimeout", "Disagreement", "DiskOffload", "Ledger", "MixedPrecision",
    "QuantizedGradients", "QuantizedWeights", "ShardedGradScaler", "clip_grad_norm_",
    "full_state_dict", "fully_shard", "init_parameters", "load", "load_full_state_dict", "no_sync",
    "piece_of", "reshard", "save", "set_modules_to_backward_prefetch",
    "set_modules_to_forward_prefetch", "set_requires_gradient_sync", "set_reshard_after_backward",
    "set_reshard_after_forward", "shard", "unit_of", "units_of", "units_on", "unshard"
]
