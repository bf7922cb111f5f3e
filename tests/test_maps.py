"""The maps of the package, held to the tree and to torch.

Three texts list the files of ``zero/`` for a reader: ``zero/__init__.py``'s docstring,
notes/15's block and the README's layout table. Each must name every ``.py`` file under
``zero/`` (a package's own ``__init__.py`` aside) and no file that does not exist: a map that
drifts sends a reader to a file that is gone, or hides one that is there.

notes/15 also lists the private names of torch that zero uses, and the FSDP2 internals zero
answers so that torch's own functions work on ``zero.fully_shard``; those are the names a torch
upgrade breaks first. ``benchmarks/shape.py`` finds most of the first kind (``test_seams``
holds its list to the table); the scan here also finds those read through ``getattr`` and
those on objects of torch's private classes. The second kind is read from torch's own source.
"""

from __future__ import annotations

import ast
import inspect
import pathlib
import re
import textwrap

ROOT = pathlib.Path(__file__).resolve().parent.parent
ZERO = ROOT / "zero"
CHAPTER = ROOT / "notes" / "15-where-ideas-go.md"
TOKEN = re.compile(r"(?<![\w/.])((?:[\w.-]+/)*\w+\.py)\b")  # a file name, with its path if any


def tree() -> set[str]:
    """Every .py file of zero/, as a path under it (``comm/ledger.py``), packages' own
    ``__init__.py`` aside (the folder is the entry)."""
    return {p.relative_to(ZERO).as_posix() for p in ZERO.rglob("*.py") if p.name != "__init__.py"}


def _named(entries: list[tuple[str, str]]) -> tuple[set[str], list[str]]:
    """From (head, text) entries, a head a folder of zero/ (``comm/``), a file of it
    (``api.py``) or another path: the files named, under zero/, and the paths named that do
    not exist. A bare name belongs to its entry's folder; a name with a path is that path."""
    named, missing = set(), []
    for head, text in entries:
        folder = head if head.endswith("/") else ""
        if head.endswith(".py"):
            named.add(head)
        for name in TOKEN.findall(text):
            if "/" in name:
                path = ROOT / name
                if name.startswith("zero/"):
                    named.add(name[len("zero/"):])
            else:
                path = ZERO / folder / name
                named.add(folder + name)
            if not path.is_file():
                missing.append(f"{head}: {name}")
    return named, missing


def init_map() -> list[tuple[str, str]]:
    """zero/__init__.py's docstring: its first paragraph (files at the top of zero/), then one
    entry per bullet, ``- ``comm/`` the collectives: ``backend.py`` ...``."""
    doc = ast.get_docstring(ast.parse((ZERO / "__init__.py").read_text())) or ""
    parts = re.split(r"^- ``([^`]+)``", doc, flags=re.M)
    entries = [("", parts[0])]
    entries += [(head, text) for head, text in zip(parts[1::2], parts[2::2])]
    return entries


def chapter_map() -> list[tuple[str, str]]:
    """notes/15's block: a line that starts with a path of zero/ opens an entry, indented lines
    go on with it (``zerolab/``'s line is not about zero/)."""
    text = CHAPTER.read_text()
    start = text.index("```\nzero/")
    block = text[start + 4: text.index("```", start + 4)]
    entries: list[tuple[str, str]] = []
    for line in block.splitlines():
        if line.startswith(" "):
            entries[-1] = (entries[-1][0], entries[-1][1] + line)
        else:
            head, _, rest = line.partition(" ")
            entries.append((head.removeprefix("zero/"), rest) if head.startswith("zero/")
                           else ("(" + head + ")", ""))
    return entries


def readme_map() -> list[tuple[str, str]]:
    """The README's "## Layout" table: a row per folder (or file) of zero/."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Layout"):]
    section = section[: section.find("\n## ", 1) if "\n## " in section[1:] else None]
    return [(head.removeprefix("zero/"), body)
            for head, body in re.findall(r"^\| `(zero/[^`]*)` \| (.*) \|$", section, re.M)]


MAPS = {"zero/__init__.py": init_map, "notes/15": chapter_map, "README.md": readme_map}


def test_every_map_names_every_file_of_zero_and_nothing_else():
    files = tree()
    for where, read in MAPS.items():
        named, missing = _named(read())
        assert not files - named, f"{where} does not name {sorted(files - named)}"
        assert not missing, f"{where} names files that do not exist: {missing}"
        assert named - files == set(), f"{where} names {sorted(named - files)}, not in zero/"


def test_a_map_that_drifts_is_caught():
    """The check itself: a file left out, and a name that is not there, are both seen."""
    entries = [("comm/", "``ledger.py`` and ``gone.py``"), ("", "``api.py``")]
    named, missing = _named(entries)
    assert "comm/ledger.py" in named and "comm/waits.py" not in named
    assert missing == ["comm/: gone.py"]


# ---- the private names of torch that zero uses ----------------------------------------------

PYTHONS = {"_getframe": "sys", "_fields": "a namedtuple's", "_Unpickler": "pickle's"}


def _defined_by_zero(trees) -> set[str]:
    """Names zero/ defines: its functions, classes, variables, parameters, its attributes on
    ``self``; and its own marks on torch's objects, which all start ``_zero_``."""
    out = set()
    for t in trees:
        for n in ast.walk(t):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(n.name)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                out.add(n.id)
            elif isinstance(n, ast.arg):
                out.add(n.arg)
            elif (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                  and isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")):
                out.add(n.attr)
    return out


def private_names_used() -> dict[str, str]:
    """{private name zero/ reads of torch: where first}: attributes (``x._name``, not on
    ``self``), ``getattr``/``hasattr``/``setattr`` with a constant ``"_name"``, and names
    imported from torch that start with an underscore."""
    sources = {p: ast.parse(p.read_text()) for p in sorted(ZERO.rglob("*.py"))}
    own = _defined_by_zero(sources.values())
    found: dict[str, str] = {}
    for path, t in sources.items():
        for n in ast.walk(t):
            names = []
            if isinstance(n, ast.Attribute) and not (isinstance(n.value, ast.Name)
                                                     and n.value.id in ("self", "cls")):
                names = [n.attr]
            elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                  and n.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(n.args) > 1
                  and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str)):
                names = [n.args[1].value]
            elif isinstance(n, ast.ImportFrom) and (n.module or "").startswith("torch"):
                names = [a.name for a in n.names]
            for name in names:
                if (name.startswith("_") and not name.startswith("__")
                        and not name.startswith("_zero_") and name not in PYTHONS
                        and (name not in own or isinstance(n, ast.ImportFrom))):
                    found.setdefault(name, f"{path.relative_to(ROOT)}:{n.lineno}")
    return found


def _table(title: str) -> str:
    text = CHAPTER.read_text()
    start = text.index(title)
    end = text.find("\n## ", start + 1)
    return text[start: end if end > 0 else None]


def _listed(name: str, table: str) -> bool:
    """``name`` written in the table as code: `._name`, `torch.x._name`, `Class._name`."""
    return re.search(r"[`.]" + re.escape(name) + r"(?![\w])", table) is not None


def test_every_private_torch_name_zero_uses_is_in_the_table():
    table = _table("## The private torch machinery")
    used = private_names_used()
    # (the two the table lacked when issue 47 was written, and benchmarks/shape.py does not see)
    assert {"_post_accumulate_grad_hooks", "_run_policy"} <= set(used), used
    unlisted = {n: where for n, where in used.items() if not _listed(n, table)}
    assert unlisted == {}, f"private torch names zero/ uses, not in notes/15's table: {unlisted}"


def test_the_scan_sees_a_private_name_read_through_getattr():
    t = ast.parse("def f(p):\n    return getattr(p, '_backward_hooks', None), p._foo\n")
    own = _defined_by_zero([t])
    assert "_backward_hooks" not in own and "_foo" not in own
    assert _listed("_version", "| `._version` | why |") and not _listed("_ver", "`._version`")


# ---- the FSDP2 internals zero answers ---------------------------------------------------------

# Who torch reads each name from, by the variable it reads it through in its source.
HOLDERS = {"self": "module", "module": "module", "cls": "module", "fsdp_state": "state",
           "fsdp_states": "state", "fsdp_param_group": "group"}


def fsdp2_reads() -> dict[str, tuple[str, bool]]:
    """{name: (whose it is, whether torch sets it)} for every attribute that torch 2.13's
    ``register_fsdp_forward_method``, ``share_comm_ctx`` and ``FSDPModule.__new__`` read of a
    module, of its FSDP state, or of the state's parameter groups (dunders aside)."""
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method, share_comm_ctx

    out: dict[str, tuple[str, bool]] = {}
    for fn in (register_fsdp_forward_method, share_comm_ctx, FSDPModule.__new__):
        for n in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(fn)))):
            if not isinstance(n, ast.Attribute) or n.attr.startswith("__"):
                continue
            base = n.value.value if isinstance(n.value, ast.Subscript) else n.value
            if isinstance(base, ast.Name) and base.id in HOLDERS:
                kind, sets = out.get(n.attr, (HOLDERS[base.id], False))
                out[n.attr] = (kind, sets or isinstance(n.ctx, ast.Store))
    return out


def test_zero_answers_every_fsdp2_internal_torchs_functions_read():
    import torch.nn as nn

    from zero.surface import fsdp2, fsdp2_state
    from zero.surface.fsdp2_module import ZeroFSDPModule

    reads = fsdp2_reads()
    # pinned to torch 2.13: a torch that reads another name fails here, naming it
    assert set(reads) == {"_get_fsdp_state", "_pre_forward", "_post_forward", "_comm_ctx",
                          "_fsdp_param_groups", "comm_ctx", "_orig_cls_mro_index"}, reads
    answers = {"module": ZeroFSDPModule, "state": fsdp2_state.FSDPStateView,
               "group": fsdp2_state._ParamGroupView}
    table = _table("## The FSDP2 internals zero answers")
    for name, (kind, sets) in reads.items():
        cls = answers[kind]
        assert name in vars(cls), f"torch reads {kind}.{name}: {cls.__name__} must define it"
        if sets:
            member = vars(cls)[name]
            assert isinstance(member, property) and member.fset is not None, \
                f"torch sets {kind}.{name}: {cls.__name__}.{name} must take it"
        assert _listed(name, table), f"{name} is not in notes/15's table of FSDP2 internals"
    assert _listed("FSDPStateView", table)

    class Block(nn.Module):
        pass

    # torch's own FSDPModule.__new__ on zero's FSDP<Class> makes the original class
    made = fsdp2._fsdp_class(Block)
    assert made.__mro__[made._orig_cls_mro_index] is Block
    assert type(made()) is Block
