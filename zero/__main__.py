"""``python -m zero export CKPT OUT.pt``: a zero.save checkpoint as one plain torch.save file."""

from __future__ import annotations

import argparse

import torch

from zero import checkpoint


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m zero",
                                     description="Tools for zero.save checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="write one torch.save file of {name: full tensor}")
    ex.add_argument("checkpoint", help="a zero.save directory or any DCP checkpoint")
    ex.add_argument("out", help="the .pt file to write")
    args = parser.parse_args(argv)
    try:
        state = checkpoint.export(args.checkpoint, args.out)
    except (OSError, RuntimeError, ValueError) as e:  # our errors say what to do: no traceback
        parser.exit(1, f"error: {e}\n")
    numel = sum(t.numel() for t in state.values() if torch.is_tensor(t))
    print(f"wrote {args.out}: {len(state)} tensors, {numel:,} elements")


if __name__ == "__main__":
    main()
