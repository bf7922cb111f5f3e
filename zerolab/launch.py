"""Run a function on N local ranks, each a forked process (tests, benchmarks, demos).

Why fork: the ranks inherit the already-imported torch, so a group of ranks starts in
a fraction of a second (``spawn`` re-imports torch in every rank: seconds per test).
The ranks rendezvous through a ``FileStore`` in a fresh temporary directory, so there
is no port to pick and no port to collide on.

The contract with a test:
- ``run_ranks(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` in every
  rank with the default process group initialised (gloo unless ``backend`` says
  otherwise), and returns the list of the ranks' return values (they must pickle).
- If any rank raises, the others are killed at once and the test fails with that
  rank's traceback (``RankError``).
- If any rank is still running after ``timeout`` seconds, every rank's Python stack is
  dumped, the ranks are killed, and the test fails with the stacks (``RankTimeout``).
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 60.0


class RankError(AssertionError):
    """A rank raised; the message carries its traceback."""


class RankTimeout(AssertionError):
    """A rank did not finish in time; the message carries every rank's stack."""


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local ranks; return their results.

    For several machines, or GPUs with NCCL, start the ranks with ``torchrun`` instead.
    """
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="zero-ranks-") as tmp:
        readers, procs = [], []
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_rank_main,
                args=(fn, rank, world_size, tmp, timeout, backend, args, writer),
                daemon=True,
            )
            proc.start()
            writer.close()  # the parent keeps only the reading end
            readers.append(reader)
            procs.append(proc)
        try:
            results = _collect(readers, procs, tmp, timeout)
            leave = time.monotonic() + 5  # they leave through a barrier: give them a moment
            for proc in procs:
                proc.join(max(leave - time.monotonic(), 0))
            return results
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join()


def _collect(readers, procs, tmp: str, timeout: float) -> list[Any]:
    results: list[Any] = [None] * len(procs)
    pending = dict(enumerate(readers))
    deadline = time.monotonic() + timeout
    while pending:
        left = deadline - time.monotonic()
        ready = mp.connection.wait(list(pending.values()), timeout=max(left, 0))
        if not ready:
            raise RankTimeout(_timeout_report(sorted(pending), procs, tmp, timeout))
        for reader in ready:
            rank = next(r for r, rd in pending.items() if rd is reader)
            del pending[rank]
            try:
                ok, payload = reader.recv()
            except EOFError:  # died without a word: killed, segfault, os._exit elsewhere
                procs[rank].join(5)
                ok, payload = False, f"rank {rank} died with exit code {procs[rank].exitcode}"
            if not ok:
                raise RankError(f"rank {rank} failed:\n{payload}")
            results[rank] = payload
    return results


def _timeout_report(hung: list[int], procs, tmp: str, timeout: float) -> str:
    # Ask every live rank to dump its Python stack (faulthandler, installed in _rank_main).
    for proc in procs:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGUSR1)
    time.sleep(0.5)
    stacks = []
    for rank in range(len(procs)):
        path = os.path.join(tmp, f"stack{rank}.txt")
        text = open(path).read().strip() if os.path.exists(path) else ""
        stacks.append(f"--- rank {rank} ---\n{text or '(finished, no stack)'}")
    return f"ranks {hung} still running after {timeout:.0f}s; stacks:\n" + "\n".join(stacks)


def _rank_main(fn, rank, world_size, tmp, timeout, backend, args, writer) -> None:
    stack_file = open(os.path.join(tmp, f"stack{rank}.txt"), "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # ranks share the cores
    try:
        store = dist.FileStore(os.path.join(tmp, "store"), world_size)
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        # Meet once before the test runs: until every rank has finished its gloo connection
        # set-up, a rank that returns at once and exits cuts a slower peer's set-up short
        # ("connectFullMesh failed ... Connection closed by peer"), on a loaded machine.
        dist.barrier()
        result = (True, fn(rank, world_size, *args))
    except BaseException:
        result = (False, traceback.format_exc())
    # Plain pickle, by value: Connection.send would use torch's shared-memory reductions for
    # tensors, which need this process alive while the parent unpickles.
    try:
        payload = pickle.dumps(result)
    except Exception:  # an unpicklable return value is the test's bug: say so
        result = (False, "rank returned a value that does not pickle:\n" + traceback.format_exc())
        payload = pickle.dumps(result)
    writer.send_bytes(payload)
    writer.close()
    waits = sys.modules.get("zero.comm.waits")
    if result[0] and not (waits and waits.expired()):
        # Leave together, so that no rank's exit closes a connection a peer's last collective
        # still uses. The parent already has this rank's result; a peer stuck in a collective
        # (a test of timeouts) must not hold this one for long, and a rank whose own wait
        # expired skips it: its group is out of step, no barrier completes.
        try:
            dist.barrier(async_op=True).wait(timeout=datetime.timedelta(seconds=2))
        except Exception:
            pass  # a peer failed or is stuck: the parent reports what it returned
    # Skip interpreter teardown (pytest's atexit handlers, gloo's destructors): the parent
    # has everything it needs, and a clean shutdown of a broken group can itself hang.
    os._exit(0)
