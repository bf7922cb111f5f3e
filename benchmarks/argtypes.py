"""Argument types shared by the benchmark scripts (argparse ``type=`` functions).

A bad value is refused while the command line is parsed: argparse's usage error, exit code
2, one line that says what is allowed. Without them a bad value surfaced as a traceback from
inside a rank, a run that printed nothing useful (NaN losses from an empty batch), or a run
with no end in sight, each after torch had been imported and ranks started.
"""

from __future__ import annotations

import argparse
import math
import os


def _refuse(what: str, text: str):
    return argparse.ArgumentTypeError(f"must be {what}, got {text!r}")


def int_in(lo: int, hi: int | None = None):
    """An integer in [lo, hi] (no upper bound when ``hi`` is None)."""
    what = f"an integer >= {lo}" if hi is None else f"an integer from {lo} to {hi:,}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise _refuse(what, text) from None
        if value < lo or (hi is not None and value > hi):
            raise _refuse(what, text)
        return value

    return parse


positive_int = int_in(1)


def float_in(lo: float, hi: float):
    """A finite number in (lo, hi]; written as a float so that 7.5e9 is accepted."""
    what = f"a number > {lo:g} and <= {hi:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise _refuse(what, text) from None
        if not (math.isfinite(value) and lo < value <= hi):  # NaN fails every comparison
            raise _refuse(what, text)
        return value

    return parse


def comma_list(choices, convert=str):
    """A non-empty comma list of distinct values from ``choices`` (a repeat would run twice)."""
    what = "a comma list of distinct values from " + ", ".join(map(str, choices))

    def parse(text: str) -> list:
        try:
            values = [convert(item.strip()) for item in text.split(",")]
        except ValueError:
            raise _refuse(what, text) from None
        if any(v not in choices for v in values) or len(set(values)) != len(values):
            raise _refuse(what, text)
        return values

    return parse


def output_file(text: str) -> str:
    """A file path that can be written, checked now: the scripts write it at the very end,
    and a path they cannot write would lose the whole run to a traceback."""
    path = os.path.abspath(text)
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"must be a file path, got the directory {text!r}")
    parent = os.path.dirname(path)
    while not os.path.exists(parent):  # the scripts create the missing directories
        parent = os.path.dirname(parent)
    writable = os.access(path, os.W_OK) if os.path.exists(path) else \
        os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK)
    if not writable:
        raise argparse.ArgumentTypeError(f"must be a file path this user can write, got {text!r}")
    return text
