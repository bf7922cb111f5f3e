"""Every wait is bounded: a rank left alone in a collective raises, saying what it waited for.

Every ``wait()`` zero makes is bounded by ``ZERO_TIMEOUT`` seconds (default 300; 0 removes the
bound), not the process group's 30 minutes, and raises ``CollectiveTimeout`` naming the
collective, what this rank issued before it and the usual causes. Why 300 s, and what gloo and
NCCL honour: notes/13-agreement.md, "Every wait has a bound".
"""

from __future__ import annotations

import contextvars
import datetime
import os
import threading
import time

DEFAULT_TIMEOUT_S = 300.0

# The collectives whose wait expired here (``expired``): a context variable, the waiting code's.
_EXPIRED: contextvars.ContextVar[tuple] = contextvars.ContextVar("zero_expired", default=())


class CollectiveTimeout(RuntimeError):
    """A rank waited longer than ``ZERO_TIMEOUT`` for a collective the others never joined."""


def timeout_seconds() -> float:
    return float(os.environ.get("ZERO_TIMEOUT", DEFAULT_TIMEOUT_S))


def expired() -> list[str]:
    """The collectives this thread gave up waiting for: its process group is out of step then
    (a launcher skips its farewell barrier)."""
    return list(_EXPIRED.get())


def wait(work, name: str, group, ctx, op: str = "", always: bool = False):
    """``work.wait()``, bounded by ``ZERO_TIMEOUT`` where the backend allows it (or ``always``:
    the CPU reads the result at once); ``work`` None: a blocking call that had finished."""
    if work is None:
        return None
    seconds = timeout_seconds()
    how = ctx.backend.bounded_wait(group, op)
    if seconds <= 0 or (how == "none" and not always):
        return work.wait()
    # (a helper that cannot start, for want of memory, is that error, not a timeout)
    helper = _Helper(work) if how == "thread" else None
    start = time.monotonic()
    try:
        if helper is not None:
            return helper.wait(seconds)
        return work.wait(timeout=datetime.timedelta(seconds=seconds))
    except RuntimeError as e:
        waited = time.monotonic() - start
        _EXPIRED.set((*_EXPIRED.get(), name))
        before = [n for n in ctx.last if n != name]
        if waited < 0.9 * seconds:  # not the bound: the collective itself failed
            raise CollectiveTimeout(
                f"rank {ctx.backend.rank(group)}: collective {name} failed after {waited:.1f} s, "
                f"before the {seconds:.0f} s bound: {e}. A peer process most likely died: gloo "
                "aborts a process whose collective does not match the others' in size (a rank that "
                "skipped a unit, ran one twice, or ran backward alone), and the others then see "
                "its connections close. Look at the other ranks' output for the first error, and "
                "run again with ZERO_CHECK=1: every rank then names the first collective that "
                f"differs. Before it, this rank issued: {'; '.join(before) or 'nothing'}") from e
        raise CollectiveTimeout(
            f"rank {ctx.backend.rank(group)} waited {seconds:.0f} s for collective {name} and "
            f"the other ranks never joined it. Before it, this rank issued: "
            f"{'; '.join(before) or 'nothing'}. Likely causes: a rank skipped a forward, a "
            "backward or an opt.step() that the others ran (or ran one they skipped, e.g. an "
            "evaluation on one rank); a rank raised and its exception was caught (a loop that "
            "logs and goes on); or a rank is still busy with something slow, such as writing a "
            f"checkpoint alone: then set ZERO_TIMEOUT above {seconds:.0f} s. ({e})") from e


class _Helper:
    """``work.wait()`` on a helper thread, which the caller waits for at most ``seconds``. On
    expiry the helper stays blocked (a daemon); the process group is broken by then anyway."""

    def __init__(self, work):
        self.done, self.outcome = threading.Event(), {}
        threading.Thread(target=self._run, args=(work,), daemon=True, name="zero-wait").start()

    def _run(self, work) -> None:
        try:
            self.outcome["value"] = work.wait()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            self.outcome["error"] = e
        self.done.set()

    def wait(self, seconds: float):
        if not self.done.wait(seconds):
            raise RuntimeError(f"no reply within {seconds:.0f} s")
        if "error" in self.outcome:
            raise self.outcome["error"]
        return self.outcome["value"]
