"""Who holds which element of one small unit, in each of the three layouts (no ranks needed).

    python notes/figures/layouts.py > notes/figures/layouts.txt

The unit is two Linear layers, 5 -> 3 -> 2 (weights and biases, 26 elements), at N = 3. Each
element of each parameter is drawn as the rank that holds it; then what each rank's optimizer
is shown. Pure index math: zero/core/flat.py, rows.py and whole.py.
"""

from zero.core.flat import FlatLayout
from zero.core.rows import RowsLayout
from zero.core.whole import WholeLayout

N = 3
PARAMS = [("0.weight", (3, 5)), ("0.bias", (3,)), ("1.weight", (2, 3)), ("1.bias", (2,))]


def owners(layout) -> list[list[str]]:
    """Per parameter, per element (row-major), the rank that holds it."""
    grid = [["?"] * layout.numels[i] for i in range(len(PARAMS))]
    for r in range(N):
        for piece in layout.pieces(r):
            for k in range(piece.param_offset, piece.param_offset + piece.length):
                grid[piece.param_index][k] = str(r)
    return grid


def shown(layout, rank: int, i: int) -> str:
    piece = layout.local(rank).pieces.get(i)
    length = piece.length if piece else 0
    if layout.name == "flat":
        return f"({length},)"
    shape = PARAMS[i][1]
    if layout.name == "rows":
        lo, hi = layout.rows_of(i, rank)
        return f"DTensor {shape}, local ({hi - lo}{', ' if len(shape) > 1 else ','}" \
               f"{', '.join(map(str, shape[1:]))})"
    owner = layout.owner[i] == rank
    return str(shape) if owner else str((0, *shape[1:]))


def main():
    shapes = [s for _, s in PARAMS]
    for cls in (FlatLayout, RowsLayout, WholeLayout):
        layout = cls(shapes, N)
        print(f"{layout.name}: shard_numel {layout.shard_numel} per rank, padded_numel "
              f"{layout.padded_numel}, padding {layout.padded_numel - layout.numel}")
        for (name, shape), row in zip(PARAMS, owners(layout)):
            cols = shape[1] if len(shape) > 1 else len(row)
            drawn = " ".join("".join(row[k : k + cols]) for k in range(0, len(row), cols))
            print(f"  {name:9} {str(shape):7} {drawn}")
        for r in range(N):
            print(f"  rank {r}'s optimizer sees: " +
                  "; ".join(f"{name} {shown(layout, r, i)}" for i, (name, _) in enumerate(PARAMS)))
        print()


if __name__ == "__main__":
    main()
