"""The collectives layer: the only part of zero that talks to other ranks.

Read bottom-up:
- ``backend``: the one place ``torch.distributed`` is called (the seam for another backend:
  ``TorchBackend``);
- ``ledger``: the record of every collective (``zero.Ledger``);
- ``waits``: every wait bounded by ``ZERO_TIMEOUT``, a named error on expiry;
- ``objects``: small Python objects between ranks (error reports);
- ``agree``: ranks about to take different paths raise instead of hanging;
- ``context``: a ``CommContext`` per root: its backend, its streams, group names, what it
  issued; every collective of a model is issued by it (all-gather, reduce-scatter,
  all-reduce, all-to-all, broadcast: each agreed in check mode, recorded and launched);
- ``collectives``: the same collectives as functions of a context given (``ctx=``), or of a
  fresh default one for code that belongs to no model;
- ``flat_collectives``: how a unit's flat buffers cross the ranks (the default comm policy).
Nothing here knows about units, stages or modules: the mechanism (``zero/core``) calls down.
"""

from zero.comm.agree import AgreementTimeout, Disagreement, agree, checking, raising_together
from zero.comm.collectives import (all_gather, all_gather_object, all_reduce, all_to_all,
                                   broadcast, reduce_scatter)
from zero.comm.context import CommContext, context_of
from zero.comm.ledger import Ledger, Record, host_side, on_host
from zero.comm.waits import CollectiveTimeout

__all__ = ["AgreementTimeout", "CollectiveTimeout", "CommContext", "Disagreement", "Ledger",
           "Record", "agree", "all_gather", "all_gather_object", "all_reduce", "all_to_all",
           "broadcast", "checking", "context_of", "host_side", "on_host", "raising_together",
           "reduce_scatter"]
