"""The collectives layer: the only part of zero that talks to other ranks.

Read bottom-up:
- ``backend``: the one place ``torch.distributed`` is called (the seam for another backend:
  ``TorchBackend``; ``logging_backend`` wraps it);
- ``context``: a ``CommContext`` per model: its backend, group names, what it issued;
- ``ledger``: the record of every collective (``zero.Ledger``);
- ``waits``: every wait bounded by ``ZERO_TIMEOUT``, a named error on expiry;
- ``agree``: ranks about to take different paths raise instead of hanging;
- ``collectives``: all-gather, reduce-scatter, all-reduce, broadcast, each agreed (check mode),
  recorded and launched; ``objects`` (small Python objects between ranks) and
  ``flat_collectives`` (how a unit's flat buffers cross the ranks).
Nothing here knows about units, stages or modules: the mechanism (``zero/core``) calls down.
"""

from zero.comm.agree import AgreementTimeout, Disagreement, agree, checking, raising_together
from zero.comm.backend import default_device, simulated
from zero.comm.collectives import (all_gather, all_gather_object, all_reduce, all_to_all,
                                   broadcast, reduce_scatter)
from zero.comm.context import CommContext
from zero.comm.ledger import Ledger, Record
from zero.comm.waits import CollectiveTimeout

__all__ = ["AgreementTimeout", "CollectiveTimeout", "CommContext", "Disagreement", "Ledger",
           "Record", "agree", "all_gather", "all_gather_object", "all_reduce", "all_to_all",
           "broadcast", "checking", "default_device", "raising_together", "reduce_scatter",
           "simulated"]
