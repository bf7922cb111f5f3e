"""Finding the tensors in a unit's inputs and outputs, wherever model code puts them, as FSDP2
walks them (``torch.distributed.utils._apply_to_tensors``): notes/12-model-code.md."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

import torch


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


def _is_dataclass_instance(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def tensors_in(x: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside ``x``, depth first."""
    if isinstance(x, torch.Tensor):
        yield x
    elif _is_namedtuple(x) or isinstance(x, (list, tuple)):
        for item in x:
            yield from tensors_in(item)
    elif _is_dataclass_instance(x):
        for field in dataclasses.fields(x):
            yield from tensors_in(getattr(x, field.name))
    elif isinstance(x, dict):
        for item in x.values():
            yield from tensors_in(item)


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], x: Any) -> Any:
    """``x`` rebuilt with ``fn`` applied to every tensor (containers copied, not modified)."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if _is_namedtuple(x):
        return type(x)(*(map_tensors(fn, item) for item in x))
    if _is_dataclass_instance(x):
        changes = {f.name: map_tensors(fn, getattr(x, f.name)) for f in dataclasses.fields(x)
                   if f.init}
        return dataclasses.replace(x, **changes)
    if isinstance(x, dict):
        out = x.copy()  # keeps the dict's class (OrderedDict, ...)
        out.update({key: map_tensors(fn, value) for key, value in x.items()})
        return out
    if isinstance(x, (list, tuple)):
        return type(x)(map_tensors(fn, item) for item in x)
    return x
