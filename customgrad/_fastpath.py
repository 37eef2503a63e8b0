"""The fast path of a customgrad op: its call, forward and backward written out for one signature.

Why: a customgrad op does more per call than a plain ``torch.autograd.Function`` (checks the
arguments, picks the kernel, keeps a record for the split backward, asks the engine which
gradients the pass needs, validates every gradient). Written generically, with loops over the
arguments and the registrations looked up on every call, that costs about 1.4x a Function on a
small op (``benchmarks/overhead.py``). This module writes, for one op, Python functions with the
argument loops unrolled and every constant bound (as ``dataclasses`` and ``torch.fx`` do), which
make the same decisions with a fraction of the interpreter work.

What it covers: ops without list arguments, keyword-only arguments, mutated arguments or
residuals, with one differentiable Tensor output, whose autograd is the input/weight pair or a
single backward called as written (``split="phase"``); called with plain tensors under grad
mode, with no dispatch or function mode, functorch transform, profiler, forward-AD level or
``torch.compile`` trace. Any other call declines (returns :data:`DECLINED`) and runs the general
path (:class:`customgrad._autograd.AutogradImpl`). Backwards that a split plans (a route on the
record), changed registrations, and observers also go to the general path.

One set of rules: the pass plan (``AutogradImpl.plan``), the saved-value layout (``_save`` /
``_restore``), the in-place watch and the gradient errors (``collect_grads``) are the general
path's own; the generated code only decides the common case inline and hands anything unusual
to them. ``tests/test_fastpath.py`` checks that both paths give the same gradients and errors.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.autograd.forward_ad as _fwad

from customgrad._autograd import (
    _ACCUMULATE,
    _SAVED_TENSORS,
    BackwardContext,
    _CustomGradNode,
    _restore,
    _save,
    _Watch,
)
from customgrad._record import NodeRecord
from customgrad._routing import current_tag
from customgrad._rules import AutogradRules
from customgrad._signature import ArgKind
from customgrad._validate import collect_grads

if TYPE_CHECKING:
    from customgrad._autograd import AutogradImpl

__all__ = ["DECLINED", "build"]

DECLINED: Any = object()
"""What a fast call returns when the general path must run the call."""

_EMPTY: dict[str, Any] = {}
_alias_check: Callable[..., bool] | None = getattr(
    torch._C, "_any_output_is_alias_to_input_or_output", None
)


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


def _first_tensor_is_required(kinds: tuple[ArgKind, ...]) -> bool:
    for kind in kinds:
        if kind is not ArgKind.OTHER:
            return kind is ArgKind.TENSOR
    return False


def eligible(impl: AutogradImpl, rules: AutogradRules, mutates: bool) -> bool:
    """Whether the fast path can serve this op with these registrations."""
    sig = impl.spec.signature
    if (
        mutates
        or sig.has_lists
        or sig.kwonly_names
        or sig.residual_names
        or not sig.flat_node
        or not _first_tensor_is_required(sig.kinds)  # it picks the kernel, as in the general path
    ):
        return False
    params = list(sig.pysig.parameters)
    if params != list(sig.names):  # positional arguments must mean the schema's arguments
        return False
    if rules.backward_shared is not None or rules.nondifferentiable:
        return False
    if rules.backward is not None and rules.auto is not None:
        return False
    return impl.ready()


def build(
    impl: AutogradImpl,
    kernels: Mapping[str | None, Callable[..., Any]],
    checked_output: Callable[[tuple[Any, ...], Any], tuple[Any, Any]],
    mutates: bool,
) -> Callable[[tuple[Any, ...]], Any] | None:
    """The fast call of ``impl``'s op for its current registrations and kernels, or None.

    Args:
        impl: the op's autograd implementation (``impl.spec`` is the op).
        kernels: the op's kernels by device type (None: every device); read on each call.
        checked_output: the op's output check, ``(args, out) -> (output, residuals)``, which
            raises the op's error for a kernel output it refuses.
        mutates: whether the op mutates an argument (no fast path then).

    Returns:
        ``call(args) -> output or DECLINED``, for schema-ordered positional ``args``.
    """
    spec = impl.spec
    rules = spec.rules
    if not eligible(impl, rules, mutates):
        return None
    sig = spec.signature
    names = [f"a{i}" for i in range(sig.nargs)]
    kinds = sig.kinds
    first = kinds.index(ArgKind.TENSOR)
    arglist = ", ".join(names)
    argtuple = f"({arglist},)"
    tensor_args = [(i, n) for i, (n, k) in enumerate(zip(names, kinds)) if k is not ArgKind.OTHER]

    def is_plain(n: str) -> str:
        return f"(type({n}) is _T or type({n}) is _P)"

    # -- the call ----------------------------------------------------------------------------
    checks: list[str] = []
    requires: list[str] = []
    for n, k in zip(names, kinds):
        if k is ArgKind.TENSOR:
            checks.append(f"not {is_plain(n)}")
            requires.append(f"{n}.requires_grad")
        elif k is ArgKind.OPTIONAL_TENSOR:
            checks.append(f"({n} is not None and not {is_plain(n)})")
            requires.append(f"({n} is not None and {n}.requires_grad)")
        else:
            checks.append(f"isinstance({n}, _T)")
    if set(kernels) == {None}:
        pick = "    kernel = _KERNEL\n"
    else:
        pick = (
            f"    kernel = _KERNELS.get(a{first}.device.type) or _KERNELS.get(None)\n"
            f"    if kernel is None:\n"
            f"        return _DECLINED\n"
        )
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
    call_src = (
        f"def call(args):\n"
        f"{count}"
        f"    {arglist}, = args\n"
        f"    if {' or '.join(checks)}:\n"
        f"        return _DECLINED\n"
        f"    if not ({' or '.join(requires)}):\n"
        f"        return _DECLINED\n"
        f"    if (_compiling() or _fwad._current_level >= 0 or _prof._is_profiler_enabled\n"
        f"            or _dispatch_len() or _tf_mode() or _functorch() or a{first}.is_meta\n"
        f"            or _SPEC.rules is not _RULES or _IMPL.observers):\n"
        f"        return _DECLINED\n"
        f"{pick}"
        f"    return _c_apply(_IMPL, kernel, {arglist})\n"
    )

    # -- Function.forward and setup_context --------------------------------------------------
    alias = (
        f"type(out) is not _T or _alias({argtuple}, _EMPTY, (out,))"
        if _alias_check is not None
        else "type(out) is not _T"
    )
    metas = ", ".join(
        f"({n}.shape, {n}.dtype, {n}.device)"
        if k is ArgKind.TENSOR
        else f"None if {n} is None else ({n}.shape, {n}.dtype, {n}.device)"
        if k is ArgKind.OPTIONAL_TENSOR
        else "None"
        for n, k in zip(names, kinds)
    )
    forward_src = (
        f"def forward(impl, kernel, {arglist}):\n"
        f"    out = kernel({arglist})\n"
        f"    if {alias}:\n"
        f"        out = _checked_output({argtuple}, out)[0]\n"
        f"    return out\n"
        f"\n"
        f"def setup_context(ctx, inputs, out):\n"
        f"    impl, kernel, {arglist} = inputs\n"
        f"    record = _Record(_IMPL, [{metas}], None, _tag())\n"
        f"    _keep(ctx, record, _SPEC, _SAVE(_new(_Inputs, {argtuple}), out))\n"
        f"    ctx._cg = record\n"
    )

    # -- the backward ------------------------------------------------------------------------
    edges: list[str] = []
    for i, _ in tensor_args:
        bit = 1 << i
        ask = (
            f"        rmask |= {bit}\n"
            f"        fn = nf[e][0]\n"
            f"        if type(fn) is _ACC and id(fn.variable) in _captured():\n"
            f"            nmask |= {bit}  # a leaf that autograd.grad captures\n"
            f"        else:\n"
            f"            try:\n"
            f"                if _will(fn):\n"
            f"                    nmask |= {bit}\n"
            f"            except Exception:  # a captured leaf the caller's frame did not name\n"
            f"                nmask |= {bit}\n"
        )
        if kinds[i] is ArgKind.TENSOR:
            edges.append(f"    if req[{i + 2}]:\n{ask}    e += 1\n")
        else:
            ask = "".join("    " + line + "\n" for line in ask.splitlines())
            edges.append(
                f"    if metas[{i}] is not None:\n        if req[{i + 2}]:\n{ask}        e += 1\n"
            )

    def half(fn: str, label: str, allowed: frozenset[str], need: str) -> str:
        """Call one registered function, check it, put its gradients in the ``gN`` slots."""
        lines = [
            f"        r = {fn}(ctx, saved, *grads)",
            f"        watch.check(_SPEC, {label!r}, {fn})",
            f"        ok = type(r) is dict and r.keys() <= _ALLOWED_{label}",
        ]
        for i, _ in tensor_args:
            name = sig.names[i]
            if name not in allowed:
                continue
            lines += [
                "        if ok:",
                f"            g = r.get({name!r}, _MISSING)",
                "            if g is _MISSING:",
                f"                ok = {name!r} not in {need}",
                "            elif g is not None:",
                f"                m = metas[{i}]",
                "                ok = (type(g) is _T and m is not None and g.shape == m[0]",
                "                      and g.dtype is m[1] and g.device == m[2])",
                f"            if ok and {name!r} in {need}:",
                f"                g{i} = g",
            ]
        lines += [
            "        if not ok:",
            f"            got = _collect(_SIG, {label!r}, {fn}, r, _ALLOWED_{label}, {need}, metas)",
        ]
        lines += [
            f"            g{i} = got.get({sig.names[i]!r}, g{i})"
            for i, _ in tensor_args
            if sig.names[i] in allowed
        ]
        return "\n".join(lines) + "\n"

    if rules.backward is not None:
        body = "    if True:\n" + half("_BWD", "full", sig.tensor_set, "needed")
    else:
        body = ""
        if sig.input_names:
            body += "    if plan.need_in:\n" + half(
                "_BWD_IN", "input", sig.input_set, "plan.need_in"
            )
        if sig.weights:
            body += "    if plan.need_w:\n" + half(
                "_BWD_W", "weight", sig.weight_set, "plan.need_w"
            )
    slots = ", ".join(f"g{i}" if i in dict(tensor_args) else "None" for i in range(sig.nargs))
    inits = "".join(f"    g{i} = None\n" for i, _ in tensor_args)
    backward_src = (
        "def apply(node, *grads):\n"
        "    record = node._cg\n"
        "    if record.route is not None or _SPEC.rules is not _RULES or _IMPL.observers:\n"
        "        return _general(node, grads)\n"
        "    metas = record.metas\n"
        "    req = node.needs_input_grad\n"
        "    nf = node.next_functions\n"
        "    rmask = nmask = e = 0\n" + "".join(edges) + "    plan = _PLANS.get((rmask, nmask))\n"
        "    if plan is None:\n"
        "        plan = _plan(rmask, nmask)\n"
        "    needed = plan.needed\n"
        "    if not needed:\n"
        "        return _NONES\n"
        "    saved = node.saved_tensors if record.kept is _SAVED_TENSORS else _restore(node, record)\n"
        "    watch = _Watch(saved, grads)\n"
        "    ctx = _Ctx(_SPEC, plan.phase, needed)\n"
        + inits
        + body
        + f"    return (None, None, {slots})\n"
    )

    ns: dict[str, Any] = {
        "_T": torch.Tensor,
        "_P": torch.nn.Parameter,
        "_DECLINED": DECLINED,
        "_MISSING": object(),
        "_EMPTY": _EMPTY,
        "_grad_enabled": torch.is_grad_enabled,
        "_fwad": _fwad,
        "_prof": torch.autograd.profiler,
        "_dispatch_len": torch._C._len_torch_dispatch_stack,
        "_tf_mode": torch._C._is_torch_function_mode_enabled,
        "_functorch": torch._C._are_functorch_transforms_active,
        "_compiling": torch.compiler.is_compiling,
        "_will": torch._C._will_engine_execute_node,
        "_ACC": _ACCUMULATE,
        "_captured": impl.captures.captured_now,
        "_alias": _alias_check,
        "_checked_output": checked_output,
        "_KERNEL": kernels.get(None),
        "_KERNELS": kernels,
        "_SPEC": spec,
        "_SIG": sig,
        "_RULES": rules,
        "_IMPL": impl,
        "_SAVE": rules.save,
        "_BWD": rules.backward,
        "_BWD_IN": rules.backward_input,
        "_BWD_W": rules.backward_weight,
        "_ALLOWED_full": sig.tensor_set,
        "_ALLOWED_input": sig.input_set,
        "_ALLOWED_weight": sig.weight_set,
        "_Inputs": sig.inputs_type,
        "_new": tuple.__new__,
        "_Record": NodeRecord,
        "_tag": current_tag,
        "_keep": _save,
        "_restore": _restore,
        "_SAVED_TENSORS": _SAVED_TENSORS,
        "_Watch": _Watch,
        "_Ctx": BackwardContext,
        "_collect": collect_grads,
        "_PLANS": impl._plans,
        "_plan": impl.plan,
        "_general": impl.backward,
        "_NONES": (None,) * (sig.nargs + 2),
        "_DEFAULTS": defaults,
    }
    source = call_src + "\n" + forward_src + "\n" + backward_src
    exec(compile(source, f"<customgrad fast path of {spec.name}>", "exec"), ns)

    function: Any = type(
        f"CustomGrad[{spec.name}]",
        (_CustomGradNode,),
        {
            "forward": staticmethod(ns["forward"]),
            "setup_context": staticmethod(ns["setup_context"]),
        },
    )
    function._backward_cls.apply = ns["apply"]
    ns["_c_apply"] = super(torch.autograd.Function, function).apply
    call: Callable[[tuple[Any, ...]], Any] = ns["call"]
    call.__customgrad_source__ = source  # type: ignore[attr-defined]
    return call
