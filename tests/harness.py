"""The multi-rank test harness: ``run_ranks(fn, n, *args)`` runs ``fn(rank, n, *args)`` on n
forked gloo ranks and fails with the failing rank's traceback, or every rank's stack on a
timeout. It lives in ``zerolab/launch.py`` because the benchmarks launch their ranks with it too.

``run_main(argv)`` runs ``python -m zero ARGV`` in a forked process: what the command line
does, exit code and output, without paying torch's import again (seconds per run).
"""

import contextlib
import io
import multiprocessing as mp
import subprocess

from zerolab.launch import DEFAULT_TIMEOUT_S, RankError, RankTimeout, run_ranks

__all__ = ["DEFAULT_TIMEOUT_S", "RankError", "RankTimeout", "run_main", "run_ranks"]


def run_main(argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    """``python -m zero`` with ``argv``, forked: its exit code, stdout and stderr."""
    ctx = mp.get_context("fork")
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_main, args=(argv, writer), daemon=True)
    proc.start()
    writer.close()
    if not reader.poll(timeout):
        proc.kill()
        raise RankTimeout(f"python -m zero {' '.join(argv)} still running after {timeout:.0f}s")
    code, out, err = reader.recv()
    proc.join()
    return subprocess.CompletedProcess(["python", "-m", "zero", *argv], code, out, err)


def _main(argv, writer) -> None:
    import os
    import traceback

    from zero.__main__ import main

    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(argv)
        except SystemExit as e:  # argparse's exit, and parser.exit(1, ...)
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:  # a traceback, as the real command line would print
            traceback.print_exc()
            code = 1
    writer.send((code, out.getvalue(), err.getvalue()))
    writer.close()
    os._exit(0)
