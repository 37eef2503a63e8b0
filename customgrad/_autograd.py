"""Autograd for customgrad ops: one ``torch.autograd.Function`` that knows which pass it is in.

The node's backward finds out which of its input edges the running pass uses: from the route a
planned split backward installed (:mod:`customgrad._routing`), else by asking the autograd
engine (``torch._C._will_engine_execute_node``). That is what lets a split backward (torch's
``stage_backward_input`` then ``stage_backward_weight``, or customgrad's) run the input half of
a customgrad op in the first pass and the weight half in the second, with nothing computed
twice. Work both halves share is computed once and handed from the earlier pass to the later.

This module depends on an op only through :class:`customgrad._rules.OpSpec`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, NamedTuple

import optree
import torch
import torch.autograd.forward_ad as _fwad
from torch.autograd.graph import GradientEdge

from customgrad._errors import (
    GradientTypeError,
    GradientValueError,
    MissingRegistrationError,
    MutationError,
    UnsupportedError,
    where,
)
from customgrad._record import NO_HANDOFF, NodeRecord
from customgrad._routing import current_tag, route_for
from customgrad._rules import AutogradRules, Half, OpSpec
from customgrad._signature import ArgKind, Signature
from customgrad._switches import STATE as SWITCHES
from customgrad._torch_internals import (
    ACCUMULATE_GRAD,
    captured_by_caller,
    graph_kept,
    graph_task_id,
    will_execute,
)
from customgrad._validate import HALF_NAMES, Meta, collect_grads, describe

__all__ = [
    "AutogradImpl",
    "BackwardContext",
    "BackwardObserver",
    "DeferredWork",
    "Phase",
    "SaveError",
    "engine_needs",
]

log = logging.getLogger("customgrad")

Phase = Literal["full", "input", "weight"]

_will_execute = will_execute
_warned_no_engine_query = False

_Tensor = torch.Tensor
_VERSION = itertools.repeat("_version")
_NO_VERSION = itertools.repeat(None)
_Parameter = torch.nn.Parameter
_functorch_active: Callable[[], bool] | None = getattr(
    torch._C, "_are_functorch_transforms_active", None
)
_unwrap_if_dead: Callable[[Any], Any] | None = getattr(
    getattr(torch._C, "_functorch", None), "unwrap_if_dead", None
)
_graph_task_id = graph_task_id
try:
    from torch._C._functorch import TransformType as _TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    _JVP: Any = _TransformType.Jvp
    _functorch_interpreters: Callable[[], Any] = retrieve_all_functorch_interpreters
except ImportError:  # pragma: no cover - torch without functorch
    _JVP = None
    _functorch_interpreters = list

BackwardObserver = Callable[[str, "Phase", "BackwardContext", Any], None]
"""Called as ``observer(label, phase, ctx, result)`` after each registered backward function
runs (``label``: ``"backward"``, ``"backward_input"``, ``"backward_weight"``,
``"backward_shared"``, or ``"backward (traced input part)"`` and the like for an automatic
split)."""


class SaveError(GradientTypeError):
    """``save_for_backward`` returned a value customgrad cannot keep safely."""


MSG_HIDDEN_TENSORS = """\
{op}: save_for_backward returned {what}, which holds Tensors customgrad cannot see. Tensors \
must be saved through autograd (so in-place changes before backward are caught and no \
reference cycle keeps outputs alive), which customgrad does for Tensors inside tuples, lists, \
dicts and NamedTuples. Return those instead:

    return inputs.x, inputs.weight, rstd            # or a dict / a NamedTuple

(save_for_backward defined at {loc})"""


_ACCUMULATE = ACCUMULATE_GRAD


_NOTHING: frozenset[int] = frozenset()


class CaptureMemo:
    """Which leaves the running ``torch.autograd.grad`` captures, remembered per graph task.

    The engine's query (``_will_engine_execute_node``) raises for a leaf that ``autograd.grad``
    captures, and each raise costs about as much as a small op's whole backward. The caller
    that started the pass knows its inputs: torch's own ``_engine_run_backward`` frame, below
    the node's backward on the calling thread (the engine runs CPU graph tasks there), holds
    them. :meth:`captured_now` reads them once per graph task; a captured leaf is then needed
    without asking the engine. Every other edge is still asked, so a frame that is missing or
    not what it seems costs only speed, never a gradient.
    """

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: tuple[int, frozenset[int]] = (-2, _NOTHING)

    def captured_now(self, above: int = 1) -> frozenset[int]:
        """The ``id`` of each leaf tensor the running ``autograd.grad`` captures (none when
        unknown, or in a ``.backward()``).

        Args:
            above: Python frames between the caller and torch's ``_engine_run_backward`` (1
                for the node's ``apply``, which the engine calls).
        """
        task = _graph_task_id()
        last = self._last  # one tuple, replaced whole: threads never see half an update
        if last[0] == task:
            return last[1]
        captured = captured_by_caller(2 + above)
        self._last = (task, captured)
        return captured


def needed_edge(fn: Any, captured: frozenset[int]) -> bool:
    """Whether the running pass uses the gradient sent along an edge to ``fn``.

    ``captured``: the leaves the running ``autograd.grad`` captures
    (:meth:`CaptureMemo.captured_now`, read once per node backward).
    """
    if type(fn) is _ACCUMULATE and id(fn.variable) in captured:  # type: ignore[attr-defined]
        return True  # a leaf that autograd.grad captures: needed, without asking the engine
    if _will_execute is None:
        return engine_needs(fn)
    try:
        return _will_execute(fn)
    except Exception:  # a captured leaf the caller's frame did not name: needed
        return True


def engine_needs(fn: Any) -> bool:
    """Whether the running graph task will use the gradient sent along an edge to ``fn``.

    Any error (outside a backward, a leaf captured by ``autograd.grad``) means "needed".
    """
    global _warned_no_engine_query
    if _will_execute is None:
        if not _warned_no_engine_query:
            _warned_no_engine_query = True
            log.warning(
                "customgrad: this torch has no torch._C._will_engine_execute_node; split "
                "backward falls back to computing every gradient in every pass."
            )
        return True
    try:
        return _will_execute(fn)
    except Exception:
        return True


# --------------------------------------------------------------------------------------------
# What a backward function sees


class _Shared:
    """``ctx.shared`` of one backward call: computed at most once, kept for a later pass."""

    __slots__ = ("computed", "grads", "keep", "record", "saved", "value", "watch")

    def __init__(
        self, record: NodeRecord, saved: Any, grads: tuple[Any, ...], watch: _Watch, keep: bool
    ):
        self.record = record
        self.saved = saved
        self.grads = grads
        self.watch = watch
        self.keep = keep
        self.value: Any = handed_over(record, grads)
        self.computed = False  # by this call (not handed over from an earlier pass)

    def get(self, ctx: BackwardContext) -> Any:
        if self.value is NO_HANDOFF:
            spec = self.record.op
            fn = spec.rules.backward_shared
            if fn is None:
                raise MissingRegistrationError(
                    f"{spec.name}: ctx.shared was read, but no shared work is registered. "
                    f"Register the work both halves need:\n\n"
                    f"    @{spec.name.split('::')[1]}.register_backward_shared\n"
                    f"    def _(ctx, saved, grad):\n"
                    f"        return grad @ saved.w_down      # read as ctx.shared\n"
                )
            nondiff = spec.rules.nondifferentiable
            self.value = _call_user(ctx, "shared", fn, self.saved, self.grads, self.watch, nondiff)
            self.computed = True
            if self.keep:
                self.record.handoff = (self.grads, self.value)
        return self.value


class BackwardContext:
    """What a customgrad backward function is told about the running pass.

    Attributes:
        op: the :class:`~customgrad.CustomOp` whose backward runs.
        phase: ``"input"`` when the pass needs only non-weight arguments' gradients,
            ``"weight"`` when it needs only weights', ``"full"`` otherwise (every argument that
            requires grad is needed, or some of each kind are).
    """

    __slots__ = ("_needed", "_shared", "op", "phase")

    def __init__(
        self,
        op: Any,
        phase: Phase,
        needed: frozenset[str],
        shared: _Shared | None = None,
    ) -> None:
        self.op = op
        self.phase: Phase = phase
        self._needed = needed
        self._shared = shared

    def needs_input_grad(self, name: str) -> bool:
        """True if argument ``name`` requires grad and the engine will use its gradient now."""
        if name not in self.op.signature.index:
            raise GradientValueError(
                f"{self.op.name}: ctx.needs_input_grad({name!r}): no such argument. "
                f"Arguments: {', '.join(self.op.signature.names)}."
            )
        return name in self._needed

    @property
    def shared(self) -> Any:
        """What ``register_backward_shared`` computes: once per node, in the earlier pass of a
        split, kept for the later one and freed after it."""
        if self._shared is None:
            var = self.op.name.split("::")[1]
            raise MissingRegistrationError(
                f"{self.op.name}: ctx.shared was read, but the op registers no shared work. "
                f"ctx.shared is what register_backward_shared computes for the halves of the "
                f"input/weight pair; register the work both halves need:\n\n"
                f"    @{var}.register_backward_shared\n"
                f"    def _(ctx, saved, grad):\n"
                f"        return grad @ saved.w_down      # read as ctx.shared in both halves\n\n"
                f"(A single register_backward computes such work itself: its automatic split "
                f"runs it once and hands it from I to W.)"
            )
        return self._shared.get(self)

    def __repr__(self) -> str:
        return (
            f"BackwardContext(op={self.op.name!r}, phase={self.phase!r}, "
            f"needed={sorted(self._needed)})"
        )


# --------------------------------------------------------------------------------------------
# Running the user's backward functions


def _watched_values(saved: Any, grads: tuple[Any, ...]) -> tuple[Any, ...]:
    """The output gradients, then the saved values (leaves of a saved pytree)."""
    if type(saved) is tuple:
        return (*grads, *saved)
    if saved is None:
        return grads
    if isinstance(saved, _Tensor):
        return (*grads, saved)
    return (*grads, *optree.tree_leaves(saved, none_is_leaf=True))


def _raise_mutation(
    spec: OpSpec,
    half: Half,
    fn: Callable[..., Any],
    values: tuple[Any, ...],
    before: list[Any],
    n_grads: int,
) -> None:
    """Raise :class:`MutationError` for the first value whose version moved (if one did)."""
    saved_tensors = 0
    for i, (v, version) in enumerate(zip(values, before)):
        is_grad = i < n_grads
        if not is_grad and isinstance(v, _Tensor):
            saved_tensors += 1
        if version is not None and v._version != version:
            what = f"the gradient of output {i}" if is_grad else f"saved tensor {saved_tensors - 1}"
            label = HALF_NAMES[half]
            raise MutationError(
                f"{spec.name}: {label} modified {what} in place (its version went from "
                f"{version} to {v._version}). The other half of a split backward may still "
                f"need it, and autograd may share it with other nodes. Compute out of place "
                f"(grad = grad * s, not grad.mul_(s)). ({label} defined at {where(fn)})"
            )


class _Watch:
    """What a backward function must not write to in place (the output gradients and the saved
    values), and their version counters before the node's backward ran.

    Versions are read with ``getattr(v, "_version", None)`` over every value (C-level ``map``,
    no Python frame per value): non-tensors read as None and never change.
    """

    __slots__ = ("before", "n_grads", "values")

    def __init__(self, saved: Any, grads: tuple[Any, ...]) -> None:
        self.values = values = _watched_values(saved, grads)
        self.n_grads = len(grads)
        self.before = [*map(getattr, values, _VERSION, _NO_VERSION)]

    def check(self, spec: OpSpec, half: Half, fn: Callable[..., Any]) -> None:
        """Raise :class:`MutationError` if ``fn`` moved a version counter."""
        if [*map(getattr, self.values, _VERSION, _NO_VERSION)] != self.before:
            _raise_mutation(spec, half, fn, self.values, self.before, self.n_grads)


def _call_user(
    ctx: BackwardContext,
    half: Half,
    fn: Callable[..., Any],
    saved: Any,
    grads: tuple[Any, ...],
    watch: _Watch,
    nondiff: frozenset[Half],
) -> Any:
    """Call one registered backward function; refuse in-place writes to grads or saved values."""
    if nondiff and half in nondiff and torch.is_grad_enabled():
        with torch.no_grad():
            result = fn(ctx, saved, *grads)
        anchors = _requiring_grad(grads, saved)
        if anchors:
            result = _delay_error(ctx.op, half, fn, result, anchors)
    else:
        result = fn(ctx, saved, *grads)
    watch.check(ctx.op, half, fn)
    return result


def _requiring_grad(grads: tuple[Any, ...], saved: Any) -> list[torch.Tensor]:
    """The output gradients and saved tensors that require grad (in double backward)."""
    tree: Any = (grads, saved)
    leaves: list[Any] = optree.tree_leaves(tree, none_is_leaf=True)
    return [t for t in leaves if isinstance(t, _Tensor) and t.requires_grad]


class _RaiseIfDifferentiated(torch.autograd.Function):
    """An alias of a tensor whose backward raises: for what autograd cannot differentiate (a
    ``differentiable=False`` backward's gradients, a residual). Unlike torch's
    ``once_differentiable``, the node has edges to the tensors the value was computed from
    (``anchors``), so ``autograd.grad`` with respect to them runs it and raises, instead of
    pruning it and returning a silently wrong gradient."""

    @staticmethod
    def forward(ctx: Any, msg: str, value: torch.Tensor, *anchors: torch.Tensor) -> torch.Tensor:
        ctx.msg = msg
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise UnsupportedError(ctx.msg)


def _raises_if_differentiated(msg: str, t: torch.Tensor, anchors: list[torch.Tensor]) -> Any:
    if not (t.is_floating_point() or t.is_complex()):
        return t
    return _RaiseIfDifferentiated.apply(msg, t, *anchors)  # type: ignore[no-untyped-call]


def _delay_error(
    spec: OpSpec, half: Half, fn: Callable[..., Any], result: Any, anchors: list[torch.Tensor]
) -> Any:
    """Make the gradients in ``result`` raise if anyone differentiates them (double backward)."""
    if not isinstance(result, dict):
        return result
    label = HALF_NAMES[half]
    msg = (
        f"{spec.name}: {label} was registered with differentiable=False, so its gradients "
        f"cannot be differentiated again (double backward, gradient penalties). Register a "
        f"differentiable {label}, written with differentiable torch ops. ({label} defined at "
        f"{where(fn)})"
    )
    out: dict[Any, Any] = {}
    for name, g in result.items():
        if isinstance(g, _Tensor):
            g = _raises_if_differentiated(msg, g, anchors)
        elif isinstance(g, (list, tuple)):
            g = [
                _raises_if_differentiated(msg, t, anchors) if isinstance(t, _Tensor) else t
                for t in g
            ]
        out[name] = g
    return out


MSG_RESIDUAL_DOUBLE_BACKWARD = """\
{op}: double backward (create_graph=True, gradient penalties) reached residual {name!r}, which \
the kernel computed in the forward: autograd sees it as a constant, so the gradient through it \
would be silently wrong. Save the inputs and recompute it in the backward with differentiable \
torch ops if you need double backward; otherwise register the backward with \
differentiable=False to declare the op once differentiable. (kernel defined at {loc})"""


def _residual_slots(saved: Any, residuals: tuple[Any, ...], names: tuple[str, ...]) -> Any:
    """For each residual that ``save_for_backward`` kept as it is: its position among the saved
    tensors (in the order :func:`_save` saves them) and its name; None when there is none."""
    tensors = [t for t in optree.tree_leaves(saved, none_is_leaf=True) if isinstance(t, _Tensor)]
    slots = tuple(
        (i, name) for i, t in enumerate(tensors) for r, name in zip(residuals, names) if t is r
    )
    return slots or None


def _guard_residuals(
    spec: OpSpec, saved: Any, grads: tuple[Any, ...], slots: tuple[tuple[int, str], ...]
) -> Any:
    """``saved`` with each residual replaced by an alias whose backward raises (in double
    backward, where the backward builds a graph).

    A residual depends on the op's inputs, not on the output gradients: its alias hangs off the
    saved tensors that require grad, so double backward with respect to the output gradients
    alone still works; only when no saved tensor requires grad does it hang off the gradients.
    """
    anchors = _requiring_grad((), saved) or _requiring_grad(grads, None)
    if not anchors:
        return saved
    names = dict(slots)
    leaves, treespec = optree.tree_flatten(saved, none_is_leaf=True)
    k = 0
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, _Tensor):
            name = names.get(k)
            if name is not None:
                msg = MSG_RESIDUAL_DOUBLE_BACKWARD.format(
                    op=spec.name, name=name, loc=where(spec.signature.fn)
                )
                leaves[i] = _raises_if_differentiated(msg, leaf, anchors)
            k += 1
    return optree.tree_unflatten(treespec, leaves)


def keeps_for_later(plan: PassPlan, target: Any) -> bool:
    """Whether a pass keeps what a node's halves share for the node's later pass: when it
    computes input gradients while weights that require grad are left for later, and that later
    pass can come (the graph is retained, or a route defers the weight half to ``target``).
    A non-retaining partial pass frees everything at once."""
    return bool(plan.later_w) and bool(plan.need_in) and (target is not None or graph_kept())


def handed_over(record: NodeRecord, grads: tuple[Any, ...]) -> Any:
    """What the node's earlier pass kept for this one (:data:`NO_HANDOFF` when nothing).

    A hand-off belongs to the pass that made it: it is read only by a pass with the same output
    gradients (the same tensors), never by a pass of another loss through the same node.
    """
    handoff = record.handoff
    if handoff is NO_HANDOFF:
        return NO_HANDOFF
    made_with, value = handoff
    if made_with is grads or _same_tensors(
        made_with, grads, record.op.signature.output_differentiability
    ):
        return value
    return NO_HANDOFF


def _same_tensors(
    a: tuple[Any, ...], b: tuple[Any, ...], differentiable: Sequence[bool] | None
) -> bool:
    """Whether two tuples of output gradients (lists for list outputs) hold the same tensors.

    The gradients of non-differentiable outputs are not compared: autograd materializes a new
    tensor of zeros for them in each pass.
    """
    if len(a) != len(b):
        return False
    for i, (x, y) in enumerate(zip(a, b)):
        if x is y or (differentiable is not None and not differentiable[i]):
            continue
        if not (
            isinstance(x, list)
            and isinstance(y, list)
            and len(x) == len(y)
            and all(p is q for p, q in zip(x, y))
        ):
            return False
    return True


class PassPlan(NamedTuple):
    """What one backward call of a node computes, from which arguments require grad and which
    the pass needs (argument names)."""

    phase: Phase
    needed: frozenset[str]
    need_in: frozenset[str]
    need_w: frozenset[str]
    later_w: frozenset[str]
    """Weights that require grad but that this pass does not compute (a later pass will, or a
    route takes them)."""
    later_in: frozenset[str]
    """Non-weight arguments that require grad but that this pass does not compute."""


def _pass_plan(sig: Signature, requires: frozenset[str], needed: frozenset[str]) -> PassPlan:
    need_w = needed & sig.weight_set
    need_in = needed - sig.weight_set
    if needed >= requires or (need_w and need_in):
        phase: Phase = "full"
    else:
        phase = "weight" if need_w else "input"
    later = requires - needed
    return PassPlan(phase, needed, need_in, need_w, later & sig.weight_set, later - sig.weight_set)


class AutogradImpl:
    """The autograd of one op: applies its node in forward and runs its backward.

    Args:
        spec: the op (anything that satisfies :class:`~customgrad._rules.OpSpec`).
    """

    def __init__(self, spec: OpSpec) -> None:
        self.spec = spec
        sig = spec.signature
        self._plans: dict[tuple[int, int], PassPlan] = {}
        self._arg_of: dict[tuple[int, ...] | None, tuple[int, ...]] = {}
        self._tensor_slots: dict[tuple[int, ...], list[tuple[str, int, int | None]]] = {}
        self._flat_arg_of = tuple(range(sig.nargs))
        self.captures = CaptureMemo()
        self.weight_flags: dict[tuple[int, ...] | None, tuple[bool, ...]] = {}
        """Per list lengths: whether each flat input is a weight (``NodeRecord.edge_is_weight``)."""
        self._ready_for: AutogradRules | None = None
        self._has_inputs = bool(sig.input_names)
        self._has_weights = bool(sig.weights)
        self.observers: tuple[BackwardObserver, ...] = ()
        # One Function class per op, so that autograd's own messages and the profiler name
        # the op: "CustomGrad[mylib::linear]".
        function: type[_CustomGradNode] = type(
            f"CustomGrad[{spec.name}]",
            (_CustomGradNode,),
            {
                "forward": staticmethod(self.forward),
                "setup_context": staticmethod(self.setup_context),
            },
        )
        function._backward_cls.apply = _node_apply  # type: ignore[attr-defined]
        self._function_apply: Callable[..., Any] = function.apply
        # What Function.apply ends in when no functorch transform is active.
        self._c_apply: Callable[..., Any] = super(torch.autograd.Function, function).apply  # type: ignore[misc]

    @contextlib.contextmanager
    def observing(self, observer: BackwardObserver) -> Iterator[None]:
        """Call ``observer`` after each registered backward function of this op runs, inside
        the block (see :data:`BackwardObserver`)."""
        self.observers = (*self.observers, observer)
        try:
            yield
        finally:
            self.observers = tuple(o for o in self.observers if o is not observer)

    # -- forward -------------------------------------------------------------------------------
    def ready(self) -> bool:
        """Whether the registrations are complete (cached per rules object)."""
        rules = self.spec.rules
        if rules is self._ready_for:
            return True
        if rules.missing(has_inputs=self._has_inputs, has_weights=self._has_weights):
            return False
        self._ready_for = rules
        return True

    def apply(self, args: tuple[Any, ...], kernel: Any, backward: bool = True) -> Any:
        """Run the op under autograd with schema-ordered ``args``; return what the op returns.

        ``kernel`` is the kernel to call directly, or None to call it through the dispatcher.
        ``backward=False``: only forward-mode AD needs the node (nothing requires grad), so
        the backward registrations may be missing.
        """
        spec = self.spec
        if backward and spec.rules is not self._ready_for and not self.ready():
            raise MissingRegistrationError(spec._missing_autograd_message())
        sig = spec.signature
        call = _Call(kernel)
        flat: Sequence[Any] = args
        if sig.has_lists:
            call.lens, flat = _flatten_args(sig, args)
        if _functorch_active is None or _unwrap_if_dead is None or _functorch_active():
            out = self._function_apply(self, call, *flat)
        else:
            # What Function.apply does without a functorch transform (unwrap dead wrappers,
            # then apply), minus its per-call signature binding.
            unwrap = _unwrap_if_dead
            out = self._c_apply(
                self, call, *[unwrap(a) if isinstance(a, _Tensor) else a for a in flat]
            )
        if sig.plain_output:
            return out
        if sig.output_is_tuple:
            return _regroup(call.out_lens, out)
        if sig.output_kinds[0] is ArgKind.TENSOR_LIST:
            return list(out)
        return out

    def forward(self, impl: AutogradImpl, call: _Call, *flat: Any) -> Any:
        """The node's forward (``Function.forward``; ``impl`` is ``self``)."""
        spec = self.spec
        sig = spec.signature
        lens = call.lens
        args = flat if lens is None else _unflatten_args(sig, lens, flat)
        outputs, residuals = spec._run_kernel(args, call.kernel)
        save = spec.rules.save
        inputs = tuple.__new__(sig.inputs_type, args)
        if save is None:
            if any(isinstance(a, _Tensor) and a.requires_grad for a in flat):
                # registrations changed since apply checked them
                raise MissingRegistrationError(spec._missing_autograd_message())
        elif sig.residuals_type is None:
            call.saved = save(inputs, outputs)
        else:
            call.saved = save(inputs, outputs, tuple.__new__(sig.residuals_type, residuals))
            call.residuals = residuals
        if sig.plain_output:
            return outputs
        outs = outputs if sig.output_is_tuple else (outputs,)
        flat_out: list[Any] = []
        out_lens: list[int | None] = []
        for kind, o in zip(sig.output_kinds, outs):
            if kind is ArgKind.TENSOR_LIST:
                out_lens.append(len(o))
                flat_out.extend(o)
            else:
                out_lens.append(None)
                flat_out.append(o)
        call.out_lens = out_lens
        return tuple(flat_out) if (sig.output_is_tuple or out_lens[0] is not None) else outputs

    def setup_context(self, ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        """The node's ``Function.setup_context``: its record, and what it saves."""
        sig = self.spec.signature
        call: _Call = inputs[1]
        flat = inputs[2:]
        record = NodeRecord(
            self,
            [(a.shape, a.dtype, a.device) if isinstance(a, _Tensor) else None for a in flat],
            call.lens,
            current_tag(),
        )
        if not sig.plain_output:
            record.out_lens = call.out_lens
            _mark_outputs(ctx, sig, call.out_lens, output)
        # Under functorch transforms setup_context runs once per transform level, on the
        # same call: ``call.saved`` stays (the call dies with ``apply``).
        _save(ctx, record, self.spec, call.saved)
        if call.residuals:
            record.residual_slots = _residual_slots(call.saved, call.residuals, sig.residual_names)
        if _forward_ad_active():
            args = flat if call.lens is None else _unflatten_args(sig, call.lens, flat)
            outputs = output if sig.plain_output else _public_outputs(sig, call.out_lens, output)
            record.forward_ad = (tuple.__new__(sig.inputs_type, args), outputs)
        ctx._cg = record

    # -- backward ------------------------------------------------------------------------------
    def plan(self, requires_mask: int, needed_mask: int) -> PassPlan:
        """The cached :class:`PassPlan` for argument bit masks (bit ``i``: argument ``i``)."""
        key = (requires_mask, needed_mask)
        plan = self._plans.get(key)
        if plan is None:
            names = self.spec.signature.names
            requires = frozenset(n for i, n in enumerate(names) if requires_mask >> i & 1)
            needed = frozenset(n for i, n in enumerate(names) if needed_mask >> i & 1)
            plan = self._plans[key] = _pass_plan(self.spec.signature, requires, needed)
        return plan

    def whole(self, plan: PassPlan) -> PassPlan:
        """The plan that computes every gradient ``plan``'s node requires (what a plain
        ``autograd.Function`` computes in each pass: used when the split is switched off)."""
        requires = plan.needed | plan.later_w | plan.later_in
        return self.plan(*_masks(self.spec.signature, requires, requires))

    def tensor_slots(self, lens: tuple[int, ...]) -> list[tuple[str, int, int | None]]:
        """For list lengths ``lens``: each Tensor argument's name, first flat position and list
        length (None for a single tensor), cached."""
        found = self._tensor_slots.get(lens)
        if found is None:
            sig = self.spec.signature
            found = [
                (name, start, n)
                for name, (start, n) in _slots(sig, lens).items()
                if sig.args[sig.index[name]].is_tensor
            ]
            if len(self._tensor_slots) < 256:
                self._tensor_slots[lens] = found
        return found

    def arg_of(self, lens: tuple[int, ...] | None) -> tuple[int, ...]:
        """For each flat input position, the index of its argument."""
        arg_of = self._arg_of.get(lens)
        if arg_of is None:
            out: list[int] = []
            it = iter(lens or ())
            for i, spec in enumerate(self.spec.signature.args):
                out.extend([i] * (next(it) if spec.kind is ArgKind.TENSOR_LIST else 1))
            arg_of = self._arg_of[lens] = tuple(out)
        return arg_of

    def compute(
        self,
        record: NodeRecord,
        plan: PassPlan,
        saved: Any,
        grads: tuple[Any, ...],
        keep: bool,
    ) -> dict[str, Any]:
        """Run the registered backward for the gradients ``plan.needed`` and validate them.

        ``keep``: a later pass of this node will compute the rest, so keep what the halves
        share (``record.handoff``) for it; else the hand-off is freed.
        """
        spec = self.spec
        sig = spec.signature
        rules = spec.rules
        metas = record.metas if record.lens is None else None
        by_name = _metas_by_name(sig, record) if metas is None else None
        phase = plan.phase
        needed = plan.needed
        observers = self.observers
        nondiff = rules.nondifferentiable
        bwd = rules.backward
        if bwd is not None:
            split = self._auto_split(record, rules, saved, grads, plan)
            if split is not None:
                handoff = handed_over(record, grads)
                result, kept = split.run(
                    saved, grads, needed, None if handoff is NO_HANDOFF else handoff, keep
                )
                record.handoff = NO_HANDOFF if kept is None else (grads, kept)
                if observers:
                    ctx = BackwardContext(spec, phase, needed)
                    for o in observers:
                        o(f"backward (traced {phase} part)", phase, ctx, result)
                return collect_grads(
                    sig, "full", bwd, result, sig.tensor_set, needed, metas, by_name
                )
            ctx = BackwardContext(spec, phase, needed)
            result = _call_user(ctx, "full", bwd, saved, grads, _Watch(saved, grads), nondiff)
            for o in observers:
                o("backward", phase, ctx, result)
            return collect_grads(sig, "full", bwd, result, sig.tensor_set, needed, metas, by_name)
        watch = _Watch(saved, grads)
        need_in = plan.need_in
        need_w = plan.need_w
        shared = None
        if rules.backward_shared is not None:
            shared = _Shared(record, saved, grads, watch, keep and bool(need_in) and not need_w)
        ctx = BackwardContext(spec, phase, needed, shared)
        grads_out: dict[str, Any] = {}
        if need_in:
            bwd_in = rules.backward_input
            if bwd_in is None:
                raise MissingRegistrationError(spec._missing_autograd_message())
            result = _call_user(ctx, "input", bwd_in, saved, grads, watch, nondiff)
            for o in observers:
                o("backward_input", phase, ctx, result)
            grads_out = collect_grads(
                sig, "input", bwd_in, result, sig.input_set, need_in, metas, by_name
            )
        if need_w:
            bwd_w = rules.backward_weight
            if bwd_w is None:
                raise MissingRegistrationError(spec._missing_autograd_message())
            result = _call_user(ctx, "weight", bwd_w, saved, grads, watch, nondiff)
            for o in observers:
                o("backward_weight", phase, ctx, result)
            got = collect_grads(
                sig, "weight", bwd_w, result, sig.weight_set, need_w, metas, by_name
            )
            if grads_out:
                grads_out.update(got)
            else:
                grads_out = got
            record.handoff = NO_HANDOFF  # the later pass ran: free what was kept for it
        if shared is not None and shared.computed and observers:
            for o in observers:
                o("backward_shared", phase, ctx, shared.value)
        return grads_out

    def _auto_split(
        self,
        record: NodeRecord,
        rules: AutogradRules,
        saved: Any,
        grads: tuple[Any, ...],
        plan: PassPlan,
    ) -> Any:
        """The node's automatic-split plan, or None to call the single backward as it is."""
        auto = rules.auto
        if auto is None or (torch.is_grad_enabled() and _graph_task_id() != -1):
            # A create_graph backward (double backward): call the backward as written, so its
            # gradients are differentiable exactly as the user wrote them.
            return None
        split = record.split
        if split is None:
            requires = plan.needed | plan.later_w | plan.later_in
            spec = self.spec

            def make_ctx(needed: frozenset[str]) -> BackwardContext:
                return BackwardContext(spec, "full", needed)

            split = auto.plan(make_ctx, saved, grads, requires)
            record.split = split if split is not None else False
        return split or None

    def backward(self, node: Any, grads: tuple[Any, ...]) -> tuple[Any, ...]:
        """The node's backward: compute what the pass needs, hand over what the route defers."""
        record: NodeRecord = node._cg
        route = None if record.route is None else route_for(record)
        flags = None if route is None else route.needed
        metas = record.metas
        lens = record.lens
        arg_of = self._flat_arg_of if lens is None else self.arg_of(lens)
        req = node.needs_input_grad  # (impl, call, *flat)
        next_fns = None
        captured: frozenset[int] = _NOTHING
        requires_mask = 0
        needed_mask = 0
        needed_items: set[int] | None = None if lens is None else set()
        edge = 0
        j = 2
        for m in metas:
            if m is not None:
                if req[j]:
                    bit = 1 << arg_of[j - 2]
                    requires_mask |= bit
                    need = None if flags is None else flags[edge]
                    if need is None:
                        if next_fns is None:
                            next_fns = node.next_functions
                            # frames above: AutogradImpl.backward, _node_apply
                            captured = self.captures.captured_now(2)
                        need = needed_edge(next_fns[edge][0], captured)
                    if need:
                        needed_mask |= bit
                        if needed_items is not None:
                            needed_items.add(j - 2)
                edge += 1
            j += 1
        plan = self._plans.get((requires_mask, needed_mask))
        if plan is None:
            plan = self.plan(requires_mask, needed_mask)
        target = None if route is None else route.defer
        deferred = plan.later_w if target is not None else frozenset()
        out: list[Any] = [None] * (len(metas) + 2)
        if not plan.needed and not deferred:
            return tuple(out)

        saved = node.saved_tensors if record.kept is _SAVED_TENSORS else _restore(node, record)
        if record.residual_slots is not None and torch.is_grad_enabled():  # create_graph=True
            saved = _guard_residuals(self.spec, saved, grads, record.residual_slots)
        out_lens = record.out_lens
        out_grads = grads if out_lens is None else _regroup(out_lens, grads)
        keep = keeps_for_later(plan, target)
        if not plan.needed:
            result: dict[str, Any] = {}
        elif not SWITCHES.split:
            # Split off: the whole backward, like a plain Function; the pass takes what it needs.
            found = self.compute(record, self.whole(plan), saved, out_grads, keep=False)
            result = {n: g for n, g in found.items() if n in plan.needed}
        else:
            result = self.compute(record, plan, saved, out_grads, keep)
        if deferred and target is not None:
            target.defer(record, _deferred(self, node, record, plan, deferred, saved, out_grads))
        if lens is None:
            index = self.spec.signature.index
            for name, g in result.items():
                out[index[name] + 2] = g
            return tuple(out)
        slots = _slots(self.spec.signature, lens)
        for name, g in result.items():
            start, n = slots[name]
            if n is None:
                out[start + 2] = g
            elif g is not None:  # a list: only the items this pass needs
                for i, gi in enumerate(g):
                    if start + i in needed_items:  # type: ignore[operator]
                        out[start + i + 2] = gi
        return tuple(out)

    def jvp(self, ctx: Any, tangents: tuple[Any, ...]) -> Any:
        record: NodeRecord = ctx._cg
        spec = self.spec
        sig = spec.signature
        rule = spec.rules.jvp
        kept, record.forward_ad = record.forward_ad, None
        if rule is None:
            raise MissingRegistrationError(
                f"{spec.name}: forward-mode AD (torch.func.jvp, jacfwd, dual tensors) reached "
                f"this op, which has no jvp rule. Register one (customgrad never differentiates "
                f"the kernel behind your registered backward):\n\n"
                f"    @{spec.name.split('::')[1]}.register_jvp\n"
                f"    def _(inputs, output, tangents):     # tangents.x is None without one\n"
                f"        return tangents.x * 2              # the output's tangent\n"
            )
        if kept is None:  # pragma: no cover - jvp without forward AD active at forward
            raise UnsupportedError(f"{spec.name}: jvp called without a forward-AD forward.")
        inputs, outputs = kept
        flat = tangents[2:]
        by_arg = flat if record.lens is None else _unflatten_args(sig, record.lens, flat)
        result = rule(inputs, outputs, tuple.__new__(sig.inputs_type, by_arg))
        return _check_tangents(spec, rule, outputs, result, record.out_lens)


def _check_tangents(
    spec: OpSpec, rule: Callable[..., Any], outputs: Any, result: Any, out_lens: Any
) -> Any:
    sig = spec.signature
    outs = outputs if sig.output_is_tuple else (outputs,)
    got = result if sig.output_is_tuple else (result,)
    loc = f"(jvp defined at {where(rule)})"
    if not isinstance(got, (tuple, list)) or len(got) != len(outs):
        raise GradientTypeError(
            f"{spec.name}: jvp returned {describe(result)}; return one tangent per output "
            f"({len(outs)}), shaped like the output. {loc}"
        )
    flat: list[Any] = []
    for i, (o, t) in enumerate(zip(outs, got)):
        pairs = list(zip(o, t)) if isinstance(o, (list, tuple)) else [(o, t)]
        if isinstance(o, (list, tuple)) and (not isinstance(t, (list, tuple)) or len(t) != len(o)):
            raise GradientTypeError(
                f"{spec.name}: jvp returned {describe(t)} as the tangent of output {i}, a list of "
                f"{len(o)} tensors; return a list of the same length. {loc}"
            )
        for oi, ti in pairs:
            if ti is not None and not (
                isinstance(ti, _Tensor)
                and ti.shape == oi.shape
                and ti.dtype == oi.dtype
                and ti.device == oi.device
            ):
                raise GradientValueError(
                    f"{spec.name}: jvp returned {describe(ti)} as the tangent of output {i}, "
                    f"but the output is {describe(oi)}. Return a tangent of the output's shape, "
                    f"dtype and device (or None). {loc}"
                )
            flat.append(ti)
    if sig.plain_output:
        return flat[0]
    return tuple(flat) if (sig.output_is_tuple or out_lens[0] is not None) else flat[0]


# --------------------------------------------------------------------------------------------
# The autograd.Function


class _Call:
    """What one op call passes through ``Function.apply`` (the node's second input)."""

    __slots__ = ("kernel", "lens", "out_lens", "residuals", "saved")

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.lens: tuple[int, ...] | None = None
        self.out_lens: list[int | None] | None = None
        self.saved: Any = None
        self.residuals: tuple[Any, ...] = ()


class _CustomGradNode(torch.autograd.Function):
    """The autograd node of a customgrad op call (ctx is the node); each op subclasses it."""

    # forward and setup_context are each op's AutogradImpl methods (set on the subclass).

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        impl: AutogradImpl = ctx._cg.impl
        return impl.backward(ctx, grads)

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        impl: AutogradImpl = ctx._cg.impl
        return impl.jvp(ctx, tangents)

    @staticmethod
    def vmap(info: Any, in_dims: Any, impl: AutogradImpl, call: _Call, *flat: Any) -> Any:
        raise UnsupportedError(
            f"{impl.spec.name}: torch.vmap over a customgrad op that takes part in autograd is "
            f"not supported (customgrad has no batching rule for your kernel and backward). "
            f"Call the op on the whole batch, or loop over the batch yourself."
        )


def _node_apply(node: Any, *grads: Any) -> Any:
    """What the engine calls to run a customgrad node (``BackwardCFunction.apply``, inlined)."""
    impl: AutogradImpl = node._cg.impl
    return impl.backward(node, grads)


# The engine runs a node by calling its ``apply``; torch's calls ``backward`` through two more
# Python frames. Each op's Function subclass gets its own node class from torch's metaclass;
# AutogradImpl points that class's ``apply`` here.


def _forward_ad_active() -> bool:
    """Whether a jvp may follow this forward: a dual level, or a functorch jvp transform."""
    if _fwad._current_level >= 0:
        return True
    if _functorch_active is None or not _functorch_active():
        return False
    return any(i.key() == _JVP for i in _functorch_interpreters())


def _public_outputs(sig: Signature, out_lens: Any, output: Any) -> Any:
    """The op's outputs from the node's flat outputs."""
    if sig.output_is_tuple:
        return _regroup(out_lens, output if isinstance(output, tuple) else (output,))
    if sig.output_kinds and sig.output_kinds[0] is ArgKind.TENSOR_LIST:
        return list(output)
    return output


def _mark_outputs(ctx: Any, sig: Signature, out_lens: Any, output: Any) -> None:
    diff = sig.output_differentiability
    if diff is None:
        return
    flat_out = output if isinstance(output, tuple) else (output,)
    pos = 0
    marked: list[torch.Tensor] = []
    for d, n in zip(diff, out_lens):
        k = 1 if n is None else n
        if not d:
            marked.extend(t for t in flat_out[pos : pos + k] if isinstance(t, _Tensor))
        pos += k
    if marked:
        ctx.mark_non_differentiable(*marked)


# --------------------------------------------------------------------------------------------
# Saving and restoring what save_for_backward returned


class _Kept(NamedTuple):
    """How a saved pytree is kept: its leaves with the tensors taken out (saved through autograd,
    in ``tensor_idx`` order), and its structure (None for a flat tuple)."""

    leaves: list[Any]
    treespec: Any
    tensor_idx: list[int]


# What ``record.kept`` holds when ``save_for_backward`` returned something simple.
_SAVED_NONE: Any = object()  # None
_SAVED_TENSOR: Any = object()  # one Tensor: saved_tensors[0]
_SAVED_TENSORS: Any = object()  # a tuple of Tensors: saved_tensors
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
    leaves, treespec = optree.tree_flatten(saved, none_is_leaf=True)
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
    """Refuse a saved leaf that hides tensors from autograd (a dataclass or an object with
    Tensor attributes); an object without tensors (a quantization state, a config) is kept."""
    attrs = getattr(leaf, "__dict__", None)
    values: list[Any] = list(attrs.values()) if isinstance(attrs, dict) else []
    for name in getattr(type(leaf), "__slots__", ()):
        values.append(getattr(leaf, name, None))
    is_dataclass = dataclasses.is_dataclass(leaf) and not isinstance(leaf, type)
    if is_dataclass:
        values += [getattr(leaf, f.name, None) for f in dataclasses.fields(leaf)]
    tree: Any = values
    if not any(isinstance(v, _Tensor) for v in optree.tree_leaves(tree, none_is_leaf=True)):
        return
    if is_dataclass:
        what = f"a dataclass ({type(leaf).__qualname__})"
    else:
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
    leaves, treespec, tensor_idx = kept
    if tensor_idx:
        leaves = list(leaves)
        for i, t in zip(tensor_idx, node.saved_tensors):
            leaves[i] = t
    if treespec is None:
        return tuple(leaves)
    return optree.tree_unflatten(treespec, leaves)


# --------------------------------------------------------------------------------------------
# Lists: flattening arguments and outputs


def _flatten_args(sig: Signature, args: tuple[Any, ...]) -> tuple[tuple[int, ...], list[Any]]:
    """List arguments' items inline, with each list's length."""
    lens: list[int] = []
    flat: list[Any] = []
    for spec, a in zip(sig.args, args):
        if spec.kind is ArgKind.TENSOR_LIST:
            items = list(a)
            lens.append(len(items))
            flat.extend(items)
        else:
            flat.append(a)
    return tuple(lens), flat


def _unflatten_args(sig: Signature, lens: tuple[int, ...], flat: Sequence[Any]) -> tuple[Any, ...]:
    out: list[Any] = []
    pos = 0
    it = iter(lens)
    for spec in sig.args:
        if spec.kind is ArgKind.TENSOR_LIST:
            n = next(it)
            out.append(list(flat[pos : pos + n]))
            pos += n
        else:
            out.append(flat[pos])
            pos += 1
    return tuple(out)


def _slots(sig: Signature, lens: tuple[int, ...]) -> dict[str, tuple[int, int | None]]:
    """Map each argument name to (first flat position, list length or None)."""
    slots: dict[str, tuple[int, int | None]] = {}
    pos = 0
    it = iter(lens)
    for spec in sig.args:
        if spec.kind is ArgKind.TENSOR_LIST:
            n = next(it)
            slots[spec.name] = (pos, n)
            pos += n
        else:
            slots[spec.name] = (pos, None)
            pos += 1
    return slots


def _metas_by_name(sig: Signature, record: NodeRecord) -> dict[str, Meta]:
    metas: dict[str, Meta] = {}
    assert record.lens is not None
    m = record.metas
    for name, start, n in record.impl.tensor_slots(record.lens):
        metas[name] = m[start] if n is None else m[start : start + n]
    return metas


def _regroup(out_lens: list[int | None] | None, flat: tuple[Any, ...]) -> tuple[Any, ...]:
    """Group a node's flat outputs (or their gradients) back into the op's outputs."""
    if out_lens is None or all(n is None for n in out_lens):
        return tuple(flat)
    out: list[Any] = []
    pos = 0
    for n in out_lens:
        if n is None:
            out.append(flat[pos])
            pos += 1
        else:
            out.append(list(flat[pos : pos + n]))
            pos += n
    return tuple(out)


# --------------------------------------------------------------------------------------------
# Deferred weight work


class DeferredWork:
    """A customgrad node's deferred weight half, as handed to a route's ``defer`` target.

    :meth:`gradients` computes the weight gradients and returns them with the edges they go
    along, so that a caller can send the work of many nodes through the engine in one call (one
    accumulation per weight, as in a full backward); calling the object does both. Everything
    is worked out then, in W: the input pass only keeps what W will need.

    Attributes:
        record: the node's record.
    """

    __slots__ = ("_grads", "_impl", "_node", "_plan", "_saved", "_weights", "record")

    def __init__(
        self,
        impl: AutogradImpl,
        node: Any,
        record: NodeRecord,
        plan: PassPlan,
        weights: frozenset[str],
        saved: Any,
        grads: tuple[Any, ...],
    ) -> None:
        self._impl = impl
        self._node = node
        self.record = record
        self._plan = plan
        self._weights = weights
        self._saved = saved
        self._grads = grads

    @property
    def device(self) -> torch.device:
        """The device of the node's first tensor input (for stream handling)."""
        return next((m[2] for m in self.record.metas if m is not None), torch.device("cpu"))

    def gradients(self) -> tuple[list[GradientEdge], list[torch.Tensor]]:
        """Compute the weight gradients; return ``(edges, gradients)`` to send through autograd."""
        impl, node, record, plan, weights = (
            self._impl,
            self._node,
            self.record,
            self._plan,
            self._weights,
        )
        sig = impl.spec.signature
        later = impl.plan(*_masks(sig, plan.needed | plan.later_w | plan.later_in, weights))
        if not SWITCHES.split:  # the whole backward again, like a plain Function
            later = impl.whole(later)
        found = impl.compute(record, later, self._saved, self._grads, keep=False)
        slots = _slots(sig, record.lens) if record.lens is not None else None
        edge_of: list[int] = []
        e = 0
        for m in record.metas:
            edge_of.append(e)
            if m is not None:
                e += 1
        req = node.needs_input_grad
        next_fns = node.next_functions
        roots: list[GradientEdge] = []
        values: list[torch.Tensor] = []
        for name in sorted(weights, key=sig.index.__getitem__):
            g = found.get(name)
            if g is None:
                continue
            start, n = (sig.index[name], None) if slots is None else slots[name]
            for i in range(1 if n is None else n):
                j = start + i
                gi = g if n is None else g[i]
                if gi is not None and req[j + 2]:
                    fn, idx = next_fns[edge_of[j]]
                    if fn is not None:
                        roots.append(GradientEdge(fn, idx))
                        values.append(gi)
        return roots, values

    def __call__(self) -> None:
        roots, values = self.gradients()
        if roots:
            torch.autograd.backward(roots, grad_tensors=values)


def _deferred(
    impl: AutogradImpl,
    node: Any,
    record: NodeRecord,
    plan: PassPlan,
    weights: frozenset[str],
    saved: Any,
    grads: tuple[Any, ...],
) -> DeferredWork:
    """The weight half for later: compute it, then send it along the weight edges."""
    return DeferredWork(impl, node, record, plan, weights, saved, grads)


def _masks(sig: Signature, requires: frozenset[str], needed: frozenset[str]) -> tuple[int, int]:
    req = sum(1 << i for i, n in enumerate(sig.names) if n in requires)
    need = sum(1 << i for i, n in enumerate(sig.names) if n in needed)
    return req, need
