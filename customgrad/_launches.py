"""Count kernel launches where FLOP counters see nothing: custom ops and raw Triton launches.

torch's FLOP formulas count matmuls, convolutions and attention; a backward that calls a Triton
kernel (or any opaque kernel) counts zero FLOPs, so "the backward kernel ran in both passes"
would not show in FLOPs. :class:`LaunchCounter` counts, while it is entered:

- every dispatcher call of an op outside torch's own namespaces (``aten``, ``prims``, ...): a
  kernel registered as an op, a customgrad op, a ``torch.library.triton_op``, with its output
  kept so that two passes computing the same thing can be told apart from two passes computing
  different things with the same kernel;
- every launch of a *compiled* Triton kernel, through Triton's launch hook
  (``triton.knobs.runtime.launch_enter_hook``), by kernel name. Triton's interpreter
  (``TRITON_INTERPRET=1``) has no launch hook: there, only kernels wrapped in an op are seen.

Triton is never imported here: if no module imported it, no Triton kernel can launch.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import optree
import torch

from customgrad._torch.dispatcher import OpOverload, TorchDispatchMode

__all__ = ["TORCH_NAMESPACES", "LaunchCounter"]

TORCH_NAMESPACES = frozenset(
    {
        "aten",
        "prims",
        "prim",
        "_c10d_functional",
        "c10d",
        "c10d_functional",
        "profiler",
        "debugprims",
    }
)
"""Namespaces of torch's own ops: calls of these are not counted as kernel launches."""


class LaunchCounter(TorchDispatchMode):
    """Counts kernel launches: calls of non-torch ops, and compiled Triton launches.

    Attributes:
        counts: launches per kernel, by name (``"examples::scale"``, or a Triton kernel's name).
        calls: each counted op call as ``(name, outputs)``, the outputs detached copies.
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.counts: Counter[str] = Counter()
        self.calls: list[tuple[str, list[torch.Tensor]]] = []
        self._triton_hooks: Any = None

    def __enter__(self) -> LaunchCounter:
        triton = sys.modules.get("triton")
        knobs = getattr(triton, "knobs", None)
        runtime = getattr(knobs, "runtime", None)
        if runtime is not None and not runtime.interpret:
            self._triton_hooks = runtime.launch_enter_hook
            self._triton_hooks.add(self._triton_launch)
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)  # type: ignore[no-untyped-call]
        if self._triton_hooks is not None:
            self._triton_hooks.remove(self._triton_launch)
            self._triton_hooks = None

    def _triton_launch(self, metadata: object) -> None:
        data = getattr(metadata, "data", None)
        name = data.get("name") if isinstance(data, dict) else None
        self.counts[f"triton:{name or 'kernel'}"] += 1

    def __torch_dispatch__(
        self,
        func: OpOverload,
        types: Sequence[type],
        args: Sequence[object] = (),
        kwargs: Mapping[str, object] | None = None,
    ) -> object:
        out = func(*args, **dict(kwargs or {}))
        namespace = getattr(func, "namespace", "aten")
        if namespace not in TORCH_NAMESPACES:
            name = f"{namespace}::{func._opname}"
            self.counts[name] += 1
            leaves = optree.tree_leaves(out, none_is_leaf=False)
            kept = [t.detach().clone() for t in leaves if isinstance(t, torch.Tensor)]
            self.calls.append((name, kept))
        return out
