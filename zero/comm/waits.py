"""Every wait is bounded: a rank left alone in a collective raises, saying what it waited for.

A collective pairs with whatever the other ranks issue next, so ranks that took different
paths (one skipped a backward, one raised and went on) wait for each other forever: until the
process group's own timeout, 30 minutes by default, and then with a message about sockets.
Here every ``wait()`` zero makes has a bound, ``ZERO_TIMEOUT`` seconds (default 300), and on
expiry raises ``CollectiveTimeout`` on the rank that waited: which collective (its number
among those this rank issued on that group), for which unit and phase, what this rank issued
just before it, and what usually causes it.

Why 300 s: long enough for a slow rank doing real work between two collectives (a step of a
big model, one rank writing a checkpoint), and as long as torchtitan's default timeout for
initialisation (it uses 100 s once training runs); six times shorter than torch's default.
A job that legitimately keeps ranks apart for longer sets ``ZERO_TIMEOUT``; ``ZERO_TIMEOUT=0``
removes the bound (waits as torch does, until the process group's timeout).

The bound costs no collective: it is a timeout on the wait itself, where the backend can
bound one (``Backend.bounded_wait``: gloo's reduce-scatter is waited for on a helper thread;
on NCCL only the agreement, whose result the CPU reads anyway, is bounded here, and the
process group's own timeout bounds the rest: NCCL's watchdog aborts a collective older than
the ``timeout`` given to ``init_process_group``, so set it as you set ``ZERO_TIMEOUT``).
"""

from __future__ import annotations

import contextvars
import datetime
import os
import threading
import time

DEFAULT_TIMEOUT_S = 300.0

# The collectives whose wait expired in this thread of execution (after one, the process
# group is out of step: a launcher reads this to skip a farewell barrier). A context
# variable, not a process-wide list: it belongs to the code that waited.
_EXPIRED: contextvars.ContextVar[tuple] = contextvars.ContextVar("zero_expired", default=())


class CollectiveTimeout(RuntimeError):
    """A rank waited longer than ``ZERO_TIMEOUT`` for a collective the others never joined."""


def timeout_seconds() -> float:
    return float(os.environ.get("ZERO_TIMEOUT", DEFAULT_TIMEOUT_S))


def expired() -> list[str]:
    """The collectives this thread gave up waiting for. After one its process group is out of
    step with the others' (a collective left pending), so nothing issued on it can be trusted
    to complete: a launcher uses this to skip a farewell barrier."""
    return list(_EXPIRED.get())


def wait(work, name: str, group, ctx, op: str = "", always: bool = False):
    """``work.wait()``, bounded by ``ZERO_TIMEOUT`` where the backend allows it (or ``always``:
    a wait whose result the CPU reads at once). ``op`` names the collective; ``ctx`` is the
    ``CommContext`` it was issued through (its backend, and what it issued before). None is
    a collective that had finished when its call returned (a backend's or FSDP2 comm
    object's blocking call)."""
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
                "aborts a process whose collective does not match the others' in size (a rank "
                "that skipped a unit, ran one twice, or ran backward alone), and the others "
                "then see its connections close. Look at the other ranks' output for the first "
                "error, and run again with ZERO_CHECK=1: every rank then names the first "
                "collective that differs. Before it, this rank issued: "
                f"{'; '.join(before) or 'nothing'}") from e
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
