"""The shape of ``zero/``, counted from its syntax: does one object hold the world?

Four counts, each from Python's ``ast`` (no code is run):

- the largest classes, by how many distinct attributes their methods assign on ``self``;
- module-level mutable objects: names bound at module level to a dict, list, set or deque
  (or one of their kin) that some code then changes (item assignment, ``append``, ``add``...,
  or a ``global`` statement) — process-wide state that two models would share;
- imports from a lower layer to a higher one, the layers bottom-up: ``zero/api.py`` (the
  seams), ``zero/comm``, ``zero/core``, ``zero/checkpoint``, ``zero/features``,
  ``zero/surface``, the top of ``zero/`` (``__init__``, ``__main__``, ``minimal``), then
  ``zerolab`` (which ``zero`` must never import);
- feature-specific branches in ``zero/core``: ``if`` tests (and conditional expressions)
  that mention an offload, hpZ's secondary group (or its post-forward mesh), HSDP's replicas
  or a layout's name;
- private torch machinery ``zero/`` uses: names imported from torch that start with an
  underscore or come from a private module, ``torch._x`` chains, and private attributes of
  torch's own classes (``module._parameters``, ``tensor._version``...), each once, with where
  it is first used (notes/15 says why each is needed).

    python benchmarks/shape.py            # the table
    python benchmarks/shape.py --json     # the same figures, for a test or a note
"""

from __future__ import annotations

import ast
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
LAYERS = ["zero.api", "zero.comm", "zero.core", "zero.checkpoint", "zero.features",
          "zero.surface", "zero", "zerolab"]
MUTABLE_CALLS = {"dict", "list", "set", "deque", "defaultdict", "OrderedDict", "Counter",
                 "WeakKeyDictionary", "WeakValueDictionary", "WeakSet"}
MUTATORS = {"append", "extend", "add", "update", "setdefault", "pop", "popitem", "remove",
            "discard", "clear", "insert", "appendleft"}
FEATURE_WORDS = ("offload", "secondary", "post_forward", "replicate", "layout.name", ".name ==",
                 "hpz", "disk")


def _modules(package: str):
    for path in sorted((ROOT / package).rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        yield name.removesuffix(".__init__"), path, ast.parse(path.read_text())


def class_attributes(tree: ast.AST) -> dict[str, set[str]]:
    out = {}
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        names = set()
        for node in ast.walk(cls):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                targets = [node.target]
            for t in targets:
                for e in ast.walk(t):
                    if (isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name)
                            and e.value.id == "self" and isinstance(e.ctx, ast.Store)):
                        names.add(e.attr)
        out[cls.name] = names
    return out


def _is_mutable(value: ast.AST) -> bool:
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        f = value.func
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
        return name in MUTABLE_CALLS
    return False


def mutable_globals(tree: ast.Module) -> list[str]:
    candidates = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else [])
        for t in targets:
            if isinstance(t, ast.Name) and t.id != "__all__" and _is_mutable(node.value):
                candidates.add(t.id)
    changed = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            changed.update(node.names)
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for t in targets:
                if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name):
                    changed.add(t.value.id)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in MUTATORS and isinstance(node.func.value, ast.Name)):
            changed.add(node.func.value.id)
    return sorted(candidates & changed)


def layer_of(module: str) -> int:
    matches = [p for p in LAYERS if module == p or module.startswith(p + ".")]
    return LAYERS.index(max(matches, key=len))  # the longest prefix: zero.core, not zero


def imports(tree: ast.Module, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``tree`` imports (``from zero import comm``: zero.comm)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            subs = {f"{node.module}.{a.name}" for a in node.names} & known
            out.update(subs or {node.module})
    return out & known


def upward_imports(modules) -> list[str]:
    known = {name for name, _, _ in modules}
    out = []
    for name, _, tree in modules:
        if not name.startswith("zero") or name.startswith("zerolab"):
            continue
        for target in sorted(imports(tree, known)):
            if layer_of(target) > layer_of(name):
                out.append(f"{name} -> {target}")
    return out


def feature_branches(tree: ast.AST, source: str) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.If, ast.IfExp, ast.While)):
            continue
        test = node.test
        text = ast.get_source_segment(source, test) or ""
        if any(w in text.lower() for w in FEATURE_WORDS):
            out.append(f"{node.lineno}: {text}")
    return out


def _torch_private_attributes() -> set[str]:
    """Underscore names torch's own classes define (what ``x._name`` on one of them reads)."""
    import torch
    import torch.nn as nn
    from torch.distributed.tensor import DTensor

    found = set()
    objects = [torch.Tensor, nn.Parameter, nn.Module, torch.optim.Optimizer, DTensor,
               torch.UntypedStorage, nn.Module(), torch.optim.SGD([torch.zeros(1,
                                                                   requires_grad=True)])]
    for obj in objects:
        names = set(dir(obj)) | set(getattr(obj, "__dict__", {}))
        found |= {n for n in names if n.startswith("_") and not n.startswith("__")}
    return found


def private_torch(modules) -> dict[str, str]:
    """{private torch name: where zero first uses it}."""
    attrs = _torch_private_attributes()
    out: dict[str, str] = {}
    for name, path, tree in modules:
        if name != "zero" and not name.startswith("zero."):
            continue
        parts = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        for node in ast.walk(tree):
            if id(node) in parts:
                continue  # (a part of a longer chain: the chain is counted once)
            found = []
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
                private_module = any(part.startswith("_") for part in node.module.split("."))
                found = [f"{node.module}.{a.name}" for a in node.names
                         if private_module or a.name.startswith("_")]
            elif isinstance(node, ast.Attribute):
                chain, inner = [node.attr], node.value
                while isinstance(inner, ast.Attribute):
                    chain.append(inner.attr)
                    inner = inner.value
                if isinstance(inner, ast.Name):
                    chain.append(inner.id)
                chain.reverse()
                if chain[0] == "torch" and any(c.startswith("_") for c in chain):
                    found = [".".join(chain)]
                elif node.attr in attrs and not (isinstance(node.value, ast.Name)
                                                 and node.value.id == "self"):
                    found = [f"._{node.attr[1:]}"]
            for f in found:
                out.setdefault(f, f"{path.relative_to(ROOT)}:{node.lineno}")
    return dict(sorted(out.items()))


def measure() -> dict:
    modules = list(_modules("zero")) + list(_modules("zerolab"))
    classes = []
    for name, _, tree in modules:
        if name.startswith("zero."):
            classes += [(len(a), f"{name}.{c}") for c, a in class_attributes(tree).items()]
    classes.sort(reverse=True)
    mutables = [f"{name}.{g}" for name, _, tree in modules if name.startswith("zero.")
                for g in mutable_globals(tree)]
    branches = []
    for name, path, tree in modules:
        if name.startswith("zero.core"):
            branches += [f"{name}:{b}" for b in feature_branches(tree, path.read_text())]
    return {"largest_classes": [[n, c] for n, c in classes[:5]],
            "mutable_globals": mutables, "upward_imports": upward_imports(modules),
            "core_feature_branches": branches, "private_torch": private_torch(modules)}


def main() -> None:
    m = measure()
    if "--json" in sys.argv:
        print(json.dumps(m, indent=1))
        return
    print("largest classes (attributes assigned on self):")
    for n, c in m["largest_classes"]:
        print(f"  {n:3d}  {c}")
    for key, title in (("mutable_globals", "module-level mutable objects in zero/"),
                       ("upward_imports", "imports from a lower layer to a higher one"),
                       ("core_feature_branches", "feature-specific branches in zero/core"),
                       ("private_torch", "private torch names zero/ uses (first use)")):
        print(f"{title}: {len(m[key])}")
        for item in m[key]:
            print(f"  {item}" + (f"  {m[key][item]}" if isinstance(m[key], dict) else ""))


if __name__ == "__main__":
    main()
