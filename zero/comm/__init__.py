"""The collectives layer: the only part of zero that talks to other ranks.

Read bottom-up, in ``zero/__init__.py``'s order. Nothing here knows about units, stages or
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
