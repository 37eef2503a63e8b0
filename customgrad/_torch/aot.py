"""AOTAutograd and inductor (``torch._functorch``, ``torch._inductor``, ``torch._guards``):
what a split-aware compile backend reads and sets while compiling.

Imported lazily.

- :func:`config_patch`: ``torch._functorch.config.patch(**changes)`` (e.g.
  ``donated_buffer=False``, ``enable_autograd_cache=False``);
- :func:`tracing_metadata`: the ``fw_metadata`` of the running trace
  (``torch._guards.TracingContext.try_get().fw_metadata``), or None;
- :func:`inductor_compilers`: ``(compile_fx, compile_fx_inner)`` of
  ``torch._inductor.compile_fx``;
- :func:`compiled_backward`: the compiled backward a ``CompiledFunctionBackward`` node runs
  (``node._forward_cls.compiled_bw``, set at its first backward), or None;
- :func:`is_tangent`: whether a placeholder of a backward graph is an output gradient
  (AOTAutograd's own ``partitioners._is_tangent``);
- :func:`tangent_outputs`: which outputs of a region's autograd node its backward graph's
  output gradients are (the rule of AOTAutograd's backward prologue,
  ``runtime_wrappers._codegen_backward_prologue``).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch

from customgrad._torch.functions import forward_cls

__all__ = [
    "compiled_backward",
    "config_patch",
    "inductor_compilers",
    "is_tangent",
    "tangent_outputs",
    "tracing_metadata",
]


def config_patch(**changes: Any) -> AbstractContextManager[Any]:
    """AOTAutograd's configuration changed inside a ``with`` block."""
    import torch._functorch.config

    patch: AbstractContextManager[Any] = torch._functorch.config.patch(**changes)
    return patch


def tracing_metadata() -> Any:
    """The ``ViewAndMutationMeta`` of the graph AOTAutograd traces now, or None."""
    import torch._guards

    ctx = torch._guards.TracingContext.try_get()
    return getattr(ctx, "fw_metadata", None)


def inductor_compilers() -> tuple[Any, Any]:
    """``(compile_fx, compile_fx_inner)``: inductor's graph compiler and its inner compiler."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    return compile_fx, compile_fx_inner


def compiled_backward(node: Any) -> Any:
    """The backward AOTAutograd compiled for the region whose backward ``node`` runs (its
    Function's ``compiled_bw``, possibly wrapped), or None (not compiled yet, another node)."""
    return getattr(forward_cls(node), "compiled_bw", None)


def is_tangent(node: Any) -> bool:
    """Whether ``node``, a placeholder of an AOTAutograd backward graph, is an output gradient
    (``torch._functorch.partitioners._is_tangent``; its naming rule where torch lacks it)."""
    try:
        from torch._functorch.partitioners import _is_tangent  # type: ignore[attr-defined]
    except ImportError:  # pragma: no cover - another torch
        return bool(node.op == "placeholder" and str(node.target).startswith("tangents"))
    return bool(_is_tangent(node))


def _requires_grad(info: Any) -> bool:
    """Whether an output of the region takes a gradient in its backward:
    ``requires_grad_for_backward`` from torch 2.13 on, ``requires_grad`` before (the same
    field, renamed)."""
    found = getattr(info, "requires_grad_for_backward", None)
    return bool(info.requires_grad if found is None else found)


def tangent_outputs(meta: Any) -> list[int] | None:
    """The positions, among the outputs of the autograd node AOTAutograd makes for a region
    (``meta``: its ``ViewAndMutationMeta``), of the output gradients its backward graph takes,
    in the order of its tangent placeholders: mutated inputs that require grad, outputs that
    are no alias (nor a view made again outside the graph) and require grad, then the
    intermediate bases (AOTAutograd's backward prologue's rule); None where ``meta`` lacks
    what the rule reads."""
    try:
        from torch._functorch._aot_autograd.schemas import OutputType

        survives: tuple[Any, ...] = (OutputType.non_alias, OutputType.unsafe_view_alias)
        view = getattr(OutputType, "custom_function_view", None)
        if view is not None:
            survives += (view,)
        n_mutated = meta.num_mutated_inp_runtime_indices
        infos = meta.input_info
        found = [
            i
            for i, at in enumerate(meta.mutated_inp_runtime_indices)
            if infos[at].mutates_data and infos[at].requires_grad
        ]
        found += [
            n_mutated + i
            for i, info in enumerate(meta.output_info)
            if info.output_type in survives
            and issubclass(info.raw_type, torch.Tensor)
            and _requires_grad(info)
        ]
        start = n_mutated + meta.num_outputs
        return found + list(range(start, start + meta.num_intermediate_bases))
    except (AttributeError, ImportError, TypeError):  # another torch, or no metadata
        return None
