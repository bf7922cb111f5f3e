"""The multi-rank test harness: ``run_ranks(fn, n, *args)`` runs ``fn(rank, n, *args)`` on n
forked gloo ranks and fails with the failing rank's traceback, or every rank's stack on a
timeout. It lives in ``zerolab/launch.py`` because the benchmarks launch their ranks with it too.
"""

from zerolab.launch import DEFAULT_TIMEOUT_S, RankError, RankTimeout, run_ranks

__all__ = ["DEFAULT_TIMEOUT_S", "RankError", "RankTimeout", "run_ranks"]
