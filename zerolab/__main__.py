"""``python -m zerolab``: the bench's two tools.

    python -m zerolab trace --stage 3                  # one training step on 2 local ranks, narrated
    python -m zerolab plan --model M --world-size N    # each system's memory, bytes and time, predicted

Both watch zero from the outside (its ledger, ``Unit.held()``); ``python -m zero export`` is
the package's own command.
"""

from __future__ import annotations

import argparse

from zerolab import plan, trace


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m zerolab",
                                     description="The bench's tools: a narrated training step, "
                                                 "and the plan for a model on a cluster.")
    sub = parser.add_subparsers(dest="command", required=True)
    tr = sub.add_parser("trace", help="run one step of a small GPT on 2 local gloo ranks and "
                                      "print every hook and collective in order")
    trace.add_arguments(tr)
    pl = sub.add_parser("plan", help="predict each system's memory, traffic and step time for "
                                     "a model on a cluster, from the real sharding on fake ranks")
    plan.add_arguments(pl)
    args = parser.parse_args(argv)
    if args.command == "trace":
        trace.run(args, tr)
    else:
        plan.run(args, pl)


if __name__ == "__main__":
    main()
