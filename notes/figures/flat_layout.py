"""Print the real flat layout of one GPT block sharded by zero.shard on 3 gloo ranks.

    python notes/figures/flat_layout.py > notes/figures/flat_layout.txt

Config at the top; the block is zerolab.models.Block with GPTConfig(dim=DIM).
"""

import torch

import zero
from zerolab.launch import run_ranks
from zerolab.models import Block, GPTConfig

WORLD_SIZE, DIM, BAR = 3, 32, 60  # BAR: characters for the whole padded buffer


def one_rank(rank, n):
    torch.manual_seed(0)
    block = Block(GPTConfig(dim=DIM))
    names = [name for name, _ in block.named_parameters()]
    shapes = [tuple(p.shape) for p in block.parameters()]
    zero.shard(block, stage=3)
    unit = zero.units_on(block)[0]
    lay = unit.layout
    return {
        "names": names, "shapes": shapes, "offsets": lay.offsets, "numels": lay.numels,
        "numel": lay.numel, "padded": lay.padded_numel, "shard": lay.shard(rank),
        "pieces": lay.pieces(rank),
        # what the optimizer sees on this rank: the original names, 1-D pieces
        "local": [(name, tuple(p.shape)) for name, p in block.named_parameters()],
    }


def main():
    out = run_ranks(one_rank, WORLD_SIZE)
    r0 = out[0]
    S = r0["shard"].size
    print(f"One GPT block (dim {DIM}) as one unit at N = {WORLD_SIZE}: "
          f"numel {r0['numel']}, padded_numel {r0['padded']} "
          f"(pad {r0['padded'] - r0['numel']}), shard_numel {S}\n")
    letters = "abcdefghijklmnopqrstuvwxyz"  # each parameter's letter in the bar below
    print(f"  {'parameter':<13} {'shape':>10} {'numel':>6}  {'flat range':>14}  "
          "pieces (rank: param elements)")
    for i, (name, shape) in enumerate(zip(r0["names"], r0["shapes"])):
        lo, n = r0["offsets"][i], r0["numels"][i]
        held = []
        for r, o in enumerate(out):
            for p in o["pieces"]:
                if p.param_index == i:
                    held.append(f"r{r}: [{p.param_offset}, {p.param_offset + p.length})")
        mark = "  <- straddles" if len(held) > 1 else ""
        print(f"{letters[i]} {name:<13} {str(shape):>10} {n:>6}  [{lo:>5}, {lo + n:>5})  "
              f"{', '.join(held)}{mark}")
    print(f". {'(padding)':<13} {'':>10} {r0['padded'] - r0['numel']:>6}  "
          f"[{r0['numel']:>5}, {r0['padded']:>5})  r{WORLD_SIZE - 1}")

    # The bar: each parameter's letter, scaled to BAR characters; | marks shard boundaries.
    scale = r0["padded"] / BAR
    cells = []
    for c in range(BAR):
        x = (c + 0.5) * scale
        spans = enumerate(zip(r0["offsets"], r0["numels"]))
        idx = next((i for i, (o, n) in spans if o <= x < o + n), None)
        cells.append(letters[idx] if idx is not None else ".")
    bar = ""
    for c, ch in enumerate(cells):
        if c and int(c * scale // S) != int((c - 1) * scale // S):
            bar += "|"
        bar += ch
    print(f"\nflat   |{bar}|")
    cells = [f" rank {r} ".center(BAR // WORLD_SIZE, " ") for r in range(WORLD_SIZE)]
    print("shards |" + "|".join(cells) + "|")
    print(f"(a letter is the parameter of the table's first column; 1 character ~ {scale:.0f} "
          "elements,\n so the parameters smaller than that fall between characters)")

    print("\nWhat each rank's optimizer sees (model.named_parameters() after zero.shard: every "
          "name,\na 1-D piece; here only the non-empty ones):")
    for r, o in enumerate(out):
        held = [f"{nm} {list(s)}" for nm, s in o["local"] if s[0]]
        print(f"  rank {r}: " + ", ".join(held) + f"; {len(o['local']) - len(held)} empty pieces")


if __name__ == "__main__":
    main()
