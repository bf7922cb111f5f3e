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
   character for character (``[`grad.to(self.reduce_dtype)`](../zero/core/grads.py#L82)``).

So a label can never be a file name with a line number attached: say which statement.
After code moves, ``python tests/notes/test_notes.py --fix`` re-points the links that break the
rule to the line that satisfies it (a definition's line; the nearest line holding the
fragment), in another file if its own no longer holds it (a file renamed or split: the one
file that defines the label, or that holds the fragment), and lists those it cannot place.

The notes quote the outputs of notes/figures/*.py, committed beside them as .txt files, and a
figure that the code no longer produces teaches the wrong thing too. ``FIGURES`` says how
each committed output is kept honest: rerun here and compared character for character, or,
where a run is too slow for the suite or its output holds timings, which numbers a test
checks instead.
"""

from __future__ import annotations

import ast
import contextlib
import glob
import importlib.util
import io
import os
import re
import sys

import pytest
import torch

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", ".."))
LINK = re.compile(r"\[(`[^`\n]+`|[^\[\]`\n]+)\]\(((?:\.\./)+)([\w/.-]+\.py)#L(\d+)\)")


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
    # `comm.reduce_scatter` in zero/comm/collectives.py; `Unit.reduce_grad` in zero/core/grads.py (a mixin's)
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
    assert checked > 200 and not bad, "\n".join(bad + ["(python tests/notes/test_notes.py --fix)"])


def test_the_rule_catches_a_link_one_line_off():
    """The checker itself: a definition one line off, a fragment one line off, a file name."""
    grads = os.path.join(ROOT, "zero", "core", "grads.py")
    def_line = definitions(grads)["Gradient.start_reduce"][1]
    assert problem("`Gradient.start_reduce`", grads, def_line) is None
    assert problem("`Gradient.start_reduce`", grads, def_line + 1) is not None
    lines = open(grads).read().splitlines()
    at = next(i for i, s in enumerate(lines, 1) if "grad.to(self.reduce_dtype)" in s)
    assert problem("`grad.to(self.reduce_dtype)`", grads, at) is None
    assert problem("`grad.to(self.reduce_dtype)`", grads, at + 1) is not None
    assert problem("`grads.py`", grads, at) is not None
    assert problem("grads.py", grads, at) is not None
    found = LINK.search("see [`grad[self._slot]`](../zero/core/grads.py#L7).")  # brackets in code
    assert found and found.group(1) == "`grad[self._slot]`" and found.group(4) == "7"
    # --fix follows a label into the one file that now defines it (a file renamed or split)
    assert _elsewhere("`Gradient.start_reduce`") == (grads, def_line)
    at = next(i for i, s in enumerate(lines, 1) if "kept = self.keeps_full and" in s)
    assert _elsewhere("`kept = self.keeps_full and`") == (grads, at)
    assert _elsewhere("`no such code anywhere`") is None


# ---- the figures' committed outputs ------------------------------------------------------

RERUN = "rerun"  # cheap and deterministic: rerun and compared character for character
SCHEDULE = ("its model-state peaks are zerolab.memory.schedule's, which tests/core/test_memory.py "
            "holds to the measured peak, to the byte (test_memory_figures_quote_the_schedule); "
            "a run takes 10-20 s")
FIGURES = {
    "flat_layout": RERUN,
    "layouts": RERUN,
    "flat_autograd": RERUN,
    "collectives": RERUN,
    "gloo_order": RERUN,
    "unused_agreement": RERUN,
    "meta_init": RERUN,
    "ledger_stage3": RERUN,
    "traffic_by_system": "its rows for our stages are ring accounting over the units' sizes "
                         "(test_traffic_figure_quotes_ring_accounting); a run takes 5-8 s",
    "trace_stage1": "tests/zerolab/test_trace.py: a fresh trace, but for its ms column",
    "trace_stage2": "tests/zerolab/test_trace.py: a fresh trace, but for its ms column",
    "trace_stage3": "tests/zerolab/test_trace.py: a fresh trace, but for its ms column",
    "stage1": SCHEDULE + "; Part 2's times vary from run to run",
    "stage2": SCHEDULE,
    "stage3": SCHEDULE + "; Part 1's times vary from run to run",
    "checkpoint_costs": "its bytes sent are 12Ψ(N-1)/N plus one agreement, 16(N-1) "
                        "(test_checkpoint_costs_quote_the_traffic_formula); its seconds vary",
    "check_mode_cost": "timings only: milliseconds per step on this machine",
    "gloo_collectives": "timings only, of torch's gloo: no code of ours",
    "fp_arithmetic": "float32 facts and torch's DDP, no code of ours; 15 s",
    "clip_norm": "35 s; tests/core/test_equality.py holds its claims (inf-norm bitwise, the 2-norm "
                 "within 3e-7, parameters within 1e-6)",
    "reduction_order": "45 s or more; tests/core/test_equality.py holds its claims (bitwise at "
                       "N = 2, within 1e-6 at N = 3 and 4)",
}
FIGURES_DIR = os.path.join(ROOT, "notes", "figures")


def test_every_figure_output_says_how_it_is_checked():
    committed = {f[:-4] for f in os.listdir(FIGURES_DIR) if f.endswith(".txt")}
    assert committed == set(FIGURES), committed ^ set(FIGURES)


@pytest.mark.parametrize("name", [n for n, how in FIGURES.items() if how == RERUN])
def test_a_figure_output_is_what_its_script_prints_today(name, monkeypatch):
    monkeypatch.setenv("ZERO_CHECK", "0")  # as a reader runs it: no agreement per collective
    spec = importlib.util.spec_from_file_location(f"figure_{name}",
                                                  os.path.join(FIGURES_DIR, f"{name}.py"))
    script = importlib.util.module_from_spec(spec)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), __import__("warnings").catch_warnings():
        spec.loader.exec_module(script)
        script.main()
    path = os.path.join(FIGURES_DIR, f"{name}.txt")
    assert printed.getvalue() == open(path).read(), (
        f"{path} is stale: python notes/figures/{name}.py > notes/figures/{name}.txt")


def test_the_animation_is_what_its_script_builds_today():
    """notes/figures/who_holds_what.html is rebuilt from the committed traces and compared; its
    frames carry every event's bytes, and the stages differ the way their tables say."""
    spec = importlib.util.spec_from_file_location("figure_who_holds_what",
                                                  os.path.join(FIGURES_DIR, "who_holds_what.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    path = os.path.join(FIGURES_DIR, "who_holds_what.html")
    assert script.page() == open(path).read(), (
        f"{path} is stale: python notes/figures/who_holds_what.py")
    stages = {s: script.frames(s) for s in (1, 2, 3)}
    for s, d in stages.items():
        rows = [line for line in open(os.path.join(FIGURES_DIR, f"trace_stage{s}.txt"))
                if re.search(r"\d+ +\d+  (all|none|root|blocks)", line)]
        assert len(d["frames"]) == len(rows) > 20, s
    most = {s: {k: max(f[k] for f in d["frames"]) for k in ("params", "grads")}
            for s, d in stages.items()}
    assert most[1]["grads"] > most[2]["grads"]  # stage 2 never holds every full gradient
    assert all(len(f["full"]) == 3 for f in stages[2]["frames"])  # stages 1, 2: all, always
    assert not stages[3]["frames"][-1]["full"]  # stage 3 keeps no full parameters
    for chapter in ("03-stage1.md", "04-stage2.md", "05-stage3.md", "00-start-here.md"):
        assert "figures/who_holds_what.html" in open(os.path.join(ROOT, "notes", chapter)).read()


def test_a_quoted_trace_is_the_committed_one():
    """The notes quote ``python -m zerolab trace`` whole once (chapter 5), as committed but for the
    times (tests/zerolab/test_trace.py holds the committed output to a fresh run); every other quote is
    an excerpt, tests/notes/test_learner_path.py's test_a_trace_excerpt_is_rows_of_the_committed_one."""
    times = re.compile(r"^ *\d+\.\d\d  ", re.M)
    quoted = 0
    for chapter in chapters():
        for block in re.findall(r"```\n(ZeRO-\d: one training step.*?)```", open(chapter).read(),
                                re.S):
            stage = block[5]
            committed = open(os.path.join(FIGURES_DIR, f"trace_stage{stage}.txt")).read()
            assert times.sub("  ", block) == times.sub("  ", committed), (chapter, stage)
            quoted += 1
    assert quoted == 1


def _numbers(pattern: str, text: str) -> list[tuple[int, ...]]:
    return [tuple(int(g) for g in m.groups()) for m in re.finditer(pattern, text)]


def test_memory_figures_quote_the_schedule():
    from zero.core.flat import FlatLayout
    from zerolab.memory import schedule
    from zerolab.models import GPT, GPTConfig

    model = GPT(GPTConfig(layers=8, dim=64, vocab=64, seq=16))  # tests/core/test_memory.py's
    block = [p.shape for p in model.blocks[0].parameters()]
    root = [p.shape for name, p in model.named_parameters() if not name.startswith("blocks.")]
    units = [FlatLayout(root, 2).padded_numel] + [FlatLayout(block, 2).padded_numel] * 8
    tensors = len(root) + 8 * len(block)
    at = {stage: schedule(units, stage, 2, tensors) for stage in (1, 2, 3)}
    read = lambda name: open(os.path.join(FIGURES_DIR, f"{name}.txt")).read()  # noqa: E731

    stage1 = _numbers(r"fp32: .*\n(?:.*\n)*?  model states +(\d+) \( *[\d.]+\) +(\d+) \(",
                      read("stage1"))
    assert stage1[0] == (at[1]["peak"], at[1]["at_rest"])
    said = _numbers(r"schedule, unit by unit: at rest (\d+) \+ in flight (\d+) = (\d+)", read("stage2"))
    assert said == [tuple(at[s][k] for k in ("at_rest", "in_flight", "peak")) for s in (1, 2)]
    measured = _numbers(r"at the worst instant (\d+) =", read("stage2"))
    assert measured == [(at[1]["peak"],), (at[2]["peak"],)]
    said = _numbers(r"schedule, unit by unit: at rest (\d+) \+ in flight (\d+) = (\d+) "
                    r"\(measured: (\d+)\)", read("stage3"))
    assert said == [(at[3]["at_rest"], at[3]["in_flight"], at[3]["peak"], at[3]["peak"])]


def test_traffic_figure_quotes_ring_accounting():
    from zero.core.flat import FlatLayout
    from zerolab.models import GPT, GPTConfig

    model = GPT(GPTConfig(vocab=512, seq=64, dim=128, heads=4, layers=4))  # the figure's
    psi = sum(p.numel() for p in model.parameters())
    blocks = [FlatLayout([p.shape for p in b.parameters()], 2).padded_numel for b in model.blocks]
    root = [p.shape for name, p in model.named_parameters() if not name.startswith("blocks.")]
    units = [FlatLayout(root, 2).padded_numel] + blocks
    tensors = len(list(model.parameters()))
    half = psi / 2  # "in Ψ" divides the elements sent by (N-1)/N Ψ
    flags, agree = tensors / half, 2 / half  # a byte per tensor (all-reduce: twice (N-1)/N)
    gathered = {"zero1": sum(units), "zero2": sum(units), "zero3": sum(units) + sum(blocks)}
    text = open(os.path.join(FIGURES_DIR, "traffic_by_system.txt")).read()
    for kind, gather in gathered.items():
        total = (sum(units) / 2 + gather / 2) / half + flags + agree
        counts = (len(units), len(units) + 1 if kind != "zero3" else len(units) + len(blocks) + 1)
        row = (f"{kind:<8} {total:>6.3f}  {flags:>14.3f} ( 1x){sum(units) / psi:>14.3f} "
               f"({counts[0]:>2}x)"
               f"{(gather / 2 + 2) / half:>14.3f} ({counts[1]:>2}x)")
        assert row in text, (row, text)


def test_checkpoint_costs_quote_the_traffic_formula():
    text = open(os.path.join(FIGURES_DIR, "checkpoint_costs.txt")).read()
    psi = int(re.search(r"psi = ([\d,]+) parameters", text).group(1).replace(",", ""))
    rows = re.findall(r"^ +(\d) +([\d,]+) +([\d,]+) ", text, re.M)
    assert len(rows) == 3
    for n, sent, formula in rows:
        n, sent, formula = int(n), int(sent.replace(",", "")), int(formula.replace(",", ""))
        assert formula == 12 * psi * (n - 1) // n
        assert formula <= sent - 16 * (n - 1) <= formula + 4 * 12 * n  # padding: a row per rank


def test_the_readme_says_how_long_the_code_is():
    """The README's sizes are lines of files (docstrings and comments included), within 10%."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    lines = lambda paths: sum(len(open(os.path.join(ROOT, p)).read().splitlines())  # noqa: E731
                              for p in paths)
    mechanism = [*glob.glob("zero/core/*.py", root_dir=ROOT), *glob.glob("zero/comm/*.py", root_dir=ROOT),
                 "zero/surface/shard.py"]
    package = glob.glob(os.path.join(ROOT, "zero", "**", "*.py"), recursive=True)
    said = re.search(r"The\s+three stages alone take (\d+) lines.*?the mechanism of the full package"
                     r".*?about\s+([\d,]+);.*?the whole\s+package.*?about\s+([\d,]+)", readme, re.S)
    assert said, "the README's sentence about sizes changed: update this test"
    minimal, mech, whole = (int(g.replace(",", "")) for g in said.groups())
    assert lines(["zero/minimal.py"]) <= minimal
    parts = re.search(r"minimal\.py\`\]\(zero/minimal\.py\):\s+(\d+) of code,\s+(\d+) of\s+docstrings",
                      readme)
    assert parts and tuple(map(int, parts.groups())) == _code_and_docstrings("zero/minimal.py")
    for claim, measured in ((mech, lines(mechanism)), (whole, lines(package))):
        assert abs(claim - measured) <= 0.1 * measured, (
            f"the README says about {claim} lines, the code has {measured}: update the README")


def _code_and_docstrings(path: str) -> tuple[int, int]:
    """Lines of code (neither blank, nor comment, nor docstring) and of docstrings in a file."""
    text = open(os.path.join(ROOT, path)).read()
    docs = set()
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and body and \
                isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and \
                isinstance(body[0].value.value, str):
            docs.update(range(body[0].lineno, body[0].end_lineno + 1))
    code = [s for i, s in enumerate(text.splitlines(), 1)
            if i not in docs and s.strip() and not s.strip().startswith("#")]
    return len(code), len(docs)


# ---- the learner's path, walked fresh (issue 34): what cost a newcomer time -----------------

def _core(chapter: str) -> str:
    """A chapter without its sections marked *On a second reading* (as the path reads it)."""
    parts = re.split(r"(?m)^(?=## )", open(os.path.join(ROOT, "notes", chapter)).read())
    return "".join(p for p in parts if "*On a second reading" not in p[:300])


def test_a_core_section_names_the_file_of_each_output_it_quotes():
    """An output quoted in the part of a chapter read first names its file there, before the
    quote, not only in a section marked *on a second reading* that the reader skipped
    (chapter 5 once quoted "Part 2 of the output" of a figure it had named only there)."""
    outputs = {f: {line.strip() for line in open(os.path.join(FIGURES_DIR, f)) if line.strip()}
               for f in os.listdir(FIGURES_DIR) if f.endswith(".txt")}
    unnamed, quotes = [], 0
    for chapter in ("03-stage1.md", "04-stage2.md", "05-stage3.md"):
        text = _core(chapter)
        for m in re.finditer(r"```\n(.*?)```", text, re.S):
            lines = [s.strip() for s in m.group(1).splitlines() if s.strip() and s.strip() != "..."]
            for name, held in outputs.items():
                if lines and all(s in held for s in lines):
                    quotes += 1
                    if f"figures/{name}" not in text[:m.start()]:
                        unnamed.append((chapter, name, lines[0]))
    assert quotes >= 1 and not unnamed, unnamed


def test_chapter_5_says_what_the_stage_table_is_where_it_uses_it():
    """The path reaches chapter 5 from the road, without chapters 3 and 4: the sentence that
    places stage 3 in ``STAGES`` says what the table's rows and columns are."""
    para = next(p for p in _core("05-stage3.md").split("\n\n") if "keep_params=False" in p)
    para = " ".join(para.split())
    assert "[`STAGES`]" in para and "a row per stage" in para and "`keep_grads`" in para, para


def test_the_core_of_chapter_5_says_which_model_it_counts():
    """A number of the 4-block GPT in chapter 5 says it is the road's model (its own trace
    has 2 blocks), and is the one the road prints where the road prints it."""
    text = " ".join(open(os.path.join(ROOT, "notes", "05-stage3.md")).read().split())
    assert "GPT above" not in text
    assert "On the road's 4-block GPT, whose root is 0.067Ψ, the package sends 2.933R" in text
    step4 = " ".join(open(os.path.join(ROOT, "notes", "road", "README.md")).read().split())
    assert "road step 4, which gathers its root again for backward, prints 3.000R" in text
    assert "(3R sent)" in step4  # the road's ZeRO-3 paragraph: every unit gathered twice


def test_the_start_page_points_to_its_table_of_names_the_right_way():
    """The path's first step names the table of names as above or below the list, as it is."""
    text = open(os.path.join(ROOT, "notes", "00-start-here.md")).read()
    table = text.index("## From the road's names to the package's")
    for m in re.finditer(r"table of names (?:just )?(above|below)", text):
        assert (m.group(1) == "above") == (table < m.start()), text[m.start() - 40: m.end() + 40]
    assert re.search(r"table of names (?:just )?(above|below)", text)


def test_the_road_folds_steps_4_and_5_until_exercise_5_is_done():
    """Exercise 5 asks to write step 4 before reading it: on the road's page the paragraphs of
    steps 4 and 5, which give its answers (resize to 0, refill through ``.data``), stay folded
    under the stop sign until the reader opens them."""
    text = open(os.path.join(ROOT, "notes", "road", "README.md")).read()
    stop, zero3 = text.index("*Stop here, after step 3"), text.index("**ZeRO-3** frees")
    fold = text.index("<details>", stop)
    assert stop < fold < zero3 < text.index("**Prefetching**") < text.index("</details>", fold)
    assert "exercise 5" in text[fold: zero3] and "<summary>" in text[fold: zero3]


def test_the_glossary_counts_the_agreement_as_the_trace_does():
    """The trace's agreement row shows its buffer (32 B) and its summary what was sent (16 B):
    the glossary says both, so that neither looks like a mistake."""
    trace = open(os.path.join(FIGURES_DIR, "trace_stage3.txt")).read()
    row = re.search(r"agree on the next step, (\d+) B", trace).group(1)
    sent = re.search(r"(\d+) agree (\d+) B", trace).groups()
    glossary = " ".join(open(os.path.join(ROOT, "notes", "00-start-here.md")).read().split())
    assert f"`agree on the next step, {row} B`: its buffer, of which each rank sends {sent[1]}" \
        in glossary and f"`{sent[0]} agree {sent[1]} B`" in glossary


def test_the_exercise_check_shows_a_path_the_learner_can_find(tmp_path):
    """``check.py 5 /tmp/mine.py`` names /tmp/mine.py, not ../../tmp/mine.py."""
    spec = importlib.util.spec_from_file_location(
        "exercise_check", os.path.join(ROOT, "notes", "exercises", "check.py"))
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    mine = str(tmp_path / "mine.py")
    assert check.shown(mine) == mine
    here = os.path.join(os.getcwd(), "notes", "exercises", "5_write_stage3.py")
    assert check.shown(here) == os.path.join("notes", "exercises", "5_write_stage3.py")


def test_table_1_quotes_the_paper_as_printed():
    """Chapter 9's and simulate.py's "paper" cells are the ZeRO paper's Table 1 as printed: each
    formula at Ψ = 7.5e9 rounded half up to the digits shown (41.25 is printed 41.3, which
    this project once misquoted as 41.2), the same in simulate.py and in its results file."""
    from decimal import ROUND_HALF_UP, Decimal

    psi = Decimal("7.5")
    formula = {1: lambda n: 4 * psi + 12 * psi / n, 2: lambda n: 2 * psi + 14 * psi / n,
               3: lambda n: 16 * psi / n}
    text = open(os.path.join(ROOT, "notes", "09-scale.md")).read().split("## Table 1", 1)[1]
    printed = {int(n): tuple(re.findall(r"([\d.]+)\*? →", cells))
               for n, cells in re.findall(r"^\| (\d+) \| (.+) \|$", text, re.M)}
    for n, cells in printed.items():
        for stage, cell in enumerate(cells, 1):
            assert formula[stage](n).quantize(Decimal(cell), ROUND_HALF_UP) == Decimal(cell), (n, cell)
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import simulate

    assert {n: tuple(float(c) for c in cells) for n, cells in printed.items()} == simulate.PAPER_TABLE1
    results = open(os.path.join(ROOT, "benchmarks", "results", "2026-11-29-x86_64-2cpu-simulate.md")).read()
    column = {(int(n), int(s)): float(p) for n, s, p in
              re.findall(r"^\| (\d+) \| ([123]) \| ([\d.]+) \| [\d.]+ \| [\d.]+ \| [\d.]+ \|$",
                         results.split("## Table 1", 1)[1].split("## Table 2", 1)[0], re.M)}
    assert column == {(n, s): v[s - 1] for n, v in simulate.PAPER_TABLE1.items() for s in (1, 2, 3)}


def test_a_core_section_sends_to_a_skipped_one_by_name():
    """"The next section" in the part of a chapter read first is a section read first too;
    a section marked *on a second reading* is named and linked (chapter 3 once sent the reader
    to "the next section", which was one the path skips and not the one that followed)."""
    bad = []
    for chapter in ("03-stage1.md", "04-stage2.md", "05-stage3.md"):
        parts = re.split(r"(?m)^(?=## )", open(os.path.join(ROOT, "notes", chapter)).read())
        second = ["*On a second reading" in p[:300] for p in parts]
        for i, part in enumerate(parts):
            if not second[i] and "next section" in " ".join(part.split()):
                if i + 1 >= len(parts) or second[i + 1]:
                    bad.append((chapter, part.split("\n", 1)[0]))
    assert not bad, bad


# ---- python tests/notes/test_notes.py --fix: re-point links after code moved -------------------

def _place(label: str, full: str, line: int) -> int | None:
    code = label[1:-1] if label.startswith("`") and label.endswith("`") else None
    if code is None or not os.path.exists(full):
        return None
    span = resolve(code, definitions(full))
    if span is not None:
        return span[1]
    hits = [i for i, s in enumerate(open(full).read().splitlines(), 1) if code in s]
    return min(hits, key=lambda i: abs(i - line)) if hits else None


def _elsewhere(label: str) -> tuple[str, int] | None:
    """Where a label that its file no longer holds went (a file renamed or split): the one
    Python file of the project that defines it, or else the one with a line containing it."""
    code = label[1:-1] if label.startswith("`") and label.endswith("`") else None
    if code is None:
        return None
    files = [f for d in ("zero", "zerolab", "benchmarks", "tests", "notes")
             for f in sorted(glob.glob(os.path.join(ROOT, d, "**", "*.py"), recursive=True))
             if not os.path.samefile(f, __file__)]  # (this file quotes labels as examples)
    name = code.removesuffix("()").removeprefix("zero.")
    defined = [(f, defs[name][1]) for f in files if name in (defs := definitions(f))]
    defined = defined or [(f, span[1]) for f in files if (span := resolve(code, definitions(f)))]
    if len(defined) == 1:
        return defined[0]
    if defined:
        return None  # defined in several files: say which in the label
    found = [(f, i) for f in files for i, s in enumerate(open(f).read().splitlines(), 1)
             if code in s]
    return found[0] if len({f for f, _ in found}) == 1 else None


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
            if new is not None:
                moved += 1
                return f"[{label}]({ups}{path}#L{new})"
            found = _elsewhere(label)
            if found is None:
                left.append(f"{os.path.relpath(chapter, ROOT)}: {m.group(0)}: "
                            f"{problem(label, full, line)}")
                return m.group(0)
            moved += 1
            rel = os.path.relpath(found[0], os.path.dirname(chapter))
            return f"[{label}]({rel}#L{found[1]})"

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
        sys.exit("usage: python tests/notes/test_notes.py --fix   (the checks run under pytest)")
