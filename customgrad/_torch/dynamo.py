"""dynamo (``torch._dynamo``): its import, backends and compiled modules.

Imported lazily (dynamo is large).

- :func:`load`: import ``torch._dynamo`` now (a first import inside a backward keeps that
  backward's frames alive);
- :func:`aot_autograd_type`: ``torch._dynamo.backends.common.AotAutograd``, what
  ``aot_autograd(...)`` makes;
- :func:`lookup_backend`: a registered backend by name;
- :func:`eager_backends`: ``aot_eager`` and ``boxed_nop`` (dynamo's debugging backends);
- :func:`optimized_module_type`: ``torch._dynamo.eval_frame.OptimizedModule``;
- :func:`compile_options`: the ``torch.compile`` options a compiled function or module was made
  with (read from dynamo's context);
- :func:`compiling_locals`: the locals of the frame dynamo compiles now;
- :func:`compiled_call`, :func:`set_compiled_call`: the compiled ``_call_impl`` that
  ``nn.Module.compile`` installs (``module._compiled_call_impl``);
- :func:`inductor_config`: the inductor config ``torch.compile(mode=, options=)`` gives
  (``torch._TorchCompileInductorWrapper``);
- :func:`compiled_autograd_on`: whether compiled autograd is on (it runs AOTAutograd's
  backward graphs itself);
- capturing a function (customgrad's automatic split): :func:`capture` runs
  ``torch.compile(fn, backend=..., fullgraph=True, dynamic=False)`` once, handing the backend's
  :class:`Captured` (the FX graph, its inputs' example values, the side effects dynamo would
  replay, the guards on constants and modules) to a callback; :func:`guard_check` is the C++
  check of the guards dynamo keeps for the captured code (its cache entry's guard manager);
  :func:`unsupported` reads why dynamo refused (an ``Unsupported`` or a graph break),
  :func:`user_frame` where in the traced code, :func:`skipped_function` which function it would
  not call and :func:`reads_function_class` whether it stopped at an ``autograd.Function`` class;
  :func:`tracing` tells a function whether dynamo traces it; :func:`dict_version` reads when a
  module's namespace was last written.
"""

from __future__ import annotations

import functools
import gc
import linecache
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "aot_autograd_type",
    "compile_options",
    "compiled_call",
    "compiled_autograd_on",
    "compiling_locals",
    "eager_backends",
    "inductor_config",
    "load",
    "lookup_backend",
    "optimized_module_type",
    "set_compiled_call",
    "Captured",
    "Refusal",
    "capture",
    "guard_check",
    "failed_guard",
    "guard_names",
    "backend_error",
    "bookkeeping",
    "class_namespace",
    "dict_version",
    "tracing",
    "readable",
    "unsupported",
    "user_frame",
    "skipped_function",
    "reads_function_class",
    "guards_instance_attributes",
    "guards_parameter_requires_grad",
    "refuses_data_pointer_comparisons",
]


def load() -> None:
    """Import ``torch._dynamo``."""
    import torch._dynamo  # noqa: F401


def aot_autograd_type() -> type[Any]:
    """``torch._dynamo.backends.common.AotAutograd``."""
    from torch._dynamo.backends.common import AotAutograd

    return AotAutograd


def lookup_backend(name: str) -> Any:
    """The backend registered as ``name`` (raises for an unknown one)."""
    from torch._dynamo.backends.registry import lookup_backend as lookup

    return lookup(name)


def eager_backends() -> tuple[Any, Any]:
    """``(aot_eager, boxed_nop)`` of ``torch._dynamo.backends.debugging``."""
    from torch._dynamo.backends.debugging import aot_eager, boxed_nop

    return aot_eager, boxed_nop


def optimized_module_type() -> type[Any]:
    """``torch._dynamo.eval_frame.OptimizedModule`` (what ``torch.compile(module)`` returns)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return OptimizedModule


def compile_options(compiled: Any) -> dict[str, Any] | None:
    """The ``torch.compile`` keyword arguments (``backend``, ``options``, ``dynamic``,
    ``fullgraph``) that made ``compiled``: a function compiled by ``torch.compile`` (what
    ``nn.Module.compile`` stores in ``_compiled_call_impl``) or an ``OptimizedModule``. Read
    from dynamo's context (``OptimizeContext``) and its backend wrapper; inductor's ``mode`` comes
    back resolved into ``options``. None when they cannot be read."""
    ctx = getattr(compiled, "dynamo_ctx", None)  # an OptimizedModule
    if ctx is None:
        code, cells = getattr(compiled, "__code__", None), getattr(compiled, "__closure__", None)
        if code is None or not cells:
            return None
        try:
            ctx = dict(zip(code.co_freevars, (c.cell_contents for c in cells))).get("self")
        except ValueError:  # an empty cell
            return None
    backend: Any = getattr(ctx, "callback", None)
    for _ in range(3):  # CatchErrorsWrapper -> ConvertFrame(Assert) -> WrapBackendDebug -> it
        backend = getattr(backend, "_torchdynamo_orig_backend", backend)
    if backend is None or not hasattr(ctx, "fullgraph"):
        return None
    found: dict[str, Any] = {
        "fullgraph": bool(getattr(ctx, "fullgraph", False)),
        "dynamic": getattr(ctx, "_dynamic", None),
    }
    if type(backend).__name__ == "_TorchCompileInductorWrapper":
        found["backend"] = "inductor"
        found["options"] = dict(getattr(backend, "config", {})) or None
    elif type(backend).__name__ == "_TorchCompileWrapper":
        found["backend"] = backend.compiler_name
        found.update(getattr(backend, "kwargs", None) or {})
    else:
        found["backend"] = backend
    return found


def compiled_autograd_on() -> bool:
    """Whether compiled autograd is on (``torch._dynamo.compiled_autograd``'s flag): it then
    traces and runs each backward itself, AOTAutograd's compiled backwards included."""
    module = sys.modules.get("torch._dynamo.compiled_autograd")
    return bool(getattr(module, "compiled_autograd_enabled", False))


def compiling_locals() -> dict[str, Any]:
    """The locals of the frame dynamo is compiling now (read from the running
    ``InstructionTranslator``, while a backend is called); empty when none."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        found = InstructionTranslator.current_tx().output.root_tx.f_locals
    except Exception:  # no frame being compiled, or a torch that keeps it elsewhere
        return {}
    return found if isinstance(found, dict) else {}


def compiled_call(module: Any) -> Any:
    """The compiled ``_call_impl`` ``nn.Module.compile`` installed on ``module``, or None."""
    return getattr(module, "_compiled_call_impl", None)


def set_compiled_call(module: Any, call: Any) -> None:
    """Install ``call`` as ``module``'s compiled ``_call_impl`` (None removes it), as
    ``nn.Module.compile`` does."""
    module._compiled_call_impl = call


def inductor_config(mode: str | None, options: Any, dynamic: Any) -> dict[str, Any]:
    """The inductor config ``torch.compile(backend="inductor", mode=, options=, dynamic=)``
    compiles with."""
    from torch import _TorchCompileInductorWrapper

    config: dict[str, Any] = _TorchCompileInductorWrapper(mode, options, dynamic).config
    return config


# -- capture ------------------------------------------------------------------------------------


@dataclass
class Captured:
    """What dynamo hands the capturing backend for one frame.

    Attributes:
        graph: the FX graph (torch-level calls), ``(*inputs) -> tuple of tensors``.
        inputs: each graph input's example value (the real tensor passed) and dynamo's name for
            where it came from (``"L['saved'][0]"``).
        outputs: each graph output's example (fake) value.
        side_effects: what the frame changes outside itself that dynamo would replay in its
            bytecode (a global rebound, a list appended to, an attribute set), in words.
        constants: dynamo's name (an expression of ``L``, the frame's locals, and ``G``, its
            globals) of each value dynamo guards by ``==`` (0j == -0j: compared again exactly).
        modules: the name of each module dynamo guards by identity only (an attribute added
            to it later, read by ``getattr(module, name, default)``, goes unguarded).
        classes: the name of each class dynamo guards by identity (``CLASS_MATCH``, with
            False) and of each object it guards by its class only (``TYPE_MATCH``, with True):
            dynamo guards no method rebound on such a class, and torch 2.11's dynamo reads
            the class's enum members' attributes and namedtuple defaults as constants.
        names: the attribute names and string constants of the code dynamo traced (the
            frame's and every function it inlined).
        reads_compiling: the frame (or a function it inlined) called one of the functions
            that say whether dynamo is compiling (``torch.compiler.is_compiling``,
            ``torch._dynamo.is_compiling``, ``torch.compiler.is_dynamo_compiling``): dynamo
            traced them as True, which a call never sees (dynamo's own flag for that,
            ``inconsistent_side_effects``; :func:`tracing` does not set it).
    """

    graph: Any
    inputs: list[tuple[Any, str]]
    outputs: list[Any]
    side_effects: list[str]
    constants: list[str]
    modules: list[str]
    classes: list[tuple[str, bool]]
    names: frozenset[str]
    reads_compiling: bool


def capture(
    fn: Callable[..., Any], args: tuple[Any, ...], on_graph: Callable[[Captured], Any]
) -> Any:
    """Run ``torch.compile(fn, fullgraph=True, dynamic=False)`` on ``args`` with a backend that
    calls ``on_graph`` with what dynamo captured; what ``on_graph`` returns is run in place of the
    graph. Raises what dynamo raises (see :func:`unsupported`), or what ``on_graph`` raised."""
    import torch
    from torch._dynamo.symbolic_convert import InstructionTranslator

    def backend(gm: Any, example_inputs: Any) -> Any:
        out = InstructionTranslator.current_tx().output
        inputs: list[tuple[Any, str]] = []
        for node in gm.graph.find_nodes(op="placeholder"):
            arg = node.meta.get("grapharg")
            source = getattr(arg, "source", None)
            inputs.append((arg.example if arg is not None else None, readable(_name(source))))
        (output,) = gm.graph.find_nodes(op="output")
        outs = output.args[0]
        outputs = [
            n.meta.get("example_value")
            for n in (outs if isinstance(outs, (tuple, list)) else [outs])
        ]
        effects = out.side_effects
        changed = [
            readable(_name(getattr(v, "source", None)))
            for v in effects.id_to_variable.values()
            if effects.is_modified(v) and getattr(v, "source", None) is not None
        ]
        if effects.tensor_hooks:
            changed.append("a tensor hook")
        constants: list[str] = []
        modules: list[str] = []
        classes: list[tuple[str, bool]] = []
        for guard in out.guards:
            kind = guard.create_fn_name()
            if kind in ("CONSTANT_MATCH", "EQUALS_MATCH"):
                constants.append(guard.name)
            elif kind == "MODULE_MATCH":
                modules.append(guard.name)
            elif kind in ("CLASS_MATCH", "TYPE_MATCH"):
                classes.append((guard.name, kind == "TYPE_MATCH"))
        names: set[str] = set()
        for code in getattr(out.tracing_context, "traced_code", None) or ():
            names.update(code.co_names)
            names.update(c for c in code.co_consts if isinstance(c, str))
        compiling = bool(getattr(out.root_tx, "inconsistent_side_effects", False))
        found = Captured(
            gm, inputs, outputs, changed, constants, modules, classes, frozenset(names), compiling
        )
        return on_graph(found)

    return torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*args)


def tracing() -> bool:
    """Whether dynamo is tracing the caller: True where dynamo traces a call of it, False where
    it is called (also while dynamo compiles another frame's graph: the call then belongs to
    that compile).

    Marked as ``torch._dynamo.assume_constant_result`` marks a function, so dynamo runs it while
    tracing and takes its result as a constant, and it then sees dynamo's current translator.
    Unlike ``torch.compiler.is_compiling()``, dynamo does not mark the traced frame for it (as
    it does for the functions whose traced value a call never sees), and it imports nothing: a
    dictionary lookup when called (as cheap as ``is_compiling()``). A capture's wrapper asks it before it calls the backward, so
    that the backward never runs eagerly where dynamo does not trace it
    (``torch.compiler.set_stance("force_eager")``, ``torch._dynamo.config.disable``,
    ``TORCHDYNAMO_DISABLE=1``, the stances that run a new frame eagerly)."""
    if not _TRANSLATING:
        translator = sys.modules.get("torch._dynamo.symbolic_convert")
        if translator is None:
            return False  # dynamo not even imported
        _TRANSLATING.append(translator.tls)
    # the thread's own dict: no AttributeError raised (and caught) per call for a missing name
    return _TRANSLATING[0].__dict__.get("current_tx") is not None


_TRANSLATING: list[Any] = []
"""dynamo's thread-local state, where the translator of the frame being traced is kept."""
tracing._dynamo_marked_constant = True  # type: ignore[attr-defined]  # assume_constant_result


def dict_version(namespace: dict[str, Any]) -> int:
    """A number that changes whenever ``namespace`` (a module's ``__dict__``) is written to
    (dynamo's ``DICT_VERSION`` guard's own reading)."""
    return _dict_version()(namespace)


def bookkeeping(name: str) -> bool:
    """Whether ``name`` in a module's namespace is bookkeeping a backward does not read:
    dunders (``__warningregistry__``, which a warning adds) and the globals dynamo installs in
    the namespace of a frame it compiles (``__compiled_fn_*``, ``__resume_at_*``,
    ``__import_*``, ``__builtins_dict___*``, ``_<id>_c<n>``)."""
    return name.startswith("__") or _BY_ID.fullmatch(name) is not None


_BY_ID = re.compile(r"_\d+_c\d+")


def class_namespace(cls: type) -> dict[str, Any] | None:
    """The dict behind ``cls.__dict__`` (what ``setattr(cls, ...)`` writes, so that
    :func:`dict_version` tells when it was written), or None for a built-in class, which no one
    can write to."""
    if not cls.__flags__ & _HEAP_TYPE:
        return None
    found = gc.get_referents(cls.__dict__)  # a mappingproxy refers to the dict it shows
    return found[0] if len(found) == 1 and type(found[0]) is dict else None


_HEAP_TYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class made by a class statement or type()


@functools.cache
def _dict_version() -> Callable[[dict[str, Any]], int]:
    try:
        from torch._C._dynamo.guards import dict_version

        version: Callable[[dict[str, Any]], int] = dict_version
    except ImportError:  # a torch without it: every value by identity (slower, as exact)

        def version(namespace: dict[str, Any]) -> int:
            return hash((len(namespace), *map(id, namespace.values())))

    return version


def _name(source: Any) -> str:
    name = getattr(source, "name", None)
    if callable(name):
        name = name()
    return name if isinstance(name, str) else "(unknown)"


def readable(source: str) -> str:
    """dynamo's name of a value in words a user reads: ``G['__import___main__'].seen`` is
    ``__main__.seen``, ``L['saved'][0]`` is ``saved[0]``."""

    def module(m: re.Match[str]) -> str:
        return m.group(1).replace("_dot_", ".")

    text = re.sub(r"G\['__import_(\w+?)'\]", module, source)
    text = re.sub(r"G\['(\w+)'\]", r"\1", text)
    return re.sub(r"L\['(\w+)'\]", r"\1", text)


def guard_check(code: Any) -> Callable[[dict[str, Any]], bool] | None:
    """The C++ check of the guards dynamo keeps for ``code``'s one cache entry (its guard
    manager's root, called with the frame's locals), or None when there is not exactly one."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    entries = _debug_get_cache_entry_list(code)
    if len(entries) != 1:
        return None
    check: Callable[[dict[str, Any]], bool] = entries[0].guard_manager.root.check
    return check


def guard_names() -> dict[str, object]:
    """The names dynamo's guard expressions call besides ``G`` and ``L``
    (``___namedtuple_fields``, ``___tuple_iterator_len``, ...), to evaluate them again."""
    try:
        from torch._dynamo.guards import _get_closure_vars
    except ImportError:  # a torch without them: expressions that use one cannot be read
        return {}
    return dict(_get_closure_vars())


def failed_guard(check: Callable[[dict[str, Any]], bool], frame: dict[str, Any]) -> str | None:
    """The first of dynamo's guards that fails for ``frame`` (its code, in words: ``ctx.sizes[1]
    == 2``), given the check :func:`guard_check` returned; None when they hold."""
    manager = getattr(check, "__self__", None)
    verbose = getattr(manager, "check_verbose", None)
    if verbose is None:
        return None
    found = verbose(frame)
    if found.result or not found.verbose_code_parts:
        return None
    return readable(str(found.verbose_code_parts[0]).split("#")[0].strip())


@dataclass(frozen=True)
class Refusal:
    """Why dynamo refused to capture a frame, read from its exception.

    Attributes:
        kind: dynamo's name for the graph break (``"Data-dependent branching"``).
        explanation: its explanation, one line.
        at: ``file:line`` of the innermost user frame, or "".
        line: that line's source text, or "".
        stack: the user frames dynamo was tracing, outermost first, as
            ``(file, line number, source line)``.
    """

    kind: str
    explanation: str
    at: str
    line: str
    stack: tuple[tuple[str, int, str], ...] = ()


def unsupported(e: BaseException) -> Refusal | None:
    """Why dynamo refused, if ``e`` is dynamo's ``Unsupported`` (or another dynamo error)."""
    from torch._dynamo.exc import TorchDynamoException

    if not isinstance(e, TorchDynamoException):
        return None
    kind = str(getattr(e, "gb_type", "") or type(e).__name__)
    msg = str(getattr(e, "msg", "") or e)
    name = _observed_name_error(e)
    if name is not None:  # torch 2.14 and later: an undefined name is an "Observed exception"
        kind = "failed to find name in frame builtins"  # what torch 2.13 and earlier say
        msg = f"Explanation: Failed to find name `{name}` in the frame's globals or builtins."
    explanation = ""
    for line in msg.splitlines():
        line = line.strip()
        if line.startswith("Explanation:"):
            explanation = line.removeprefix("Explanation:").strip()
            break
    if not explanation:
        explanation = (msg.strip().splitlines() or [""])[0]
    frame = user_frame(e)
    at = f"{frame[0]}:{frame[1]}" if frame is not None else ""
    text = frame[2] if frame is not None else ""
    stack = tuple(
        (f.filename, f.lineno or 0, (f.line or "").strip())
        for f in getattr(e, "real_stack", None) or ()
    )
    return Refusal(kind, explanation, at, text, stack)


def user_frame(e: BaseException) -> tuple[str, int, str] | None:
    """The innermost frame of the traced code where dynamo stopped with ``e`` (any exception it
    raised or passed on while tracing): ``(file, line number, source line)``, or None."""
    frame = getattr(e, "innermost_user_frame_summary", None)
    if frame is None:
        stack = getattr(e, "real_stack", None)
        frame = stack[-1] if stack else None
    if frame is not None:
        return frame.filename, frame.lineno or 0, (frame.line or "").strip()
    # dynamo's internal errors carry the frames in their message only
    found = re.findall(r'File "([^"]+)", line (\d+)', str(e).partition("from user code:")[2])
    if not found:
        return None
    file, number = found[-1]
    return file, int(number), linecache.getline(file, int(number)).strip()


def skipped_function(e: BaseException) -> tuple[str, int] | None:
    """The name and ``id`` of the function dynamo would not call (wrapped with
    ``torch.compiler.disable``, or marked skipped), if that is why it stopped."""
    found = re.search(r"Skip calling function `<function ([\w.<>]+) at 0x([0-9a-f]+)>`", str(e))
    return (found.group(1), int(found.group(2), 16)) if found else None


def reads_function_class(e: BaseException) -> bool:
    """Whether dynamo stopped at an ``autograd.Function`` class used as a class (an attribute,
    ``cls`` of a classmethod, ``super()``, ``Cls.backward(ctx, ...)``, ``.__func__``): dynamo
    models such a class for ``apply`` and its staticmethods only (torch 2.13)."""
    text = str(e)
    if "AutogradFunctionVariable" in text or "Expected FakeBackwardCFunction" in text:
        return True
    # torch 2.11 and 2.12: a bare assert in that variable's method, the last frame raised
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = tb.tb_frame.f_locals.get("self") if tb is not None else None
    return type(where).__name__ == "AutogradFunctionVariable"


def _observed_name_error(e: BaseException) -> str | None:
    """The undefined name, where dynamo reports a ``NameError`` of the traced code as an
    observed exception (torch 2.14 and later: ``Unsupported`` caused by
    ``ObservedNameError``); else None."""
    seen: BaseException | None = e.__cause__
    for _ in range(4):
        if seen is None:
            return None
        if type(seen).__name__.startswith("ObservedNameError"):
            found = re.search(r"name '([^']+)' is not defined", str(seen))
            return found.group(1) if found else None
        seen = seen.__cause__
    return None


def backend_error(e: BaseException) -> BaseException | None:
    """What the capturing backend raised, if ``e`` is dynamo's wrapper of it
    (``BackendCompilerFailed``)."""
    from torch._dynamo.exc import BackendCompilerFailed

    if isinstance(e, BackendCompilerFailed):
        inner = getattr(e, "inner_exception", None)
        return inner if isinstance(inner, BaseException) else e.__cause__
    return None


@functools.cache
def guards_instance_attributes() -> bool:
    """Whether dynamo guards the values a captured function reads through objects it treats as
    constants: an enum member's instance attribute set after the class was made (torch 2.12 and
    later re-capture when it changes; torch 2.11's dynamo reuses the stale capture, and misses a
    namedtuple's mutable default and a monkeypatched ``torch.nn.functional`` function alike).
    Probed once, by that behaviour: a function reading ``Member.A.scale`` captured, the attribute
    changed, the function called again."""
    import enum
    import types

    import torch

    member = enum.Enum("member", {"A": 1})
    member.A.scale = 1.0  # type: ignore[attr-defined]

    def read(x: Any) -> Any:
        return x * probe.A.scale  # type: ignore[name-defined]  # noqa: F821

    scope = {"probe": member, "__name__": __name__, "__builtins__": __builtins__}
    fn = types.FunctionType(read.__code__, scope, "guard_probe")
    from customgrad._torch.dispatcher import disable_current_modes

    compiled = torch.compile(fn, backend="eager", fullgraph=True, dynamic=False)
    # asked from inside a backward: without the modes on the stack (a FLOP counter), no graph
    with torch.no_grad(), disable_current_modes():
        x = torch.ones(())
        compiled(x)
        member.A.scale = 2.0  # type: ignore[attr-defined]
        return bool(compiled(x).item() == 2.0)


@functools.cache
def guards_parameter_requires_grad() -> bool:
    """Whether a compiled module recompiles when one of its parameters is frozen or unfrozen
    (``requires_grad_``) between calls (torch 2.12 and later). torch 2.11's dynamo keeps the
    graph traced with the old flag: a weight frozen after the first compile still has its
    gradient computed by the backward graph (and dropped by autograd), under ``torch.compile``
    and ``customgrad.compile`` alike. Probed once, by that behaviour: a compiled ``nn.Linear``
    called, its weight frozen, called again, the backend's compiles counted."""
    import torch

    from customgrad._torch.dispatcher import disable_current_modes

    compiles = []

    def backend(gm: Any, example_inputs: Any) -> Any:
        compiles.append(gm)
        return gm.forward

    linear = torch.nn.Linear(1, 1)
    compiled = torch.compile(linear, backend=backend, fullgraph=True, dynamic=False)
    with torch.enable_grad(), disable_current_modes():
        x = torch.ones(1, 1)
        compiled(x)
        linear.weight.requires_grad_(False)
        compiled(x)
    return len(compiles) == 2


@functools.cache
def refuses_data_pointer_comparisons() -> bool:
    """Whether dynamo refuses (a graph break) to trace a comparison of a tensor's
    ``data_ptr()`` it cannot decide (torch 2.13 and later). torch 2.11's and 2.12's dynamo
    evaluate ``t.data_ptr() == 0`` to False at trace time whatever the tensor, and capture the
    rest. Probed once, by that behaviour, on an empty tensor (whose data pointer is 0), in a
    thread of its own: dynamo keeps its refusal, whose frames would otherwise keep the caller's
    frames (a backward's node and tensors) alive."""
    import threading

    got: list[bool] = []
    probe = threading.Thread(target=lambda: got.append(_refuses_data_pointer_comparisons()))
    probe.start()
    probe.join()
    return got[0]


def _refuses_data_pointer_comparisons() -> bool:
    import torch

    from customgrad._torch.dispatcher import disable_current_modes

    def compare(t: Any) -> Any:
        return t.data_ptr() == 0

    compiled = torch.compile(compare, backend="eager", fullgraph=True, dynamic=False)
    with torch.no_grad(), disable_current_modes():
        try:
            return bool(compiled(torch.empty(0))) is not False
        except Exception:  # dynamo's Unsupported: it refuses, as it should
            return True
