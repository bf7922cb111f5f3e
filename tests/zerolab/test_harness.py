"""The multi-rank harness itself: results, failures with tracebacks, hangs caught, overhead."""

import time

import pytest
import torch.distributed as dist

from harness import RankError, RankTimeout, run_ranks


def _rank_and_size(rank, n):
    return rank, n, dist.get_rank(), dist.get_world_size(), dist.get_backend()


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_every_rank_runs_with_gloo(n):
    assert run_ranks(_rank_and_size, n) == [(r, n, r, n, "gloo") for r in range(n)]


def _rank1_raises(rank, n):
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # rank 0 would wait forever: the harness must not


def test_a_rank_raising_fails_promptly_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(_rank1_raises, 2, timeout=30)
    assert time.monotonic() - start < 5
    assert "rank 1 failed" in str(info.value) and "boom on rank 1" in str(info.value)
    assert "_rank1_raises" in str(info.value)  # the traceback, not just the message


def _rank0_hangs(rank, n):
    if rank == 0:
        time.sleep(60)


def test_a_hung_rank_is_caught_by_the_timeout():
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        run_ranks(_rank0_hangs, 2, timeout=2)
    assert time.monotonic() - start < 6
    assert "ranks [0] still running" in str(info.value)
    assert "_rank0_hangs" in str(info.value)  # rank 0's stack shows where it hung


def test_overhead_per_group_is_well_under_a_second():
    run_ranks(_rank_and_size, 2)  # warm
    start = time.monotonic()
    for _ in range(5):
        run_ranks(_rank_and_size, 2)
    assert (time.monotonic() - start) / 5 < 0.5
