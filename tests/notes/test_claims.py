"""What the pages claim about the package is checked wherever a command can check it.

tests/notes/test_notes.py holds the notes' links to code lines and their committed figures;
tests/notes/test_learner_path.py the path's clock and its numbers. This file holds the rest of
what a page says about the code's structure or its printed output:

- every file a page names exists, every ``zero.*`` name imports, and every ``Class.member``
  of a class the project defines is a member of it;
- the start page's table of names maps each road name to what the package calls it;
- every word of the path's glossary is used on the path, and the words it does not use wait
  in a section after it (a link to a word lands on the section that defines it); the glossary
  holds exercise 5's tools, not its answers;
- the predict-then-check questions come before every page whose output answers them;
- each sentence in ``CLAIMS`` is on its page, and the committed trace it describes (which
  tests/zerolab/test_trace.py holds to a fresh run, but for its times) says the same; the
  sentences that earlier editions got wrong are refuted by the same checks.

Where a claim is about a figure's timings (which change from run to run) it is checked
against the committed figure the page shows.
"""

from __future__ import annotations

import ast
import functools
import glob
import importlib
import importlib.util
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_learner_path import minimal_part, read, readme_part, road_split  # noqa: E402

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", ".."))
FIGURES = os.path.join(ROOT, "notes", "figures")


def pages() -> list[str]:
    """Every page a reader may open: the notes and the README (the CHANGELOG is history)."""
    return sorted(glob.glob(os.path.join(ROOT, "notes", "**", "*.md"), recursive=True)) + [
        os.path.join(ROOT, "README.md")]


def flat(text: str) -> str:
    return " ".join(text.split())


def section(text: str, heading: str) -> str:
    """The text under ``## heading``, to the next heading of that level."""
    at = text.index(f"## {heading}\n")
    nxt = text.find("\n## ", at + 3)
    return text[at: nxt if nxt >= 0 else len(text)]


# ---- the package's structure: files, modules, members ---------------------------------------

PATH_NAME = re.compile(r"`((?:zero|zerolab|benchmarks|tests|notes)/[\w/.-]+)`")
LINK = re.compile(r"\]\(((?!https?:)[\w./-]+?)(?:#[\w-]*)?\)")


def named_files(page: str) -> list[str]:
    """Repository paths a page names in backticks, and relative links, resolved."""
    text = open(page).read()
    out = [os.path.join(ROOT, p) for p in PATH_NAME.findall(text)]
    out += [os.path.normpath(os.path.join(os.path.dirname(page), p)) for p in LINK.findall(text)]
    return out


def test_every_file_a_page_names_exists():
    missing = [(os.path.relpath(page, ROOT), os.path.relpath(f, ROOT))
               for page in pages() for f in named_files(page) if not os.path.exists(f)]
    assert not missing, missing


# The README's layout table names each folder's files bare (`unit.py` in the `zero/core/` row).


def layout_names() -> list[tuple[str, str]]:
    """(folder, file) for each file a row of the README's layout table names."""
    table = section(read("README.md"), "Layout")
    out = []
    for row in re.findall(r"^\| (.+?) \| (.+) \|$", table, re.M):
        first = re.findall(r"`([^`]+)`", row[0])
        if not first or not first[0].startswith(("zero/", "zerolab/", "benchmarks/")):
            continue
        folder = first[0] if first[0].endswith("/") else os.path.dirname(first[0]) + "/"
        for name in re.findall(r"`([\w]+\.py)`", row[0] + " " + row[1]):
            out.append((folder, name))
    return out


def test_every_file_the_readme_layout_names_exists():
    names = layout_names()
    assert len(names) > 40
    stale = {(d, f) for d, f in names if not os.path.exists(os.path.join(ROOT, d, f))}
    assert stale == set(), f"named in the README's layout, not there: {stale}"


@functools.lru_cache(maxsize=None)
def project_classes() -> dict[str, set[str]]:
    """{class name: every member it or a class of the same name defines}, over the package,
    the bench and the road (methods, class attributes, and attributes set on ``self``)."""
    files = [f for d in ("zero", "zerolab", "notes") for f in
             glob.glob(os.path.join(ROOT, d, "**", "*.py"), recursive=True)]
    members: dict[str, set[str]] = {}
    bases: dict[str, set[str]] = {}
    for f in files:
        for node in ast.walk(ast.parse(open(f).read())):
            if not isinstance(node, ast.ClassDef):
                continue
            got = members.setdefault(node.name, set())
            bases.setdefault(node.name, set()).update(
                b.id for b in node.bases if isinstance(b, ast.Name))
            for sub in ast.walk(node):
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    got.add(sub.name)
                elif isinstance(sub, ast.AnnAssign) and isinstance(sub.target, ast.Name):
                    got.add(sub.target.id)
                elif isinstance(sub, ast.AnnAssign) and isinstance(sub.target, ast.Attribute):
                    got.add(sub.target.attr)  # (self.form: api.ParamForm = ...)
                elif isinstance(sub, ast.Assign):
                    for t in sub.targets:
                        for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
                            if isinstance(e, ast.Name):
                                got.add(e.id)
                            elif isinstance(e, ast.Attribute):
                                got.add(e.attr)
    for name in list(members):  # inherited members, over the project's classes
        todo, seen = list(bases.get(name, ())), set()
        while todo:
            base = todo.pop()
            if base in members and base not in seen:
                seen.add(base)
                members[name] |= members[base]
                todo += bases.get(base, ())
    return members


DOTTED = re.compile(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\([^`]*\))?`")


def missing_names(text: str, classes: dict[str, set[str]]) -> list[str]:
    """The dotted names in backticks that do not exist: ``zero.X.Y`` that does not import,
    ``Class.member`` of a project class that has no such member."""
    out = []
    for name in DOTTED.findall(text):
        parts = name.split(".")
        if parts[0] in ("zero", "zerolab"):
            obj = None
            try:
                obj = importlib.import_module(parts[0])
                for i, part in enumerate(parts[1:], 1):
                    obj = getattr(obj, part) if hasattr(obj, part) else importlib.import_module(
                        ".".join(parts[: i + 1]))
            except ImportError:
                out.append(name)
        elif parts[0] in classes and len(parts) == 2 and parts[1] not in classes[parts[0]]:
            out.append(name)
    return out


def test_every_name_a_page_gives_exists():
    classes = project_classes()
    bad = {os.path.relpath(p, ROOT): m for p in pages() if (m := missing_names(open(p).read(), classes))}
    assert not bad, bad


def test_the_name_rule_catches_a_name_that_is_not_there():
    classes = project_classes()
    assert missing_names("`Unit.unshard`, `Unit._free`, `zero.shard`, `Schedule.forward_prefetch`",
                         classes) == []
    assert missing_names("`Unit.unshard_all`, `zero.shardd`, `zero.core.nothing`", classes) == [
        "Unit.unshard_all", "zero.shardd", "zero.core.nothing"]


# ---- the start page's table of names ---------------------------------------------------------

def road_defines() -> set[str]:
    """Every function, method and class the road's steps and zero/minimal.py define."""
    files = glob.glob(os.path.join(ROOT, "notes", "road", "[0-9]_*.py")) + [
        os.path.join(ROOT, "zero", "minimal.py")]
    return {n.name for f in files for n in ast.walk(ast.parse(open(f).read()))
            if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def names_table() -> list[tuple[list[str], list[str]]]:
    """(road names, package names) of each row: each code span's last dotted name."""
    table = section(read("notes/00-start-here.md"), "From the road's names to the package's")
    name = lambda code: code.split("(")[0].split(".")[-1]  # noqa: E731
    return [([name(c) for c in re.findall(r"`([^`]+)`", a)], [name(c) for c in re.findall(r"`([^`]+)`", b)])
            for a, b in re.findall(r"^\| (.+?) \| (.+?) \| .+ \|$", table, re.M)
            if not a.startswith("road, ")]


def test_the_table_of_names_maps_each_road_name_once():
    """A road function named in the table exists in the road; and where the road defines a
    name the package also has (road step 5's ``unshard``), the two share a row (the third
    edition mapped the road's ``gather`` to the package's ``unshard``, beside step 5's own)."""
    rows, defined = names_table(), road_defines()
    assert len(rows) >= 10
    for road, _ in rows:
        called = [n for n in road if n not in ("unit", "full", "shard", "next")]  # attributes
        assert all(n in defined for n in called), (road, defined)
    for road, package in rows:
        for name in set(package) & defined:
            assert name in road, f"the package's `{name}` is mapped from {road}, but the road defines `{name}` too"


# ---- the glossary ----------------------------------------------------------------------------

def glossary(heading: str) -> dict[str, str]:
    """{term: its entry} for each bullet of a glossary section (the term: its first bold)."""
    text = section(read("notes/00-start-here.md"), heading)
    out = {}
    for entry in re.split(r"\n(?=- \*\*)", text)[1:]:
        out[re.search(r"\*\*(.+?)\*\*", entry).group(1).strip("`")] = flat(entry)
    return out


# How a glossary term shows in running text, where that is not the term itself.
USED_AS = {"N": r"\bN = \d", "R": r"\d\.\d{3}R|\b\dR\b", "Ψ": "Ψ", "hooks": r"\bhook",
           "the four hooks of a unit": r"\bpre_forward\b", "full": r"\bfull\b",
           "P_os, P_os+g, P_os+g+p": r"P_os", "the agreement": r"\bagree",
           "t.data": r"\.data\b", "the ledger": r"(?<!-)\bledger\b"}


def the_path() -> str:
    """What the path to the goal reads, but for the glossary itself: the README's part, the
    start page to its table of names, the road (page and steps), exercise 5, zero/minimal.py's
    part, chapter 5 without its second-reading sections, and the predictions' answers."""
    start = read("notes/00-start-here.md").split("## From the road's names")[0]
    start = start.replace(section(start + "\n## ", "Words used everywhere"), "")
    road = read("notes/road/README.md") + "".join(
        read(f"notes/road/{s}.py") for s in ("1_ddp", "2_zero1", "3_zero2", "4_zero3", "5_prefetch"))
    parts = [readme_part(), start, road, read("notes/exercises/README.md").split("**1. ZeRO-1")[0],
             read("notes/exercises/5_write_stage3.py"), minimal_part(), chapter_5_core(),
             read("notes/exercises/solutions/predict.md")]
    return "\n".join(parts)


def chapter_5_core() -> str:
    parts = re.split(r"(?m)^(?=## )", read("notes/05-stage3.md"))
    return "".join(p for p in parts if "*On a second reading" not in p[:300])


def used(term: str, text: str) -> bool:
    pattern = USED_AS.get(term, re.escape(term.removeprefix("the ")))
    return re.search(pattern, text, re.I if term not in USED_AS else 0) is not None


def test_every_word_of_the_glossary_is_used_on_the_path():
    """The path's glossary asks a newcomer to learn only words the path uses (the third
    edition's held `TrainingState`, check mode, `reduce_dtype`, router, `use_orig_params`)."""
    path = the_path()
    words = glossary("Words used everywhere")
    assert len(words) >= 12
    unused = [w for w in words if not used(w, path)]
    assert not unused, f"the path never uses {unused}: move them to 'Words of the chapters after the path'"


def test_the_words_the_path_does_not_use_are_defined_after_it():
    """A word of the later section is one the path does not use, and some chapter does."""
    path, later = the_path(), glossary("Words of the chapters after the path")
    assert {"check mode", "TrainingState", "reduce_dtype", "router", "use_orig_params"} <= set(later)
    chapters = "".join(read(os.path.relpath(p, ROOT)) for p in pages()
                       if not p.endswith(("00-start-here.md", "README.md")))
    assert not [w for w in later if used(w, path)], [w for w in later if used(w, path)]
    assert not [w for w in later if not used(w, chapters)]


def test_a_link_to_the_glossary_lands_on_its_word():
    """``[router](00-start-here.md#words-...)``: the section it opens defines ``router``."""
    start = read("notes/00-start-here.md")
    sections = {"words-used-everywhere": glossary("Words used everywhere"),
                "words-of-the-chapters-after-the-path": glossary("Words of the chapters after the path")}
    for heading in ("Words used everywhere", "Words of the chapters after the path"):
        assert f"## {heading}\n" in start
    bad, links = [], 0
    for page in pages():
        for label, anchor in re.findall(r"\[([^\]]+)\]\((?:[\w./-]*)00-start-here\.md#([\w-]+)\)",
                                        open(page).read()):
            if anchor not in sections or label in ("the start page", "start page") or \
                    label.replace(" ", "-") == anchor:  # (the section itself, by its name)
                continue
            links += 1
            term = label.strip("`").lower()
            if not any(term in w.lower() or w.lower() in term for w in sections[anchor]):
                bad.append((os.path.relpath(page, ROOT), label, anchor))
    assert links >= 5 and not bad, bad


# Exercise 5's questions 2 and 4, and what answers each: a tool, and what it does for the
# question. An entry of the glossary may name the tool (the exercise sends the reader there
# for the tools), never both.
ANSWERS = {
    2: (r"resize_", r"views?\b[^.]*\b(stay|remain|keep)s? valid|keeps the tensor object"),
    4: (r"\.data\b", r"(does not|doesn't|never) (count|notice|see)|version counter"),
}


def gives_away(entry: str) -> list[int]:
    return [q for q, (tool, effect) in ANSWERS.items()
            if re.search(tool, entry) and re.search(effect, entry, re.I)]


def test_the_glossary_holds_exercise_5s_tools_not_its_answers():
    third_edition = ("freeing by resizing: `t.untyped_storage().resize_(0)` gives a tensor's bytes "
                     "back but keeps the tensor object, so the views of it that autograd saved stay "
                     "valid; `resize_(nbytes)` and a gather into `t.data` fill it again. A write to "
                     "`t.data` is one autograd does not count")
    assert gives_away(third_edition) == [2, 4]  # the rule catches the entry issue 43 found
    entries = {**glossary("Words used everywhere"), **glossary("Words of the chapters after the path")}
    assert {w: q for w, e in entries.items() if (q := gives_away(e))} == {}
    assert "resize_" in entries["storage"] and "t.data" in entries  # the tools are there
    doc = read("notes/exercises/5_write_stage3.py")
    assert "glossary has the tools, not the answers" in flat(doc)


def test_the_glossary_quotes_trace_rows_the_trace_prints():
    """A trace row the glossary quotes (``Trace row: `...```) is in the committed trace."""
    trace = flat(open(os.path.join(FIGURES, "trace_stage3.txt")).read())
    entries = glossary("Words used everywhere")
    rows = [r for e in entries.values() for r in re.findall(r"Trace row: `([^`]+)`", e)]
    assert len(rows) >= 2 and all(flat(r) in trace for r in rows), rows


# ---- the predictions come before their answers -----------------------------------------------

def answers() -> list[str]:
    """The numbers the predict-then-check answers give (the bold of each answer)."""
    text = read("notes/exercises/solutions/predict.md")
    bold = " ".join(re.findall(r"^\d\. \*\*(.+?)\*\*", text, re.M | re.S))
    return sorted(set(re.findall(r"\d+\.\d+|\d{4,}", bold)))


def test_the_predictions_come_before_the_pages_that_answer_them():
    """On the path, the five questions come before any page or figure that prints their
    answers: the path up to chapter 5's questions quotes none of the answers, and chapter 5
    links to the traces and their animation only after them (issue 43: a newcomer who met
    the questions after chapter 5's trace scored 5/5 with two real predictions)."""
    found = answers()
    assert {"2.874", "90816", "116224", "65408", "123520"} <= set(found), found
    ch5 = read("notes/05-stage3.md")
    questions = ch5.index("## Predict, then check\n")
    assert questions < ch5.index("## The step, traced\n")
    before = "\n".join([readme_part(), read("notes/00-start-here.md"), read("notes/road/README.md"),
                        read("notes/exercises/README.md"), read("notes/exercises/5_write_stage3.py"),
                        minimal_part(), ch5[:questions]])
    assert not [a for a in found if a in before], [a for a in found if a in before]
    assert not re.search(r"trace_stage\d|who_holds_what", ch5[:questions])
    start = flat(read("notes/00-start-here.md"))
    path = start[start.index("## The path"): start.index("**Optional")]
    assert "Answer its five questions on paper before you read the traced step" in path
    assert "(../05-stage3.md#predict-then-check)" in read("notes/exercises/README.md")


# ---- claims a committed trace confirms or refutes ---------------------------------------------

ROW = re.compile(r"^ *(\d+\.\d\d)  (.{8})  (.*?) +(\d+) +(\d+)  (\S.*)$")


def rows(stage: int) -> list[tuple[str, str, int, int]]:
    """(unit, event, parameter bytes, gradient bytes) of each row of a committed trace."""
    out = []
    for line in open(os.path.join(FIGURES, f"trace_stage{stage}.txt")):
        m = ROW.match(line.rstrip("\n"))
        if m:
            out.append((m.group(2).strip(), m.group(3).strip(), int(m.group(4)), int(m.group(5))))
    return out


def at(trace, unit: str, event: str) -> int:
    """The index of the first row of ``unit`` whose event starts with ``event``."""
    return next(i for i, (u, e, _, _) in enumerate(trace) if u == unit and e.startswith(event))


UNITS = ["root", "blocks.0", "blocks.1"]  # the traced GPT's, in forward order


def reduce_issued_after_complete(stage: int) -> dict[str, int]:
    """Per unit, how many rows come between its gradient being complete and its
    reduce-scatter being issued (0: issued at once)."""
    trace = rows(stage)
    return {u: at(trace, u, "reduce-scatter issued") - at(trace, u, "post_backward: gradient complete") - 1
            for u in UNITS}


def zero2_frees_each_full_gradient_zero1_keeps_them() -> bool:
    one, two = rows(1), rows(2)
    freed = all(at(two, u, "full gradient freed") > at(two, u, "reduce-scatter done") for u in UNITS)
    never = not any(e.startswith("full gradient freed") for _, e, _, _ in one)
    kept = one[at(one, "", "opt.step() returns")][3] == one[at(one, "", "autograd is done")][3] > 0
    return freed and never and kept


def stages_1_and_2_send_the_same() -> bool:
    sent = [re.search(r"sent by this rank, in all.*?\n.*?\n", open(os.path.join(
        FIGURES, f"trace_stage{s}.txt")).read()).group(0) for s in (1, 2)]
    return sent[0] == sent[1]


def package_stage_1_reduces_as_each_gradient_completes() -> bool:
    trace, waits = rows(1), reduce_issued_after_complete(1)
    first = min(UNITS, key=lambda u: at(trace, u, "reduce-scatter issued"))
    return set(waits.values()) == {0} and first == "blocks.1"  # the last block first


def zero2_issues_each_reduce_scatter_earlier() -> bool:
    """The third edition's start page: "ZeRO-2 only issues each reduce-scatter earlier"."""
    one, two = reduce_issued_after_complete(1), reduce_issued_after_complete(2)
    return all(two[u] < one[u] for u in UNITS)


def forward_gathers_end_inside_their_own_forward() -> bool:
    """Each unit's forward all-gather is waited for inside its own forward (after its
    ``pre_forward`` row, before its ``post_forward`` row)."""
    trace = rows(3)
    return all(at(trace, u, "pre_forward") < at(trace, u, "all-gather done")
               < at(trace, u, "post_forward") for u in UNITS)


def reduce_scatters_end_inside_the_next_backward() -> bool:
    """The second edition's schedule: each block's reduce-scatter but the last ends inside the
    next block's backward, before that block's gradient is complete (its pre-backward waited)."""
    trace = rows(3)
    done = lambda u: at(trace, u, "reduce-scatter done")  # noqa: E731
    return at(trace, "blocks.0", "pre_backward") < done("blocks.1") < at(
        trace, "blocks.0", "post_backward: gradient complete")


def reduce_scatters_end_where_the_next_gradient_completes() -> bool:
    """Each reduce-scatter runs under the next unit's backward and is waited for in that
    unit's post-backward, once its gradient is complete, just before it issues its own (the
    last block's by the root's)."""
    trace = rows(3)
    done = lambda u: at(trace, u, "reduce-scatter done")  # noqa: E731
    return all(at(trace, nxt, "post_backward: gradient complete") < done(unit) <
               at(trace, nxt, "reduce-scatter issued")
               for unit, nxt in (("blocks.1", "blocks.0"), ("blocks.0", "root")))


def timeline() -> dict[tuple[str, str, str], tuple[float, float]]:
    """{(op, unit, phase): (issued, done)} of chapter 5's committed timeline (Part 1)."""
    text = open(os.path.join(FIGURES, "stage3.txt")).read()
    return {(op, unit, phase): (float(a), float(b)) for a, b, op, unit, phase in re.findall(
        r"^ +([\d.]+) +([\d.]+)  (all_gather|reduce_scatter) +(\S+) +(forward|backward) ", text, re.M)}


def blocks_1_waited_for_its_gather() -> bool:
    """In the committed timeline, ``blocks.1``'s forward began by the time it issued
    ``blocks.2``'s prefetch (in its ``pre_forward``) and its own gather ended 4.30 -> 6.66 ms."""
    t = timeline()
    began, done = t[("all_gather", "blocks.2", "forward")][0], t[("all_gather", "blocks.1", "forward")][1]
    return (began, done) == (4.30, 6.66) and done - began > 2


def each_gather_ends_where_its_forward_begins() -> bool:
    """The third edition's chapter 5: a forward gather "ends where its own forward begins"
    (within a millisecond: a forward begins by the time it issues the next unit's prefetch)."""
    t = timeline()
    return all(t[("all_gather", f"blocks.{k}", "forward")][1] - t[("all_gather", f"blocks.{k + 1}", "forward")][0] < 1
               for k in range(3))


def the_root_computes_through_the_whole_forward() -> bool:
    """The root unit's module is the model: the road's steps make it so, and in the package's
    trace its ``pre_forward`` comes before every block's, its ``post_forward`` after."""
    road = all('Unit("root", model,' in read(f"notes/road/{s}.py") for s in ("3_zero2", "4_zero3"))
    trace = rows(3)
    blocks = UNITS[1:]
    return road and all(at(trace, "root", "pre_forward") < at(trace, b, "pre_forward") and
                        at(trace, b, "post_forward") < at(trace, "root", "post_forward") for b in blocks)


# (page, what it says, the check that confirms it)
CLAIMS = [
    ("notes/exercises/README.md", "The root may keep its parameters through the whole forward "
     "because it computes through the whole forward: its module is the model itself, whose "
     "forward begins before the first block's (the embeddings) and ends after the last block's",
     the_root_computes_through_the_whole_forward),
    ("notes/00-start-here.md", "ZeRO-2 sends the same collectives and saves memory, not bytes: it "
     "frees each unit's full gradient once that unit's reduce-scatter is done, where ZeRO-1 keeps "
     "every full gradient until the step.",
     lambda: stages_1_and_2_send_the_same() and zero2_frees_each_full_gradient_zero1_keeps_them()),
    ("notes/road/README.md", "the package's stage 1 issues each unit's reduce-scatter as soon as "
     "that unit's gradient is complete (the last block first, as `python -m zerolab trace --stage 1` shows)",
     package_stage_1_reduces_as_each_gradient_completes),
    ("notes/05-stage3.md", "a dark bar that begins under the previous block's light one and ends "
     "inside the block's own light bar. The light bar begins when the block's `pre_forward` hook "
     "starts, and the hook waits there for the gather",
     forward_gathers_end_inside_their_own_forward),
    ("notes/05-stage3.md", "In this run `blocks.1` waited about 2 ms: its `pre_forward` began by "
     "4.30 ms, when it issued `blocks.2`'s prefetch, and its own gather was done at 6.66 ms.",
     blocks_1_waited_for_its_gather),
    ("notes/05-stage3.md", "Each block's reduce-scatter runs under the next block's backward and "
     "ends as that block's light bar ends: its `post_backward` waits for it once the block's own "
     "gradient is complete, just before issuing its own reduce-scatter; the last, `blocks.0`'s, is "
     "waited for once the root's gradient is complete, just before the root's own reduce-scatter "
     "is issued", reduce_scatters_end_where_the_next_gradient_completes),
]

# What earlier editions said, which the same traces refute.
REFUTED = [
    ("ZeRO-2 only issues each reduce-scatter earlier", zero2_issues_each_reduce_scatter_earlier),
    ("a dark bar that begins under the previous block's light one and ends where its own forward "
     "begins", each_gather_ends_where_its_forward_begins),
    ("as that block's `pre_backward` waits for it before the block computes its gradient",
     reduce_scatters_end_inside_the_next_backward),
]


@pytest.mark.parametrize("page, says, check", CLAIMS, ids=[f"{c[0]}: {c[1][:40]}" for c in CLAIMS])
def test_a_claim_is_on_its_page_and_its_trace_confirms_it(page, says, check):
    assert says in flat(read(page)), f"{page} no longer says: {says}"
    assert check(), f"{page} says {says!r}, and the committed trace disagrees"


@pytest.mark.parametrize("says, check", REFUTED, ids=[r[0][:40] for r in REFUTED])
def test_a_claim_an_earlier_edition_made_is_refuted_and_gone(says, check):
    assert not check(), f"the trace now confirms {says!r}: this check cannot tell"
    assert not [p for p in pages() if says in flat(open(p).read())]


# ---- zero/minimal.py: what the path reads of it ----------------------------------------------

def functions(path: str) -> dict[str, ast.AST]:
    """{Class.method or function: its node} of a file."""
    tree, out = ast.parse(read(path)), {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, ast.FunctionDef):
                    out[f"{node.name}.{sub.name}"] = sub
        elif isinstance(node, ast.FunctionDef):
            out[node.name] = node
    return out


def body(node: ast.AST, rename: dict[str, str] | None = None) -> str:
    """A function's statements as ``ast.dump`` (comments and the docstring dropped)."""
    stmts = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    text = "\n".join(ast.unparse(s) for s in stmts)
    for old, new in (rename or {}).items():
        text = re.sub(rf"\b{re.escape(old)}\b", new, text)
    return ast.dump(ast.parse(text))


def test_minimal_py_s_gather_and_unit_are_road_step_4s():
    """The start page reads only zero/minimal.py's docstring, stages and ``shard``, because
    ``Gather`` and ``Unit`` are road step 4's, with the stage's two decisions made calls:
    after the forward (step 4's ``post_forward`` is ``Stage3.after_forward``) and when the
    gradient is complete (step 4's ``Gather.backward`` is ``Stage3.gradient_ready``)."""
    mine, road = functions("zero/minimal.py"), functions("notes/road/4_zero3.py")
    for name in ("Gather.forward", "Unit.pre_forward", "Unit.gather", "Unit.free"):
        assert body(mine[name]) == body(road[name]), name
    assert body(mine["Unit.reduce_scatter"]) == body(road["Unit.reduce"])
    assert body(mine["Stage3.after_forward"]) == body(road["Unit.post_forward"], {"self": "unit"})
    assert body(road["Gather.backward"]) == body(ast.parse(
        "def f(ctx, full_grad):\n ctx.unit.reduce(full_grad)\n ctx.unit.free()\n return None, None").body[0])
    assert body(mine["Stage3.gradient_ready"]) == body(ast.parse(
        "def f(self, unit, full_grad):\n super().gradient_ready(unit, full_grad)\n unit.free()").body[0])
    start = flat(read("notes/00-start-here.md"))
    assert "Read its docstring, the classes `Stage1` to `Stage3` and `shard`; `Gather` and `Unit` are road step 4's" in start
    assert road_split()  # (the road's page splits where the clock says)


# ---- the path's commands ----------------------------------------------------------------------

def path_commands() -> list[str]:
    """Every command the path gives to run, as printed: in a bash block, in backticks, or on
    the first line of a road step's or the exercise's docstring. A template (``--stage N``,
    ``my.py``: yours) is given once per value; ``pip`` installs are run by hand (a fresh
    environment), and the table header's ``diff \\| grep`` is a fragment."""
    text = the_path()
    found = re.findall(r"`((?:python|pytest|diff|pip) [^`]+)`", text)
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        found += [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]
    found += re.findall(r'^"""[^\n]*?  ((?:python|pytest) \S+(?: \d)?)\n', text, re.M)
    out = []
    for cmd in found:
        if cmd.startswith("pip ") or "\\|" in cmd or cmd.endswith(" my.py"):
            continue
        out += [cmd.replace("--stage N", f"--stage {k}") for k in (1, 2, 3)] if "--stage N" in cmd else [cmd]
    return sorted(set(out))


def test_every_command_the_path_gives_names_what_exists():
    cmds = path_commands()
    assert {"python notes/road/1_ddp.py", "python notes/road/5_prefetch.py",
            "python notes/exercises/check.py 5", "python -m zerolab trace --stage 3",
            "pytest tests/notes/test_road.py", "diff notes/road/2_zero1.py notes/road/3_zero2.py"} <= set(cmds), cmds
    for cmd in cmds:
        words = cmd.split()
        assert words[0] in ("python", "pytest", "diff"), cmd
        for w in words[1:]:
            if "/" in w or w.endswith(".py"):
                assert os.path.exists(os.path.join(ROOT, w)), cmd
        if words[:2] == ["python", "-m"]:
            assert importlib.util.find_spec(words[2] + ".__main__"), cmd


# What a command the path gives exits with, as the page says: the check fails on the untouched
# starting file ("before you edit anything every check fails, saying why"), diff finds changes.
EXITS = {"python notes/exercises/check.py 5": 1, "diff notes/road/2_zero1.py notes/road/3_zero2.py": 1}


@pytest.mark.full
@pytest.mark.parametrize("cmd", path_commands())
def test_a_command_the_path_gives_runs_as_printed(cmd):
    """Run from the repository's root, as the road's page says, without check mode (a reader's
    default); ``pytest`` runs in its own process."""
    import subprocess

    env = dict(os.environ, PYTHONPATH=ROOT, ZERO_CHECK="0")
    args = cmd.split()
    args[0] = {"python": sys.executable, "pytest": sys.executable}.get(args[0], args[0])
    if cmd.startswith("pytest"):
        args.insert(1, "-m")
        args.insert(2, "pytest")
        args += ["-q", "-p", "no:cacheprovider"]
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == EXITS.get(cmd, 0), (cmd, done.stdout[-2000:], done.stderr[-2000:])
    assert "Traceback" not in done.stdout + done.stderr, (cmd, done.stderr[-2000:])
