"""``customgrad.compile``: ``torch.compile`` with a backward that splits into I and W.

:func:`compile` compiles a module in place (it keeps its identity, so torch's zero-bubble
schedules accept the stage) with a backend that goes through AOTAutograd; each compiled region's
backward is cut into an input pass and a weight pass by :mod:`customgrad._compiled_backward`
(the split program traced backwards use too) and described by
:class:`customgrad._compiled_region.CompiledRegion`. This module is the public entry, the
backend and the plumbing that makes dynamo compile a module's frame.
"""

from __future__ import annotations

import functools
import itertools
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import fx, nn

from customgrad._compiled_backward import SplitCompiler, no_donated_buffers, region_of, watching
from customgrad._compiled_region import CompiledRegion, regions, register
from customgrad._errors import ArgumentTypeError, ArgumentValueError, CustomGradError
from customgrad._torch.aot import config_patch, inductor_compilers
from customgrad._torch.dispatcher import is_traceable_wrapper_subclass
from customgrad._torch.dynamo import (
    aot_autograd_type,
    compiled_call,
    compiling_locals,
    eager_backends,
    inductor_config,
    lookup_backend,
    optimized_module_type,
    set_compiled_call,
)
from customgrad._torch.errors import errors_first
from customgrad._torch.fake import is_fake

__all__ = ["CompiledRegion", "compile", "region_of", "regions"]

_LOCK = threading.Lock()

_M = TypeVar("_M")

SUPPORTED_BACKENDS = ("inductor", "aot_eager")

MSG_NOT_CALLABLE = """\
customgrad.compile: expected an nn.Module or a callable to compile, got {got}. Pass the block \
(or the whole stage) itself:

    customgrad.compile(block)                      # compiles in place, returns block
    for block in model.layers: customgrad.compile(block)
"""

MSG_BACKEND = """\
customgrad.compile: backend {got} does not go through AOTAutograd, so its backward cannot be \
split into an input and a weight pass. Supported: "inductor" (the default), "aot_eager" (for \
debugging), or an AOTAutograd backend made with torch._dynamo.backends.common.aot_autograd(...):

    customgrad.compile(block)                        # inductor
    customgrad.compile(block, backend="aot_eager")   # debugging
"""

MSG_MODE = """\
customgrad.compile: mode={mode!r} and options={options!r} are inductor's settings; backend \
{got} takes neither. Drop them, or compile with inductor:

    customgrad.compile(block, mode="max-autotune")   # backend="inductor", the default
"""

MSG_TWICE = """\
customgrad.compile: {got} is already compiled ({how}). Compile it once, with \
customgrad.compile only, on the module itself (not torch.compile's OptimizedModule):

    customgrad.compile(block)          # instead of block.compile() / torch.compile(block)
"""


def _kind(x: Any) -> bool | None:
    if not isinstance(x, torch.Tensor):
        return None
    return isinstance(x, nn.Parameter)


def _subclass_input(example_inputs: Sequence[Any]) -> bool:
    return any(
        isinstance(x, torch.Tensor)
        and not isinstance(x, nn.Parameter)
        and (is_traceable_wrapper_subclass(x) or type(x) not in (torch.Tensor,))
        and not is_fake(x)
        for x in example_inputs
    )


def _dynamo_input_names(gm: fx.GraphModule) -> list[str]:
    names = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        source = n.meta.get("grapharg")
        label = getattr(getattr(source, "source", None), "name", None)
        text = label() if callable(label) else label
        names.append(_readable(str(text)) if text else n.name)
    return names


def _region_label(gm: fx.GraphModule) -> str:
    """The class of the module whose frame dynamo compiled (``Block``), else of the first
    module the graph calls, else "compiled function"."""
    frame = compiling_locals()  # forward(self, ...), or _call_for's call(*args) of call_impl
    module = frame.get("self", getattr(frame.get("call_impl"), "__self__", None))
    if isinstance(module, nn.Module):
        for cls in type(module).__mro__:  # past FSDP2's generated FSDP<Block> class
            if not cls.__module__.startswith("torch.distributed"):
                return cls.__qualname__
        return type(module).__qualname__
    for n in gm.graph.nodes:
        stack = n.meta.get("nn_module_stack")
        if stack:
            _, cls = next(iter(stack.values()))
            name = getattr(cls, "__qualname__", None) or str(cls).rsplit(".", 1)[-1]
            return str(name)
    return "compiled function"


def _readable(source: str) -> str:
    """``L['self']._modules['fc1']._parameters['weight']`` -> ``fc1.weight``."""
    import re

    if source.startswith("L['args']"):
        index = re.findall(r"\[(\d+)\]", source)
        return f"input {index[0]}" if index else "input"
    parts = [p for p in re.findall(r"\['([^']+)'\]", source) if p not in ("self", "call_impl")]
    return ".".join(parts) if parts else source


class _Backend:
    """The ``torch.compile`` backend :func:`compile` installs: one per compiled module."""

    def __init__(self, backend: object, mode: str | None, options: object, dynamic: object) -> None:
        self.backend = backend
        self.counter = itertools.count()
        self.inductor_config: dict[str, Any] = {}
        if backend == "inductor":
            self.inductor_config = inductor_config(mode, options, dynamic)

    def __call__(
        self, gm: fx.GraphModule, example_inputs: list[object], **kwargs: object
    ) -> Callable[..., object]:
        region = CompiledRegion(name=f"{_region_label(gm)} (graph {next(self.counter)})")
        register(region)
        kinds = [_kind(x) for x in example_inputs]
        reason = None
        if _subclass_input(example_inputs):
            reason = "a tensor-subclass input (its gradient is flattened into inner tensors)"
        names = _dynamo_input_names(gm)

        def split(compile_one: Callable[..., object]) -> SplitCompiler:
            """The backward compiler: ``compile_one`` (the backend's) compiling full, I and W."""
            return SplitCompiler(region, kinds, compile_one, reason, names)

        with config_patch(donated_buffer=False, enable_autograd_cache=False):
            compiled = self._compile(gm, example_inputs, split)
        no_donated_buffers()
        return watching(region, compiled)

    def _compile(
        self,
        gm: fx.GraphModule,
        example_inputs: list[object],
        split: Callable[[Callable[..., object]], SplitCompiler],
    ) -> Any:  # the backend's compiled callable
        backend = self.backend
        if backend == "inductor":
            compile_fx, compile_fx_inner = inductor_compilers()

            def inner(g: fx.GraphModule, ex: Sequence[Any], **kw: Any) -> Any:
                if not kw.get("is_backward"):
                    return compile_fx_inner(g, ex, **kw)
                return split(compile_fx_inner)(g, ex, **kw)

            config = dict(self.inductor_config)
            return compile_fx(gm, example_inputs, inner_compile=inner, config_patches=config)
        AotAutograd = aot_autograd_type()
        aot_eager, boxed_nop = eager_backends()
        if backend == "aot_eager":
            return aot_eager(gm, example_inputs, bw_compiler=split(boxed_nop))
        assert isinstance(backend, AotAutograd)
        bw = split(backend.kwargs.get("bw_compiler") or backend.kwargs["fw_compiler"])
        return AotAutograd(**{**backend.kwargs, "bw_compiler": bw})(gm, example_inputs)


def _user_forward(module: nn.Module) -> bool:
    """Whether the module's ``forward`` is the user's code (a frame dynamo compiles)."""
    forward = getattr(type(module), "forward", None)
    return not str(getattr(forward, "__module__", "torch.")).startswith("torch.")


def _calls(call_impl: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kw: Any) -> Any:
        return call_impl(*args, **kw)

    return call


_CODES: weakref.WeakKeyDictionary[type, Any] = weakref.WeakKeyDictionary()


def _call_for(module: nn.Module) -> Callable[..., Any]:
    """``module._call_impl`` in a function whose code object is its class's own, for modules
    whose ``forward`` is torch's own (``nn.Linear``, ``nn.Sequential``): dynamo skips torch's
    frames, so compiling ``_call_impl`` as ``nn.Module.compile`` does would compile nothing.
    Dynamo traces this function's frame, inlining ``_call_impl`` (hooks included) and
    ``forward``; it keeps compiled graphs per code object: modules of one class share theirs,
    and other classes never evict them.
    """
    call = _calls(module._call_impl)
    cls = type(module)
    with _LOCK:
        code = _CODES.get(cls)
        if code is None:
            code = _CODES[cls] = call.__code__.replace(co_name=f"call_{cls.__name__}")
    call.__code__ = code
    return call


_BACKENDS: dict[tuple[Any, ...], _Backend] = {}


def _backend_for(backend: Any, mode: str | None, options: Any, dynamic: Any) -> _Backend:
    """One backend object per setting: dynamo reuses a compiled graph only for the same
    backend object, so blocks of one class compiled alike share their compiled code."""
    key = (id(backend) if not isinstance(backend, str) else backend, mode, repr(options), dynamic)
    with _LOCK:
        found = _BACKENDS.get(key)
        if found is None:
            found = _BACKENDS[key] = _Backend(backend, mode, options, dynamic)
        return found


def _resolve_backend(backend: Any) -> Any:
    if isinstance(backend, aot_autograd_type()):
        return backend
    if isinstance(backend, str):
        if backend in SUPPORTED_BACKENDS:
            return backend
        try:
            found = lookup_backend(backend)
        except Exception:
            found = None
        if isinstance(found, aot_autograd_type()):
            return found
    raise ArgumentValueError(MSG_BACKEND.format(got=_describe(backend)))


def _describe(value: object) -> str:
    if isinstance(value, str):
        return repr(value)
    name = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
    return f"{type(value).__name__} {name}" if name else f"{type(value).__name__}"


def compile(module: _M, **torch_compile_kwargs: object) -> _M:
    """Compile ``module`` in place with ``torch.compile``, with a backward that splits.

    Like ``nn.Module.compile``, the module keeps its identity (so torch's zero-bubble
    schedules accept the stage: no ``OptimizedModule``) and its next calls run compiled. Each
    compiled region's backward is cut into an input-gradient graph (I) and a weight-gradient
    graph (W), compiled by the same backend: under torch's or customgrad's
    ``stage_backward_input`` / ``stage_backward_weight`` nothing is computed twice, and a full
    ``loss.backward()`` runs the uncut graph. What cannot split runs its full backward in each
    pass that reaches it, with one log line (logger ``"customgrad"``) saying why.

    Args:
        module: an ``nn.Module`` (compiled in place) or a function (a compiled function is
            returned). Per block (regional compile) or a whole stage; customgrad ops inside
            are compiled with the rest.
        **torch_compile_kwargs: what ``torch.compile`` takes: ``backend`` (``"inductor"``,
            the default; ``"aot_eager"``; or an AOTAutograd backend), ``mode``, ``options``,
            ``dynamic``, ``fullgraph``, ...

    Returns:
        ``module`` itself, compiled (for a function: the compiled function).

    Raises:
        ArgumentTypeError: ``module`` is neither an ``nn.Module`` nor callable, or an
            ``OptimizedModule`` (already ``torch.compile``\\ d).
        ArgumentValueError: the backend does not go through AOTAutograd.

    Example:
        >>> import torch, customgrad
        >>> block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
        >>> block = customgrad.compile(block, backend="aot_eager")
        >>> block(torch.randn(2, 4)).sum().backward()
    """
    if isinstance(module, optimized_module_type()):
        raise ArgumentTypeError(
            MSG_TWICE.format(got="this OptimizedModule", how="by torch.compile(module)")
        )
    if not callable(module):
        raise ArgumentTypeError(MSG_NOT_CALLABLE.format(got=_describe(module)))
    kwargs: dict[str, Any] = dict(torch_compile_kwargs)  # torch.compile checks its own keywords
    backend = _resolve_backend(kwargs.pop("backend", "inductor"))
    mode = kwargs.pop("mode", None)
    options = kwargs.pop("options", None)
    if backend != "inductor" and (mode not in (None, "default") or options):
        got = _describe(torch_compile_kwargs["backend"])
        raise ArgumentValueError(MSG_MODE.format(got=got, mode=mode, options=options))
    compiled_backend = _backend_for(backend, mode, options, kwargs.get("dynamic"))
    label = type(module).__qualname__ if isinstance(module, nn.Module) else _describe(module)
    if isinstance(module, nn.Module):
        if compiled_call(module) is not None:
            raise ArgumentTypeError(
                MSG_TWICE.format(got=label, how="its _compiled_call_impl is set")
            )
        # as nn.Module.compile does: dynamo skips _call_impl's own frame, so the module's hooks
        # (FSDP2's, any torch._dynamo.disable'd one) run outside the graph, and compiles
        # forward's frame, whose code object blocks of one class share
        call = module._call_impl if _user_forward(module) else _call_for(module)
        compiled = _errors_first(torch.compile(call, backend=compiled_backend, **kwargs))
        compiled._customgrad_compiled = True
        set_compiled_call(module, compiled)
        return module
    return _errors_first(torch.compile(module, backend=compiled_backend, **kwargs))  # type: ignore[return-value]


def _errors_first(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled``, raising a customgrad error that dynamo or AOTAutograd wrapped while they
    traced (a missing fake kernel, a wrong gradient) as itself: its type and text, with what
    torch raised as its cause."""

    @functools.wraps(compiled)
    def call(*args: Any, **kwargs: Any) -> Any:
        with errors_first(CustomGradError):
            return compiled(*args, **kwargs)

    return call
