"""The notes link to code by line; a link that names a function must land inside it.

Code moves, and a chapter that points at the wrong line teaches the wrong thing. For every
link like [`Unit.reduce_grad`](../zero/unit.py#L215) in notes/, the line must fall within
the named definition (found with ``ast``); every linked file and line must exist.
"""

import ast
import os
import re

ROOT = os.path.join(os.path.dirname(__file__), "..")
LINK = re.compile(r"\[`([^`]+)`\]\(\.\./([\w/]+\.py)#L(\d+)\)")


def definitions(path: str) -> dict[str, tuple[int, int]]:
    """{qualified name: (first line, last line)} of every class and function in a file."""
    out: dict[str, tuple[int, int]] = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                out[name] = (first, child.end_lineno)
                visit(child, name + ".")

    visit(ast.parse(open(path).read()), "")
    return out


def resolve(symbol: str, defs: dict) -> tuple[int, int] | None:
    name = symbol.removesuffix("()").removeprefix("zero.")
    if name in defs:
        return defs[name]
    matches = [span for q, span in defs.items() if q.endswith("." + name)]
    if len(matches) == 1:
        return matches[0]
    module, _, rest = name.partition(".")  # `comm.reduce_scatter` in zero/comm.py
    return resolve(rest, defs) if rest and module.islower() and module not in defs else None


def links():
    for chapter in sorted(os.listdir(os.path.join(ROOT, "notes"))):
        if chapter.endswith(".md"):
            text = open(os.path.join(ROOT, "notes", chapter)).read()
            for m in LINK.finditer(text):
                yield chapter, m.group(1), m.group(2), int(m.group(3))


def test_every_code_link_lands_on_what_it_names():
    bad, checked = [], 0
    for chapter, symbol, path, line in links():
        full = os.path.join(ROOT, path)
        if not os.path.exists(full):
            bad.append(f"{chapter}: {path} does not exist")
            continue
        if line > len(open(full).read().splitlines()):
            bad.append(f"{chapter}: {path}#L{line} is past the end")
            continue
        span = resolve(symbol, definitions(full))
        if span is not None:
            checked += 1
            if not span[0] <= line <= span[1]:
                bad.append(f"{chapter}: `{symbol}` is at {path}#L{span[0]}, the link says L{line}")
    assert checked > 50 and not bad, "\n".join(bad)
