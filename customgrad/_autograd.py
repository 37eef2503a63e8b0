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
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn, Protocol

import optree
import torch
from torch.autograd.function import FunctionCtx
from torch.autograd.graph import GradientEdge, Node

from customgrad._calls import CallCounts
from customgrad._codegen import Runner, Runners
from customgrad._errors import MissingRegistrationError, UnsupportedError, where
from customgrad._forward_ad import jvp
from customgrad._handoff import Describe, describer, edge_name, read_values, verify, versions
from customgrad._kernels import Kernel
from customgrad._layout import (
    _flatten_args,
    _public_outputs,
    _regroup,
    _slots,
    _unflatten_args,
)
from customgrad._pass import (
    BackwardContext,
    BackwardObserver,
    PassPlan,
    Phase,
    keeps_for_later,
    pass_plan,
)
from customgrad._record import NodeRecord
from customgrad._releases import refuse_torch_split
from customgrad._routing import current_tag, route_for
from customgrad._rules import AutogradRules, Gradient, OpSpec
from customgrad._runtime import CaptureMemo, needed_edges
from customgrad._saving import _SAVED_TENSORS, _TENSOR_OR_NONE, SaveError, _restore, _save
from customgrad._signature import ArgKind, Signature
from customgrad._switches import STATE as SWITCHES
from customgrad._torch.dispatcher import alias_check
from customgrad._torch.functions import plain_apply, set_backward_apply
from customgrad._torch.transforms import (
    forward_ad_level,
    functorch_active,
    jvp_transform_active,
    unwrap_if_dead,
)
from customgrad._user_calls import _guard_residuals, _residual_slots
from customgrad._user_calls import _raises_if_differentiated as _raises_if_differentiated
from customgrad._user_calls import _requiring_grad as _requiring_grad
from customgrad._validate import TensorMeta

__all__ = [
    "AutogradImpl",
    "BackwardContext",
    "BackwardObserver",
    "DeferredWork",
    "Phase",
    "SaveError",
    "keeps_for_later",
]


_Tensor = torch.Tensor
_functorch_active = functorch_active
_unwrap_if_dead = unwrap_if_dead
_fwd_level = forward_ad_level
_alias_check = alias_check
_EMPTY: dict[str, Any] = {}
_needed_edges = needed_edges
_new_record = object.__new__


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
        self._slots: dict[tuple[int, ...], dict[str, tuple[int, int | None]]] = {}
        self._flat_arg_of = tuple(range(sig.nargs))
        self.captures = CaptureMemo()
        """Which leaves the running ``autograd.grad`` captures (for the engine query)."""
        self.weight_flags: dict[tuple[int, ...] | None, tuple[bool, ...]] = {}
        """Per list lengths: whether each flat input is a weight (``NodeRecord.edge_is_weight``)."""
        self._ready_for: AutogradRules | None = None
        self.runners = Runners(spec, self, self.slots)
        """The runners of this op's plans (:class:`customgrad._codegen.Runners`)."""
        self._flat_rules: AutogradRules | None = None
        self._flat_runners: dict[tuple[int, int], Runner] = {}
        """``runners.table(rules, None)`` for ``_flat_rules`` (the backward reads it first)."""
        self._has_inputs = bool(sig.input_names)
        self._has_weights = bool(sig.weights)
        self.observers: tuple[BackwardObserver, ...] = ()
        self.calls = CallCounts()
        """What each backward call of the op did (counted by the runners, for ``summary()``)."""
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
        set_backward_apply(function, _node_apply)
        self._function_apply: Callable[..., Any] = function.apply
        # What Function.apply ends in when no functorch transform is active.
        self._c_apply: Callable[..., Any] = plain_apply(function)

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

    def apply(
        self, args: tuple[object, ...], kernel: Kernel | None, backward: bool = True
    ) -> object:
        """Run the op under autograd with schema-ordered ``args``; return what the op returns.

        ``kernel`` is the kernel to call directly, or None to call it through the dispatcher.
        ``backward=False``: only forward-mode AD needs the node (nothing requires grad), so
        the backward registrations may be missing.
        """
        spec = self.spec
        if backward and spec.rules is not self._ready_for and not self.ready():
            raise MissingRegistrationError(spec._missing_autograd_message())
        sig = spec.signature
        call = _Call()
        call.kernel = kernel
        flat: Sequence[Any] = args
        if sig.has_lists:
            call.lens, flat = _flatten_args(sig, args)
            call.args = args
        if kernel is not None:
            # Kernels.route sent the call straight to a kernel: plain tensors, no functorch
            # transform active (nothing for Function.apply's functorch handling to do).
            out = self._c_apply(self, call, *flat)
        elif _unwrap_if_dead is None or _functorch_active():
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

    def forward(self, impl: AutogradImpl, call: _Call, *flat: object) -> object:
        """The node's forward (``Function.forward``; ``impl`` is ``self``)."""
        spec = self.spec
        sig = spec.signature
        kernel = call.kernel
        args: Sequence[Any]
        if kernel is not None and sig.simple:
            # the node's inputs are the arguments, its output the kernel's: Kernels.run, then
            # Kernels.checked_output only for what is not a fresh Tensor
            kernels = spec._kernels
            args = flat
            outputs: Any = kernels.run(kernel, flat)
            residuals: tuple[Any, ...] = ()
            if type(outputs) is not _Tensor or _alias_check(flat, _EMPTY, (outputs,)):
                outputs, residuals = kernels.checked_output(flat, outputs)
        else:
            lens = call.lens
            if lens is None:
                args = flat
            elif kernel is not None:  # the node's inputs are the call's tensors: its arguments
                args = call.args
            else:  # under a transform each level's forward sees its own tensors
                args = _unflatten_args(sig, lens, flat)
            outputs, residuals = spec._run_kernel(args, kernel)
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

    def setup_context(self, ctx: FunctionCtx, inputs: tuple[object, ...], output: object) -> None:
        """The node's ``Function.setup_context``: its record, and what it saves."""
        sig = self.spec.signature
        call: _Call = inputs[1]  # type: ignore[assignment]
        flat = inputs[2:]
        metas: list[TensorMeta] = []
        for a in flat:  # a loop, not a comprehension: no frame of its own
            metas.append((a.shape, a.dtype, a.device) if isinstance(a, _Tensor) else None)
        record = _new_record(NodeRecord)  # NodeRecord's attributes, set without a call
        record.impl = self
        record.metas = metas
        record.lens = call.lens
        record.tag = current_tag()
        if not sig.plain_output:
            record.out_lens = call.out_lens
            _mark_outputs(ctx, sig, call.out_lens, output)
        # Under functorch transforms setup_context runs once per transform level, on the
        # same call: ``call.saved`` stays (the call dies with ``apply``).
        saved = call.saved
        if type(saved) is tuple and _TENSOR_OR_NONE.issuperset(map(type, saved)):
            ctx.save_for_backward(*saved)  # _save's commonest case, inline
            record.saved_layout = _SAVED_TENSORS
        else:
            _save(ctx, record, self.spec, saved)
        if call.residuals:
            record.residual_slots = _residual_slots(call.saved, call.residuals, sig.residual_names)
        if _fwd_level() >= 0 or (_functorch_active() and jvp_transform_active()):
            args = flat if call.lens is None else _unflatten_args(sig, call.lens, flat)
            outputs = output if sig.plain_output else _public_outputs(sig, call.out_lens, output)
            record.forward_ad = (tuple.__new__(sig.inputs_type, args), outputs)
        ctx._cg = record  # type: ignore[attr-defined]

    # -- backward ------------------------------------------------------------------------------
    def plan(self, requires_mask: int, needed_mask: int) -> PassPlan:
        """The cached :class:`PassPlan` for argument bit masks (bit ``i``: argument ``i``)."""
        key = (requires_mask, needed_mask)
        plan = self._plans.get(key)
        if plan is None:
            names = self.spec.signature.names
            requires = frozenset(n for i, n in enumerate(names) if requires_mask >> i & 1)
            needed = frozenset(n for i, n in enumerate(names) if needed_mask >> i & 1)
            plan = self._plans[key] = pass_plan(self.spec, requires, needed, key)
        return plan

    def whole(self, plan: PassPlan) -> PassPlan:
        """The plan that computes every gradient ``plan``'s node requires (what a plain
        ``autograd.Function`` computes in each pass: used when the split is switched off)."""
        requires = plan.key[0]
        return self.plan(requires, requires)

    def slots(self, lens: tuple[int, ...]) -> dict[str, tuple[int, int | None]]:
        """For list lengths ``lens``: each argument's first flat position and list length
        (None for a single value), cached (:func:`customgrad._layout._slots`)."""
        found = self._slots.get(lens)
        if found is None:
            found = _slots(self.spec.signature, lens)
            if len(self._slots) < 256:
                self._slots[lens] = found
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

    def split_off(
        self, record: NodeRecord, plan: PassPlan, saved: object, grads: tuple[object, ...]
    ) -> dict[str, Gradient]:
        """The split switched off: the whole backward, like a plain Function; the pass takes
        what it needs."""
        if plan.needed != plan.requires:
            self.calls.add("split off", plan.phase)
        found = self.compute(record, self.whole(plan), saved, grads, keep=False)
        return {n: g for n, g in found.items() if n in plan.needed}

    def listed(
        self,
        lens: tuple[int, ...],
        result: dict[str, Gradient],
        out: list[object],
        needed_items: set[int],
    ) -> tuple[object, ...]:
        """``out`` (the node's backward outputs: the kernel and call, then one per flat input)
        with the gradients of ``result`` placed, list items one by one (only those needed)."""
        slots = self._slots.get(lens) or self.slots(lens)
        for name, g in result.items():
            start, n = slots[name]
            if n is None:
                out[start + 2] = g
            elif g is not None:
                for i, gi in enumerate(g):
                    if start + i in needed_items:
                        out[start + i + 2] = gi
        return tuple(out)

    def compute(
        self,
        record: NodeRecord,
        plan: PassPlan,
        saved: object,
        grads: tuple[object, ...],
        keep: bool,
    ) -> dict[str, Gradient]:
        """Run ``plan``'s runner: the registered backward for the gradients ``plan.needed``,
        validated (:func:`customgrad._codegen.write_runner`).

        ``keep``: a later pass of this node will compute the rest, so keep what the halves
        share (``record.handoff``) for it; else the hand-off is freed.
        """
        lens = record.lens
        run = self.runners.table(self.spec.rules, lens).get(plan.key)
        if run is None:
            run = self.runners.runner(plan, lens)
        return run(record, saved, grads, keep)


# --------------------------------------------------------------------------------------------
# The autograd.Function


class NodeCtx(Protocol):
    """A customgrad node as its backward reads it (torch's ``BackwardCFunction`` of the op's
    Function: ``ctx`` and node in one object)."""

    _cg: NodeRecord
    needs_input_grad: tuple[bool, ...]
    next_functions: tuple[tuple[Node | None, int], ...]
    saved_tensors: tuple[torch.Tensor | None, ...]


class _Call:
    """What one op call passes through ``Function.apply`` (the node's second input). The
    class holds the defaults (no ``__init__``: a call sets only what differs)."""

    kernel: Kernel | None = None
    args: tuple[object, ...] = ()
    """The op's arguments (set for an op with list arguments, whose node inputs are flat)."""
    lens: tuple[int, ...] | None = None
    out_lens: list[int | None] | None = None
    saved: object = None
    residuals: tuple[object, ...] = ()


class _CustomGradNode(torch.autograd.Function):
    """The autograd node of a customgrad op call (ctx is the node); each op subclasses it."""

    # forward and setup_context are each op's AutogradImpl methods (set on the subclass).

    @staticmethod
    def backward(ctx: NodeCtx, *grads: torch.Tensor | None) -> tuple[object, ...]:
        return _node_apply(ctx, *grads)

    @staticmethod
    def jvp(ctx: NodeCtx, *tangents: torch.Tensor | None) -> object:
        return jvp(ctx._cg.impl.spec, ctx, tangents)

    @staticmethod
    def vmap(
        info: object,
        in_dims: tuple[int | None, ...],
        impl: AutogradImpl,
        call: _Call,
        *flat: object,
    ) -> NoReturn:
        raise UnsupportedError(
            f"{impl.spec.name}: torch.vmap over a customgrad op that takes part in autograd is "
            f"not supported (customgrad has no batching rule for your kernel and backward). "
            f"Call the op on the whole batch, or loop over the batch yourself."
        )


def _node_apply(node: NodeCtx, *grads: Any) -> tuple[Any, ...]:
    """The node's backward: compute what the pass needs, hand over what the route defers.

    The engine calls it as the node's ``apply`` (``BackwardCFunction.apply``, whose torch
    version calls ``backward`` through two more Python frames): every backward of every
    customgrad node runs here, planned by a route or not, split on or off.
    """
    record: NodeRecord = node._cg
    self: AutogradImpl = record.impl  # type: ignore[assignment]  # (the record's, always)
    route = None if record.route is None else route_for(record)
    flags = None if route is None else route.needed
    metas = record.metas
    lens = record.lens
    arg_of = self._flat_arg_of if lens is None else self._arg_of.get(lens) or self.arg_of(lens)
    req = node.needs_input_grad  # (impl, call, *flat)
    need = _needed_edges(node, flags, self.captures, 1)  # frames above: _node_apply
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
                if need is None or need[edge]:
                    needed_mask |= bit
                    if needed_items is not None:
                        needed_items.add(j - 2)
            edge += 1
        j += 1
    if route is None and needed_mask != requires_mask:  # a split not customgrad's
        self.calls.other_split += 1
        refuse_torch_split(self.spec.name)
    plan = self._plans.get((requires_mask, needed_mask))
    if plan is None:
        plan = self.plan(requires_mask, needed_mask)
    target = None if route is None else route.defer
    deferred = plan.later_weight if target is not None else frozenset()
    out: list[Any] = [None] * (len(metas) + 2)
    if not plan.needed and not deferred:
        return tuple(out)

    saved = node.saved_tensors if record.saved_layout is _SAVED_TENSORS else _restore(node, record)
    if record.residual_slots is not None and torch.is_grad_enabled():  # create_graph=True
        saved = _guard_residuals(self.spec, saved, grads, record.residual_slots)
    out_lens = record.out_lens
    out_grads = grads if out_lens is None else _regroup(out_lens, grads)
    # only a pass that leaves gradients for later may keep what it computed
    keep = bool(plan.later_weight or plan.later_input) and keeps_for_later(plan, target)
    if not plan.needed:
        result: dict[str, Any] = {}
    elif not SWITCHES.split:
        result = self.split_off(record, plan, saved, out_grads)
    else:
        rules = self.spec.rules
        run = None
        if lens is None and rules is self._flat_rules:
            run = self._flat_runners.get(plan.key)
        if run is None:
            run = self.runners.runner(plan, lens)
            if lens is None:  # the op's runners without list arguments, read at once next time
                self._flat_rules = rules
                self._flat_runners = self.runners.table(rules, None)
        result = run(record, saved, out_grads, keep)
    if deferred and target is not None:
        target.defer(record, DeferredWork(self, node, record, plan, deferred, saved, out_grads))
    if lens is None:
        index = self.spec.signature.index
        for name, g in result.items():
            out[index[name] + 2] = g
        return tuple(out)
    return self.listed(lens, result, out, needed_items)  # type: ignore[arg-type]


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

    __slots__ = ("_grads", "_impl", "_node", "_plan", "_saved", "_versions", "_weights", "record")

    def __init__(
        self,
        impl: AutogradImpl,
        node: NodeCtx,
        record: NodeRecord,
        plan: PassPlan,
        weights: frozenset[str],
        saved: object,
        grads: tuple[object, ...],
    ) -> None:
        self._impl = impl
        self._node = node
        self.record = record
        self._plan = plan
        self._weights = weights
        self._saved = saved
        self._grads = grads
        # what W reads of what I had: torch's saved-tensor rule across the passes (only the
        # versions now; what names them is worked out if one moved)
        self._versions = versions(read_values(grads, saved))

    @property
    def device(self) -> torch.device:
        """The device of the node's first tensor input (for stream handling)."""
        return next((m[2] for m in self.record.metas if m is not None), torch.device("cpu"))

    def owner(self) -> Node:
        """The node whose weight half it is."""
        return self._node  # type: ignore[return-value]

    def gradients(self) -> tuple[list[GradientEdge], list[torch.Tensor]]:
        """Compute the weight gradients; return ``(edges, gradients)`` to send through autograd."""
        impl, node, record, plan, weights = (
            self._impl,
            self._node,
            self.record,
            self._plan,
            self._weights,
        )
        saved, grads = self._saved, self._grads
        verify(record.label, read_values(grads, saved), self._versions, self._describer)
        sig = impl.spec.signature
        later = impl.plan(plan.key[0], _mask(sig, weights))
        if not SWITCHES.split:  # the whole backward again, like a plain Function
            impl.calls.add("split off", later.phase)
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
                if isinstance(gi, _Tensor) and req[j + 2]:  # validated: a tensor or None
                    fn, idx = next_fns[edge_of[j]]
                    if fn is not None:
                        roots.append(GradientEdge(fn, idx))
                        values.append(gi)
        return roots, values

    def _describer(self) -> Describe:
        node, record, saved = self._node, self.record, self._saved
        return describer(self._grads, saved, lambda k: describe_saved(node, record, saved, k))

    def __call__(self) -> None:
        roots, values = self.gradients()
        if roots:
            torch.autograd.backward(roots, grad_tensors=values)


def describe_saved(node: NodeCtx, record: NodeRecord, saved: object, k: int) -> tuple[str, str]:
    """The ``k``-th tensor of ``saved`` (what ``save_for_backward`` returned for ``node``), in
    words, with the argument it is when it is one of the op's inputs."""
    tree: Any = saved
    t = [v for v in optree.tree_leaves(tree, none_is_leaf=True) if isinstance(v, _Tensor)][k]
    names = record.op.signature.names
    arg_of = record.impl.arg_of(record.lens)
    edges = [names[arg_of[i]] for i, m in enumerate(record.metas) if m is not None]
    return (
        f"saved tensor {k}{edge_name(t, node.next_functions, edges)}",
        f"saved by save_for_backward at {where(record.op.rules.save)}",
    )


def _mask(sig: Signature, names: frozenset[str]) -> int:
    """``names`` as an argument bit mask (bit ``i``: argument ``i``)."""
    return sum(1 << i for i, n in enumerate(sig.names) if n in names)
