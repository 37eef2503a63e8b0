"""Where the user's code made a value of a compiled graph: module path and source line.

AOTAutograd copies the forward's metadata onto the backward graph's nodes: ``stack_trace`` (the
user's frames), ``fwd_nn_module_stack`` / ``nn_module_stack`` (the modules being called, as
dynamo's source paths such as ``L['self'].attn.o``) and ``fwd_source_fn_stack``. A value I keeps
for W is named from them (``attn.o (Linear), model.py:42``) instead of by its FX name
(``view_22``), which says nothing to the person who wrote the model.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from torch import fx

__all__ = ["ValueOrigin", "by_module", "origin_of", "summary"]

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n(?:\s*(\S.*)\n)?')
_ROOT = re.compile(r"^L\['[^']*'\](?:\.__self__)?")
_PACKAGE = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True)
class ValueOrigin:
    """One value of a compiled graph and where the user's forward code made it.

    Attributes:
        name: the FX node's name (``"view_22"``).
        module: the path of the innermost module being called, relative to the compiled
            module (``"attn.o"``; ``""`` for the compiled module's own code).
        module_type: that module's class name (``"Linear"``), or ``""`` when unknown.
        source: ``"file.py:42"`` of the innermost user frame, or ``""`` when unknown.
        code: that frame's line of code, or ``""``.
        shape: the value's shape (``None`` when symbolic or unknown).
        dtype: the value's dtype, e.g. ``"float32"``, or ``""``.
        nbytes: its size in bytes (``None`` when unknown).
    """

    name: str
    module: str
    module_type: str
    source: str
    code: str
    shape: tuple[int, ...] | None
    dtype: str
    nbytes: int | None

    @property
    def where(self) -> str:
        """``"attn.o (Linear)"``; ``"(compiled module)"`` for the module's own code."""
        where = self.module or "(compiled module)"
        return f"{where} ({self.module_type})" if self.module_type else where


def _module_path(source: str) -> str:
    """``L['call_impl'].__self__.attn.o`` or ``L['self']._modules['attn']`` -> ``attn.o``."""
    path = _ROOT.sub("", source)
    path = re.sub(r"\._modules\['([^']+)'\]|\['([^']+)'\]", lambda m: "." + (m[1] or m[2]), path)
    path = re.sub(r"getattr\((.*?), '([^']+)'\)", r"\1.\2", path)
    return path.lstrip(".")


def _module(meta: dict[str, Any]) -> tuple[str, str]:
    stack = meta.get("fwd_nn_module_stack") or meta.get("nn_module_stack")
    if not stack:
        return "", ""
    path, cls = list(stack.values())[-1]
    name = getattr(cls, "__name__", None) or str(cls).rsplit(".", 1)[-1].rstrip("'>")
    return _module_path(str(path)), str(name)


def _frame(stack_trace: str | None) -> tuple[str, str]:
    """The innermost frame of the user's code (not customgrad's, not torch's)."""
    for path, line, _, code in reversed(_FRAME.findall(stack_trace or "")):
        full = os.path.abspath(path)
        if full.startswith(_PACKAGE) or f"{os.sep}torch{os.sep}" in full:
            continue
        return f"{os.path.basename(path)}:{line}", code.strip()
    return "", ""


def origin_of(node: fx.Node) -> ValueOrigin:
    """Where the forward code made ``node`` (a node of an AOTAutograd graph)."""
    module, module_type = _module(node.meta)
    source, code = _frame(node.meta.get("stack_trace"))
    val: Any = node.meta.get("val")
    shape: tuple[int, ...] | None = None
    nbytes: int | None = None
    dtype = str(getattr(val, "dtype", "")).removeprefix("torch.")
    try:
        shape = tuple(int(s) for s in val.shape)
        nbytes = int(val.numel()) * val.element_size()
    except (AttributeError, TypeError, ValueError):  # not a tensor, or symbolic sizes
        pass
    return ValueOrigin(node.name, module, module_type, source, code, shape, dtype, nbytes)


def by_module(origins: Iterable[ValueOrigin]) -> dict[str, list[ValueOrigin]]:
    """The origins grouped by :attr:`ValueOrigin.where`, in order of first appearance."""
    groups: dict[str, list[ValueOrigin]] = {}
    for o in origins:
        groups.setdefault(o.where, []).append(o)
    return groups


def summary(origins: Iterable[ValueOrigin]) -> str:
    """One line: ``"2 from attn.qkv (Linear), 1 from fc1 (Linear)"``."""
    return ", ".join(f"{len(v)} from {k}" for k, v in by_module(origins).items())
