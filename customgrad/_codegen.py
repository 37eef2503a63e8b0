"""The code customgrad writes (the one module that writes code), and the one door it runs through.

Two things are written, both from the op's pass plans and run through :func:`run_source`, which
prints them first under ``CUSTOMGRAD_FASTPATH=show``:

- a pass plan's runner (:func:`write_runner`), written once per (registrations, plan, layout of
  list lengths) with every decision taken: which registered functions it calls, the
  version-counter check that refuses in-place writes (:func:`watch_lines`, :func:`call_lines`),
  the validation of what they return (:func:`check_source`, whose complete, interpreted twin is
  :func:`customgrad._validate.collect_grads`: a property test runs both on the same results),
  the run-once rule and the hand-off;
- the op's call and autograd node for one signature (:func:`write_call`: the fast path), the
  argument handling of ``CustomOp.__call__`` and ``AutogradImpl`` unrolled. The generated code stays where ``benchmarks/overhead.py`` shows it
buys at least 10% per call (fast path on against off: docs/concepts/performance.md).
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from customgrad import _kernels
from customgrad._calls import CallCounts, slot
from customgrad._errors import MissingRegistrationError
from customgrad._handoff import hand_over, handed_over, release
from customgrad._pass import (
    BackwardContext,
    PassPlan,
    _Shared,
    auto_split,
    keeps_for_later,
)
from customgrad._record import NO_HANDOFF, NodeRecord
from customgrad._releases import refuse_torch_split
from customgrad._routing import current_tag
from customgrad._rules import AutogradRules, OpSpec
from customgrad._saving import _SAVED_TENSORS, _TENSOR_OR_NONE, _restore, _save
from customgrad._signature import ArgKind, Signature
from customgrad._switches import STATE as SWITCHES
from customgrad._torch import dispatcher, functions
from customgrad._torch.transforms import forward_ad_level
from customgrad._triton import raise_if_raw_launch
from customgrad._user_calls import (
    _NO_VERSION,
    _VERSION,
    _call_user,
    _raise_mutation,
    _watched_values,
)
from customgrad._validate import _MISSING, HALF_NAMES, TensorMeta, collect_grads

if TYPE_CHECKING:
    from customgrad._autograd import AutogradImpl
    from customgrad._kernels import Kernels

__all__ = [
    "DECLINED",
    "MAX_LAYOUTS",
    "Runner",
    "Runners",
    "call_lines",
    "check_source",
    "run_source",
    "watch_lines",
    "eligible",
    "write_call",
    "write_kernel_run",
    "write_check",
    "write_runner",
]

_Tensor = torch.Tensor


def run_source(source: str, filename: str, ns: dict[str, Any]) -> None:
    """Run generated ``source`` in ``ns``; with ``CUSTOMGRAD_FASTPATH=show``, print it first."""
    if SWITCHES.show_fastpath:
        print(f"# {filename}\n{source}", file=sys.stderr)
    exec(compile(source, filename, "exec"), ns)


class Observed(Protocol):
    """What holds the observers a runner calls after each registered function runs (the op's
    ``AutogradImpl``; read on every call, so observers added later are called)."""

    observers: tuple[Callable[..., None], ...]
    calls: CallCounts


SlotsOf = Callable[[tuple[int, ...]], dict[str, tuple[int, int | None]]]
"""List lengths -> each argument's first flat position and list length (``AutogradImpl.slots``)."""

Runner = Callable[[NodeRecord, Any, tuple[Any, ...], bool], dict[str, Any]]
"""``run(record, saved, grads, keep) -> {name: gradient}`` for the needed arguments.

``keep``: a later pass of this node will compute the rest, so keep what the halves share
(``record.handoff``) for it; else the hand-off is freed."""


MAX_LAYOUTS = 64
"""Layouts of list lengths an op gets runners written for; calls with others share one set."""


def write_runner(
    spec: OpSpec,
    rules: AutogradRules,
    plan: PassPlan,
    observed: Observed,
    slots_of: SlotsOf,
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
        "_raise_if_raw_launch": raise_if_raw_launch,
        "_collect": collect_grads,
        "_OBSERVED": observed,
        "_slots_of": slots_of,
        "_SLOTS": slots,
        "_auto_split": auto_split,
        "_AUTO": rules.auto,
        "_REQUIRES": plan.requires,
        "_make_ctx": functools.partial(BackwardContext, spec, "full"),
        "_handed_over": handed_over,
        "_hand_over": hand_over,
        "_release": release,
        "_Shared": _Shared,
        "_BackwardContext": BackwardContext,
        "_missing": spec._missing_autograd_message,
        "_Missing": MissingRegistrationError,
        "_CALLS": observed.calls.counts,
    }
    watch = watch_lines()
    partial = plan.needed != plan.requires

    def count(kind: str) -> str:
        """The line that counts this call for ``summary()`` (:mod:`customgrad._calls`)."""
        return f"_CALLS[{slot(kind, phase)}] += 1"

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
                        "if handoff is not None:",
                        "    handoff = _handed_over(record, grads, 'kept')",
                        "r, kept = split.run(saved, grads, _NEEDED, "
                        "None if handoff is _NO_HANDOFF else handoff, keep)",
                        "if kept is None:",
                        "    _release(record, grads)",
                        "else:",
                        "    _hand_over(record, grads, 'kept', kept)",
                        "ctx = _CTX",
                        *_observe(f"backward (traced {phase} part)", "r"),
                        *check_source(
                            sig, "full", "_FN_full", sig.tensor_set, plan.needed, "got", slots
                        ),
                        count("split" if partial else "whole"),
                        "return got",
                    ]
                ),
            ]
            if partial:
                lines += _run_once_lines(
                    spec, sig, plan, ns, watch, slots, "full" in nondiff, count
                )
        lines += ["ctx = _CTX", *watch]
        lines += half_lines("full", bwd, sig.tensor_set, plan.needed, "got")
        lines += [count("per pass" if partial and rules.auto is None else "whole"), "return got"]
    else:
        lines += watch
        shared = rules.backward_shared is not None
        if shared:
            keep_now = bool(plan.need_input) and not plan.need_weight
            lines += [
                f"shared = _Shared(record, saved, grads, (values, before, len(grads)), "
                f"keep and {keep_now})",
                "ctx = _BackwardContext(_SPEC, _PHASE, _NEEDED, shared)",
            ]
        else:
            lines.append("ctx = _CTX")
        lines.append("got = {}")
        if plan.need_input:
            lines += half_lines(
                "input", rules.backward_input, sig.input_set, plan.need_input, "got_in", "got"
            )
        if plan.need_weight:
            lines += half_lines(
                "weight", rules.backward_weight, sig.weight_set, plan.need_weight, "got_w", "got"
            )
            # the later pass ran: free what was kept for it
            lines += ["if record.handoff is not None:", "    _release(record, grads)"]
        if shared:
            lines += ["if shared.computed:", *_indent(_observe("backward_shared", "shared.value"))]
        lines += [count("split" if partial else "whole"), "return got"]
    source = "def run(record, saved, grads, keep):\n" + "".join(f"    {x}\n" for x in lines)
    where = f"{spec.name}: {phase} {sorted(plan.needed)}" + (
        f", list lengths {lens}" if lens else ""
    )
    run_source(source, f"<customgrad pass of {where}>", ns)
    run: Runner = ns["run"]
    run.__customgrad_source__ = source  # type: ignore[attr-defined]
    return run


def _run_once_lines(
    spec: OpSpec,
    sig: Any,
    plan: PassPlan,
    ns: dict[str, Any],
    watch: list[str],
    slots: Any,
    nondifferentiable: bool,
    count: Callable[[str], str],
) -> list[str]:
    """Lines of a partial pass of a single backward that is not split (the run-once rule): the
    first pass that needs any gradient calls it once for every argument that requires grad and
    hands the gradients it does not need to the node's later pass, which takes them instead of
    calling it again. (Only ``split="phase"`` calls a backward once per pass.)"""
    ns["_WHOLE_CTX"] = BackwardContext(spec, "full", plan.requires)
    ns["_ALLOWED_every"] = sig.tensor_set
    ns["_NEEDED_every"] = plan.requires
    return [
        "if record.handoff is not None:",
        "    handed = _handed_over(record, grads, 'gradients')",
        "    if handed is not _NO_HANDOFF:",
        "        got = {n: handed.pop(n) for n in _NEEDED if n in handed}",
        "        if not handed:",
        "            _release(record, grads)",
        f"        {count('handed')}",
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
                "_hand_over(record, grads, 'gradients', every)",
                "_AUTO.held(every)",
                count("ran once"),
                "return got",
            ]
        ),
    ]


class Runners:
    """The runners of one op's plans: per set of registrations, per layout of list lengths
    (up to :data:`MAX_LAYOUTS`, then one shared set that reads the layout from the node), per
    plan key; each written on first use.

    Args:
        spec: the op.
        observed: what holds the observers (see :func:`write_runner`).
        slots_of: list lengths -> the op's slots.
    """

    def __init__(self, spec: OpSpec, observed: Observed, slots_of: SlotsOf) -> None:
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
        "try:",
        f"    r = {fn}(ctx, saved, *grads)",
        "except Exception as e:  # a raw Triton launch on fake tensors (torch.compile)?",
        f"    _raise_if_raw_launch(e, _SPEC.name, {HALF_NAMES[half]!r}, {fn})",
        "    raise",
        "if [*_map(_getattr, values, _VERSION, _NO_VERSION)] != before:",
        f"    _raise_mutation(_SPEC, {half!r}, {fn}, values, before, len(grads))",
    ]


def _observe(label: str, value: str) -> list[str]:
    """Lines that call the observers (read on each call) after a registered function ran."""
    return ["for o in _OBSERVED.observers:", f"    o({label!r}, _PHASE, ctx, {value})"]


def _indent(lines: list[str]) -> list[str]:
    return ["    " + x for x in lines]


def check_source(
    sig: Signature,
    half: str,
    fn: str,
    allowed: frozenset[str],
    needed: frozenset[str],
    out: str,
    slots: Mapping[str, tuple[int, int | None]] | None = None,
    into: str | None = None,
) -> list[str]:
    """Python lines that validate ``r``, what the registered function named ``fn`` returned, and
    set ``out`` to the needed gradients by name (or, with ``into``, add them to the dict named
    ``into``): the validation of one pass written out for one (signature, half, needed
    arguments, layout of list lengths).

    The lines read ``r`` and ``metas`` (the node record's flat metas), and the names ``_T``
    (``torch.Tensor``), ``_MISSING``, ``_SIG`` (``sig``), ``_collect`` (:func:`collect_grads`),
    ``_ALLOWED_<out>`` and ``_NEEDED_<out>`` (``allowed`` and ``needed``). For an op with list
    arguments, ``slots`` (:func:`customgrad._layout._slots` of one layout, bound as ``_SLOTS``)
    places every item, one check each; without it the lines read the call's layout from a
    variable ``slots`` and loop over the items. A plain dict of valid gradients is accepted
    inline; anything else goes to :func:`collect_grads`, which accepts exactly the same results
    (and casts an autocast gradient) and raises the errors.
    """
    lists = sig.has_lists

    def tensor_ok(g: str, m: str, indent: str) -> list[str]:
        return [
            f"{indent}m = metas[{m}]",
            f"{indent}ok = (type({g}) is _T and m is not None and {g}.shape == m[0]",
            f"{indent}      and {g}.dtype is m[1] and {g}.device == m[2])",
        ]

    lines = [f"ok = type(r) is dict and r.keys() <= _ALLOWED_{out}"]
    for name in sig.names:
        if name not in allowed:
            continue
        i = sig.index[name]
        g = f"g_{i}"
        lines += ["if ok:", f"    {g} = r.get({name!r}, _MISSING)", f"    if {g} is _MISSING:"]
        lines.append("        ok = False" if name in needed else f"        {g} = None")
        lines.append(f"    elif {g} is not None:")
        if sig.kinds[i] is ArgKind.TENSOR_LIST and slots is not None:
            start, n = slots[name]
            lines.append(
                f"        ok = (type({g}) is list or type({g}) is tuple) and len({g}) == {n}"
            )
            for k in range(n or 0):
                lines += [
                    "        if ok:",
                    f"            gi = {g}[{k}]",
                    "            if gi is not None:",
                    *tensor_ok("gi", str(start + k), "                "),
                ]
        elif sig.kinds[i] is ArgKind.TENSOR_LIST:
            lines += [
                f"        start, n = slots[{name!r}]",
                f"        ok = (type({g}) is list or type({g}) is tuple) and len({g}) == n",
                "        if ok:",
                f"            for gi, m in zip({g}, metas[start : start + n]):",
                "                if gi is not None and not (type(gi) is _T and m is not None",
                "                        and gi.shape == m[0] and gi.dtype is m[1] and gi.device == m[2]):",
                "                    ok = False",
                "                    break",
            ]
        elif not lists:
            lines += tensor_ok(g, str(i), "        ")
        elif slots is not None:
            lines += tensor_ok(g, str(slots[name][0]), "        ")
        else:
            lines += tensor_ok(g, f"slots[{name!r}][0]", "        ")
    kept = [n for n in sig.names if n in needed and n in allowed]
    layout = "None" if not lists else "slots" if slots is None else "_SLOTS"
    full = f"_collect(_SIG, {half!r}, {fn}, r, _ALLOWED_{out}, _NEEDED_{out}, metas, {layout})"
    if into is None:
        items = ", ".join(f"{n!r}: g_{sig.index[n]}" for n in kept)
        return [*lines, "if ok:", f"    {out} = {{{items}}}", "else:", f"    {out} = {full}"]
    stores = [f"    {into}[{n!r}] = g_{sig.index[n]}" for n in kept] or ["    pass"]
    return [*lines, "if ok:", *stores, "else:", f"    {into}.update({full})"]


def write_check(
    sig: Signature,
    half: str,
    allowed: frozenset[str],
    needed: frozenset[str],
    slots: Mapping[str, tuple[int, int | None]] | None = None,
    into: bool = False,
) -> Callable[[Callable[..., Any], object, Sequence[TensorMeta], Any], dict[str, Any]]:
    """:func:`check_source` as a function ``check(fn, r, metas, slots) -> gradients`` (what a
    pass's runner runs inline; for tests). ``slots``: write it for that one layout; ``into``:
    the lines that add the gradients to a dict."""
    lines = check_source(sig, half, "fn", allowed, needed, "got", slots, "got" if into else None)
    if into:
        lines = ["got = {}", *lines]
    source = "def check(fn, r, metas, slots):\n" + "".join(f"    {line}\n" for line in lines)
    source += "    return got\n"
    ns: dict[str, Any] = {
        "_T": _Tensor,
        "_MISSING": _MISSING,
        "_SIG": sig,
        "_SLOTS": slots,
        "_collect": collect_grads,
        "_ALLOWED_got": allowed,
        "_NEEDED_got": needed,
    }
    run_source(source, f"<customgrad check of {sig.qualname}>", ns)
    check: Callable[[Callable[..., Any], object, Sequence[TensorMeta], Any], dict[str, Any]]
    check = ns["check"]
    return check


# --------------------------------------------------------------------------------------------
# The op's call and autograd node, written per signature (the fast path)
#
# Why: a customgrad op does more per call than a plain ``torch.autograd.Function`` (checks the
# arguments, picks the kernel, keeps a record for the split backward, asks the engine which
# gradients the pass needs, validates every gradient). Written generically, with loops over the
# arguments and the registrations looked up on every call, that costs about 1.4x a Function on a
# small op (``benchmarks/overhead.py``). :func:`write_call` writes, for one op, its call and the
# node's forward, ``setup_context`` and backward with the argument loops unrolled and every
# constant bound (as ``dataclasses`` and ``torch.fx`` do): the same decisions with a fraction of
# the interpreter work.
#
# What it covers: ops without keyword-only arguments, mutated arguments, residuals, shared
# backward work or lists of ``Optional[Tensor]``, with one differentiable Tensor output, whose
# autograd is the input/weight pair or a single backward; ``list[Tensor]`` arguments get one
# written call per layout of list lengths, written on first use (at most ``MAX_LAYOUTS``).
# Calls must have plain tensors, no forward-AD level or ``torch.compile`` trace, and be ones
# that :meth:`customgrad._kernels.Kernels.route` (the op's one dispatch decision,
# which the general call asks too) sends straight to a kernel; one that records nothing (no grad
# mode, nothing requiring grad) runs the kernel there and then. Any other call declines (returns
# :data:`DECLINED`) and runs ``CustomOp.__call__``, which ends in ``CustomOp.run_call``.
# Backwards that a split plans (a route on the record), changed registrations and a switched-off
# split go to ``AutogradImpl.backward``. ``CUSTOMGRAD_FASTPATH=0`` turns the written call off (a
# debugging switch); ``CUSTOMGRAD_FASTPATH=show`` prints each piece of code written (to stderr);
# ``call.__customgrad_source__`` holds it too.
#
# What is written is argument handling only (unpacking, the per-argument checks of the call, the
# edge loop and the placement of gradients, the version check around the kernel). Which edges a
# pass needs (``needed_edge``), the pass plan (``AutogradImpl.plan``), the plan's runner above,
# the saved-value layout (``_save`` / ``_restore``) and the observers are the general path's
# own, called from here. ``tests/test_fastpath.py`` checks that both give the same gradients and
# errors.

DECLINED: Any = object()
"""What a fast call returns when the general path must run the call."""

_EMPTY: dict[str, Any] = {}
_alias_check = dispatcher.alias_check


def _trailing_defaults(pysig: inspect.Signature, nargs: int) -> tuple[Any, ...]:
    """The defaults of the last positional parameters (all parameters are positional here)."""
    params = list(pysig.parameters.values())
    if len(params) != nargs or any(
        p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params
    ):
        return ()
    defaults: list[Any] = []
    for p in reversed(params):
        if p.default is p.empty:
            break
        defaults.append(p.default)
    return tuple(reversed(defaults))


def _kernel_picker(kinds: tuple[ArgKind, ...]) -> int | None:
    """The argument whose (first) tensor picks the kernel, as in the general path: the first
    Tensor or list argument, when that is not an Optional one."""
    for i, kind in enumerate(kinds):
        if kind is not ArgKind.OTHER:
            return i if kind in (ArgKind.TENSOR, ArgKind.TENSOR_LIST) else None
    return None


def eligible(impl: AutogradImpl, rules: AutogradRules, mutates: bool) -> bool:
    """Whether the fast path can serve this op with these registrations."""
    sig = impl.spec.signature
    if (
        mutates
        or sig.kwonly_names
        or sig.residual_names
        or not sig.plain_output
        or _kernel_picker(sig.kinds) is None
        or any(  # lists of Optional[Tensor]: items without edges
            a.kind is ArgKind.TENSOR_LIST and "?" in a.type_str for a in sig.args
        )
    ):
        return False
    params = list(sig.pysig.parameters)
    if params != list(sig.names):  # positional arguments must mean the schema's arguments
        return False
    if rules.backward_shared is not None or rules.nondifferentiable:
        return False
    return impl.ready()


def write_call(impl: AutogradImpl, kernels: Kernels) -> Callable[[tuple[Any, ...]], Any] | None:
    """The fast call of ``impl``'s op for its current registrations and kernels, or None.

    Args:
        impl: the op's autograd implementation (``impl.spec`` is the op).
        kernels: the op's kernels: which one runs is :meth:`Kernels.route`'s decision, made on
            each call (a call it does not send straight to a kernel declines); what a kernel
            returns is checked by :meth:`Kernels.checked_output`.

    Returns:
        ``call(args) -> output or DECLINED``, for schema-ordered positional ``args``; None when
        this op has no fast path (not :func:`eligible`, or a torch that keeps no
        ``torch.library`` registrations, where every call goes through the dispatcher).
    """
    if _kernels.IMPLS is None or not eligible(impl, impl.spec.rules, kernels.mutates):
        return None
    sig = impl.spec.signature
    lists = [i for i, k in enumerate(sig.kinds) if k is ArgKind.TENSOR_LIST]
    defaults = _trailing_defaults(sig.pysig, sig.nargs)
    n_min = sig.nargs - len(defaults)
    if defaults:
        count = (
            f"    n = len(args)\n"
            f"    if n != {sig.nargs}:\n"
            f"        if n < {n_min} or n > {sig.nargs}:\n"
            f"            return _DECLINED\n"
            f"        args += _DEFAULTS[n - {n_min}:]\n"
        )
    else:
        count = f"    if len(args) != {sig.nargs}:\n        return _DECLINED\n"
    if not lists:
        return _Writer(impl, kernels, (), count).write()

    # List arguments: one fast path per list-length layout, written on first use.
    layouts: dict[tuple[int, ...], Callable[[tuple[Any, ...]], Any]] = {}

    def layout(lens: tuple[int, ...]) -> Callable[[tuple[Any, ...]], Any]:
        if len(layouts) >= MAX_LAYOUTS:
            return _decline
        call = _Writer(impl, kernels, lens, "").write()
        layouts[lens] = call
        return call

    lengths = ", ".join(
        f"len(args[{i}]) if type(args[{i}]) is list or type(args[{i}]) is tuple else -1"
        for i in lists
    )
    source = (
        f"def call(args):\n"
        f"{count}"
        f"    lens = ({lengths},)\n"
        f"    return (_LAYOUTS.get(lens) or _layout(lens))(args)\n"
    )
    ns: dict[str, Any] = {
        "_grad_enabled": torch.is_grad_enabled,
        "_DECLINED": DECLINED,
        "_DEFAULTS": defaults,
        "_LAYOUTS": layouts,
        "_layout": layout,
    }
    run_source(source, f"<customgrad fast path of {impl.spec.name}>", ns)
    dispatch: Callable[[tuple[Any, ...]], Any] = ns["call"]
    dispatch.__customgrad_source__ = source  # type: ignore[attr-defined]
    return dispatch


def _runtime() -> dict[str, Any]:
    """What every written call reads that is the same for every op (each gets its own copy)."""
    from customgrad._autograd import needed_edge  # _autograd imports this module

    return {**_RUNTIME, "_needed": needed_edge}


_RUNTIME: dict[str, Any] = {
    "_T": torch.Tensor,
    "_P": torch.nn.Parameter,
    "_DECLINED": DECLINED,
    "_DISPATCH": _kernels.DISPATCH,
    "_EMPTY": _EMPTY,
    "_grad_enabled": torch.is_grad_enabled,
    "_fwd_level": forward_ad_level,
    "_compiling": torch.compiler.is_compiling,
    "_alias": _alias_check,
    "_Record": NodeRecord,
    "_tag": current_tag,
    "_keep": _save,
    "_restore": _restore,
    "_SAVED_TENSORS": _SAVED_TENSORS,
    "_TENSOR_OR_NONE": _TENSOR_OR_NONE,
    "_SWITCHES": SWITCHES,
    "_keeps_for_later": keeps_for_later,
}
"""What every fast path reads that is the same for every op (each gets its own copy)."""


def _decline(args: tuple[Any, ...]) -> Any:
    return DECLINED


class _Writer:
    """Writes the fast path of one op for one layout of its list arguments' lengths.

    Each Tensor argument is one *slot* (a flat input of the autograd node, named ``aI``); a
    ``list[Tensor]`` argument of length ``n`` is ``n`` slots (``aI_0``...); other arguments are
    passed through. The written code has one statement per slot where the general path loops.
    """

    def __init__(
        self,
        impl: AutogradImpl,
        kernels: Kernels,
        lens: tuple[int, ...],
        count: str,
    ) -> None:
        self.impl = impl
        self.kernels = kernels
        self.lens = lens
        self.count = count
        sig = impl.spec.signature
        self.sig = sig
        self.rules = impl.spec.rules
        it = iter(lens)
        # per argument: its name and its slots (None for a non-tensor argument)
        self.args: list[tuple[int, str, ArgKind, list[str] | None]] = []
        self.slots: list[tuple[int, str, ArgKind]] = []  # (argument, slot name, argument kind)
        for i, kind in enumerate(sig.kinds):
            if kind is ArgKind.TENSOR_LIST:
                names = [f"a{i}_{k}" for k in range(next(it))]
            elif kind is ArgKind.OTHER:
                names = None
            else:
                names = [f"a{i}"]
            self.args.append((i, f"a{i}", kind, names))
            for n in names or ():
                self.slots.append((i, n, kind))

    def _regrouped(self) -> str:
        """The op's arguments, as a tuple expression of the slot names."""
        parts = []
        for _, name, kind, names in self.args:
            parts.append(f"[{', '.join(names or ())}]" if kind is ArgKind.TENSOR_LIST else name)
        return f"({', '.join(parts)},)"

    def write(self) -> Callable[[tuple[Any, ...]], Any]:
        sig = self.sig
        arglist = ", ".join(name for _, name, _, _ in self.args)

        # -- the call --------------------------------------------------------------------------
        unpack: list[str] = []
        checks: list[str] = []
        requires: list[str] = []

        def plain(n: str) -> str:
            return f"(type({n}) is _T or type({n}) is _P)"

        for _, name, kind, names in self.args:
            if kind is ArgKind.TENSOR_LIST:
                assert names is not None
                n = len(names)
                unpack.append(
                    f"    if (type({name}) is not list and type({name}) is not tuple)"
                    f" or len({name}) != {n}:\n        return _DECLINED\n"
                )
                if names:
                    unpack.append(f"    {', '.join(names)}, = {name}\n")
                checks += [f"not {plain(x)}" for x in names]
                requires += [f"{x}.requires_grad" for x in names]
            elif kind is ArgKind.TENSOR:
                checks.append(f"not {plain(name)}")
                requires.append(f"{name}.requires_grad")
            elif kind is ArgKind.OPTIONAL_TENSOR:
                checks.append(f"({name} is not None and not {plain(name)})")
                requires.append(f"({name} is not None and {name}.requires_grad)")
            else:
                checks.append(f"isinstance({name}, _T)")
        picker = _kernel_picker(sig.kinds)
        first = next((n for i, n, _ in self.slots if i == picker), None)
        if first is None:  # an empty list picks the kernel: the general path decides
            return _decline
        regrouped = self._regrouped()
        alias = "type(out) is not _T or _alias(args, _EMPTY, (out,))"
        node_inputs = self._node_inputs()
        # The version counters of every tensor argument (none is in mutates_args here), read
        # before and after the kernel: Kernels.run's check, unrolled.
        tensors = [(n, kind) for _, n, kind, is_slot in self._flat() if is_slot]
        read = "".join(
            f"        v_{n} = None if {n} is None else {n}._version\n"
            if kind is ArgKind.OPTIONAL_TENSOR
            else f"        v_{n} = {n}._version\n"
            for n, kind in tensors
        )
        moved = " or ".join(
            f"({n} is not None and {n}._version != v_{n})"
            if kind is ArgKind.OPTIONAL_TENSOR
            else f"{n}._version != v_{n}"
            for n, kind in tensors
        )
        before = ", ".join(f"v_{n}" for n, _ in tensors)
        # The kernel's call with Kernels.run's check of its writes, unrolled: in the node's
        # forward, and in the call itself when nothing is recorded.
        kernel_lines = (
            "    try:\n"
            + read
            + "    except RuntimeError:  # an inference tensor keeps no version\n"
            "        out = _run_any(kernel, args)\n"
            "    else:\n"
            "        out = kernel(*args)\n"
            f"        if {moved or 'False'}:\n"
            f"            _raise_if_mutated(args, [{before}])\n"
            f"    if {alias}:\n"
            "        out = _checked_output(args, out)[0]\n"
            "    return out\n"
        )
        call_src = (
            f"def call(args):\n"
            f"{self.count}"
            f"    {arglist}, = args\n" + "".join(unpack) + f"    if {' or '.join(checks)}:\n"
            f"        return _DECLINED\n"
            f"    if _compiling() or _fwd_level() >= 0 or _SPEC.rules is not _RULES:\n"
            f"        return _DECLINED\n"
            f"    kernel = _route({first}, True)\n"
            f"    if kernel is None or kernel is _DISPATCH:\n"
            f"        return _DECLINED\n"
            f"    if _grad_enabled() and ({' or '.join(requires) or 'False'}):\n"
            f"        return _c_apply(_IMPL, kernel, {self._node_inputs()})\n"
            f"    # nothing to record: CustomOp.run_call's last case\n" + kernel_lines
        )

        # -- Function.forward and setup_context ------------------------------------------------
        forward_src = (
            f"def forward(impl, kernel, {node_inputs}):\n"
            f"    args = {regrouped}\n" + kernel_lines + "\n"
            f"def setup_context(ctx, inputs, out):\n"
            f"    impl, kernel, {node_inputs}, = inputs\n"
            f"    record = _Record(_IMPL, [{self._all_metas()}], _LENS, _tag())\n"
            f"    saved = _SAVE(_new(_Inputs, {regrouped}), out)\n"
            f"    if type(saved) is tuple and _TENSOR_OR_NONE.issuperset(map(type, saved)):\n"
            f"        ctx.save_for_backward(*saved)\n"
            f"        record.kept = _SAVED_TENSORS\n"
            f"    else:\n"
            f"        _keep(ctx, record, _SPEC, saved)\n"
            f"    ctx._cg = record\n"
        )
        source = call_src + "\n" + forward_src + "\n" + self._backward_source()
        return self._compile(source)

    def _node_inputs(self) -> str:
        """The autograd node's inputs after ``(impl, kernel)``: every argument in order, list
        items inline (the general path's flat layout, which ``needs_input_grad`` and the
        record's ``metas`` follow)."""
        return ", ".join(n for _, n, _, _ in self._flat())

    def _flat(self) -> list[tuple[int, str, ArgKind, bool]]:
        """Every node input in order: (argument, name, kind, is a tensor slot)."""
        out: list[tuple[int, str, ArgKind, bool]] = []
        for i, name, kind, names in self.args:
            if names is None:
                out.append((i, name, kind, False))
            else:
                out += [(i, n, kind, True) for n in names]
        return out

    def _all_metas(self) -> str:
        parts = []
        for _, n, kind, is_slot in self._flat():
            if not is_slot:
                parts.append("None")
            elif kind is ArgKind.OPTIONAL_TENSOR:
                parts.append(f"None if {n} is None else ({n}.shape, {n}.dtype, {n}.device)")
            else:
                parts.append(f"({n}.shape, {n}.dtype, {n}.device)")
        return ", ".join(parts)

    def _backward_source(self) -> str:
        """The node's backward: the edge loop and the gradient placement unrolled for this
        signature; what a pass computes, calls, validates and hands off is the general path's
        (``needed_edge``, ``AutogradImpl.plan``, the plan's runner from :mod:`customgrad._codegen`)."""
        sig = self.sig
        flat = self._flat()
        edges: list[str] = []
        for p, (i, _, kind, is_slot) in enumerate(flat):
            if not is_slot:
                continue
            bit = 1 << i
            mark = f"nmask |= {bit}" + (f"; n{p} = True" if kind is ArgKind.TENSOR_LIST else "")
            ask = (
                f"        rmask |= {bit}\n"
                f"        if _needed(nf[e][0], captured):\n"
                f"            {mark}\n"
            )
            if kind is ArgKind.OPTIONAL_TENSOR:
                ask = "".join("    " + line + "\n" for line in ask.splitlines())
                edges.append(
                    f"    if metas[{p}] is not None:\n        if req[{p + 2}]:\n{ask}        e += 1\n"
                )
            else:
                edges.append(f"    if req[{p + 2}]:\n{ask}    e += 1\n")
        positions: dict[int, list[int]] = {}  # argument -> its flat positions
        for p, (i, _, _, is_slot) in enumerate(flat):
            if is_slot:
                positions.setdefault(i, []).append(p)
        items = [p for p, (_, _, kind, _) in enumerate(flat) if kind is ArgKind.TENSOR_LIST]
        place = ""
        for i, ps in positions.items():
            name = sig.names[i]
            if sig.kinds[i] is ArgKind.TENSOR_LIST:
                place += f"    g = got.get({name!r})\n    if g is not None:\n"
                place += "".join(
                    f"        if n{p}:\n            g{p} = g[{k}]\n" for k, p in enumerate(ps)
                )
            else:
                (p,) = ps
                place += f"    g{p} = got.get({name!r})\n"
        outs = ", ".join(
            f"g{p}" if is_slot else "None" for p, (_, _, _, is_slot) in enumerate(flat)
        )
        inits = "".join(
            f"    g{p} = None\n"
            for p, (_, _, kind, s) in enumerate(flat)
            if s and kind is ArgKind.TENSOR_LIST
        )
        inits += "".join(f"    n{p} = False\n" for p in items)
        return (
            "def apply(node, *grads):\n"
            "    record = node._cg\n"
            "    if (record.route is not None or _SPEC.rules is not _RULES\n"
            "            or not _SWITCHES.split):\n"
            "        return _general(node, grads)\n"
            "    metas = record.metas\n"
            "    req = node.needs_input_grad\n"
            "    nf = node.next_functions\n"
            "    captured = _captured_now()\n"
            "    rmask = nmask = e = 0\n"
            + inits
            + "".join(edges)
            + "    if rmask != nmask:  # a split not customgrad's (see AutogradImpl.backward)\n"
            "        _refuse_torch_split(_SPEC.name)\n"
            "    plan = _PLANS.get((rmask, nmask))\n"
            "    if plan is None:\n"
            "        plan = _plan(rmask, nmask)\n"
            "    if not plan.needed:\n"
            "        return _NONES\n"
            "    saved = node.saved_tensors if record.kept is _SAVED_TENSORS else _restore(node, record)\n"
            "    run = _RUNNERS.get(plan.key)\n"
            "    if run is None:\n"
            "        run = _runner(plan, _LENS)\n"
            "    got = run(record, saved, grads, plan.splits and _keeps_for_later(plan, None))\n"
            + place
            + f"    return (None, None, {outs})\n"
        )

    def _compile(self, source: str) -> Callable[[tuple[Any, ...]], Any]:
        impl, sig, rules = self.impl, self.sig, self.rules
        spec = impl.spec
        n_inputs = len(self._flat())
        ns: dict[str, Any] = {
            **_runtime(),
            "_checked_output": self.kernels.checked_output,
            "_raise_if_mutated": self.kernels.raise_if_mutated,
            "_run_any": self.kernels.run_any,
            "_route": self.kernels.route,
            "_SPEC": spec,
            "_SIG": sig,
            "_RULES": rules,
            "_IMPL": impl,
            "_LENS": self.lens or None,
            "_SAVE": rules.save,
            "_Inputs": sig.inputs_type,
            "_new": tuple.__new__,
            "_PLANS": impl._plans,
            "_plan": impl.plan,
            "_general": impl.backward,
            "_RUNNERS": impl.runners.table(rules, self.lens or None),
            "_runner": impl.runners.runner,
            "_captured_now": impl.captures.captured_now,
            "_refuse_torch_split": refuse_torch_split,
            "_NONES": (None,) * (n_inputs + 2),
            "_DEFAULTS": _trailing_defaults(sig.pysig, sig.nargs),
        }
        where = f"{spec.name}" + (f", list lengths {self.lens}" if self.lens else "")
        run_source(source, f"<customgrad fast path of {where}>", ns)
        from customgrad._autograd import _CustomGradNode

        function: Any = type(
            f"CustomGrad[{spec.name}]",
            (_CustomGradNode,),
            {
                "forward": staticmethod(ns["forward"]),
                "setup_context": staticmethod(ns["setup_context"]),
            },
        )
        functions.set_backward_apply(function, ns["apply"])
        ns["_c_apply"] = functions.plain_apply(function)
        call: Callable[[tuple[Any, ...]], Any] = ns["call"]
        call.__customgrad_source__ = source  # type: ignore[attr-defined]
        return call


# --------------------------------------------------------------------------------------------
# The kernel call with the check of its writes, written per op


def write_kernel_run(kernels: Kernels) -> Callable[[Callable[..., Any], tuple[Any, ...]], Any]:
    """``run(kernel, args)`` for one op: the version counters of every argument not in
    ``mutates_args`` read before and after the kernel, unrolled (``Kernels.run_any`` loops and
    asks per tensor; a tensor without a counter, an inference tensor, goes there)."""
    sig = kernels.sig
    reads: list[str] = []
    for i in kernels.watched:
        kind = sig.kinds[i]
        if kind is ArgKind.TENSOR:
            reads.append(f"args[{i}]._version")
        elif kind is ArgKind.OPTIONAL_TENSOR:
            reads.append(f"None if args[{i}] is None else args[{i}]._version")
        else:
            reads.append(f"*[None if t is None else t._version for t in args[{i}]]")
    versions = f"[{', '.join(reads)}]"
    call = "_call(kernel, args)" if sig.kwonly_names else "kernel(*args)"
    source = (
        "def run(kernel, args):\n"
        "    try:\n"
        f"        before = {versions}\n"
        "    except RuntimeError:  # an inference tensor keeps no version counter\n"
        "        return _run_any(kernel, args)\n"
        f"    out = {call}\n"
        f"    if {versions} != before:\n"
        "        _raise_if_mutated(args, before)\n"
        "    return out\n"
    )
    ns: dict[str, Any] = {
        "_call": sig.call,
        "_run_any": kernels.run_any,
        "_raise_if_mutated": kernels.raise_if_mutated,
    }
    run_source(source, f"<customgrad kernel call of {sig.qualname}>", ns)
    run: Callable[[Callable[..., Any], tuple[Any, ...]], Any] = ns["run"]
    run.__customgrad_source__ = source  # type: ignore[attr-defined]
    return run
