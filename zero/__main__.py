"""``python -m zero``: two tools.

    python -m zero export CKPT OUT.pt   # a zero.save checkpoint as one plain torch.save file
    python -m zero trace --stage 3      # one training step on 2 local ranks, narrated
    python -m zero plan --model M --world-size N   # each system's memory, bytes and time, predicted
"""

from __future__ import annotations

import argparse

import torch

from zero import checkpoint


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m zero",
                                     description="Tools for zero.save checkpoints, and a "
                                                 "narrated training step.")
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="write one torch.save file of {name: full tensor}")
    ex.add_argument("checkpoint", help="a zero.save directory or any DCP checkpoint")
    ex.add_argument("out", help="the .pt file to write")
    tr = sub.add_parser("trace", help="run one step of a small GPT on 2 local gloo ranks and "
                                      "print every hook and collective in order")
    from zerolab import trace  # the bench's: it watches zero from the outside

    trace.add_arguments(tr)
    pl = sub.add_parser("plan", help="predict each system's memory, traffic and step time for "
                                     "a model on a cluster, from the real sharding on fake ranks")
    from zerolab import plan

    plan.add_arguments(pl)
    args = parser.parse_args(argv)
    if args.command == "trace":
        trace.run(args, tr)
        return
    if args.command == "plan":
        plan.run(args, pl)
        return
    try:
        state = checkpoint.export(args.checkpoint, args.out)
    except (OSError, RuntimeError, ValueError) as e:  # our errors say what to do: no traceback
        parser.exit(1, f"error: {e}\n")
    numel = sum(t.numel() for t in state.values() if torch.is_tensor(t))
    print(f"wrote {args.out}: {len(state)} tensors, {numel:,} elements")


if __name__ == "__main__":
    main()
