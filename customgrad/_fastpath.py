"""The fast path of a customgrad op: its call, forward and backward written out for one signature.

Why: a customgrad op does more per call than a plain ``torch.autograd.Function`` (checks the
arguments, picks the kernel, keeps a record for the split backward, asks the engine which
gradients the pass needs, validates every gradient). Written generically, with loops over the
arguments and the registrations looked up on every call, that costs about 1.4x a Function on a
small op (``benchmarks/overhead.py``). This module writes, for one op, Python functions with the
argument loops unrolled and every constant bound (as ``dataclasses`` and ``torch.fx`` do), which
make the same decisions with a fraction of the interpreter work.

What it covers: ops without keyword-only arguments, mutated arguments, residuals, shared
backward work or lists of ``Optional[Tensor]``, with one differentiable Tensor output, whose
autograd is the input/weight pair or a single backward; ``list[Tensor]`` arguments get one fast
path per layout of list lengths, written on first use (at most ``MAX_LAYOUTS``). Calls must
have plain tensors under grad mode, no forward-AD level or ``torch.compile`` trace, and be
ones that :meth:`customgrad._kernels.Kernels.route` (the op's one dispatch decision, which the
general call asks too) sends straight to a kernel: no dispatch or function mode, functorch
transform or profiler, no kernel or autocast rule registered for the op through
``torch.library`` by someone else. Any other call declines (returns :data:`DECLINED`) and runs
the general path (:class:`customgrad._autograd.AutogradImpl`). Backwards that a split plans (a
route on the record), changed registrations and a switched-off split also go to the general
path. ``CUSTOMGRAD_FASTPATH=0`` turns this module off; ``CUSTOMGRAD_FASTPATH=show`` prints each
piece of code it writes (to stderr); ``call.__customgrad_source__`` holds it too.

It stays while it buys at least 10% of a small op's forward + backward on some path: compare
``benchmarks/overhead.py`` runs with ``CUSTOMGRAD_FASTPATH=0`` and without, alternated.

One set of rules: what is generated is argument handling only (unpacking, the per-argument
checks of the call, the edge loop and the placement of gradients). Which edges a pass needs
(``needed_edge``), the pass plan (``AutogradImpl.plan``) and the plan's runner, which computes,
validates and hands to the later pass (:mod:`customgrad._codegen`), the saved-value layout
(``_save`` / ``_restore``) and observers are the general path's own, called from here.
``tests/test_fastpath.py`` checks that both paths give the same gradients and errors.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from customgrad import _kernels
from customgrad._autograd import _CustomGradNode, needed_edge
from customgrad._codegen import MAX_LAYOUTS
from customgrad._codegen import run_source as _exec
from customgrad._pass import keeps_for_later
from customgrad._record import NodeRecord
from customgrad._routing import current_tag
from customgrad._rules import AutogradRules
from customgrad._saving import _SAVED_TENSORS, _TENSOR_OR_NONE, _restore, _save
from customgrad._signature import ArgKind
from customgrad._switches import STATE as SWITCHES
from customgrad._torch import dispatcher, functions
from customgrad._torch.transforms import forward_ad_level

if TYPE_CHECKING:
    from customgrad._autograd import AutogradImpl
    from customgrad._kernels import Kernels

__all__ = ["DECLINED", "build"]

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


def build(impl: AutogradImpl, kernels: Kernels) -> Callable[[tuple[Any, ...]], Any] | None:
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
            f"        if not _grad_enabled() or n < {n_min} or n > {sig.nargs}:\n"
            f"            return _DECLINED\n"
            f"        args += _DEFAULTS[n - {n_min}:]\n"
            f"    elif not _grad_enabled():\n"
            f"        return _DECLINED\n"
        )
    else:
        count = (
            f"    if not _grad_enabled() or len(args) != {sig.nargs}:\n        return _DECLINED\n"
        )
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
    _exec(source, f"<customgrad fast path of {impl.spec.name}>", ns)
    dispatch: Callable[[tuple[Any, ...]], Any] = ns["call"]
    dispatch.__customgrad_source__ = source  # type: ignore[attr-defined]
    return dispatch


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
    "_needed": needed_edge,
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
        call_src = (
            f"def call(args):\n"
            f"{self.count}"
            f"    {arglist}, = args\n" + "".join(unpack) + f"    if {' or '.join(checks)}:\n"
            f"        return _DECLINED\n"
            f"    if not ({' or '.join(requires) or 'False'}):\n"
            f"        return _DECLINED\n"
            f"    if _compiling() or _fwd_level() >= 0 or _SPEC.rules is not _RULES:\n"
            f"        return _DECLINED\n"
            f"    kernel = _route({first}, True)\n"
            f"    if kernel is None or kernel is _DISPATCH:\n"
            f"        return _DECLINED\n"
            f"    return _c_apply(_IMPL, kernel, {self._node_inputs()})\n"
        )

        # -- Function.forward and setup_context ------------------------------------------------
        regrouped = self._regrouped()
        alias = (
            "type(out) is not _T or _alias(args, _EMPTY, (out,))"
            if _alias_check is not None
            else "type(out) is not _T"
        )
        node_inputs = self._node_inputs()
        # The version counters of every tensor argument (none is in mutates_args here), read
        # before and after the kernel: Kernels.run's check, unrolled.
        versions = ", ".join(
            f"None if {n} is None else {n}._version"
            if kind is ArgKind.OPTIONAL_TENSOR
            else f"{n}._version"
            for _, n, kind, is_slot in self._flat()
            if is_slot
        )
        forward_src = (
            f"def forward(impl, kernel, {node_inputs}):\n"
            f"    args = {regrouped}\n"
            f"    before = [{versions}]\n"
            f"    out = kernel(*args)\n"
            f"    if [{versions}] != before:\n"
            f"        _raise_if_mutated(args, before)\n"
            f"    if {alias}:\n"
            f"        out = _checked_output(args, out)[0]\n"
            f"    return out\n"
            f"\n"
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
            + "    plan = _PLANS.get((rmask, nmask))\n"
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
            **_RUNTIME,
            "_checked_output": self.kernels.checked_output,
            "_raise_if_mutated": self.kernels.raise_if_mutated,
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
            "_NONES": (None,) * (n_inputs + 2),
            "_DEFAULTS": _trailing_defaults(sig.pysig, sig.nargs),
        }
        where = f"{spec.name}" + (f", list lengths {self.lens}" if self.lens else "")
        _exec(source, f"<customgrad fast path of {where}>", ns)
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
