"""Keeping what ``save_for_backward`` returned: its tensors through autograd (so in-place
changes are caught and no reference cycle keeps outputs alive), the rest as it is."""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import optree
import torch

from customgrad._errors import (
    GradientTypeError,
    where,
)
from customgrad._record import NodeRecord
from customgrad._rules import OpSpec

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter

__all__ = ["SAVED", "SaveError", "register_dataclasses"]

SAVED = "customgrad"
"""The optree namespace of what a backward is handed: there a dataclass is a node (its fields),
as tuples, lists, dicts and NamedTuples are, so that the tensors in it are saved through
autograd, watched for in-place writes and captured like any other."""

_registering = threading.Lock()


def register_dataclasses(leaves: Sequence[object]) -> bool:
    """Make the dataclass types among ``leaves`` nodes of :data:`SAVED` (once each); True if
    there was one (flatten again to see inside it)."""
    found: set[Any] = {
        type(v)
        for v in leaves
        if dataclasses.is_dataclass(v)
        and not isinstance(v, type)
        and type(v).__new__ is object.__new__  # rebuilt as _rebuild does (not a dict subclass)
    }
    with _registering:
        for cls in found:
            if optree.register_pytree_node.get(cls, namespace=SAVED) is None:
                rebuild: Any = functools.partial(_rebuild, cls)
                optree.register_pytree_node(cls, _fields, rebuild, namespace=SAVED)
    return bool(found)


def _fields(obj: Any) -> tuple[list[object], tuple[str, ...], tuple[str, ...]]:
    """A dataclass instance's fields and other attributes, named."""
    names = [f.name for f in dataclasses.fields(obj)]
    names += [n for n in getattr(obj, "__dict__", {}) if n not in names]
    return [getattr(obj, n) for n in names], tuple(names), tuple(names)


def _rebuild(cls: type, names: tuple[str, ...], values: Any) -> object:
    """An instance of ``cls`` with these attributes, made without ``__init__`` or
    ``__post_init__`` (which may compute, or refuse to set a frozen field)."""
    obj: object = object.__new__(cls)
    for n, v in zip(names, values):
        object.__setattr__(obj, n, v)
    return obj


class SaveError(GradientTypeError):
    """``save_for_backward`` returned a value customgrad cannot keep safely."""


MSG_HIDDEN_TENSORS = """\
{op}: save_for_backward returned {what}, which holds Tensors customgrad cannot see. Tensors \
must be saved through autograd (so in-place changes before backward are caught and no \
reference cycle keeps outputs alive), which customgrad does for Tensors inside tuples, lists, \
dicts, NamedTuples and dataclasses. Return those instead:

    return inputs.x, inputs.weight, rstd            # or a dict, a NamedTuple, a dataclass

(save_for_backward defined at {loc})"""


class _Kept(NamedTuple):
    """How a saved pytree is kept: its leaves with the tensors taken out (saved through autograd,
    in ``tensor_idx`` order), and its structure (None for a flat tuple)."""

    leaves: list[object]
    treespec: optree.PyTreeSpec | None
    tensor_idx: list[int]


# What ``record.kept`` holds when ``save_for_backward`` returned something simple.
_SAVED_NONE = object()  # None
_SAVED_TENSOR = object()  # one Tensor: saved_tensors[0]
_SAVED_TENSORS = object()  # a tuple of Tensors: saved_tensors
_OPAQUE_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
_TENSOR_OR_NONE = frozenset((_Tensor, _Parameter, type(None)))


def _save(ctx: Any, record: NodeRecord, spec: OpSpec, saved: Any) -> None:
    """Keep what ``save_for_backward`` returned: its tensors through ``ctx.save_for_backward``."""
    if saved is None:
        record.kept = _SAVED_NONE
        return
    kind = type(saved)
    if kind is _Tensor or kind is _Parameter:
        ctx.save_for_backward(saved)
        record.kept = _SAVED_TENSOR
        return
    if kind is tuple:
        if _TENSOR_OR_NONE.issuperset(map(type, saved)):
            # Tensors and Nones: saved_tensors gives the same tuple back
            ctx.save_for_backward(*saved)
            record.kept = _SAVED_TENSORS
            return
        tensor_idx: list[int] = []
        for i, v in enumerate(saved):
            k = type(v)
            if k is _Tensor or k is _Parameter:
                tensor_idx.append(i)
            elif k not in _OPAQUE_LEAVES:
                break
        else:  # a flat tuple of leaves: no pytree needed
            leaves = list(saved)
            if tensor_idx:
                ctx.save_for_backward(*[leaves[i] for i in tensor_idx])
                for i in tensor_idx:
                    leaves[i] = None
            record.kept = _Kept(leaves, None, tensor_idx)
            return
    leaves, treespec = optree.tree_flatten(saved, none_is_leaf=True, namespace=SAVED)
    if register_dataclasses(leaves):
        leaves, treespec = optree.tree_flatten(saved, none_is_leaf=True, namespace=SAVED)
    tensor_idx = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, _Tensor):
            tensor_idx.append(i)
        elif not isinstance(leaf, _OPAQUE_LEAVES):
            _check_opaque_leaf(spec, leaf)
    if tensor_idx:
        ctx.save_for_backward(*[leaves[i] for i in tensor_idx])
        for i in tensor_idx:
            leaves[i] = None
    record.kept = _Kept(leaves, treespec, tensor_idx)


def _check_opaque_leaf(spec: OpSpec, leaf: Any) -> None:
    """Refuse a saved leaf that hides tensors from autograd (an object with Tensor attributes);
    an object without tensors (a quantization state, a config) is kept."""
    attrs = getattr(leaf, "__dict__", None)
    values: list[Any] = list(attrs.values()) if isinstance(attrs, dict) else []
    for name in getattr(type(leaf), "__slots__", ()):
        values.append(getattr(leaf, name, None))
    tree: Any = values
    leaves = optree.tree_leaves(tree, none_is_leaf=True, namespace=SAVED)
    if not any(isinstance(v, _Tensor) for v in leaves):
        return
    what = f"a {type(leaf).__qualname__} object with Tensor attributes"
    save = spec.rules.save
    raise SaveError(MSG_HIDDEN_TENSORS.format(op=spec.name, what=what, loc=where(save)))


def _restore(node: Any, record: NodeRecord) -> Any:
    kept = record.kept
    if kept is _SAVED_TENSORS:
        return node.saved_tensors
    if kept is _SAVED_TENSOR:
        return node.saved_tensors[0]
    if kept is _SAVED_NONE:
        return None
    assert isinstance(kept, _Kept)  # the other layouts are the sentinels above
    leaves, treespec, tensor_idx = kept
    if tensor_idx:
        leaves = list(leaves)
        for i, t in zip(tensor_idx, node.saved_tensors):
            leaves[i] = t
    if treespec is None:
        return tuple(leaves)
    return optree.tree_unflatten(treespec, leaves)
