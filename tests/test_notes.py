"""The notes link to code by line; every such link names the line it lands on.

Code moves, and a chapter that points at the wrong line teaches the wrong thing. The rule,
for every link to a line of a Python file, ``[`label`](../path.py#L<n>)``, in any markdown
file under notes/:

1. the label is code (in backticks), and the file and the line exist;
2. a label that names a class or function of that file (``Unit.reduce_grad``,
   ``hooks.post_backward``, ``zero.clip_grad_norm_()``: found with ``ast``; a trailing ``()``,
   a leading ``zero.`` and a module prefix are ignored) points at its ``def`` or ``class``
   line, or at one of its decorators;
3. any other label is a fragment of the statement it points at, and line n contains it,
   character for character (``[`grad.to(self.reduce_dtype)`](../zero/grads.py#L82)``).

So a label can never be a file name with a line number attached: say which statement.
After code moves, ``python tests/test_notes.py --fix`` re-points the links that break the
rule to the line that satisfies it (a definition's line; the nearest line holding the
fragment) and lists those it cannot place.
"""

from __future__ import annotations

import ast
import glob
import os
import re
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), ".."))
LINK = re.compile(r"\[([^\[\]\n]+)\]\(((?:\.\./)+)([\w/.-]+\.py)#L(\d+)\)")


def definitions(path: str) -> dict[str, tuple[int, int]]:
    """{qualified name: (first decorator line, def/class line)} of every class and function."""
    out: dict[str, tuple[int, int]] = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                out[name] = (first, child.lineno)
                visit(child, name + ".")

    visit(ast.parse(open(path).read()), "")
    return out


def resolve(symbol: str, defs: dict) -> tuple[int, int] | None:
    """The definition a label names, if it names one: (first decorator line, def line)."""
    name = symbol.removesuffix("()").removeprefix("zero.")
    if name in defs:
        return defs[name]
    matches = [span for q, span in defs.items() if q.endswith("." + name)]
    if len(matches) == 1:
        return matches[0]
    # `comm.reduce_scatter` in zero/comm.py; `Unit.reduce_grad` in zero/grads.py (a mixin's)
    prefix, _, rest = name.partition(".")
    return resolve(rest, defs) if rest and prefix not in defs else None


def chapters() -> list[str]:
    return sorted(glob.glob(os.path.join(ROOT, "notes", "**", "*.md"), recursive=True))


def target(chapter: str, ups: str, path: str) -> str:
    return os.path.normpath(os.path.join(os.path.dirname(chapter), ups, path))


def problem(label: str, full: str, line: int) -> str | None:
    """What is wrong with a link to ``full``'s line ``line`` labelled ``label``, or None."""
    if not os.path.exists(full):
        return "the file does not exist"
    lines = open(full).read().splitlines()
    if not 1 <= line <= len(lines):
        return f"line {line} is past the end ({len(lines)} lines)"
    if not (label.startswith("`") and label.endswith("`") and len(label) > 2):
        return f"the label {label} is not code in backticks"
    code = label[1:-1]
    span = resolve(code, definitions(full))
    if span is not None:
        if not span[0] <= line <= span[1]:
            return f"`{code}` is defined at line {span[1]}"
    elif code not in lines[line - 1]:
        return f"line {line} does not contain `{code}`: {lines[line - 1].strip()!r}"
    return None


def links():
    """(chapter, label, ups, path, line) for every line link in the notes."""
    for chapter in chapters():
        for m in LINK.finditer(open(chapter).read()):
            yield chapter, m.group(1), m.group(2), m.group(3), int(m.group(4))


def test_every_code_link_names_the_line_it_lands_on():
    bad, checked = [], 0
    for chapter, label, ups, path, line in links():
        checked += 1
        why = problem(label, target(chapter, ups, path), line)
        if why:
            bad.append(f"{os.path.relpath(chapter, ROOT)}: [{label}]({ups}{path}#L{line}): {why}")
    assert checked > 200 and not bad, "\n".join(bad + ["(python tests/test_notes.py --fix)"])


def test_the_rule_catches_a_link_one_line_off():
    """The checker itself: a definition one line off, a fragment one line off, a file name."""
    grads = os.path.join(ROOT, "zero", "grads.py")
    def_line = definitions(grads)["GradientMixin.reduce_grad"][1]
    assert problem("`Unit.reduce_grad`", grads, def_line) is None
    assert problem("`Unit.reduce_grad`", grads, def_line + 1) is not None
    lines = open(grads).read().splitlines()
    at = next(i for i, s in enumerate(lines, 1) if "grad.to(self.reduce_dtype)" in s)
    assert problem("`grad.to(self.reduce_dtype)`", grads, at) is None
    assert problem("`grad.to(self.reduce_dtype)`", grads, at + 1) is not None
    assert problem("`grads.py`", grads, at) is not None
    assert problem("grads.py", grads, at) is not None


# ---- python tests/test_notes.py --fix: re-point links after code moved -------------------

def _place(label: str, full: str, line: int) -> int | None:
    code = label[1:-1] if label.startswith("`") and label.endswith("`") else None
    if code is None or not os.path.exists(full):
        return None
    span = resolve(code, definitions(full))
    if span is not None:
        return span[1]
    hits = [i for i, s in enumerate(open(full).read().splitlines(), 1) if code in s]
    return min(hits, key=lambda i: abs(i - line)) if hits else None


def fix() -> None:
    moved, left = 0, []
    for chapter in chapters():
        text = open(chapter).read()

        def repoint(m):
            nonlocal moved
            label, ups, path, line = m.group(1), m.group(2), m.group(3), int(m.group(4))
            full = target(chapter, ups, path)
            if problem(label, full, line) is None:
                return m.group(0)
            new = _place(label, full, line)
            if new is None:
                left.append(f"{os.path.relpath(chapter, ROOT)}: {m.group(0)}: "
                            f"{problem(label, full, line)}")
                return m.group(0)
            moved += 1
            return f"[{label}]({ups}{path}#L{new})"

        new_text = LINK.sub(repoint, text)
        if new_text != text:
            open(chapter, "w").write(new_text)
    print(f"re-pointed {moved} link(s)")
    for entry in left:
        print("cannot place:", entry)


if __name__ == "__main__":
    if sys.argv[1:] == ["--fix"]:
        fix()
    else:
        sys.exit("usage: python tests/test_notes.py --fix   (the checks run under pytest)")
