"""The collectives layer: the only part of zero that talks to other ranks.

Read bottom-up, as ``zero/__init__.py`` lists it: ``backend``, ``ledger``, ``waits``,
``objects``, ``agree``, ``context`` (a ``CommContext`` per root issues every collective of a
model), ``collectives``, ``flat_collectives``. Nothing here knows about units, stages or
modules: the mechanism (``zero/core``) calls down.
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
