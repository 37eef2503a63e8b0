"""What one backward call of a customgrad node computes: its pass plan, and the plan's runner.

A :class:`PassPlan` is decided once per (op, arguments that require grad, arguments the pass
needs): the phase, which registered functions run, what is left for a later pass and whether
this pass keeps what the halves share for it. Its runner (:func:`write_runner`) is that plan
executed: a Python function written once per (registrations, plan) with every decision taken,
which calls the registered functions, refuses in-place writes to the gradients and saved values,
validates what they return (:func:`customgrad._validate.check_source`) and keeps or frees the
hand-off. Every backward of a customgrad node runs a runner: the general path
(``AutogradImpl.backward``, deferred weight work) and the fast path (:mod:`customgrad._fastpath`)
alike, so these rules are written here once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import torch

from customgrad._errors import GradientValueError, MissingRegistrationError
from customgrad._handoff import HandOff, handed_over
from customgrad._record import NO_HANDOFF, NodeRecord
from customgrad._rules import AutogradRules, OpSpec
from customgrad._torch.engine import graph_kept, graph_task_id
from customgrad._user_calls import (
    _NO_VERSION,
    _VERSION,
    _call_user,
    _raise_mutation,
    _Watch,
    _watched_values,
)
from customgrad._validate import _MISSING, HALF_NAMES, check_source, collect_grads

__all__ = [
    "BackwardContext",
    "PassPlan",
    "Phase",
    "Runner",
    "Runners",
    "keeps_for_later",
    "pass_plan",
    "write_runner",
]

Phase = Literal["full", "input", "weight"]

Runner = Callable[[NodeRecord, Any, tuple[Any, ...], bool], dict[str, Any]]
"""``run(record, saved, grads, keep) -> {name: gradient}`` for the needed arguments.

``keep``: a later pass of this node will compute the rest, so keep what the halves share
(``record.handoff``) for it; else the hand-off is freed."""

MAX_LAYOUTS = 64
"""Layouts of list lengths an op gets runners written for; calls with others share one set."""

_grad_enabled = torch.is_grad_enabled
_graph_task_id = graph_task_id


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
        self.value: Any = handed_over(record, grads, "shared")
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
                self.record.handoff = HandOff(self.grads, "shared", self.value)
        return self.value


class BackwardContext:
    """What a customgrad backward function is told about the running pass.

    Attributes:
        op: the :class:`~customgrad.CustomOp` whose backward runs.
        phase: ``"input"`` when the pass needs only non-weight arguments' gradients,
            ``"weight"`` when it needs only weights', ``"full"`` otherwise (every argument that
            requires grad is needed, or some of each kind are).
    """

    __slots__ = ("_needed", "_op", "_phase", "_shared")

    def __init__(
        self,
        op: Any,
        phase: Phase,
        needed: frozenset[str],
        shared: _Shared | None = None,
    ) -> None:
        self._op = op
        self._phase: Phase = phase
        self._needed = needed
        self._shared = shared

    # Read-only: a context without shared work is made once per pass plan and reused by every
    # backward call with that plan (:attr:`PassPlan.ctx`).
    @property
    def op(self) -> Any:
        return self._op

    @property
    def phase(self) -> Phase:
        return self._phase

    def needs_input_grad(self, name: str) -> bool:
        """True if argument ``name`` requires grad and the engine will use its gradient now."""
        if name in self._needed:
            return True
        if name not in self._op.signature.index:
            raise GradientValueError(
                f"{self._op.name}: ctx.needs_input_grad({name!r}): no such argument. "
                f"Arguments: {', '.join(self._op.signature.names)}."
            )
        return False

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


def keeps_for_later(plan: PassPlan, target: Any) -> bool:
    """Whether a pass keeps what it computed for the node's later pass: when gradients that
    require grad are left for a later pass and that pass can come (the graph is retained, or a
    route defers the weight half to ``target``). A non-retaining partial pass frees everything
    at once."""
    if target is not None:
        return bool(plan.later_w) and bool(plan.needed)
    return bool(plan.later_w or plan.later_in) and bool(plan.needed) and graph_kept()


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
    splits: bool
    """Whether the pass computes input gradients while weights that require grad are left for
    a later pass (the earlier pass of a split)."""
    ctx: BackwardContext
    """The backward functions' context for this plan when the op registers no shared work
    (a context is read-only then, so every call with this plan shares one)."""
    requires: frozenset[str]
    """Every argument of the node that requires grad (``needed | later_w | later_in``)."""
    key: tuple[int, int]
    """(arguments that require grad, arguments needed) as bit masks (bit ``i``: argument
    ``i``): the plan's key among its op's plans and runners."""


def pass_plan(
    spec: OpSpec, requires: frozenset[str], needed: frozenset[str], key: tuple[int, int]
) -> PassPlan:
    """The plan for a call where ``requires`` require grad and the pass needs ``needed``
    (``key``: the same as argument bit masks)."""
    sig = spec.signature
    need_w = needed & sig.weight_set
    need_in = needed - sig.weight_set
    if needed >= requires or (need_w and need_in):
        phase: Phase = "full"
    else:
        phase = "weight" if need_w else "input"
    later = requires - needed
    later_w = later & sig.weight_set
    splits = bool(later_w) and bool(need_in)
    later_in = later - sig.weight_set
    ctx = BackwardContext(spec, phase, needed)
    return PassPlan(phase, needed, need_in, need_w, later_w, later_in, splits, ctx, requires, key)


def auto_split(
    record: NodeRecord,
    auto: Any,
    make_ctx: Callable[[frozenset[str]], BackwardContext],
    saved: Any,
    grads: Any,
    requires: frozenset[str],
) -> Any:
    """The node's automatic-split plan (``auto``: the op's ``AutoSplitter``), or None to call
    the single backward as it is. ``requires``: the arguments of the node that require grad."""
    if _grad_enabled() and _graph_task_id() != -1:
        # A create_graph backward (double backward): call the backward as written, so its
        # gradients are differentiable exactly as the user wrote them.
        return None
    split = record.split
    layout = _layout_of(grads)
    if split is None or layout != record.split_grads:
        # A node's first backward, or a backward of a retained graph with output gradients of
        # another layout (other strides select another trace).
        split = auto.plan(make_ctx, saved, grads, requires)
        record.split = split if split is not None else False
        record.split_grads = layout
    return split or None


def _layout_of(grads: tuple[Any, ...]) -> Any:
    """What of the output gradients selects a trace besides the saved values: their shapes,
    strides and dtypes (a key that holds no tensor)."""
    if len(grads) == 1:
        (g,) = grads
        if type(g) is torch.Tensor:
            return (g.shape, g.stride(), g.dtype)
    return tuple(
        (g.shape, g.stride(), g.dtype)
        if isinstance(g, torch.Tensor)
        else tuple((t.shape, t.stride(), t.dtype) if isinstance(t, torch.Tensor) else t for t in g)
        if isinstance(g, list)
        else g
        for g in grads
    )


# --------------------------------------------------------------------------------------------
# The runner of a plan


def write_runner(
    spec: OpSpec,
    rules: AutogradRules,
    plan: PassPlan,
    observed: Any,
    slots_of: Callable[[Any], Any],
    lens: tuple[int, ...] | None = None,
) -> Runner:
    """The runner of ``plan`` under ``rules`` (see :data:`Runner`).

    Args:
        spec: the op.
        rules: its registrations (a runner is written for one set; new ones get new runners).
        plan: the pass plan.
        observed: what holds the observers to call after each registered function runs, as
            its ``observers`` attribute (the op's ``AutogradImpl``; read on every call).
        slots_of: list lengths -> the op's slots (``AutogradImpl.slots``; for list arguments).
        lens: for an op with list arguments, the one layout of list lengths the runner is for
            (its items are checked one by one); None: any layout, read from the record.
    """
    sig = spec.signature
    nondiff = rules.nondifferentiable
    phase = plan.phase
    lines: list[str] = ["metas = record.metas"]
    slots = None if lens is None else slots_of(lens)
    if sig.has_lists and slots is None:
        lines.append("slots = _slots_of(record.lens)")
    ns: dict[str, Any] = {
        "_SPEC": spec,
        "_SIG": sig,
        "_CTX": plan.ctx,
        "_PHASE": phase,
        "_NEEDED": plan.needed,
        "_NONDIFF": nondiff,
        "_T": torch.Tensor,
        "_MISSING": _MISSING,
        "_NO_HANDOFF": NO_HANDOFF,
        "_map": map,
        "_getattr": getattr,
        "_VERSION": _VERSION,
        "_NO_VERSION": _NO_VERSION,
        "_watched_values": _watched_values,
        "_raise_mutation": _raise_mutation,
        "_call_user": _call_user,
        "_collect": collect_grads,
        "_OBSERVED": observed,
        "_slots_of": slots_of,
        "_SLOTS": slots,
        "_auto_split": auto_split,
        "_AUTO": rules.auto,
        "_REQUIRES": plan.requires,
        "_make_ctx": functools.partial(BackwardContext, spec, "full"),
        "_handed_over": handed_over,
        "_HandOff": HandOff,
        "_Shared": _Shared,
        "_BackwardContext": BackwardContext,
        "_missing": spec._missing_autograd_message,
        "_Missing": MissingRegistrationError,
    }
    watch = watch_lines()

    def half_lines(
        half: str,
        fn: Callable[..., Any] | None,
        allowed: frozenset[str],
        need: frozenset[str],
        out: str,
        into: str | None = None,
    ) -> list[str]:
        """Call one registered function (refusing in-place writes), its observers, then check
        what it returned."""
        if fn is None:  # registrations without it: the op's own message
            return ["raise _Missing(_missing())"]
        var = f"_FN_{half}"
        ns[var] = fn
        ns[f"_ALLOWED_{out}"] = allowed
        ns[f"_NEEDED_{out}"] = need
        return [
            *call_lines(half, var, half in nondiff),
            *_observe(HALF_NAMES[half], "r"),
            *check_source(sig, half, var, allowed, need, out, slots, into),
        ]

    if rules.backward is not None:
        bwd = rules.backward
        if rules.auto is not None:
            ns["_FN_full"] = bwd
            ns["_ALLOWED_got"] = sig.tensor_set
            ns["_NEEDED_got"] = plan.needed
            # The automatic split: the traced part for this pass, with the hand-off it reads
            # and keeps; the backward as written when the split declines.
            lines += [
                "split = _auto_split(record, _AUTO, _make_ctx, saved, grads, _REQUIRES)",
                "if split is not None:",
                *_indent(
                    [
                        "handoff = record.handoff",
                        "if handoff is not _NO_HANDOFF:",
                        "    handoff = _handed_over(record, grads, 'traced')",
                        "r, kept = split.run(saved, grads, _NEEDED, "
                        "None if handoff is _NO_HANDOFF else handoff, keep)",
                        "record.handoff = _NO_HANDOFF if kept is None else "
                        "_HandOff(grads, 'traced', kept)",
                        "ctx = _CTX",
                        *_observe(f"backward (traced {phase} part)", "r"),
                        *check_source(
                            sig, "full", "_FN_full", sig.tensor_set, plan.needed, "got", slots
                        ),
                        "return got",
                    ]
                ),
            ]
            if plan.needed != plan.requires:
                lines += _run_once_lines(spec, sig, plan, ns, watch, slots, "full" in nondiff)
        lines += ["ctx = _CTX", *watch]
        lines += half_lines("full", bwd, sig.tensor_set, plan.needed, "got")
        lines.append("return got")
    else:
        lines += watch
        shared = rules.backward_shared is not None
        if shared:
            keep_now = bool(plan.need_in) and not plan.need_w
            lines += [
                f"shared = _Shared(record, saved, grads, (values, before, len(grads)), "
                f"keep and {keep_now})",
                "ctx = _BackwardContext(_SPEC, _PHASE, _NEEDED, shared)",
            ]
        else:
            lines.append("ctx = _CTX")
        lines.append("got = {}")
        if plan.need_in:
            lines += half_lines(
                "input", rules.backward_input, sig.input_set, plan.need_in, "got_in", "got"
            )
        if plan.need_w:
            lines += half_lines(
                "weight", rules.backward_weight, sig.weight_set, plan.need_w, "got_w", "got"
            )
            # the later pass ran: free what was kept for it
            lines += ["if record.handoff is not _NO_HANDOFF:", "    record.handoff = _NO_HANDOFF"]
        if shared:
            lines += ["if shared.computed:", *_indent(_observe("backward_shared", "shared.value"))]
        lines.append("return got")
    source = "def run(record, saved, grads, keep):\n" + "".join(f"    {x}\n" for x in lines)
    where = f"{spec.name}: {phase} {sorted(plan.needed)}" + (
        f", list lengths {lens}" if lens else ""
    )
    exec(compile(source, f"<customgrad pass of {where}>", "exec"), ns)
    run: Runner = ns["run"]
    run.__customgrad_source__ = source  # type: ignore[attr-defined]
    return run


class Runners:
    """The runners of one op's plans: per set of registrations, per layout of list lengths
    (up to :data:`MAX_LAYOUTS`, then one shared set that reads the layout from the node), per
    plan key; each written on first use.

    Args:
        spec: the op.
        observed: what holds the observers (see :func:`write_runner`).
        slots_of: list lengths -> the op's slots.
    """

    def __init__(self, spec: OpSpec, observed: Any, slots_of: Callable[[Any], Any]) -> None:
        self._spec = spec
        self._observed = observed
        self._slots_of = slots_of
        self._tables: dict[tuple[int, ...] | None, dict[tuple[int, int], Runner]] = {}
        self._rules: AutogradRules | None = None

    def table(
        self, rules: AutogradRules, lens: tuple[int, ...] | None
    ) -> dict[tuple[int, int], Runner]:
        """The runners written for ``rules`` and the layout ``lens``, by plan key (a new set of
        registrations starts new tables)."""
        if rules is not self._rules:
            self._tables = {}
            self._rules = rules
        table = self._tables.get(lens)
        if table is None:
            if len(self._tables) >= MAX_LAYOUTS:
                lens = None
            table = self._tables.setdefault(lens, {})
        return table

    def runner(self, plan: PassPlan, lens: tuple[int, ...] | None) -> Runner:
        """``plan``'s runner under the op's current registrations for the layout ``lens``."""
        rules = self._spec.rules
        table = self.table(rules, lens)
        run = table.get(plan.key)
        if run is None:
            layout = lens if self._tables.get(lens) is table else None
            run = table[plan.key] = write_runner(
                self._spec, rules, plan, self._observed, self._slots_of, layout
            )
        return run

    def layouts(self) -> list[tuple[int, ...] | None]:
        """The layouts that have their own runners (None: the shared set)."""
        return list(self._tables)

    def forget(self) -> None:
        """Write every runner again on next use (the tables the fast path holds included)."""
        for table in self._tables.values():
            table.clear()


def _run_once_lines(
    spec: OpSpec,
    sig: Any,
    plan: PassPlan,
    ns: dict[str, Any],
    watch: list[str],
    slots: Any,
    nondifferentiable: bool,
) -> list[str]:
    """Lines of a partial pass of a single backward that is not split (the run-once rule): the
    first pass that needs any gradient calls it once for every argument that requires grad and
    hands the gradients it does not need to the node's later pass, which takes them instead of
    calling it again. (Only ``split="phase"`` calls a backward once per pass.)"""
    ns["_WHOLE_CTX"] = BackwardContext(spec, "full", plan.requires)
    ns["_ALLOWED_every"] = sig.tensor_set
    ns["_NEEDED_every"] = plan.requires
    return [
        "if record.handoff is not _NO_HANDOFF:",
        "    early = _handed_over(record, grads, 'gradients')",
        "    if early is not _NO_HANDOFF:",
        "        got = {n: early.pop(n) for n in _NEEDED if n in early}",
        "        if not early:",
        "            record.handoff = _NO_HANDOFF",
        "        return got",
        "if keep:",
        *_indent(
            [
                "ctx = _WHOLE_CTX",
                *watch,
                *call_lines("full", "_FN_full", nondifferentiable),
                *_observe(HALF_NAMES["full"], "r"),
                *check_source(
                    sig, "full", "_FN_full", sig.tensor_set, plan.requires, "every", slots
                ),
                "got = {n: every.pop(n) for n in _NEEDED if n in every}",
                "record.handoff = _HandOff(grads, 'gradients', every)",
                "_AUTO.held(every)",
                "return got",
            ]
        ),
    ]


def watch_lines() -> list[str]:
    """Lines that read the version counters of the output gradients and the saved values before
    the registered functions run (``values``, ``before``)."""
    return [
        "values = (*grads, *saved) if type(saved) is tuple else _watched_values(saved, grads)",
        "before = [*_map(_getattr, values, _VERSION, _NO_VERSION)]",
    ]


def call_lines(half: str, fn: str, nondifferentiable: bool) -> list[str]:
    """Lines that call the registered function named ``fn`` (into ``r``) and refuse an in-place
    write to what :func:`watch_lines` watched; a ``differentiable=False`` one runs without grad
    (:func:`customgrad._user_calls._call_user`)."""
    if nondifferentiable:
        return [
            f"r = _call_user(ctx, {half!r}, {fn}, saved, grads, (values, before, len(grads)), "
            f"_NONDIFF)"
        ]
    return [
        f"r = {fn}(ctx, saved, *grads)",
        "if [*_map(_getattr, values, _VERSION, _NO_VERSION)] != before:",
        f"    _raise_mutation(_SPEC, {half!r}, {fn}, values, before, len(grads))",
    ]


def _observe(label: str, value: str) -> list[str]:
    """Lines that call the observers (read on each call) after a registered function ran."""
    return ["for o in _OBSERVED.observers:", f"    o({label!r}, _PHASE, ctx, {value})"]


def _indent(lines: list[str]) -> list[str]:
    return ["    " + x for x in lines]
