"""Modules compiled by torch (``nn.Module.compile``, ``torch.compile`` wrappers) made into split
regions, for customgrad's ``PipelineStage``.

torchtitan compiles each block with ``block.compile()``. Under a zero-bubble schedule such a
block's compiled backward must run twice (I, then W), which torch's default configuration
refuses ("compiled with non-empty donated buffers"); with ``donated_buffer=False`` it runs the
whole backward in each pass, and gradients were observed wrong. A ``torch.compile(block)``
wrapper is refused by the schedules outright. :func:`split_compiled` recompiles each such module
with :func:`customgrad.compile` and the options it was compiled with, in place, so its backward
splits.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from customgrad._compile import compile as cg_compile
from customgrad._errors import ArgumentValueError
from customgrad._torch.dynamo import (
    compile_options,
    compiled_call,
    optimized_module_type,
    set_compiled_call,
)

__all__ = ["split_compiled"]

log = logging.getLogger("customgrad")


def _by_torch(module: nn.Module) -> bool:
    """Whether ``module`` was compiled by ``nn.Module.compile`` (not by customgrad)."""
    compiled = compiled_call(module)
    return compiled is not None and not getattr(compiled, "_customgrad_compiled", False)


def _recompile(
    module: nn.Module, compiled: Any, how: str, path: str, done: list[str], kept: list[str]
) -> None:
    options = compile_options(compiled)
    if options is None:
        log.warning(
            "customgrad: could not read the torch.compile options of %s (%s); recompiling it "
            "with customgrad.compile's defaults",
            path or "the stage module",
            how,
        )
        options = {}
    name = f"{path or '<stage>'} ({type(module).__qualname__}, {how})"
    try:
        cg_compile(module, **options)
    except ArgumentValueError:
        # a backend without AOTAutograd (backend="eager", ...): its backward is autograd's own,
        # which splits as it is; a wrapper becomes the in-place compile the schedules accept
        if isinstance(compiled, nn.Module):  # the OptimizedModule
            module.compile(**options)
        else:
            set_compiled_call(module, compiled)
        kept.append(name)
        return
    done.append(name)


def split_compiled(module: nn.Module, owner: str) -> tuple[nn.Module, list[str]]:
    """Recompile the modules in ``module`` that torch compiled, with customgrad.compile.

    Args:
        module: a stage module; itself an ``OptimizedModule`` (a ``torch.compile(stage)``
            wrapper) is unwrapped.
        owner: who asks (for the log line).

    Returns:
        The module to use (``module``, or the module the wrapper held), and one entry per
        module recompiled (its path, class and how torch had compiled it), also logged in one
        line.
    """
    OptimizedModule = optimized_module_type()
    done: list[str] = []
    kept: list[str] = []
    if isinstance(module, OptimizedModule):
        inner = module._orig_mod
        _recompile(inner, module, "torch.compile wrapper", "", done, kept)
        module = inner
    for path, parent in list(module.named_modules()):
        for name, child in list(parent._modules.items()):
            if isinstance(child, OptimizedModule):
                inner = child._orig_mod
                parent._modules[name] = inner
                full = f"{path}.{name}" if path else name
                _recompile(inner, child, "torch.compile wrapper", full, done, kept)
    for path, sub in module.named_modules():
        if _by_torch(sub):
            compiled = compiled_call(sub)
            set_compiled_call(sub, None)
            _recompile(sub, compiled, "nn.Module.compile", path, done, kept)
    if kept:
        log.info(
            "%s: compiled modules left as torch compiled them (a backend without AOTAutograd: "
            "autograd's own backward, which splits): %s",
            owner,
            ", ".join(kept),
        )
    if done:
        log.warning(
            "%s: compiled modules recompiled with customgrad.compile (same options) so their "
            "backward splits into I and W: %s",
            owner,
            ", ".join(done),
        )
    return module, done
