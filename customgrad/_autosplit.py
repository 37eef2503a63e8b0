"""The automatic split of a single backward: capture it with dynamo, cut the capture into I and W.

One ``register_backward`` that returns every gradient is how people write a backward (as in
``torch.autograd.Function``), but under a pipeline's split backward such a function runs whole in
the input pass (I) and again in the weight pass (W). With ``split="auto"`` (the default)
customgrad captures it with torch's own frontend, dynamo
(``torch.compile(..., fullgraph=True)`` with a backend that only keeps the graph), lowers the
captured graph to aten ops with ``make_fx`` on fake tensors (other custom ops, customgrad ops
among them, stay single opaque calls) and cuts it in two:

- work that only input gradients need runs in I, work that only weight gradients need in W, and
  work that no requested gradient needs is dropped;
- work that both need runs once, in the earlier pass, and its results are handed to the later
  pass through the node's hand-off (``NodeRecord.handoff``, freed once W ran); with
  ``recompute="cheap"`` shared results that cost no FLOPs (views, elementwise ops) are
  recomputed in the later pass instead of kept;
- random ops all run in the earlier pass, in the order the backward calls them, and what the
  later pass needs of them is handed over: the draws are those of one call at the first pass;
- a full backward runs the whole capture once.

Each pass is a generated :class:`torch.fx.GraphModule` (straight-line Python calling aten ops),
so a call costs about what a hand-written pair costs. The gradients go back to customgrad's
validation as any backward's do.

**What selects a capture.** Dynamo guards what the backward read (globals, closures, modules'
attributes, objects' fields, torch's global state, the arguments' metadata); customgrad checks
those guards per node, in C++, through the guard manager dynamo keeps for the captured code
(:func:`customgrad._torch.dynamo.guard_check`), and adds what dynamo's guards miss: each tensor
argument's ``is_leaf``, floats and complex numbers compared by their exact bits (``0j`` and
``-0j``), attributes added later to a module the backward read (``getattr(torch, name,
default)``), the values of plain saved values and the ambient state (:func:`ambient`). Each
capture has its own code object, so dynamo's caches, recompile limits and the user's own
``torch.compile`` calls are not shared with it; a guard that fails captures again, up to
:data:`RECAPTURES` times per signature, then the op runs once.

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
import logging
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import optree
import torch
import torch.fx as fx

from customgrad._errors import CustomGradError, where
from customgrad._handoff import nbytes
from customgrad._partition import ancestors, cut, extract, free
from customgrad._rules import OpSpec
from customgrad._torch import dynamo
from customgrad._torch.dispatcher import (
    INFRA_MODES,
    OpOverload,
    TorchDispatchMode,
    any_autocast_enabled,
    aten_callables,
    deterministic,
    deterministic_warn_only,
    dispatch_stack_len,
    function_stack_len,
    get_dispatch_mode,
    overload_name,
    schema_of,
)
from customgrad._torch.dispatcher import disable_current_modes as _disable_current_modes
from customgrad._torch.fake import (
    FAKE_TENSOR_LOGGER,
    data_dependent_errors,
    detect_fake_mode,
    fake_tensor_type,
    functional_tensor_type,
)
from customgrad._torch.transforms import functorch_active, legacy_batched

__all__ = [
    "CONSTANTS",
    "MAX_SIGNATURES",
    "RECAPTURES",
    "AutoSplitter",
    "Fallback",
    "TracedSplit",
    "ambient",
    "describe_node",
]

log = logging.getLogger("customgrad")

MAX_SIGNATURES = 256
"""Input signatures captured per op; calls with new ones beyond that fall back (one log line)."""

RECAPTURES = 8
"""Captures per input signature (the first, then one per failed guard: a global the backward
reads rebound, a flag flipped); beyond that the op runs once (one log line)."""

RETRIES = 2
"""Captures tried again for a signature whose capture failed for a reason of an unknown kind."""

MSG_FALLBACK = (
    "{op}: the single backward cannot be split automatically: {why}. It runs once, whole, in "
    "the first pass that needs any of its gradients, and hands the gradients a later pass "
    "needs to that pass: nothing is computed twice, but under a split backward the weight "
    "work is done in the input pass. To split it automatically, {fix}. To silence this, "
    "register the register_backward_input/_weight pair, or register_backward(fn, "
    "split='phase') (called once per pass with ctx.needs_input_grad set for it: repeated "
    "work, unsafe for kernels that write into their inputs). (backward defined at {loc})"
)

# Plain values compared by value (floats apart: by their exact bits). A saved value of one of
# these kinds selects a capture by its value (the capture specializes on it).
CONSTANTS = (
    type(None),
    bool,
    int,
    complex,
    str,
    bytes,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    torch.Size,
)

_Tensor = torch.Tensor
_functorch_active = functorch_active
_dispatch_stack_len = dispatch_stack_len
_get_mode = get_dispatch_mode
_INFRA_MODES = INFRA_MODES  # fake, proxy, functional

_TRACE_LOCK = threading.RLock()
"""One capture at a time in the process: dynamo, ``make_fx`` and fake modes keep global state."""

_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu", "privateuseone", "mtia", "maia")
_any_autocast = any_autocast_enabled
_function_modes = function_stack_len
_deterministic = deterministic
_warn_only = deterministic_warn_only
_default_dtype: Any = torch.get_default_dtype


def ambient() -> Any:
    """The ambient state a capture depends on, as a hashable key (cheap: read per backward):
    deterministic algorithms, the default dtype, autocast per device and the default device.

    The grad mode is not in it: a captured backward runs only without grad (a ``create_graph``
    backward calls the function as written).
    """
    det = _deterministic()
    plain = (det and (_warn_only() or 2), _default_dtype())  # warn-only matters only when on
    if not _any_autocast() and not _function_modes():
        return plain
    autocast: Any = None
    if _any_autocast():
        enabled = tuple(
            (d, torch.get_autocast_dtype(d))
            for d in _AUTOCAST_DEVICES
            if torch.is_autocast_enabled(d)
        )
        autocast = (enabled, torch.is_autocast_cache_enabled())
    # set_default_device works through a torch function mode
    device = torch.get_default_device() if _function_modes() else None
    return (plain, autocast, device)


def _tracing_now() -> bool:
    """Whether this backward runs inside another trace (make_fx, AOTAutograd, functorch)."""
    if _functorch_active():
        return True
    return bool(_dispatch_stack_len()) and any(_get_mode(k) is not None for k in _INFRA_MODES)


def _trace_types() -> tuple[type, ...]:
    return (fake_tensor_type(), functional_tensor_type())


class Fallback:
    """Why a backward is not split automatically: it runs once, whole (the run-once rule).

    Attributes:
        why: the reason, for reports.
        fix: what would make it traceable.
        logged: the reason is worth a log line (a backward that merely returned something
            invalid raises customgrad's validation error when called, which says it all).
    """

    __slots__ = ("fix", "logged", "retries", "why")

    def __init__(self, why: str, fix: str, logged: bool = True) -> None:
        self.why = why
        self.fix = fix
        self.logged = logged
        # Traces left to try: a failure of an unknown kind may come from outside the backward
        # (another thread tracing with make_fx, torch.compile), so it is not final at once.
        self.retries = 0

    def describe(self) -> str:
        return (
            f"not split automatically ({self.why}): runs once, whole, in the first pass that "
            f"needs a gradient, and hands the later pass its gradients"
        )

    def __repr__(self) -> str:
        return f"Fallback({self.why!r})"


_INSIDE_TRACE = Fallback(
    "called inside another trace: torch.compile, make_fx or a functorch transform",
    "",
    logged=False,
)


class _Invalid(Exception):
    """The traced backward returned something customgrad's validation refuses."""


def _why(e: BaseException) -> tuple[str, str]:
    """The reason and fix for a backward that ``make_fx`` could not trace."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    from customgrad._triton import raw_launch

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
            "make the kernel an op with a fake kernel (a customgrad op, or "
            "torch.library.triton_op) and call the op from the backward: the trace keeps it as "
            "one opaque call",
        )
    if "data pointer" in first or "data_ptr" in first:
        return (
            "it launches a kernel on raw data pointers (Triton, ctypes), which fake tensors "
            "do not have",
            "wrap the kernel in a custom op with a fake kernel (torch.library.triton_op, or a "
            "customgrad op), which the trace keeps as one opaque call",
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
def _quiet_tracing() -> Iterator[None]:
    """Fake tensors log an error with a traceback for every op that fails while tracing; the
    fallback's log line says it once. Only this thread's records, only while it traces: the
    logger's level and other threads' records are left alone. (Held under ``_TRACE_LOCK``.)"""
    logger = logging.getLogger(FAKE_TENSOR_LOGGER)
    quiet = _ThisThread()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


# --------------------------------------------------------------------------------------------
# The splitter of one op's single backward


# --------------------------------------------------------------------------------------------
# The splitter of one op's single backward


class AutoSplitter:
    """The automatic split of one op's single backward (``AutogradRules.auto``).

    :meth:`plan` is called at a node's first backward; it returns the node's
    :class:`TracedSplit` (shared by every node whose call selects the same capture), or None to
    call the backward as written.

    Args:
        op: the op.
        fn: its single backward, ``fn(ctx, saved, *grads) -> dict``.
        recompute: ``"cheap"`` recomputes shared results without FLOPs in the later pass.

    Attributes:
        traces: how many times the backward was captured.
        last: what the latest node's :meth:`plan` found (a :class:`TracedSplit` or a
            :class:`Fallback`), or None before any backward.
    """

    def __init__(self, op: OpSpec, fn: Callable[..., Any], recompute: str) -> None:
        self.op = op
        self.fn = fn
        self.recompute = recompute == "cheap"
        self.traces = 0
        self.last: TracedSplit | Fallback | None = None
        # signature -> the captures made for it (newest first), or why there is none
        # signature -> its captures (any shapes: dynamo's guards select among them) and why
        # there is none
        self._cache: dict[Any, _Entry] = {}
        self._ctx: dict[frozenset[str], Any] = {}  # read-only contexts, one per requires
        self._logged = False
        self.held_bytes: int | None = None
        """The bytes of gradients the latest run-once backward held from its first pass for
        the later one (None before any)."""

    def plan(
        self,
        make_ctx: Callable[[frozenset[str]], Any],
        saved: Any,
        grads: tuple[Any, ...],
        requires: frozenset[str],
    ) -> TracedSplit | None:
        """The split for a node whose backward got ``saved`` and ``grads`` (None: call it)."""
        if _tracing_now():
            # An outer trace (AOTAutograd building torch.compile's backward graph, make_fx, a
            # functorch transform) records whatever runs here: the backward as written is what
            # it should record, and every gradient comes out right.
            self.last = _INSIDE_TRACE
            return None
        structure: Any
        if type(saved) is tuple and type(grads) is tuple:  # the common case, without optree
            leaves: Sequence[Any] = saved + grads
            structure = len(saved)
            signature = _signature(leaves, (structure, requires), flat=True)
        else:
            signature = None
        if signature is None:
            leaves, structure = _flatten(saved, grads)
            signature = _signature(leaves, (structure, requires), flat=False)
        if not isinstance(signature, Fallback):
            signature = (signature, ambient())
            if _batched(grads):
                # torch's legacy vmap (is_grads_batched, jacobian(vectorize=True)) runs the
                # backward on batched gradients: called as written, it batches each op it runs.
                signature = _INSIDE_TRACE
        outcome: TracedSplit | Fallback
        if isinstance(signature, Fallback):
            outcome = signature
        else:
            entry = self._cache.get(signature)
            ctx = self._ctx.get(requires)
            if ctx is None:
                ctx = self._ctx[requires] = make_ctx(requires)
            frame = {"ctx": ctx, "saved": saved, "grads": grads}
            if entry is not None and entry.fallback is not None and not entry.fallback.retries:
                outcome = entry.fallback
            else:
                for capture in entry.captures if entry is not None else ():
                    if capture.holds(frame):
                        outcome = capture.split
                        break
                else:
                    outcome = self._capture(signature, frame, leaves, structure, requires)
        self.last = outcome
        if isinstance(outcome, TracedSplit):
            return outcome
        if outcome.logged and not self._logged:
            self._logged = True
            log.warning(
                MSG_FALLBACK.format(
                    op=self.op.name, why=outcome.why, fix=outcome.fix, loc=where(self.fn)
                )
            )
        return None

    def _capture(
        self,
        signature: Any,
        frame: dict[str, Any],
        leaves: Sequence[Any],
        structure: Any,
        requires: frozenset[str],
    ) -> TracedSplit | Fallback:
        with _TRACE_LOCK:
            entry = self._cache.get(signature)
            if entry is None:
                entry = self._cache[signature] = _Entry()
            for capture in entry.captures:  # another thread captured it meanwhile
                if capture.holds(frame):
                    return capture.split
            found = entry.fallback
            if found is not None and not found.retries:
                return found
            shapes = _shapes(leaves)
            tries = entry.tries.get(shapes, 0)
            if not tries and len(entry.tries) >= MAX_SIGNATURES:
                return Fallback(
                    f"it was captured for {MAX_SIGNATURES} input signatures already (shapes, "
                    f"dtypes or saved values change from call to call)",
                    "call the op with a few distinct shapes (pad to buckets)",
                )
            if tries >= RECAPTURES:
                return Fallback(
                    f"what it reads changed {RECAPTURES} times (dynamo's guards failed: a "
                    f"global rebound, a flag flipped, an object's field set), and each change "
                    f"needs a new capture",
                    "pass what changes as an argument of the op (tensors and plain values "
                    "select the capture), or keep it fixed during training",
                )
            entry.tries[shapes] = tries + 1
            self.traces += 1
            outcome = _capture(self.op, self.fn, frame, leaves, structure, requires, self.recompute)
            if isinstance(outcome, _Capture):
                entry.captures.insert(0, outcome)
                entry.fallback = None
                return outcome.split
            if entry.captures:
                # What it reads now cannot be captured (a flag that sends it down a Python
                # branch dynamo refuses): run once now; what it read before may come back (each
                # such try counts against the captures of the shapes).
                return outcome
            if outcome.retries:
                outcome.retries = RETRIES if found is None else found.retries - 1
            entry.fallback = outcome
            return outcome

    def held(self, value: Any) -> None:
        """Note what a run-once backward hands to its later pass (for reports)."""
        self.held_bytes = nbytes(value)

    def describe(self) -> str:
        """How the latest backward of this op was split, in words (for reports)."""
        last = self.last
        if last is None:
            return "split automatically when its first backward runs (none ran yet)"
        return self.describe_fallback(last) if isinstance(last, Fallback) else last.describe()

    def describe_fallback(self, fallback: Fallback) -> str:
        """A fallback in words, with the bytes it held between the passes."""
        text = fallback.describe()
        if self.held_bytes is not None:
            text += f" ({self.held_bytes} bytes held between the passes at the latest split)"
        return text

    def fallback(self) -> Fallback | None:
        """The latest reason not to split, if the latest backward was not split."""
        last = self.last
        return last if isinstance(last, Fallback) else None


# --------------------------------------------------------------------------------------------
# Capturing with dynamo


class _Capture:
    """One capture of a backward: its split and what must hold to reuse it.

    ``holds(frame)`` is dynamo's guard check for the capture's code (C++), then customgrad's
    checks of what those guards compare too loosely: floats and complex numbers read by exact
    bits, and modules the backward read that gained an attribute its code names.
    """

    __slots__ = ("_bits", "_check", "_globals", "_modules", "_names", "_read", "split")

    def __init__(
        self,
        split: TracedSplit,
        check: Callable[[dict[str, Any]], bool],
        scope: dict[str, Any],
        constants: tuple[Callable[..., tuple[Any, ...]] | None, tuple[Any, ...]],
        modules: list[list[Any]],
        names: frozenset[str],
    ) -> None:
        self.split = split
        self._check = check
        self._globals = scope
        self._read, self._bits = constants
        self._modules = modules
        self._names = names

    def holds(self, frame: dict[str, Any]) -> bool:
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
                if tuple(map(_bits, read(self._globals, frame))) != self._bits:
                    return False
            except Exception:
                return False
        for entry in self._modules:
            module, size, keys = entry
            now = module.__dict__
            if len(now) != size:
                added = now.keys() - keys
                if added & self._names:
                    return False  # getattr(module, name, default) reads something else now
                entry[1], entry[2] = len(now), frozenset(now)  # unrelated (a lazy import)
        return True


class _Entry:
    """The captures of one signature (newest first), the captures tried per shapes, and why
    there is none (a :class:`Fallback` cached for the signature)."""

    __slots__ = ("captures", "fallback", "tries")

    def __init__(self) -> None:
        self.captures: list[_Capture] = []
        self.tries: dict[Any, int] = {}
        self.fallback: Fallback | None = None


def _shapes(leaves: Sequence[Any]) -> Any:
    """The tensors' shapes, strides, dtypes, devices and requires-grad (dynamo's guards check
    them: here they only count captures per shapes)."""
    return tuple(
        (t.shape, t.stride(), t.dtype, t.device, t.requires_grad)
        for t in leaves
        if isinstance(t, _Tensor)
    )


def _bits(value: Any) -> Any:
    """``value`` as compared exactly: floats by their bits (-0.0 != 0.0, nan == nan)."""
    kind = type(value)
    if kind is float:
        return (float, value.hex())
    if kind is complex:
        return (complex, value.real.hex(), value.imag.hex())
    return (kind, value)


class _Refused(Exception):
    """Why a capture cannot be used (raised in the capturing backend, or after it)."""

    def __init__(self, why: str, fix: str, known: bool = True) -> None:
        super().__init__(why)
        self.why = why
        self.fix = fix
        self.known = known  # an unknown reason may come from outside the backward: try again


def _calls_fn(ctx: Any, saved: Any, grads: Any) -> Any:
    """The code of every capture's wrapper: ``fn`` is the wrapper's own global (see below)."""
    return fn(ctx, saved, *grads)  # type: ignore[name-defined]  # noqa: F821


def _wrapper(op: OpSpec, fn: Callable[..., Any]) -> Any:
    """A new function (with its own code object: dynamo's cache, guards and recompile count are
    per code object) that calls ``fn``."""
    # ``__name__``: an importable module (torch 2.11's dynamo keeps no cache entry, hence no
    # guard manager, for a frame whose globals have none, and imports the one named).
    scope: dict[str, Any] = {"fn": fn, "__name__": __name__, "__builtins__": builtins}
    code = _calls_fn.__code__.replace(
        co_name="backward", co_filename=f"<customgrad capture of {op.name}>"
    )
    return types.FunctionType(code, scope, "backward")


def _capture(
    op: OpSpec,
    fn: Callable[..., Any],
    frame: dict[str, Any],
    leaves: Sequence[Any],
    structure: Any,
    requires: frozenset[str],
    recompute: bool,
) -> _Capture | Fallback:
    """Capture ``fn`` called on ``frame`` with dynamo, lower the graph to aten, split it."""
    if not dynamo.guards_instance_attributes():
        return Fallback(
            f"torch {torch.__version__}'s dynamo does not guard every value a backward reads (an "
            "enum member's attribute, a namedtuple's default, a monkeypatched library function), "
            "so a capture could be reused stale",
            "use torch 2.12 or later for the automatic split, or register the "
            "register_backward_input/_weight pair",
        )
    wrapper = _wrapper(op, fn)
    got: list[dynamo.Captured] = []
    markers: list[Any] = []

    def on_graph(captured: dynamo.Captured) -> Callable[..., Any]:
        if captured.side_effects:
            changed = ", ".join(_in_words(source, fn) for source in captured.side_effects)
            raise _Refused(
                f"it changes state outside itself ({changed}), which "
                f"dynamo replays after the graph and a split pass would not",
                "return what it computes instead of storing it (or keep it run once)",
            )
        for value in captured.outputs:
            if not isinstance(value, _Tensor) or any(
                not isinstance(s, int) for s in (*value.shape, *value.stride())
            ):
                raise _Refused(
                    "a gradient's shape depends on tensor values (.item(), nonzero)",
                    "keep shapes fixed and compute with tensor ops (torch.where, masks)",
                )
            # Stand-ins: the capture call returns them in place of the gradients, so that the
            # dict dynamo rebuilds says which graph output each gradient is.
            markers.append(
                torch.empty_strided(
                    value.shape, value.stride(), dtype=value.dtype, device=value.device
                )
            )
        got.append(captured)
        outs = tuple(markers)
        return lambda *args: outs

    try:
        try:
            with torch.no_grad(), _disable_current_modes(), _quiet_tracing():
                result = dynamo.capture(
                    wrapper, (frame["ctx"], frame["saved"], frame["grads"]), on_graph
                )
        except Exception as e:
            why, fix, known = _refusal(e)
            fallback = Fallback(why, fix)
            fallback.retries = int(not known)
            return fallback
        if not got:
            return Fallback(
                "dynamo did not capture it (torch.compile is disabled here: "
                "torch.compiler.set_stance, TORCHDYNAMO_DISABLE)",
                "let torch.compile run",
            )
        captured = got[0]
        try:
            gm, layout, tensor_idx = _lower(op, captured, markers, result, leaves, structure)
            split = _split(op, gm, layout, tensor_idx, leaves, structure, requires, recompute)
            if isinstance(split, Fallback):
                return split
            check = dynamo.guard_check(wrapper.__code__)
            if check is None:
                raise _Refused("dynamo kept no single guard set for it", "report it")
            extra = _extra_checks(captured, wrapper.__globals__, frame)
        except _Refused as e:
            fallback = Fallback(e.why, e.fix)
            fallback.retries = int(not e.known)
            return fallback
        except _Invalid:
            # Called as written, the backward raises customgrad's own error, which says it all.
            return Fallback("it returned what customgrad's validation refuses", "", logged=False)
        return _Capture(split, check, wrapper.__globals__, *extra, captured.names)

    finally:
        # dynamo's cache entry keeps the backend (and so these lists): keep no tensor of the
        # call alive through them
        got.clear()
        markers.clear()


def _in_words(source: str, fn: Callable[..., Any]) -> str:
    """dynamo's name of what ``fn`` reads, with ``fn``'s closure cells named."""
    import re

    found = re.match(r"fn\.__closure__\[(\d+)\]\.cell_contents(.*)", source)
    code = getattr(fn, "__code__", None)
    if found is None or code is None or int(found.group(1)) >= len(code.co_freevars):
        return source
    var = code.co_freevars[int(found.group(1))]
    return f"the closure variable {var!r} of {fn.__qualname__}{found.group(2)}"


def _extra_checks(
    captured: dynamo.Captured, scope: dict[str, Any], frame: dict[str, Any]
) -> tuple[tuple[Any, tuple[Any, ...]], list[list[Any]]]:
    """The checks customgrad adds to dynamo's guards: each float or complex value dynamo
    compares by ``==``, compared by its bits; each module it guards by identity, with its
    attributes as they are now."""
    names = {"G": scope, "L": frame}
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
    read: Any = eval(f"lambda G, L: ({', '.join(exact)},)", {}) if exact else None
    constants = (read, tuple(map(_bits, read(scope, frame))) if read is not None else ())
    modules: list[list[Any]] = []
    for source in captured.modules:
        try:
            module = eval(source, dict(names))
        except Exception:
            continue  # dynamo's ID_MATCH on it holds it fixed; its attributes are guarded
        held = vars(module)
        modules.append([module, len(held), frozenset(held)])
    return constants, modules


def _lower(
    op: OpSpec,
    captured: dynamo.Captured,
    markers: list[Any],
    result: Any,
    leaves: Sequence[Any],
    structure: Any,
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
    plan: list[tuple[str, Any]] = []
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
        plan.append((name, slots if values is not None else slots[0]))
    graph = captured.graph
    layouts: list[list[tuple[str, Any]]] = []

    def body(*tensors: Any) -> list[Any]:
        outs = graph(*(tensors[k] for k in inputs))
        flat: list[Any] = []
        layout: list[tuple[str, Any]] = []

        def put(slot: Any) -> int | None:
            if slot is None:
                return None
            flat.append(outs[slot[1]] if slot[0] == "out" else tensors[slot[1]])
            return len(flat) - 1

        for name, slot in plan:
            layout.append((name, [put(s) for s in slot] if isinstance(slot, list) else put(slot)))
        layouts.append(layout)
        return flat

    # Detached (copying a non-leaf's autograd metadata warns), with requires_grad as it is.
    args = [_like(leaves[i]) for i in tensor_idx]
    try:
        # Modes on the stack (a FLOP counter, a profiler's) must not see the fake ops.
        with torch.no_grad(), _disable_current_modes(), _quiet_tracing():
            gm = make_fx(body, tracing_mode="fake", _allow_non_fake_inputs=True)(*args)
            if _mutating(gm):
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
    layout: list[tuple[str, Any]],
    tensor_idx: list[int],
    leaves: Sequence[Any],
    structure: Any,
    requires: frozenset[str],
    recompute: bool,
) -> TracedSplit | Fallback:
    mutated = _mutating(gm)
    if mutated:
        return Fallback(
            f"it writes in place into a tensor it did not create ({mutated[0].target})",
            "compute out of place into new tensors",
        )
    gm = _without_common_subexpressions(gm)
    flat = isinstance(structure, int)
    all_tensors = flat and len(tensor_idx) == len(leaves)
    return TracedSplit(op, gm, layout, tensor_idx, all_tensors, flat, requires, recompute)


def _refusal(e: BaseException) -> tuple[str, str, bool]:
    """Why dynamo could not capture a backward, the fix, and whether the reason is known (an
    unknown one may come from outside the backward, and is tried again)."""
    from customgrad._triton import raw_launch

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
            "wrap the Triton launch in an op with a fake kernel (torch.library.triton_op, or "
            "a customgrad op with register_fake) and call the op from the backward: the "
            "capture keeps it as one opaque call",
            True,
        )
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


def _triton_frame(stack: Sequence[tuple[str, int, str]]) -> Any:
    """The raw Triton launch in the frames dynamo was tracing (the first frame in Triton's
    runtime, and the user's line that launched it), or None."""
    import os
    import re

    from customgrad._triton import RawLaunch

    runtime = f"{os.sep}triton{os.sep}runtime{os.sep}"
    for i, (file, _, _) in enumerate(stack):
        if runtime in file and i:
            caller_file, lineno, line = stack[i - 1]
            found = re.match(r"\s*(?:[\w.]+\s*=\s*)?([\w.]+)\s*\[", line)
            kernel = found.group(1).rpartition(".")[2] if found else "(unknown)"
            return RawLaunch(kernel, f"{caller_file}:{lineno}")
    return None


def _batched(grads: tuple[Any, ...]) -> bool:
    """Whether an output gradient is batched by torch's legacy vmap (the saved values never
    are: they were made before the backward)."""
    for g in grads:
        if isinstance(g, _Tensor):
            if legacy_batched(g):
                return True
        elif isinstance(g, list) and any(isinstance(t, _Tensor) and legacy_batched(t) for t in g):
            return True
    return False


def _flatten(saved: Any, grads: tuple[Any, ...]) -> tuple[list[Any], Any]:
    """The leaves of the saved values and the output gradients, and their structure."""
    tree: Any = (saved, grads)
    saved_leaves, saved_spec = optree.tree_flatten(tree[0], none_is_leaf=True)
    grad_leaves, grads_spec = optree.tree_flatten(tree[1], none_is_leaf=True)
    return [*saved_leaves, *grad_leaves], (len(saved_leaves), saved_spec, grads_spec)


def _unflatten(structure: Any, values: list[Any]) -> tuple[Any, tuple[Any, ...]]:
    """``(saved, grads)`` from their leaves (the inverse of :func:`_flatten` or of a flat
    ``saved + grads``)."""
    if isinstance(structure, int):
        return tuple(values[:structure]), tuple(values[structure:])
    n_saved, saved_spec, grads_spec = structure
    saved = optree.tree_unflatten(saved_spec, values[:n_saved])
    grads: Any = optree.tree_unflatten(grads_spec, values[n_saved:])
    return saved, grads


def _signature(leaves: Sequence[Any], head: tuple[Any, ...], flat: bool) -> Any:
    """What selects the captures to check besides dynamo's guards (which check the tensors'
    shapes, strides, dtypes, devices and requires-grad): the tensors' is-leaf, the values of
    everything else.

    Returns the signature (a tuple), a :class:`Fallback` for leaves a trace can't take, or None
    when ``flat`` and a leaf is a container (flatten it first).
    """
    key: list[Any] = [head]
    for leaf in leaves:
        kind = type(leaf)
        if kind is _Tensor or kind is torch.nn.Parameter:
            key.append(leaf.is_leaf)  # dynamo guards the rest of a tensor, not is_leaf
        elif kind is float:
            key.append((float, leaf.hex()))  # exact, and nan equals nan
        elif kind in CONSTANTS:
            key.append((kind, leaf))
        elif flat:
            return None
        elif isinstance(leaf, _trace_types()):
            return _INSIDE_TRACE
        elif isinstance(leaf, _Tensor):
            return Fallback(
                f"a saved tensor or output gradient is a {kind.__qualname__} (a tensor subclass)",
                "pass plain tensors to the op",
            )
        else:
            return Fallback(
                f"save_for_backward returned a {kind.__qualname__} object, which a trace would "
                f"freeze as a constant",
                "save tensors and plain values (int, float, bool, str, None, dtype, device) "
                "instead",
            )
    return tuple(key)


def describe_node(record: Any) -> str | None:
    """How the single backward of a customgrad node was split, or None for a node whose op
    registered the pair (or ``split="phase"``)."""
    auto = record.op.rules.auto
    if not isinstance(auto, AutoSplitter) or record.op.rules.backward is None:
        return None
    split = record.split
    if isinstance(split, TracedSplit):
        return split.describe()
    if split is False:
        fallback = auto.fallback()
        return (
            auto.describe_fallback(fallback) if fallback is not None else "not split automatically"
        )
    return "split automatically when its first backward runs (none ran yet)"


# --------------------------------------------------------------------------------------------
# Tracing


def _flatten_result(sig: Any, result: Any) -> tuple[list[Any], list[tuple[str, Any]]]:
    """The tensors of a backward's dict in a flat list, and where each gradient sits in it.

    Each layout entry is ``(name, slot)``: an ``int`` position, None, or a list of those (a
    list argument). Anything customgrad's validation would refuse raises :class:`_Invalid`.
    """
    if type(result) is not dict:
        raise _Invalid
    flat: list[Any] = []
    layout: list[tuple[str, Any]] = []
    for name, value in result.items():
        if not isinstance(name, str) or name not in sig.tensor_set:
            raise _Invalid
        is_list = sig.args[sig.index[name]].kind.value == "Tensor[]"
        if value is None:
            layout.append((name, None))
        elif isinstance(value, _Tensor) and not is_list:
            layout.append((name, len(flat)))
            flat.append(value)
        elif isinstance(value, (list, tuple)) and is_list:
            items: list[int | None] = []
            for t in value:
                if t is None:
                    items.append(None)
                elif isinstance(t, _Tensor):
                    items.append(len(flat))
                    flat.append(t)
                else:
                    raise _Invalid
            layout.append((name, items))
        else:
            raise _Invalid
    return flat, layout


def _mutating(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes that write in place, after rewriting those that need not (:func:`_pure`)."""
    found = [
        n
        for n in gm.graph.nodes
        if n.op == "call_function"
        and isinstance(n.target, OpOverload)
        and schema_of(n.target).is_mutable
    ]
    if found:
        rewritten = [n for n in found if _pure(n) or _ordered(n)]
        if rewritten:
            gm.recompile()
            found = [n for n in found if n not in rewritten]
    return found


def _written(t: _Tensor, writer: Any) -> _Tensor:
    """``t`` once ``writer`` wrote into it (in a trace: makes the write an input of its readers)."""
    return t


def _ordered(node: fx.Node) -> bool:
    """Make the write of an opaque op that writes into tensors the trace created (an
    out-variant custom op filling an ``empty_like``) an input of every node that reads them
    after it, so that the partition keeps it, runs it once and before them. Whether it could."""
    target = node.target
    assert isinstance(target, OpOverload)
    if target.namespace in ("aten", "prims"):
        return False  # functionalized
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    written: list[fx.Node] = []
    for a, value in zip(schema_of(target).arguments, node.args):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        if not isinstance(value, fx.Node) or free(value):
            return False  # an input of the backward (or not a tensor the trace made)
        made = value.target
        if isinstance(made, OpOverload) and made.is_view:
            return False  # a view: it may write into an input
        if any(order[u] < order[node] for u in value.users if u is not node):
            return False  # read before the write: which value a reader sees depends on order
        written.append(value)
    if not written or node.kwargs:
        return False
    graph = node.graph
    for value in written:
        later = [u for u in value.users if order[u] > order[node]]
        with graph.inserting_after(node):
            after = graph.call_function(_written, (value, node))
        after.meta["val"] = value.meta.get("val")
        for u in later:
            u.replace_input_with(value, after)
    return True


def _pure(node: fx.Node) -> bool:
    """Rewrite an in-place metadata write (``squeeze_``, ``t_``: the ``squeeze_`` inside
    ``torch.matmul`` of a vector, which functionalization keeps) on a tensor the trace created
    and reads nowhere else into its out-of-place view. Whether it could."""
    target = node.target
    assert isinstance(target, OpOverload)
    if target.namespace != "aten" or not node.args:
        return False
    mutated = node.args[0]
    if not isinstance(mutated, fx.Node) or free(mutated) or len(mutated.users) != 1:
        return False
    schema = schema_of(target)
    written = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if len(written) != 1 or written[0] is not schema.arguments[0]:
        return False
    name = target.overloadpacket.__name__
    packet = getattr(torch.ops.aten, name[:-1], None) if name.endswith("_") else None
    twin = getattr(packet, overload_name(target), None)
    if not isinstance(twin, OpOverload) or schema_of(twin).is_mutable or not twin.is_view:
        return False  # only metadata writes (data writes are functionalized)
    node.target = twin
    return True


def _without_common_subexpressions(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with each repeated pure aten op computed once (torch's ``CSEPass``), so that work a
    backward writes twice (unsloth's LoRA computes ``dY @ B.t()`` for dX and again for dA) is
    shared, run once in the earlier pass and handed to the later one. Opaque ops, random ops and
    writes are never merged."""
    from torch.fx.passes.dialect.common.cse_pass import CSEPass, get_CSE_banned_ops

    banned: set[Any] = set(get_CSE_banned_ops())
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        packet = getattr(target, "overloadpacket", target)
        if (
            not isinstance(target, OpOverload)
            or target.namespace not in ("aten", "prims")
            or schema_of(target).is_mutable
            or torch.Tag.nondeterministic_seeded in target.tags
        ):
            banned.add(packet)
    result = CSEPass(banned_ops=banned)(gm)
    return result.graph_module if result is not None and result.modified else gm


def _random(node: fx.Node) -> bool:
    """Whether ``node`` draws from a random generator (an aten op tagged nondeterministic_seeded)."""
    target = node.target
    return isinstance(target, OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


def _like(t: _Tensor) -> _Tensor:
    """``t`` detached, requiring grad as ``t`` does."""
    d = t.detach()
    return d.requires_grad_() if t.requires_grad else d


# --------------------------------------------------------------------------------------------
# The traced backward and its passes


class _SeenOps(TorchDispatchMode):
    """Records the aten ops a call dispatches."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops: list[Any] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func.namespace != "prim":  # metadata queries (prim.device) are not ops that run
            self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _binding(node: fx.Node) -> Callable[..., Any] | None:
    """torch's Python binding that runs exactly the node's aten op (``torch.mm`` for
    ``aten.mm.default``), or None.

    A binding parses its arguments in C++ and skips the boxed call of an ``OpOverload``: half
    the overhead on small tensors. It is used only when calling it on the node's fake inputs
    dispatches the node's op and nothing else.
    """
    target = node.target
    if not isinstance(target, OpOverload) or target.namespace != "aten":
        return None
    name = target.overloadpacket.__name__
    # torch.split and Tensor.split (& co.) are Python wrappers: only the builtins themselves.
    function, method = aten_callables(name)
    if function is not None and getattr(torch, name, None) is function:
        fn: Any = function
    elif method is not None and getattr(torch.Tensor, name, None) is method:
        fn = method
    else:
        return None
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    fake = detect_fake_mode([*args, *kwargs.values()])
    if fake is None:
        return None
    seen = _SeenOps()
    try:
        with fake, seen:
            fn(*args, **kwargs)
    except Exception:
        return None
    return fn if seen.ops == [target] else None


class _Pass:
    """One generated pass: ``fn(*tensors[, *kept]) -> outputs`` and how to read the outputs."""

    __slots__ = ("entries", "fn", "n_kept", "n_ops", "n_out")

    def __init__(
        self,
        fn: Callable[..., Any],
        entries: tuple[tuple[str, int, Any], ...],
        n_out: int,
        n_kept: int,
        n_ops: int,
    ) -> None:
        self.fn = fn
        self.entries = entries
        self.n_out = n_out
        self.n_kept = n_kept
        self.n_ops = n_ops

    def result(self, outs: Sequence[Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, kind, at in self.entries:
            if kind == 0:
                out[name] = outs[at]
            elif kind == 1:
                out[name] = None
            else:
                out[name] = [None if i is None else outs[i] for i in at]
        return out


class TracedSplit:
    """A single backward traced for one input signature, with its generated passes.

    Shared by every node of the op with that signature; a node's own state (what the earlier
    pass handed to the later) travels through :meth:`run`'s ``handoff``.

    Attributes:
        graph_module: the whole trace, ``(*saved tensors, *output grads) -> gradients``.
        requires: the arguments that required grad at trace time.
    """

    def __init__(
        self,
        op: OpSpec,
        gm: fx.GraphModule,
        layout: list[tuple[str, Any]],
        tensor_idx: list[int],
        all_tensors: bool,
        flat: bool,
        requires: frozenset[str],
        recompute: bool,
    ) -> None:
        self.op = op
        self.graph_module = gm
        self.requires = requires
        self._layout = layout
        self._tensor_idx = tensor_idx
        self._flat = flat
        # The leaves are all tensors (no None gradient, no plain saved value): they are the
        # arguments of a pass as they are.
        self._all_tensors = all_tensors
        self._recompute = recompute
        graph = gm.graph
        self._nodes = list(graph.nodes)
        self._placeholders = [n for n in self._nodes if n.op == "placeholder"]
        (out_node,) = (n for n in self._nodes if n.op == "output")
        self._outputs: list[fx.Node] = list(out_node.args[0])
        self._fakes: dict[str, Any] = {}
        for name, slot in layout:
            if name not in requires and slot is not None:
                slots = [slot] if isinstance(slot, int) else slot
                vals = [None if i is None else self._outputs[i].meta.get("val") for i in slots]
                if all(v is None or isinstance(v, _Tensor) for v in vals):
                    self._fakes[name] = vals[0] if isinstance(slot, int) else vals
        # Random ops run in the first pass of a node, all of them, in the order the backward
        # calls them: the generator draws what one call of the backward draws there, and what
        # the later pass needs of them is handed over.
        self._random = [n for n in self._nodes if _random(n)]
        self._passes: dict[Any, _Pass] = {}
        self._bindings: dict[fx.Node, Any] = {}
        self._kept: dict[frozenset[str], tuple[list[fx.Node], set[fx.Node]]] = {}

    # -- running -------------------------------------------------------------------------------
    def run(
        self,
        saved: Any,
        grads: tuple[Any, ...],
        needed: frozenset[str],
        handoff: Any,
        keep: bool,
    ) -> tuple[dict[str, Any], Any]:
        """Compute the gradients ``needed``: ``(gradients by name, what to keep for later)``.

        ``handoff`` is what this node's earlier pass kept (or None); ``keep``: a later pass of
        this node will compute the remaining gradients, so keep what it shares with this one.
        """
        if torch.is_grad_enabled():
            # Outside the engine (a create_graph backward calls the function as written): a
            # deferred weight pass, whose gradients go to .grad. Build no graph for them.
            with torch.no_grad():
                return self.run(saved, grads, needed, handoff, keep)
        if self._flat:
            leaves: Sequence[Any] = saved + grads
        else:
            leaves = _flatten(saved, grads)[0]
        args = leaves if self._all_tensors else [leaves[i] for i in self._tensor_idx]
        kept: Any = None
        if handoff is not None and handoff[0] is self and needed <= handoff[1]:
            p = self._pass(("late", needed, handoff[1]))
            result = p.result(p.fn(*args, *handoff[2]))
        elif keep:
            later = self.requires - needed
            p = self._pass(("early", needed, later))
            outs = p.fn(*args)
            result = p.result(outs)
            if len(outs) > p.n_out:
                kept = (self, later, outs[p.n_out :])
        else:
            p = self._pass(("alone", needed, None))
            result = p.result(p.fn(*args))
        if self._fakes:
            # The gradients no pass computes (of arguments that don't require grad), as the
            # trace's fake tensors: customgrad's validation sees every gradient the backward
            # returns, on every call, as it does for a backward called as written.
            for name, value in self._fakes.items():
                result.setdefault(name, value)
        return result, kept

    # -- building the passes ---------------------------------------------------------------------
    def _pass(self, key: tuple[str, frozenset[str], frozenset[str] | None]) -> _Pass:
        p = self._passes.get(key)
        if p is None:
            with _TRACE_LOCK:
                p = self._passes.get(key)
                if p is None:
                    with _disable_current_modes():  # checking bindings runs fake ops
                        p = self._passes[key] = self._build(*key)
        return p

    def _slots(self, names: frozenset[str]) -> list[int]:
        """Positions in the trace's outputs of the gradients of ``names``."""
        slots: list[int] = []
        for name, slot in self._layout:
            if name in names:
                if isinstance(slot, int):
                    slots.append(slot)
                elif isinstance(slot, list):
                    slots.extend(i for i in slot if i is not None)
        return slots

    def _handoff(self, later: frozenset[str]) -> tuple[list[fx.Node], set[fx.Node]]:
        """What the earlier pass (the gradients not in ``later``) hands to the later pass.

        Returns the nodes to keep, in graph order, and the nodes the later pass recomputes
        (:func:`customgrad._partition.cut`).
        """
        found = self._kept.get(later)
        if found is None:
            outs = self._outputs
            early = [*(outs[i] for i in self._slots(self.requires - later)), *self._random]
            c = cut(self.graph_module.graph, early, [outs[i] for i in self._slots(later)],
                    "cheap" if self._recompute else "none")  # fmt: skip
            found = self._kept[later] = (list(c.kept), set(c.recomputed))
        return found

    def _build(self, kind: str, needed: frozenset[str], later: frozenset[str] | None) -> _Pass:
        outs = self._outputs
        kept_in: list[fx.Node] = []
        kept_out: list[fx.Node] = []
        if kind == "late":
            assert later is not None
            kept_in = self._handoff(later)[0]
        elif kind == "early":
            assert later is not None
            kept_out = self._handoff(later)[0]

        # The pass's outputs: the gradients it computes, then what it keeps for later.
        entries: list[tuple[str, int, Any]] = []
        results: list[fx.Node] = []
        position: dict[int, int] = {}

        def at(i: int) -> int:
            if i not in position:
                position[i] = len(results)
                results.append(outs[i])
            return position[i]

        for name, slot in self._layout:
            if name not in needed:
                continue
            if slot is None:
                entries.append((name, 1, None))
            elif isinstance(slot, int):
                entries.append((name, 0, at(slot)))
            else:
                entries.append((name, 2, [None if i is None else at(i) for i in slot]))
        n_out = len(results)
        results += kept_out
        drawn = self._random if kind != "late" else []
        nodes = ancestors([*results, *drawn], kept_in)
        if kind == "alone":
            results += [n for n in drawn if n not in position]  # drawn, not used

        def fast(node: fx.Node, copy: fx.Node) -> None:
            target = self._bindings.get(node, node.target)
            if target is node.target:
                target = self._bindings[node] = _binding(node) or node.target
            copy.target = target

        module = extract(self.graph_module, nodes, results, kept_in, fast)
        n_ops = sum(1 for n in nodes if n.op == "call_function")
        return _Pass(module.forward, tuple(entries), n_out, len(kept_out), n_ops)

    # -- reporting ---------------------------------------------------------------------------------
    def describe(self) -> str:
        """What each pass runs, in words."""
        weights = self.op.signature.weight_set
        need_w = self.requires & weights
        need_in = self.requires - weights
        total = sum(1 for n in self._nodes if n.op == "call_function")
        if not need_w or not need_in:
            only = "weights" if need_w else "inputs"
            return (
                f"split automatically (traced: {total} ops, all in one pass: only its {only} "
                f"required grad, so there was nothing to split)"
            )
        early = self._pass(("early", need_in, need_w))
        late = self._pass(("late", need_w, need_w))
        again = sum(1 for n in self._handoff(need_w)[1] if n.op == "call_function")
        return (
            f"split automatically (traced: {total} ops; the input pass runs {early.n_ops}, the "
            f"weight pass {late.n_ops}; {early.n_kept} tensor(s) handed from the input pass to "
            f"the weight pass, {again} op(s) recomputed there)"
        )

    def __repr__(self) -> str:
        return f"<TracedSplit of {self.op.name} for {sorted(self.requires)}>"
