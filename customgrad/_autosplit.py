"""The automatic split of a single backward: capture it with dynamo, cut the capture into I and W.

One ``register_backward`` that returns every gradient is how people write a backward (as in
``torch.autograd.Function``), but under a pipeline's split backward such a function runs whole in
the input pass (I) and again in the weight pass (W). With ``split="auto"`` (the default)
customgrad captures it with dynamo (:mod:`customgrad._capture`) and cuts it in two:

- work that only input gradients need runs in I, work that only weight gradients need in W, and
  work that no requested gradient needs is dropped;
- work that both need runs once, in the input pass, and its results are handed to the weight
  pass through the node's hand-off (freed once W ran); with ``recompute="cheap"`` shared
  results that cost no FLOPs (views, elementwise ops) are recomputed in the weight pass instead
  of kept;
- random ops all run in the input pass, in the order the backward calls them, and what the
  weight pass needs of them is handed over: the draws are those of one call at the first pass;
- a full backward (every gradient the node requires, as a plain ``.backward()`` asks) calls the
  function as written, validated like any backward: nothing is captured or checked for it, so
  it costs what a hand-written pair's full backward costs. The capture happens at the first
  pass that splits (an input or weight pass).

The cut and the passes are the split program's (:mod:`customgrad._split_program`, shared with
compiled regions), run per node by :class:`customgrad._traced_split.TracedSplit`. This module
keeps the captures of one op (:class:`AutoSplitter`) and selects one per call; the gradients go
back to customgrad's validation as any backward's do.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from customgrad._capture import (
    INSIDE_TRACE,
    NOT_COMPILING,
    Capture,
    Fallback,
    capture_backward,
)
from customgrad._errors import where
from customgrad._handoff import nbytes
from customgrad._rules import BackwardContext, OpSpec
from customgrad._torch.dispatcher import (
    INFRA_MODES,
    any_autocast_enabled,
    deterministic,
    deterministic_warn_only,
    dispatch_stack_len,
    function_stack_len,
    get_dispatch_mode,
)
from customgrad._torch.fake import fake_tensor_type, functional_tensor_type
from customgrad._torch.transforms import functorch_active, legacy_batched
from customgrad._traced_split import TRACE_LOCK, TracedSplit, flatten

if TYPE_CHECKING:
    from customgrad._record import NodeRecord

__all__ = [
    "CONSTANTS",
    "MAX_SIGNATURES",
    "NOT_SPLIT_YET",
    "RECAPTURES",
    "AutoSplitter",
    "Fallback",
    "TracedSplit",
    "ambient",
    "describe_node",
]

log = logging.getLogger("customgrad")

MAX_SIGNATURES = 256
"""Input signatures (plain values and shapes) captured per backward; calls with new ones beyond
that run once (one log line)."""

RECAPTURES = 8
"""Captures per input signature (the first, then one per failed guard: a global the backward
reads rebound, a flag flipped); beyond that calls with it run once (one log line)."""

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

NOT_SPLIT_YET = (
    "split automatically at its first split pass (one that needs only the input or only the "
    "weight gradients); none ran yet (a full backward calls the function as written)"
)
"""How a single backward is described before any pass split it."""

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

_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu", "privateuseone", "mtia", "maia")
_any_autocast = any_autocast_enabled
_function_modes = function_stack_len
_deterministic = deterministic
_warn_only = deterministic_warn_only
_default_dtype: Any = torch.get_default_dtype


def ambient() -> Hashable:
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


# --------------------------------------------------------------------------------------------
# The splitter of one op's single backward
class AutoSplitter:
    """The automatic split of one single backward: an op's (``AutogradRules.auto``), or a plain
    Function's for one layout of its arguments (:mod:`customgrad.pipelining._function_split`).

    :meth:`find` is the one capture cache and retry rule: the captures of each signature (the
    values that are not tensors, the tensors' ``is_leaf``, the ambient state), the first whose
    checks hold selected; else a new capture, up to :data:`RECAPTURES` per shapes of the
    signature and :data:`MAX_SIGNATURES` shapes. An op node asks :meth:`select` at its first
    split pass (a full backward calls the function as written and never asks): its
    :class:`TracedSplit` (shared by every node whose call selects the same capture), or None to
    call the backward as written.

    Args:
        op: the op (for a Function, what the capture reads of one: its name and signature).
        fn: the single backward, ``fn(ctx, saved, *grads) -> dict``.
        recompute: ``"cheap"`` recomputes shared results without FLOPs in the weight pass.

    Attributes:
        traces: how many times the backward was captured.
        last: what the latest :meth:`find` found (a :class:`TracedSplit` or a
            :class:`Fallback`), or None before any split pass.
    """

    def __init__(self, op: OpSpec, fn: Callable[..., object], recompute: str) -> None:
        self.op = op
        self.fn = fn
        self.recompute = recompute == "cheap"
        self.traces = 0
        self.last: TracedSplit | Fallback | None = None
        # signature -> its captures (any shapes: dynamo's guards select among them) and why
        # there is none
        self._cache: dict[Any, _Entry] = {}
        self._signatures = 0  # (signature, shapes) pairs captured
        self._ctx: dict[frozenset[str], Any] = {}  # read-only contexts, one per requires
        self._logged = False
        self.held_bytes: int | None = None
        """The bytes of gradients the latest run-once backward held from its first pass for
        the later one (None before any)."""

    def select(
        self,
        make_ctx: Callable[[frozenset[str]], BackwardContext],
        saved: object,
        grads: tuple[object, ...],
        requires: frozenset[str],
    ) -> TracedSplit | None:
        """The split for an op node whose backward got ``saved`` and ``grads`` (None: call it):
        :meth:`find` with the op's read-only context for ``requires``, the reason not to split
        logged once."""
        ctx = self._ctx.get(requires)
        if ctx is None:
            ctx = self._ctx[requires] = make_ctx(requires)
        outcome = self.find(ctx, saved, grads, requires)
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

    def find(
        self, ctx: object, saved: object, grads: tuple[object, ...], requires: frozenset[str]
    ) -> TracedSplit | Fallback:
        """The one capture cache and retry rule, for op nodes and plain Functions alike: the
        capture whose checks hold for ``fn(ctx, saved, *grads)``, else a new one (up to
        :data:`RECAPTURES` per shapes of a signature), else why not."""
        outcome = self._find(ctx, saved, grads, requires)
        self.last = outcome
        return outcome

    def _find(
        self, ctx: object, saved: object, grads: tuple[object, ...], requires: frozenset[str]
    ) -> TracedSplit | Fallback:
        if _tracing_now():
            # An outer trace (AOTAutograd building torch.compile's backward graph, make_fx, a
            # functorch transform) records whatever runs here: the backward as written is what
            # it should record, and every gradient comes out right.
            return INSIDE_TRACE
        structure: Any
        if type(saved) is tuple and type(grads) is tuple:  # the common case, without optree
            leaves: Sequence[Any] = saved + grads
            structure = len(saved)
            signature = _signature(leaves, (structure, requires), flat=True)
        else:
            signature = None
        if signature is None:
            leaves, structure = flatten(saved, grads)
            signature = _signature(leaves, (structure, requires), flat=False)
        if isinstance(signature, Fallback):
            return signature
        if _batched(grads):
            # torch's legacy vmap (is_grads_batched, jacobian(vectorize=True)) runs the
            # backward on batched gradients: called as written, it batches each op it runs.
            return INSIDE_TRACE
        signature = (signature, ambient())
        entry = self._cache.get(signature)
        frame = {"ctx": ctx, "saved": saved, "grads": grads}
        if entry is not None:
            if entry.fallback is not None and not entry.fallback.retries:
                return entry.fallback
            for capture in entry.captures:
                if capture.holds(frame):
                    return capture.split
        return self._capture(signature, frame, leaves, structure, requires)

    def _capture(
        self,
        signature: Any,
        frame: dict[str, Any],
        leaves: Sequence[Any],
        structure: Any,
        requires: frozenset[str],
    ) -> TracedSplit | Fallback:
        with TRACE_LOCK:
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
            if not tries and self._signatures >= MAX_SIGNATURES:
                return Fallback(
                    f"it was captured for {MAX_SIGNATURES} input signatures already (shapes, "
                    f"dtypes or saved values change from call to call)",
                    "call it with a few distinct shapes (pad to buckets)",
                )
            if tries >= RECAPTURES:
                latest = entry.captures[0].changed(frame) if entry.captures else "it changed"
                return Fallback(
                    f"what it reads changed {RECAPTURES} times (dynamo's guards failed: a "
                    f"global rebound, a flag flipped, an object's or ctx's field set; the "
                    f"latest: {latest}), and each change needs a new capture",
                    "pass what changes as an argument of the op, or keep it fixed during "
                    "training; a size that changes every step (the group sizes of a routing) "
                    "belongs in a tensor the backward reads with .tolist(), so that one capture "
                    "serves every value",
                )
            outcome = capture_backward(
                self.op, self.fn, frame, leaves, structure, requires, self.recompute
            )
            if outcome is NOT_COMPILING:
                return outcome  # dynamo is off now: nothing tried, nothing kept
            self._signatures += not tries
            entry.tries[shapes] = tries + 1
            self.traces += 1
            if isinstance(outcome, Capture):
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

    def held(self, value: object) -> None:
        """Note what a run-once backward hands to its later pass (for reports)."""
        self.held_bytes = nbytes(value)

    def describe(self) -> str:
        """How the latest backward of this op was split, in words (for reports)."""
        last = self.last
        if last is None:
            return NOT_SPLIT_YET
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


class _Entry:
    """The captures of one signature (newest first), the captures tried per shapes, and why
    there is none (a :class:`Fallback` cached for the signature)."""

    __slots__ = ("captures", "fallback", "tries")

    def __init__(self) -> None:
        self.captures: list[Capture] = []
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


def _signature(leaves: Sequence[Any], head: tuple[Any, ...], flat: bool) -> Any:
    """What selects the captures to check besides dynamo's guards (which check the tensors'
    shapes, strides, dtypes, devices and requires-grad, and what the backward reads of other
    objects): the tensors' is-leaf, the values of plain leaves, the types of objects.

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
            return INSIDE_TRACE
        elif isinstance(leaf, _Tensor):
            return Fallback(
                f"a saved tensor or output gradient is a {kind.__qualname__} (a tensor subclass)",
                "pass plain tensors to the op",
            )
        else:
            key.append(kind)  # an object (an enum member, a config): dynamo guards what is read
    return tuple(key)


def describe_node(record: NodeRecord) -> str | None:
    """How the single backward of a customgrad node was split, or None for a node whose op
    registered the pair (or ``split="phase"``)."""
    auto = record.op.rules.auto
    if not isinstance(auto, AutoSplitter) or record.op.rules.backward is None:
        return None
    split = record.traced
    if isinstance(split, TracedSplit):
        return split.describe()
    if split is False:
        fallback = auto.fallback()
        return (
            auto.describe_fallback(fallback) if fallback is not None else "not split automatically"
        )
    return NOT_SPLIT_YET
