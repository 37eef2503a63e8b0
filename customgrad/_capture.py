"""Capturing a single backward with dynamo and lowering it to an aten graph.

:func:`capture_backward` runs the backward under ``torch.compile(fullgraph=True)`` (through
:mod:`customgrad._torch.dynamo`) with a backend that only keeps the graph, lowers the graph to
aten ops with ``make_fx`` on fake tensors (other custom ops, customgrad ops among them, stay
opaque calls) and returns a :class:`Capture`: its :class:`TracedSplit` and what must hold to
reuse it, or a :class:`Fallback` that says why not.

**What selects a capture.** Dynamo guards what the backward read (globals, closures, modules'
attributes, objects' fields, torch's global state, the arguments' metadata); customgrad checks
those guards per node, in C++, through the guard manager dynamo keeps for the captured code
(:func:`customgrad._torch.dynamo.guard_check`), and adds what dynamo's guards miss: each tensor
argument's ``is_leaf``, floats and complex numbers compared by their exact bits (``0j`` and
``-0j``), attributes added to or removed from a module or class the backward read, whatever
names them (``getattr(torch, NAME, default)``, ``hasattr``), a method rebound on such a class,
on torch 2.11 what its dynamo reads unguarded (:class:`Namespace`, :func:`_constants_of`), the
values of plain saved values and the ambient state (:func:`customgrad._autosplit.ambient`). Each
capture has its own code object, so dynamo's caches, recompile limits and the user's own
``torch.compile`` calls are not shared with it; a guard that fails captures again, up to
:data:`customgrad._autosplit.RECAPTURES` times per signature, then the op runs once.

**Never stale, never twice.** A backward that asks whether dynamo is compiling
(``torch.compiler.is_compiling()``: True while dynamo traces it, False when it is called) runs
once. The capture's wrapper asks dynamo whether it is being traced before it calls the backward:
where torch.compile is off (``torch.compiler.set_stance("force_eager")``,
``torch._dynamo.config.disable``, ``TORCHDYNAMO_DISABLE=1``) the backward runs once, never
eagerly inside the capture, and nothing of the try is kept: it is captured once torch.compile
runs again. The capture returns meta stand-ins once, so dynamo's cache entry keeps no tensor.

**What runs once.** A backward dynamo cannot capture whole (a graph break: Python control flow
on tensor values, ``print``, a function dynamo skips such as ``torch.manual_seed``, a raw Triton
launch on the CPU interpreter, a name that is not defined), one that changes state outside itself
(a global rebound, a list appended to: dynamo would replay it in bytecode a split never runs),
one that reads a tensor that is not an argument, or one ``make_fx`` cannot lower, runs once,
whole (the run-once rule of :mod:`customgrad._codegen`), and one log line on the ``customgrad``
logger says why, with dynamo's reason and the line. Inside another trace (``torch.compile``'s
AOTAutograd, ``make_fx``, functorch transforms) the backward is called as written, and the outer
trace records it. Capturing holds one process-wide lock and changes no logger level, warning
filter or dynamo setting.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import enum
import logging
import os
import re
import threading
import traceback
import types
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, TypeAlias

import torch
import torch.fx as fx

from customgrad._errors import CustomGradError
from customgrad._rules import OpSpec
from customgrad._split_program import mutating
from customgrad._torch import dynamo
from customgrad._torch.dispatcher import disable_current_modes as _disable_current_modes
from customgrad._torch.dispatcher import dispatch_stack_len
from customgrad._torch.fake import FAKE_TENSOR_LOGGER, data_dependent_errors
from customgrad._traced_split import Layout, Structure, TracedSplit
from customgrad._triton import FIX_RAW_LAUNCH, RawLaunch, function_named, launch_in, raw_launch

__all__ = [
    "INSIDE_TRACE",
    "NOT_COMPILING",
    "Capture",
    "Fallback",
    "bits",
    "capture_backward",
    "quiet_tracing",
]

_Tensor = torch.Tensor
_dispatch_stack_len = dispatch_stack_len
_dict_version = dynamo.dict_version
_bookkeeping = dynamo.bookkeeping


class Fallback:
    """Why a backward is not split automatically: it runs once, whole (the run-once rule).

    Attributes:
        why: the reason, for reports.
        fix: what would make it traceable.
        logged: the reason is worth a log line (a backward that merely returned something
            invalid raises customgrad's validation error when called, which says it all).
    """

    __slots__ = ("fix", "logged", "retries", "why")

    def __init__(self, why: str, fix: str, logged: bool = True, retries: int = 0) -> None:
        self.why = why
        self.fix = fix
        self.logged = logged
        # Traces left to try: a failure of an unknown kind may come from outside the backward
        # (another thread tracing with make_fx, torch.compile), so it is not final at once.
        self.retries = retries

    def describe(self) -> str:
        return (
            f"not split automatically ({self.why}): runs once, whole, in the first pass that "
            f"needs a gradient, and hands the later pass its gradients"
        )

    def __repr__(self) -> str:
        return f"Fallback({self.why!r})"


INSIDE_TRACE = Fallback(
    "called inside another trace: torch.compile, make_fx or a functorch transform",
    "",
    logged=False,
)


NOT_COMPILING = Fallback(
    "torch.compile is off here (torch.compiler.set_stance('force_eager'), "
    "torch._dynamo.config.disable or TORCHDYNAMO_DISABLE=1), so dynamo cannot capture it; it "
    "is captured again once torch.compile runs",
    "let torch.compile run where the split backward runs",
)
"""Dynamo does not trace here now: the backward runs once, and nothing is kept of the try."""


class _NotCompiling(Exception):
    """The capture's wrapper was called rather than traced (dynamo is off)."""


class _Invalid(Exception):
    """The traced backward returned something customgrad's validation refuses."""


def _why(e: BaseException) -> tuple[str, str]:
    """The reason and fix for a backward that ``make_fx`` could not trace."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    DataDependentOutputException, DynamicOutputShapeException = data_dependent_errors()

    first = (str(e).strip().splitlines() or [""])[0]
    if len(first) > 160:
        first = first[:157] + "..."
    if isinstance(e, (GuardOnDataDependentSymNode, DataDependentOutputException)):
        return (
            "it branches on tensor values in Python (if tensor:, bool(), .item() in a condition)",
            "compute with tensor ops instead (torch.where, masks), so the same ops run for "
            "every value",
        )
    if isinstance(e, DynamicOutputShapeException):
        return (
            "it calls an op whose output shape depends on tensor values (nonzero, "
            "masked_select, unique)",
            "keep shapes fixed (masks instead of selection)",
        )
    launch = raw_launch(e)
    if launch is not None:
        return (
            f"it launches the Triton kernel {launch.kernel} directly ({launch.at}), which fake "
            f"tensors cannot run",
            FIX_RAW_LAUNCH,
        )
    if "data pointer" in first or "data_ptr" in first:
        return (
            "it launches a kernel on raw data pointers (Triton, ctypes), which fake tensors "
            "do not have",
            FIX_RAW_LAUNCH,
        )
    return (
        f"lowering it to aten ops (make_fx on fake tensors) raised {type(e).__name__}: {first}",
        "make it run on fake tensors (no data access from Python; opaque kernels wrapped in "
        "custom ops with fake kernels)",
    )


class _ThisThread(logging.Filter):
    """Drops the records of one thread (the one tracing), lets every other thread's through."""

    def __init__(self) -> None:
        super().__init__()
        self.thread = threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        return record.thread != self.thread


@contextlib.contextmanager
def quiet_tracing() -> Iterator[None]:
    """Fake tensors log an error with a traceback for every op that fails while tracing; the
    fallback's log line says it once. Only this thread's records, only while it traces: the
    logger's level and other threads' records are left alone. (Held under :data:`TRACE_LOCK`.)"""
    logger = logging.getLogger(FAKE_TENSOR_LOGGER)
    quiet = _ThisThread()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


Reader: TypeAlias = Callable[[dict[str, object], dict[str, object]], tuple[object, ...]]
"""Reads the values compared by their bits from the globals (``G``) and the frame (``L``)."""
Extra: TypeAlias = "tuple[tuple[Reader | None, tuple[object, ...]], list[Namespace], list[tuple[object, Hashable]]]"
"""What customgrad checks besides dynamo's guards (see :func:`_extra_checks`)."""


@dataclasses.dataclass(slots=True)
class Namespace:
    """The namespace of a module or class a capture read, as last seen: its version, and the
    identity of each value by name (dynamo's and Python's bookkeeping names left out).

    A name added or removed fails the check (``getattr(module, name, default)``, ``hasattr``
    read it, whatever expression made the name: dynamo guards neither); so does a value rebound
    where ``rebinding`` (a class's: dynamo does not guard a method monkeypatched on the class of
    an object it read; a module's where dynamo misses guards on values it treats as constants,
    torch 2.11)."""

    owner: str
    namespace: dict[str, object]
    version: int
    values: dict[str, int]
    rebinding: bool

    @staticmethod
    def of(owner: str, namespace: dict[str, object], rebinding: bool) -> Namespace:
        return Namespace(owner, namespace, _dict_version(namespace), _values(namespace), rebinding)

    def holds(self) -> bool:
        version = _dict_version(self.namespace)
        if version == self.version:
            return True
        values = _values(self.namespace)
        if values.keys() != self.values.keys() or (self.rebinding and values != self.values):
            return False
        self.version, self.values = version, values  # written to, not where it matters
        return True

    def changed(self) -> str:
        values = _values(self.namespace)
        names = sorted(values.keys() ^ self.values.keys()) or sorted(
            k for k in values if values[k] != self.values[k]
        )
        return f"the names {names} of {self.owner} changed"


def _values(namespace: dict[str, object]) -> dict[str, int]:
    return {k: id(v) for k, v in list(namespace.items()) if not _bookkeeping(k)}


def _constants_of(cls: object) -> Hashable:
    """What a dynamo that misses guards on values it treats as constants (torch 2.11) reads of
    ``cls`` unguarded: its enum members' attributes, its namedtuple defaults (None: nothing)."""
    if isinstance(cls, enum.EnumMeta):
        return tuple(_frozen(vars(member)) for member in cls)  # type: ignore[var-annotated]
    defaults = getattr(cls, "_field_defaults", None)
    if isinstance(defaults, dict) and issubclass(cls, tuple):  # type: ignore[arg-type]
        return _frozen(defaults)
    return None


def _frozen(value: object, depth: int = 4) -> Hashable:
    """``value`` compared exactly: plain values by :func:`bits`, the items of lists, tuples and
    dicts (``depth`` levels down) by theirs, anything else by identity."""
    kind = type(value)
    if kind in _PLAIN:
        return bits(value)
    if depth and kind in (list, tuple):
        return (kind, *(_frozen(v, depth - 1) for v in value))  # type: ignore[attr-defined]
    if depth and kind is dict:
        items = value.items()  # type: ignore[attr-defined]
        return (kind, *((k, _frozen(v, depth - 1)) for k, v in items))
    return (kind, id(value))


_PLAIN = (type(None), bool, int, float, complex, str, bytes)


class Capture:
    """One capture of a backward: its split and what must hold to reuse it.

    ``holds(frame)`` is dynamo's guard check for the capture's code (C++), then customgrad's
    checks of what those guards compare too loosely or miss: floats and complex numbers read by
    exact bits; the namespaces of the modules and classes the backward read (a name added or
    removed, a method rebound on a class; see :class:`Namespace`); where dynamo misses guards
    on values it treats as constants, what it read of them (:func:`_constants_of`).
    """

    __slots__ = ("_bits", "_check", "_classes", "_globals", "_namespaces", "_read", "split")

    def __init__(
        self,
        split: TracedSplit,
        check: Callable[[dict[str, object]], bool],
        scope: dict[str, object],
        constants: tuple[Reader | None, tuple[object, ...]],
        namespaces: list[Namespace],
        classes: list[tuple[object, Hashable]],
    ) -> None:
        self.split = split
        self._check = check
        self._globals = scope
        self._read, self._bits = constants
        self._namespaces = namespaces
        self._classes = classes

    def changed(self, frame: dict[str, object]) -> str:
        """What no longer holds for ``frame``, in words (for the reason a backward stops being
        captured)."""
        with _disable_current_modes():
            guard = dynamo.failed_guard(self._check, frame)
        if guard:
            return f"`{guard}` no longer holds"
        for seen in self._namespaces:
            if not seen.holds():
                return seen.changed()
        return "a value customgrad compares exactly changed"

    def holds(self, frame: dict[str, object]) -> bool:
        if _dispatch_stack_len():
            # A dispatch mode (a FLOP counter, a profiler's) adds the Python key to every
            # tensor's dispatch keys, which dynamo's tensor guards compare: check as captured.
            with _disable_current_modes():
                if not self._check(frame):
                    return False
        elif not self._check(frame):
            return False
        read = self._read
        if read is not None:
            try:
                if tuple(map(bits, read(self._globals, frame))) != self._bits:
                    return False
            except Exception:
                return False
        for seen in self._namespaces:
            if not seen.holds():
                return False
        return all(_constants_of(cls) == held for cls, held in self._classes)


def bits(value: object) -> tuple[object, ...]:
    """``value`` as compared exactly: floats by their bits (-0.0 != 0.0, nan == nan)."""
    if type(value) is float:
        return (float, value.hex())
    if type(value) is complex:
        return (complex, value.real.hex(), value.imag.hex())
    return (type(value), value)


class _Refused(Exception):
    """Why a capture cannot be used (raised in the capturing backend, or after it)."""

    def __init__(self, why: str, fix: str, known: bool = True) -> None:
        super().__init__(why)
        self.why = why
        self.fix = fix
        self.known = known  # an unknown reason may come from outside the backward: try again


def _calls_fn(ctx: Any, saved: Any, grads: Any) -> Any:
    """The code of every capture's wrapper: ``fn``, ``tracing`` and ``NotCompiling`` are the
    wrapper's own globals (see below). Called rather than traced (dynamo is off), it raises
    before the user's backward runs: a capture never runs it eagerly."""
    if not tracing():  # type: ignore[name-defined]  # noqa: F821
        raise NotCompiling  # type: ignore[name-defined]  # noqa: F821
    return fn(ctx, saved, *grads)  # type: ignore[name-defined]  # noqa: F821


def _wrapper(op: OpSpec, fn: Callable[..., Any]) -> Any:
    """A new function (with its own code object: dynamo's cache, guards and recompile count are
    per code object) that calls ``fn`` where dynamo traces it."""
    # ``__name__``: an importable module (torch 2.11's dynamo keeps no cache entry, hence no
    # guard manager, for a frame whose globals have none, and imports the one named).
    scope: dict[str, Any] = {
        "fn": fn,
        "tracing": dynamo.tracing,
        "NotCompiling": _NotCompiling,
        "__name__": __name__,
        "__builtins__": builtins,
    }
    code = _calls_fn.__code__.replace(
        co_name="backward", co_filename=f"<customgrad capture of {op.name}>"
    )
    return types.FunctionType(code, scope, "backward")


def capture_backward(
    op: OpSpec,
    fn: Callable[..., object],
    frame: dict[str, object],
    leaves: Sequence[object],
    structure: Structure,
    requires: frozenset[str],
    recompute: bool,
) -> Capture | Fallback:
    """Capture ``fn`` called on ``frame`` with dynamo, lower the graph to aten, split it."""
    wrapper = _wrapper(op, fn)
    got: list[dynamo.Captured] = []
    markers: list[Any] = []
    extra: list[Extra] = []
    # dynamo's cache entry keeps the backend (and so what it closes over): the frame reaches it
    # through a list emptied once the capture returns, so no tensor of the call stays alive.
    frames = [frame]

    def on_graph(captured: dynamo.Captured) -> Callable[..., Any]:
        if captured.reads_compiling:
            raise _Refused(
                "it asks whether dynamo is compiling (torch.compiler.is_compiling(), "
                "torch._dynamo.is_compiling()), which is True while dynamo captures it and "
                "False when it is called, so a capture would not compute what a call does",
                "decide it outside the backward (in the forward, saved as a plain value with "
                "save_for_backward), or drop the check",
            )
        if captured.side_effects:
            changed = ", ".join(_in_words(source, fn) for source in captured.side_effects)
            raise _Refused(
                f"it changes state outside itself ({changed}), which "
                f"dynamo replays after the graph and a split pass would not",
                "return what it computes instead of storing it (or keep it run once)",
            )
        for value in captured.outputs:
            if not isinstance(value, _Tensor):
                raise _Refused(
                    "it returns a value computed from tensor values that is not a tensor",
                    "return tensors (or None) as gradients",
                )
            # Stand-ins: the capture call returns them in place of the gradients, so that the
            # dict dynamo rebuilds says which graph output each gradient is (their identity is
            # all that counts: a size read from a tensor, such as a group size, may be
            # symbolic). On the meta device, and handed out once: dynamo's cache entry keeps
            # the function returned, never a tensor.
            markers.append(torch.empty(0, dtype=value.dtype, device="meta"))
        # What customgrad checks besides dynamo's guards, read as dynamo read it.
        extra.append(_extra_checks(captured, wrapper.__globals__, frames[0]))
        got.append(captured)
        once = [tuple(markers)]
        return lambda *args: once.pop()

    try:
        try:
            with torch.no_grad(), _disable_current_modes(), quiet_tracing():
                result = dynamo.capture(
                    wrapper, (frame["ctx"], frame["saved"], frame["grads"]), on_graph
                )
        except _NotCompiling:
            return NOT_COMPILING
        except Exception as e:
            why, fix, known = _refusal(e)
            _forget(e)
            return Fallback(why, fix, retries=int(not known))
        if not got:
            return Fallback(
                "dynamo made no graph of it (it runs no tensor operation)",
                "nothing to split: register the register_backward_input/_weight pair",
            )
        captured = got[0]
        try:
            if "data_ptr" in captured.names and not dynamo.refuses_data_pointer_comparisons():
                raise _Refused(
                    "it reads a tensor's data_ptr(), and this release's dynamo (torch 2.11 and "
                    "2.12) captures a data pointer comparison as False whatever the tensors",
                    "compare tensors another way, or use torch 2.13 or later",
                )
            gm, layout, tensor_idx = _lower(op, captured, markers, result, leaves, structure)
            split = _split(op, gm, layout, tensor_idx, leaves, structure, requires, recompute)
            if isinstance(split, Fallback):
                return split
            check = dynamo.guard_check(wrapper.__code__)
            if check is None:
                raise _Refused("dynamo kept no single guard set for it", "report it")
        except _Refused as e:
            return Fallback(e.why, e.fix, retries=int(not e.known))
        except _Invalid:
            # Called as written, the backward raises customgrad's own error, which says it all.
            return Fallback("it returned what customgrad's validation refuses", "", logged=False)
        return Capture(split, check, wrapper.__globals__, *extra[0])

    finally:
        # dynamo's cache entry keeps the backend (and so these lists): keep no tensor of the
        # call alive through them
        got.clear()
        markers.clear()
        extra.clear()
        frames.clear()


def _forget(error: BaseException) -> None:
    """Clear the frames of ``error``'s tracebacks (its causes' and contexts' too): dynamo's
    frames hold the backward's saved tensors and output gradients, and a frame that refers to
    the exception again (``except ... as e`` inside dynamo) makes a reference cycle that the
    cyclic GC alone would free (a refused capture would keep its step alive until then)."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [error]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)
            e.__traceback__ = None
        stack += [e.__cause__, e.__context__]


def _in_words(source: str, fn: Callable[..., Any]) -> str:
    """dynamo's name of what ``fn`` reads, with ``fn``'s closure cells named."""
    found = re.match(r"fn\.__closure__\[(\d+)\]\.cell_contents(.*)", source)
    code = getattr(fn, "__code__", None)
    if found is None or code is None or int(found.group(1)) >= len(code.co_freevars):
        return source
    var = code.co_freevars[int(found.group(1))]
    return f"the closure variable {var!r} of {fn.__qualname__}{found.group(2)}"


def _extra_checks(
    captured: dynamo.Captured, scope: dict[str, object], frame: dict[str, object]
) -> Extra:
    """The checks customgrad adds to dynamo's guards: each float or complex value dynamo
    compares by ``==``, compared by its bits; each module it guards by identity, with its
    names and namespace version as they are now; on a dynamo that misses guards on values it
    treats as constants, what it reads of the classes it guards."""
    helpers = dynamo.guard_names()  # the functions dynamo's guard expressions call
    names = {**helpers, "G": scope, "L": frame}
    exact: list[str] = []
    for source in captured.constants:
        try:
            value = eval(source, dict(names))
        except Exception:
            raise _Refused(
                f"dynamo guards {source} by ==, which customgrad cannot read again",
                "pass it as an argument of the op",
            ) from None
        if type(value) in (float, complex):
            exact.append(source)
    # One function reads them all per check: dynamo's names are expressions of G and L.
    read: Reader | None = (
        eval(f"lambda G, L: ({', '.join(exact)},)", dict(helpers)) if exact else None
    )
    constants = (read, tuple(map(bits, read(scope, frame))) if read is not None else ())
    rebinding = not dynamo.guards_instance_attributes()
    namespaces: dict[int, Namespace] = {}
    for source in captured.modules:
        try:
            module = eval(source, dict(names))
        except Exception:
            continue  # dynamo's ID_MATCH on it holds it fixed; its attributes are guarded
        namespace = vars(module)
        if id(namespace) not in namespaces:
            owner = f"the module {getattr(module, '__name__', source)}"
            namespaces[id(namespace)] = Namespace.of(owner, namespace, rebinding)
    kinds: list[type] = []
    for source, of_instance in captured.classes:
        try:
            found = eval(source, dict(names))
        except Exception:
            raise _Refused(
                f"dynamo guards the class of {dynamo.readable(source)}, which customgrad "
                f"cannot read again to check its attributes",
                "pass what the backward reads of it as an argument of the op",
            ) from None
        kinds.append(type(found) if of_instance else found)
    classes: list[tuple[object, Hashable]] = []
    for kind in kinds:
        for base in getattr(kind, "__mro__", ()):
            namespace = dynamo.class_namespace(base)
            if namespace is not None and id(namespace) not in namespaces:
                owner = f"the class {base.__module__}.{base.__qualname__}"
                namespaces[id(namespace)] = Namespace.of(owner, namespace, True)
        if rebinding:
            held = _constants_of(kind)
            if held is not None:
                classes.append((kind, held))
    return constants, list(namespaces.values()), classes


def _lower(
    op: OpSpec,
    captured: dynamo.Captured,
    markers: list[Any],
    result: Any,
    leaves: Sequence[Any],
    structure: Structure,
) -> tuple[fx.GraphModule, list[tuple[str, Any]], list[int]]:
    """The captured graph lowered to aten ops by ``make_fx`` on fake tensors, as
    ``(*tensor leaves) -> gradients``, with where each gradient sits in its outputs."""
    from torch.fx.experimental.proxy_tensor import make_fx

    tensor_idx = [i for i, leaf in enumerate(leaves) if isinstance(leaf, _Tensor)]
    position = {id(leaves[i]): k for k, i in enumerate(tensor_idx)}
    inputs: list[int] = []
    for example, source in captured.inputs:
        k = position.get(id(example))
        if k is None:
            raise _Refused(
                f"it reads the tensor {source}, which is not one of its arguments (a trace "
                f"would keep that tensor's value)",
                "save it with save_for_backward, or pass it to the op as an argument",
            )
        inputs.append(k)
    # Where each gradient is: graph output i, argument k, or None.
    where_out = {id(m): i for i, m in enumerate(markers)}
    sig = op.signature
    if type(result) is not dict:
        raise _Invalid
    slots_of: list[tuple[str, Any]] = []
    for name, value in result.items():
        if not isinstance(name, str) or name not in sig.tensor_set:
            raise _Invalid
        is_list = sig.args[sig.index[name]].kind.value == "Tensor[]"
        values = value if is_list and isinstance(value, (list, tuple)) else None
        if values is None and is_list and value is not None:
            raise _Invalid
        slots: list[tuple[str, int] | None] = []
        for t in values if values is not None else [value]:
            if t is None:
                slots.append(None)
            elif not isinstance(t, _Tensor):
                raise _Invalid
            elif id(t) in where_out:
                slots.append(("out", where_out[id(t)]))
            elif id(t) in position:
                slots.append(("in", position[id(t)]))
            else:
                raise _Refused(
                    "it returns a tensor that it did not compute from its arguments (a global "
                    "tensor, or one made outside what dynamo captured)",
                    "compute every gradient from the saved values and output gradients",
                )
        slots_of.append((name, slots if values is not None else slots[0]))
    graph = captured.graph
    layouts: list[Layout] = []

    def body(*tensors: Any) -> list[Any]:
        outs = graph(*(tensors[k] for k in inputs))
        flat: list[Any] = []
        layout: Layout = []

        def put(slot: Any) -> int | None:
            if slot is None:
                return None
            flat.append(outs[slot[1]] if slot[0] == "out" else tensors[slot[1]])
            return len(flat) - 1

        for name, slot in slots_of:
            layout.append((name, [put(s) for s in slot] if isinstance(slot, list) else put(slot)))
        layouts.append(layout)
        return flat

    # Detached (copying a non-leaf's autograd metadata warns), with requires_grad as it is.
    args = [_like(leaves[i]) for i in tensor_idx]
    try:
        # Modes on the stack (a FLOP counter, a profiler's) must not see the fake ops.
        with torch.no_grad(), _disable_current_modes(), quiet_tracing():
            gm = make_fx(body, tracing_mode="fake", _allow_non_fake_inputs=True)(*args)
            if mutating(gm):
                # In-place ops: lower again, functionalized, so that every node is a pure
                # function of its inputs (the partition below relies on it).
                layouts.clear()
                functional = torch.func.functionalize(body)
                gm = make_fx(functional, tracing_mode="fake", _allow_non_fake_inputs=True)(*args)
    except (_Refused, _Invalid, CustomGradError):
        raise
    except Exception as e:
        why, fix = _why(e)
        raise _Refused(why, fix, known=not why.startswith("lowering it")) from None
    return gm, layouts[-1], tensor_idx


def _split(
    op: OpSpec,
    gm: fx.GraphModule,
    layout: Layout,
    tensor_idx: list[int],
    leaves: Sequence[object],
    structure: Structure,
    requires: frozenset[str],
    recompute: bool,
) -> TracedSplit | Fallback:
    flat = isinstance(structure, int)
    all_tensors = flat and len(tensor_idx) == len(leaves)
    split = TracedSplit(op, gm, layout, tensor_idx, all_tensors, flat, requires, recompute)
    mutated = split.program.mutated
    if mutated:
        return Fallback(
            f"it writes in place into a tensor it did not create ({mutated[0].target})",
            "compute out of place into new tensors",
        )
    return split


def _refusal(e: BaseException) -> tuple[str, str, bool]:
    """Why dynamo could not capture a backward, the fix, and whether the reason is known (an
    unknown one may come from outside the backward, and is tried again)."""
    if isinstance(e, _Refused):
        return e.why, e.fix, True
    inner = dynamo.backend_error(e)
    if isinstance(inner, _Refused):
        return inner.why, inner.fix, True
    refusal = dynamo.unsupported(e)
    launch = raw_launch(e) or (raw_launch(inner) if inner is not None else None)
    if launch is None and refusal is not None:
        launch = _triton_frame(refusal.stack)
    if launch is not None:
        return (
            f"it launches the Triton kernel {launch.kernel} directly ({launch.at}): a raw "
            f"launch, which dynamo cannot capture here",
            FIX_RAW_LAUNCH,
            True,
        )
    named = _named_cause(e)
    if named is not None:
        return (*named, True)
    if refusal is None:
        first = (str(e).strip().splitlines() or [""])[0]
        if len(first) > 160:
            first = first[:157] + "..."
        return (
            f"capturing it with dynamo raised {type(e).__name__}: {first}",
            "make it run under torch.compile(fullgraph=True)",
            False,
        )
    at = f" at {refusal.at}" if refusal.at else ""
    line = f" (`{refusal.line}`)" if refusal.line else ""
    kind = refusal.kind
    if kind == "failed to find name in frame builtins" or "find name" in kind:
        name = refusal.explanation.split("`")[1] if refusal.explanation.count("`") >= 2 else "?"
        return (
            f"NameError: name {name!r} is not defined{at}{line}",
            f"define or import {name!r} in the module of the backward",
            True,
        )
    text = f"{kind} {refusal.explanation}".lower()
    if "data-dependent" in text or "data dependent" in text:
        return (
            f"it branches on tensor values in Python{at}{line}",
            "compute with tensor ops instead (torch.where, masks), so the same ops run for "
            "every value",
            True,
        )
    return (
        f"dynamo cannot capture it{at}{line}: {(refusal.explanation or kind).rstrip('.')}",
        "rewrite that line with torch ops, or pass what it reads as an argument of the op",
        True,
    )


FIX_FUNCTION_CLASS = (
    "read what the backward needs of the class in forward and keep it on ctx (ctx.scale = "
    "cls.SCALE), and put the backward's body in a plain function (at module level) that each "
    "Function's backward is or calls (backward = staticmethod(_backward), instead of "
    "Orig.backward.__func__(cls, ctx, grad) or super().backward(ctx, grad))"
)

FIX_NO_CUDA = (
    "decide with a value dynamo reads as a constant (the tensor's device: if grad.is_cuda:, or "
    "torch.cuda.is_available()) instead of calling CUDA and catching its error, or run on a "
    "CUDA device"
)


def _named_cause(e: BaseException) -> tuple[str, str] | None:
    """Why dynamo stopped, when the cause is one the user can act on and dynamo's own words do
    not say it: an ``autograd.Function`` class used as a class, a function dynamo does not trace
    that launches a Triton kernel, CUDA called where this torch has none."""
    frame = dynamo.user_frame(e)
    at = f" at {frame[0]}:{frame[1]}" if frame is not None else ""
    line = f" (`{frame[2]}`)" if frame is not None and frame[2] else ""
    if dynamo.reads_function_class(e):
        return (
            f"it uses a torch.autograd.Function class as a class{at}{line}: torch "
            f"{torch.__version__}'s dynamo traces such a class only in Cls.apply(...) and calls "
            f"of its staticmethods, not its attributes, a classmethod's cls, super(), "
            f"Cls.backward(ctx, ...) or .__func__",
            FIX_FUNCTION_CLASS,
        )
    skipped = dynamo.skipped_function(e)
    if skipped is not None:
        name = skipped[0]
        fn = function_named(*skipped)
        launch = launch_in(fn) if fn is not None else None
        if launch is not None:
            return (
                f"it calls {name}{at}, which launches the Triton kernel {launch.kernel} at "
                f"{launch.at}, and dynamo does not trace {name} (torch.compiler.disable)",
                FIX_RAW_LAUNCH,
            )
        return (
            f"it calls {name}{at}, which dynamo does not trace (torch.compiler.disable)",
            f"call {name} outside the backward, or make it an op with a fake kernel (a "
            f"customgrad op, or torch.library.custom_op) and call the op from the backward",
        )
    seen: BaseException | None = e
    for _ in range(4):  # the error, and what it was raised from
        if seen is None:
            break
        first = (str(seen).strip().splitlines() or [""])[0]
        if "not compiled with CUDA" in first or "NVIDIA driver" in first:
            return (f"it calls CUDA{at}{line}, which this torch cannot reach: {first}", FIX_NO_CUDA)
        seen = seen.__cause__
    return None


def _triton_frame(stack: Sequence[tuple[str, int, str]]) -> RawLaunch | None:
    """The raw Triton launch in the frames dynamo was tracing (the first frame in Triton's
    runtime, and the user's line that launched it), or None."""
    runtime = f"{os.sep}triton{os.sep}runtime{os.sep}"
    for i, (file, _, _) in enumerate(stack):
        if runtime in file and i:
            caller_file, lineno, line = stack[i - 1]
            found = re.match(r"\s*(?:[\w.]+\s*=\s*)?([\w.]+)\s*\[", line)
            kernel = found.group(1).rpartition(".")[2] if found else "(unknown)"
            return RawLaunch(kernel, f"{caller_file}:{lineno}")
    return None


def _like(t: _Tensor) -> _Tensor:
    """``t`` detached, requiring grad as ``t`` does."""
    d = t.detach()
    return d.requires_grad_() if t.requires_grad else d
