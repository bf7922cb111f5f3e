"""``python -m zero export CKPT OUT.pt``: a zero.save checkpoint as one plain torch.save file."""

from __future__ import annotations

import argparse

import torch

from zero import checkpoint

_MOVED = {"trace": "python -m zerolab trace", "plan": "python -m zerolab plan"}  # the bench's


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m zero",
                                     description="Write a zero.save checkpoint as one plain "
                                                 "torch.save file. (A narrated step and the "
                                                 "plan: python -m zerolab trace | plan)")
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="write one torch.save file of {name: full tensor}")
    ex.add_argument("checkpoint", help="a zero.save directory or any DCP checkpoint")
    ex.add_argument("out", help="the .pt file to write")
    args = list(argv) if argv is not None else None
    command = (args if args is not None else __import__("sys").argv[1:])[:1]
    if command and command[0] in _MOVED:
        parser.exit(2, f"error: '{command[0]}' is the bench's: run {_MOVED[command[0]]} "
                       "(the same arguments)\n")
    parsed = parser.parse_args(args)
    try:
        state = checkpoint.export(parsed.checkpoint, parsed.out)
    except (OSError, RuntimeError, ValueError) as e:  # our errors say what to do: no traceback
        parser.exit(1, f"error: {e}\n")
    numel = sum(t.numel() for t in state.values() if torch.is_tensor(t))
    print(f"wrote {parsed.out}: {len(state)} tensors, {numel:,} elements")


if __name__ == "__main__":
    main()
