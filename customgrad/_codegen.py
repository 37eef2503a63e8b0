"""The code customgrad writes (the one module that writes code), and the one door it runs through.

Two things are written, each once per op and run through :func:`run_source`, which prints them
first under ``CUSTOMGRAD_SHOW_CODE=1``:

- a pass plan's runner (:func:`write_runner`), written once per (registrations, plan, layout of
  list lengths) with every decision taken: which registered functions it calls, the
  version-counter check that refuses in-place writes (:func:`watch_lines`, :func:`call_lines`),
  the validation of what they return (:func:`check_source`, whose complete, interpreted twin is
  :func:`customgrad._validate.collect_grads`: a property test runs both on the same results),
  the run-once rule and the hand-off;
- the op's kernel call with the check of its writes (:func:`write_kernel_run`).

Everything else of a call (the call's checks, the node's forward, ``setup_context`` and the edge
loop of its backward) is plain Python in :mod:`customgrad._op` and :mod:`customgrad._autograd`
that reads the op's signature and its plans: one implementation for every call.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from customgrad._calls import CallCounts, slot
from customgrad._errors import MissingRegistrationError
from customgrad._pass import (
    BackwardContext,
    BackwardObserver,
    PassPlan,
    _Shared,
    auto_split,
)
from customgrad._record import NodeRecord
from customgrad._rules import AutogradRules, Gradient, OpSpec
from customgrad._runtime import free, keep_gradients, take_gradients
from customgrad._signature import ArgKind, Signature
from customgrad._switches import STATE as SWITCHES
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
    from customgrad._kernels import Kernel, Kernels

__all__ = [
    "MAX_LAYOUTS",
    "Runner",
    "Runners",
    "call_lines",
    "check_source",
    "run_source",
    "watch_lines",
    "write_kernel_run",
    "write_check",
    "write_runner",
]

_Tensor = torch.Tensor


def run_source(source: str, filename: str, ns: dict[str, object]) -> None:
    """Run generated ``source`` in ``ns``; with ``CUSTOMGRAD_SHOW_CODE=1``, print it first."""
    if SWITCHES.show_code:
        print(f"# {filename}\n{source}", file=sys.stderr)
    exec(compile(source, filename, "exec"), ns)


class Observed(Protocol):
    """What holds the observers a runner calls after each registered function runs (the op's
    ``AutogradImpl``; read on every call, so observers added later are called)."""

    observers: tuple[BackwardObserver, ...]
    calls: CallCounts


Slots = Mapping[str, tuple[int, int | None]]
"""Each argument's first flat position and list length (None for a single value)."""

SlotsOf = Callable[[tuple[int, ...]], dict[str, tuple[int, int | None]]]
"""List lengths -> each argument's first flat position and list length (``AutogradImpl.slots``)."""

Runner = Callable[[NodeRecord, object, tuple[object, ...], bool], dict[str, Gradient]]
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
    writer = _RunnerWriter(spec, rules, plan, observed, slots_of, lens)
    body = writer.single() if rules.backward is not None else writer.pair()
    source = "def run(record, saved, grads, keep):\n" + "".join(
        f"    {x}\n" for x in [*writer.head, *body]
    )
    where = f"{spec.name}: {plan.phase} {sorted(plan.needed)}" + (
        f", list lengths {lens}" if lens else ""
    )
    run_source(source, f"<customgrad pass of {where}>", writer.ns)
    run: Runner = writer.ns["run"]
    run.__customgrad_source__ = source  # type: ignore[attr-defined]
    return run


class _RunnerWriter:
    """The lines of one runner and the names they read (see :func:`write_runner`)."""

    def __init__(
        self,
        spec: OpSpec,
        rules: AutogradRules,
        plan: PassPlan,
        observed: Observed,
        slots_of: SlotsOf,
        lens: tuple[int, ...] | None,
    ) -> None:
        self.spec, self.rules, self.plan = spec, rules, plan
        self.sig = sig = spec.signature
        self.slots = None if lens is None else slots_of(lens)
        self.head = ["metas = record.metas"]
        if sig.has_lists and self.slots is None:
            self.head.append("slots = _slots_of(record.lens)")
        self.watch = watch_lines()
        self.partial = plan.needed != plan.requires
        self.ns: dict[str, Any] = {
            "_SPEC": spec, "_SIG": sig, "_CTX": plan.ctx, "_PHASE": plan.phase,
            "_NEEDED": plan.needed, "_NONDIFF": rules.nondifferentiable, "_T": torch.Tensor,
            "_MISSING": _MISSING, "_map": map, "_getattr": getattr, "_VERSION": _VERSION,
            "_NO_VERSION": _NO_VERSION, "_watched_values": _watched_values,
            "_raise_mutation": _raise_mutation, "_call_user": _call_user,
            "_raise_if_raw_launch": raise_if_raw_launch, "_collect": collect_grads,
            "_OBSERVED": observed, "_slots_of": slots_of, "_SLOTS": self.slots,
            "_auto_split": auto_split, "_AUTO": rules.auto, "_REQUIRES": plan.requires,
            "_make_ctx": functools.partial(BackwardContext, spec, "full"),
            "_take_gradients": take_gradients, "_keep_gradients": keep_gradients, "_free": free,
            "_Shared": _Shared, "_BackwardContext": BackwardContext,
            "_missing": spec._missing_autograd_message, "_Missing": MissingRegistrationError,
            "_CALLS": observed.calls.counts,
        }  # fmt: skip

    def count(self, kind: str) -> str:
        """The line that counts this call for ``summary()`` (:mod:`customgrad._calls`)."""
        return f"_CALLS[{slot(kind, self.plan.phase)}] += 1"

    def half(
        self,
        half: str,
        fn: Callable[..., object] | None,
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
        self.ns[var] = fn
        self.ns[f"_ALLOWED_{out}"] = allowed
        self.ns[f"_NEEDED_{out}"] = need
        return [
            *call_lines(half, var, half in self.rules.nondifferentiable),
            *_observe(HALF_NAMES[half], "r"),
            *check_source(self.sig, half, var, allowed, need, out, self.slots, into),
        ]

    def single(self) -> list[str]:
        """A single ``register_backward``: its automatic split in a pass that splits, then the
        function as written (a full pass: the reference a capture is checked against)."""
        sig, plan, auto = self.sig, self.plan, self.rules.auto
        lines: list[str] = []
        if auto is not None and self.partial:
            lines += [*self.split(), *self.run_once()]
        lines += ["ctx = _CTX", *self.watch]
        lines += self.half("full", self.rules.backward, sig.tensor_set, plan.needed, "got")
        if auto is not None and not self.partial:
            # a full pass after a split one of a retained graph: free what was kept for W
            lines += ["if record.handoff is not None:", "    _free(record, grads)"]
        kind = "per pass" if self.partial and auto is None else "whole"
        return [*lines, self.count(kind), "return got"]

    def split(self) -> list[str]:
        """The captured part of a single backward for this pass (the runtime keeps and takes
        what its passes share); none when the split declines."""
        sig, plan = self.sig, self.plan
        self.ns["_FN_full"] = self.rules.backward
        self.ns["_ALLOWED_got"] = sig.tensor_set
        self.ns["_NEEDED_got"] = plan.needed
        body = [
            "r = split.run(record, saved, grads, _NEEDED, keep)",
            "ctx = _CTX",
            *_observe(f"backward (traced {plan.phase} part)", "r"),
            *check_source(sig, "full", "_FN_full", sig.tensor_set, plan.needed, "got", self.slots),
            self.count("split"),
            "return got",
        ]
        return [
            "split = _auto_split(record, _AUTO, _make_ctx, saved, grads, _REQUIRES)",
            "if split is not None:",
            *_indent(body),
        ]

    def run_once(self) -> list[str]:
        """The run-once rule, for a single backward that is not split: the first pass that
        needs any gradient calls it once for every argument that requires grad and hands the
        gradients it does not need to the node's later pass, which takes them instead of
        calling it again. (Only ``split="phase"`` calls a backward once per pass.)"""
        sig, plan = self.sig, self.plan
        self.ns["_WHOLE_CTX"] = BackwardContext(self.spec, "full", plan.requires)
        self.ns["_ALLOWED_every"] = sig.tensor_set
        self.ns["_NEEDED_every"] = plan.requires
        nondifferentiable = "full" in self.rules.nondifferentiable
        body = [
            "ctx = _WHOLE_CTX",
            *self.watch,
            *call_lines("full", "_FN_full", nondifferentiable),
            *_observe(HALF_NAMES["full"], "r"),
            *check_source(
                sig, "full", "_FN_full", sig.tensor_set, plan.requires, "every", self.slots
            ),
            "got = _keep_gradients(record, grads, every, _NEEDED)",
            "_AUTO.held(every)",
            self.count("ran once"),
            "return got",
        ]
        return [
            "if record.handoff is not None:",
            "    got = _take_gradients(record, grads, _NEEDED)",
            "    if got is not None:",
            f"        {self.count('handed')}",
            "        return got",
            "if keep:",
            *_indent(body),
        ]

    def pair(self) -> list[str]:
        """The pair (and its shared work): each half this pass needs."""
        sig, plan, rules = self.sig, self.plan, self.rules
        lines = [*self.watch]
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
            lines += self.half(
                "input", rules.backward_input, sig.input_set, plan.need_input, "got_in", "got"
            )
        if plan.need_weight:
            lines += self.half(
                "weight", rules.backward_weight, sig.weight_set, plan.need_weight, "got_w", "got"
            )
            # the later pass ran: free what was kept for it
            lines += ["if record.handoff is not None:", "    _free(record, grads)"]
        if shared:
            lines += ["if shared.computed:", *_indent(_observe("backward_shared", "shared.value"))]
        return [*lines, self.count("split" if self.partial else "whole"), "return got"]


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
) -> Callable[
    [Callable[..., object], object, Sequence[TensorMeta], Slots | None], dict[str, object]
]:
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
    check: Callable[
        [Callable[..., object], object, Sequence[TensorMeta], Slots | None], dict[str, object]
    ]
    check = ns["check"]
    return check


# --------------------------------------------------------------------------------------------
# The kernel call with the check of its writes, written per op


def write_kernel_run(kernels: Kernels) -> Callable[[Kernel, tuple[object, ...]], object]:
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
    run: Callable[[Kernel, tuple[object, ...]], object] = ns["run"]
    run.__customgrad_source__ = source  # type: ignore[attr-defined]
    return run
