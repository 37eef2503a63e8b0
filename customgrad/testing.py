"""Check a custom op the way a library author needs: one call, every check, every failure listed.

:func:`check_op` runs, on the arguments you give it:

- ``opcheck``: :func:`torch.library.opcheck` (schema, autograd registration, fake tensor,
  AOT dispatch);
- ``fake``: the fake kernel against the real one, output by output (shape, dtype, device,
  strides), under :class:`~torch._subclasses.fake_tensor.FakeTensorMode`;
- ``gradcheck``: :func:`torch.autograd.gradcheck` on float64 copies of the arguments (or in the
  dtype given with ``dtype=``, with tolerances that fit it);
- ``gradgradcheck``: :func:`torch.autograd.gradgradcheck`, when the backward is differentiable;
- ``split``: the input pass then the weight pass (``torch.autograd.grad`` restricted to the
  non-weight arguments, then to the weights) gives the gradients of the full backward (for a
  single backward split automatically: its captured input and weight parts against the
  function as written, which is what a full backward calls);
- ``flops``: the split does no work twice: FLOPs(input pass) + FLOPs(weight pass) equal
  FLOPs(full backward), counted with torch's formulas; and, since opaque kernels (Triton, other
  custom ops) count zero FLOPs, every call of the op's backward functions is watched (a half
  may only run in its own pass, and a backward may not return a gradient that
  ``ctx.needs_input_grad`` said is not needed) and kernel launches are counted per pass
  (kernels called as ops, and compiled Triton launches): a kernel that computes the same
  thing in the input pass and again in the weight pass is reported.

Every check says which dtype it ran in (:attr:`CheckResult.dtype`): float64 by default for the
gradient checks, since finite differences need it, or the arguments' own dtypes for an op that
raises in float64 (most Triton kernels have no float64 path; :attr:`CheckReport.dtype_note`
says so); ``check_op(..., dtype=torch.float32)`` or ``dtype="own"`` chooses.

It returns a :class:`CheckReport` and raises :class:`CheckFailed` listing every failure.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, ParamSpec, TypeVar

import optree
import torch
from torch.autograd.gradcheck import GradcheckError

from customgrad._autosplit import AutoSplitter, TracedSplit
from customgrad._errors import (
    ArgumentTypeError,
    ArgumentValueError,
    CustomGradError,
    DoubleBackwardError,
)
from customgrad._from_function import DeferredFunctionOp, FunctionPatch
from customgrad._op import CustomOp, autograd_impl
from customgrad._rules import BackwardContext
from customgrad._split_run import SplitRun, differences
from customgrad._torch.dispatcher import OpOverload
from customgrad._torch.errors import wrapped_error
from customgrad._torch.fake import (
    FAKE_TENSOR_LOGGER,
    data_dependent_errors,
    fake_tensor_mode_type,
    is_fake,
)
from customgrad._validate import HALF_NAMES

__all__ = ["CHECKS", "CheckFailed", "CheckReport", "CheckResult", "check_op"]

CHECKS: tuple[str, ...] = ("opcheck", "fake", "gradcheck", "gradgradcheck", "split", "flops")
"""The names of the checks :func:`check_op` runs, in order."""

Status = Literal["passed", "failed", "skipped"]
DType = torch.dtype | Literal["own"] | None
Pass = Literal["full", "input", "weight"]
Values = dict[str, object]
"""The op's arguments by name."""
Counted = tuple[OpOverload, int, torch.Tensor | None]
"""A computation the FLOP counter recorded: the op, its FLOPs, its output."""
_P = ParamSpec("_P")
_R = TypeVar("_R")

FIX_FLOPS = """\
The split repeats work. Compute each gradient in exactly one pass: either register the pair

    @op.register_backward_input      # non-weight arguments only
    def _(ctx, saved, grad): ...
    @op.register_backward_weight     # weights only
    def _(ctx, saved, grad): ...

or, in a single register_backward, compute a gradient only when asked:

    grads = {}
    if ctx.needs_input_grad("x"):
        grads["x"] = grad @ weight       # not computed in the weight pass
    if ctx.needs_input_grad("weight"):
        grads["weight"] = grad.mT @ x    # not computed in the input pass
    return grads"""

FIX_TWICE = """\
Compute it once: hand it from the input pass to the weight pass with register_backward_shared

    @op.register_backward_shared     # runs once, in the earlier pass that needs it
    def _(ctx, saved, grad):
        return grad @ down           # what both halves need
    @op.register_backward_input
    def _(ctx, saved, grad):
        dh = ctx.shared              # computed once
        return {"x": dh @ saved.w_up}

or register one backward that computes every gradient (register_backward, split="auto", the
default): customgrad traces it and runs shared work once, handing it to the weight pass."""

FIX_LAUNCHED_TWICE = """\
Launch the kernel once: call it from register_backward_shared (it runs once per op call, in the
earlier pass that needs a gradient) and hand each half its part:

    @op.register_backward_shared
    def _(ctx, saved, grad):
        return fused_backward(grad, *saved)          # one launch: (dx, dweight)
    @op.register_backward_input
    def _(ctx, saved, grad):
        return {"x": ctx.shared[0]}
    @op.register_backward_weight
    def _(ctx, saved, grad):
        return {"weight": ctx.shared[1]}

or register one backward (register_backward) that calls it once and returns every gradient."""

MSG_NO_FLOAT64 = (
    "{op} raised {exc} when called on float64 copies of its arguments (check_op checks "
    "gradients in float64 by default): its kernel has no float64 path. Check it in a dtype it "
    "takes, with tolerances that fit that dtype: check_op(op, ..., dtype=torch.float32), or "
    'dtype="own" for the arguments\' own dtypes.'
)

MSG_RAN_OWN = (
    "gradcheck, gradgradcheck, split and flops ran in {dtype}, the arguments' dtype: in "
    'float64, check_op\'s default for them, {op} raised {exc}. Pass dtype="own" (or a dtype) to '
    "choose yourself."
)

MSG_FLOAT64_MISMATCH = (
    "{check} ran in float64, check_op's default (gradcheck, gradgradcheck, split and flops run "
    "on float64 copies of the arguments; opcheck and fake on the arguments as given), and the "
    "op's arguments are {own}: a kernel that computes in float32 inside (Triton kernels "
    "usually do; Liger-Kernel's have no float64) cannot match float64 finite differences. "
    "Check it in its own dtype, with tolerances that fit it: check_op(op, ..., "
    'dtype=torch.float32), or dtype="own".'
)

MSG_COARSE_DTYPE = (
    "finite differences in {dtype} are too coarse to check a gradient; run check_op(op, ..., "
    "dtype=torch.float32) (or float64) for this check"
)

MSG_NO_FLOPS = (
    "could not measure FLOPs: torch's FLOP formulas count none of the ops the backward runs "
    "(they count matmuls, convolutions and attention), so repeated work would not show. "
    "Checked instead: which backward functions ran in each pass ({ran}), and that no pass "
    "returned a gradient it was not asked for."
)

MSG_FULL_DOES_MORE = (
    "the split does {less} FLOPs less than the full backward (input pass {input} + weight pass "
    "{weight} < full backward {full}): a full backward calls the backward as written, and "
    "{label} computed the gradient of {names}, which nothing requires (ctx.needs_input_grad is "
    "False: the argument does not require grad); the split computes only what its passes need. "
    "Skip it in a full backward too: if ctx.needs_input_grad({name!r}): ..."
)

MSG_BRANCH = (
    "torch.library.opcheck's {test} not applicable: the backward {once}branches on a tensor "
    "value at {at}, which AOTAutograd (torch.compile, this test) cannot trace with symbolic "
    "values: the op runs in eager mode, not under torch.compile. Compute with tensor ops "
    "(torch.where, masks) to compile it."
)

MSG_CAPTURE_CHECKED = (
    "the captured input and weight parts give the gradients of the backward as written (which "
    "the full backward and gradcheck call)"
)

FIX_FAKE = (
    "Make the fake kernel (register_fake) return tensors exactly like the real kernel's: same "
    "shape, dtype, device and strides (new_empty/empty_like give contiguous tensors; use "
    "torch.empty_strided for others)."
)


class CheckFailed(CustomGradError, AssertionError):
    """:func:`check_op` found at least one failure; the message lists all of them.

    Attributes:
        report: the full :class:`CheckReport`.
    """

    def __init__(self, report: CheckReport) -> None:
        super().__init__(report.failure_message())
        self.report = report


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one check.

    Attributes:
        name: one of :data:`CHECKS`.
        status: ``"passed"``, ``"failed"`` or ``"skipped"``.
        detail: why it failed or was skipped (empty when it passed).
        dtype: the dtype the check ran the op in (``"float64"``, ``"float32"``, ...), or
            ``"own"`` when it used the arguments as given; empty when it did not run.
    """

    name: str
    status: Status
    detail: str = ""
    dtype: str = ""


@dataclass
class CheckReport:
    """What :func:`check_op` found.

    Attributes:
        op: the op's name, ``"ns::name"``.
        results: one :class:`CheckResult` per check, in the order of :data:`CHECKS`.
        flops: FLOPs of each backward pass: ``"full"``, ``"input"`` and ``"weight"``
            (empty when the split was not run).
        calls: how often each backward function ran in each pass, e.g.
            ``calls["input"]["backward_input"] == 1``.
        launches: kernel launches in each pass (``"full"``, ``"input"``, ``"weight"``), by
            kernel: ops outside torch's namespaces by name (``"ns::kernel"``) and compiled
            Triton kernels (``"triton:<name>"``; Triton's interpreter has no launch hook).
        dtype_note: why the gradient checks ran in the arguments' dtypes rather than
            float64, the default (the op raised in float64), or "".
        backward: how the op's backward splits, in words: for the pair, which half returns
            which gradients in which pass; for one backward (``register_backward``), split
            automatically, with what each pass runs, or why it was not (the reason of the
            fallback), or called per pass (``split="phase"``). Empty without a backward.
    """

    op: str
    results: list[CheckResult] = field(default_factory=list)
    flops: dict[str, int] = field(default_factory=dict)
    calls: dict[str, dict[str, int]] = field(default_factory=dict)
    launches: dict[str, dict[str, int]] = field(default_factory=dict)
    backward: str = ""
    dtype_note: str = ""

    @property
    def ok(self) -> bool:
        """True when no check failed (skipped checks do not count as failures)."""
        return not self.failures

    @property
    def failures(self) -> list[CheckResult]:
        """The checks that failed."""
        return [r for r in self.results if r.status == "failed"]

    def __getitem__(self, name: str) -> CheckResult:
        for r in self.results:
            if r.name == name:
                return r
        raise KeyError(f"no check named {name!r}; checks: {', '.join(CHECKS)}")

    def failure_message(self) -> str:
        """The message :class:`CheckFailed` carries: every failure, with its details; checks
        that failed with the same error are listed together, the error once."""
        n = len(self.failures)
        lines = [f"check_op({self.op}): {n} of {len(self.results)} checks failed:"]
        for names, detail in _grouped(self.failures):
            detail = detail.replace("\n", "\n      ")
            if len(names) > 1:
                lines.append(f"  - {', '.join(names)}: each raised {detail}")
            else:
                lines.append(f"  - {names[0]}: {detail}")
        return "\n".join(lines)

    def raise_if_failed(self) -> CheckReport:
        """Raise :class:`CheckFailed` if any check failed; return the report otherwise."""
        if self.failures:
            raise CheckFailed(self)
        return self

    def __str__(self) -> str:
        lines = [f"check_op({self.op}):"]
        first_with: dict[str, str] = {}  # an error -> the first check that raised it
        for r in self.results:
            mark = {"passed": "ok  ", "failed": "FAIL", "skipped": "skip"}[r.status]
            first = r.detail.splitlines()[0] if r.detail else ""
            error = _raised(r.detail) if r.status == "failed" else None
            if error is not None:
                if error in first_with:
                    first = f"raised the same error as {first_with[error]}"
                first_with.setdefault(error, r.name)
            shown = r.dtype and r.name not in ("opcheck", "fake")  # those use the arguments
            dtype = f" ({r.dtype})" if shown else ""
            lines.append(f"  [{mark}] {r.name}{dtype}" + (f": {first}" if first else ""))
        if self.dtype_note:
            lines.append(f"  dtype: {self.dtype_note}")
        if self.flops:
            f = self.flops
            lines.append(
                f"  FLOPs: full {f['full']}, input pass {f['input']}, weight pass {f['weight']}"
            )
        if self.backward:
            lines.append(f"  backward: {self.backward}")
        if self.calls:
            for p in ("input", "weight"):
                ran = ", ".join(f"{k} x{v}" for k, v in sorted(self.calls.get(p, {}).items()))
                lines.append(f"  {p} pass ran: {ran or 'nothing'}")
        if any(self.launches.values()):
            for p in ("full", "input", "weight"):
                ran = ", ".join(f"{k} x{v}" for k, v in sorted(self.launches.get(p, {}).items()))
                lines.append(f"  kernel launches, {p}: {ran or 'none'}")
        return "\n".join(lines)


def check_op(
    op: CustomOp[_P, _R] | DeferredFunctionOp,
    /,
    *args: object,
    checks: Sequence[str] = CHECKS,
    dtype: DType = None,
    atol: float | None = None,
    rtol: float | None = None,
    raise_on_failure: bool = True,
    **kwargs: object,
) -> CheckReport:
    """Check a customgrad op on the given arguments: correctness, fake kernel and split.

    The arguments that are differentiated are the tensors (and items of tensor lists) that
    require grad; when none does, every floating-point tensor argument is. Gradient checks
    run on float64 copies by default (``dtype=`` chooses another); ``opcheck`` and ``fake``
    use the arguments as given. The op's own arguments are never modified. Keyword arguments
    other than the options below go to the op (pass an op argument positionally if its name
    clashes with an option).

    While it runs, ``check_op`` wraps the op's registered backward functions to count their
    calls; do not register new ones for this op from another thread meanwhile.

    Args:
        op: the op to check.
        *args: positional arguments for the op.
        checks: the checks to run, a subset of :data:`CHECKS`; the others are reported as
            skipped.
        dtype: the dtype of the floating-point arguments in ``gradcheck``,
            ``gradgradcheck``, ``split`` and ``flops``: ``torch.float64`` when None (the
            default; an op whose call or backward raises in float64 but not on the arguments
            as given is checked on them, and :attr:`CheckReport.dtype_note` says why), another
            floating dtype (kernels without float64: Triton's), or ``"own"`` for the arguments
            as given. float32 gradchecks use a larger step and
            tolerances (``eps=1e-3``, ``atol=rtol=1e-2``); float16 and bfloat16 are too coarse
            for finite differences, and those gradchecks are skipped, saying so.
        atol: absolute tolerance for the split comparison (default 1e-7 in float64, torch's
            default for the dtype otherwise, as ``torch.testing.assert_close``).
        rtol: relative tolerance for the split comparison (same defaults as ``atol``).
        raise_on_failure: raise :class:`CheckFailed` if anything failed (default). When False,
            return the report and let the caller look at ``report.ok``.
        **kwargs: keyword arguments for the op.

    Returns:
        The :class:`CheckReport`.

    Raises:
        CheckFailed: one or more checks failed; the message lists each, with details.
        ValueError: ``checks`` names an unknown check.

    Examples:
        >>> import torch, customgrad as cg
        >>> from customgrad.testing import check_op
        >>> @cg.op("doc_testing::scale", weights=("w",))
        ... def scale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ...     return x * w
        >>> @scale.register_fake
        ... def _(x, w):
        ...     return torch.empty_like(x)
        >>> @scale.register_save_for_backward
        ... def _(inputs, output):
        ...     return inputs.x, inputs.w
        >>> @scale.register_backward_input
        ... def _(ctx, saved, grad):
        ...     return {"x": grad * saved[1]}
        >>> @scale.register_backward_weight
        ... def _(ctx, saved, grad):
        ...     return {"w": grad * saved[0]}
        >>> report = check_op(scale, torch.randn(3), torch.randn(3))
        >>> report.ok
        True
        >>> report.calls["input"]
        {'backward_input': 1}
        >>> report["gradcheck"].dtype
        'float64'
        >>> check_op(scale, torch.randn(3), torch.randn(3), dtype=torch.float32)["split"].dtype
        'float32'
    """
    checked = _the_op(op, args, kwargs)
    unknown = [c for c in checks if c not in CHECKS]
    if unknown:
        raise ArgumentValueError(
            f"check_op: unknown check {unknown[0]!r}. Checks: {', '.join(CHECKS)}."
        ) from None
    if not (
        dtype is None
        or dtype == "own"
        or (isinstance(dtype, torch.dtype) and dtype.is_floating_point)
    ):
        raise ArgumentValueError(
            f'check_op({checked.name}): dtype must be a floating-point torch.dtype, "own" (the '
            f"arguments' own dtypes) or None (float64), got {dtype!r}. Pass e.g. "
            f"dtype=torch.float32."
        )
    case = _Case(checked, args, kwargs, dtype=dtype, atol=atol, rtol=rtol)
    report = CheckReport(checked.name)
    for name in CHECKS:
        if name not in checks:
            report.results.append(CheckResult(name, "skipped", "not requested"))
            continue
        try:
            status, detail = case.run(name)
        except Exception as e:  # a check that crashes is a failure of the op, reported
            status, detail = "failed", f"raised {_short_exc(e)}"
        used = "own" if name in ("opcheck", "fake") else case.dtype_label
        report.results.append(CheckResult(name, status, detail, used))
    report.flops = dict(case.split.flops)
    report.calls = {p: dict(c) for p, c in case.split.calls.items()}
    report.launches = {p: dict(c) for p, c in case.split.launches.items()}
    report.backward = _backward_split(checked, {s.name for s in case.args.diff})
    report.dtype_note = case.note
    if raise_on_failure:
        report.raise_if_failed()
    return report


MSG_NOT_AN_OP = """\
check_op: expected a customgrad op, got {got}. Pass the op that customgrad.op, \
customgrad.from_function or customgrad.from_functions made:

    check_op(linear, x, weight)                  # @customgrad.op(...) def linear(...)
    check_op(patch.ops["mymodule.MyFunction"], x, weight)   # patch = from_functions(...)

For other torch.library ops use torch.library.opcheck."""


def _the_op(
    op: object, args: tuple[object, ...], kwargs: Mapping[str, object]
) -> CustomOp[..., Any]:
    """The :class:`CustomOp` to check: ``op`` itself, or the op a ``from_function`` op defined
    at its first call stands for (defined now from these arguments, when it was not called
    yet: on copies, without gradients)."""
    if isinstance(op, DeferredFunctionOp):
        if op.op is None:
            given: Any = (args, kwargs)
            copies: Any = optree.tree_map(
                lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, given
            )
            with torch.no_grad():
                op(*copies[0], **copies[1])
        assert op.op is not None  # its first call defines it
        return op.op
    if isinstance(op, CustomOp):
        return op
    got = (
        "a FunctionPatch (what from_functions returns): check one of its ops, patch.ops[...] "
        f"({', '.join(op.ops) or 'none'})"
        if isinstance(op, FunctionPatch)
        else repr(op)
    )
    raise ArgumentTypeError(MSG_NOT_AN_OP.format(got=got))


# --------------------------------------------------------------------------------------------
# Arguments


@dataclass(frozen=True)
class _Slot:
    """Where one differentiable tensor sits in the arguments: name and list index."""

    name: str
    index: int | None
    is_weight: bool

    def label(self) -> str:
        return repr(self.name) if self.index is None else f"{self.name!r}[{self.index}]"


_OPCHECK_FAILED = re.compile(r"^torch\.library\.opcheck's \w+ failed: ", re.MULTILINE)


def _raised(detail: str) -> str | None:
    """The one error a failed check's detail reports (``"raised X: ..."``, or opcheck's tests
    that all failed with it), or None."""
    if detail.startswith("raised "):
        return detail.removeprefix("raised ")
    first, *errors = _OPCHECK_FAILED.split(detail)
    if errors and not first and len({e.rstrip("\n") for e in errors}) == 1:
        return errors[0].rstrip("\n")
    return None


def _grouped(failures: Sequence[CheckResult]) -> list[tuple[list[str], str]]:
    """The failures as (check names, detail), the checks that raised the same error together
    (the detail then the error alone), in the order of their first check."""
    groups: dict[str, tuple[list[str], str]] = {}
    out: list[tuple[list[str], str]] = []
    for r in failures:
        error = _raised(r.detail)
        if error is None:
            out.append(([r.name], r.detail))
        elif error in groups:
            groups[error][0].append(r.name)
        else:
            groups[error] = ([r.name], r.detail)
            out.append(groups[error])
    return [
        (names, detail if len(names) == 1 else (_raised(detail) or detail)) for names, detail in out
    ]


def _backward_split(op: CustomOp[_P, _R], differentiated: set[str]) -> str:
    """:attr:`CheckReport.backward`: how the op's backward splits (for a pair, the gradients
    each half returns in the check: those of the ``differentiated`` arguments)."""
    rules = op.rules
    if rules.backward is None:
        sig = op.signature

        def returns(names: Sequence[str]) -> str:
            found = [repr(n) for n in names if n in differentiated]
            return f"returns {', '.join(found)}" if found else "returns no gradient here"

        halves = [
            f"{label} {returns(names)} in the {when} pass"
            for label, fn, names, when in (
                ("backward_input", rules.backward_input, sig.input_names, "input"),
                ("backward_weight", rules.backward_weight, sig.weights, "weight"),
            )
            if fn is not None
        ]
        if not halves:
            return ""
        return ("the pair: " if len(halves) == 2 else "one half: ") + "; ".join(halves)
    if isinstance(rules.auto, AutoSplitter):
        return f"one backward, {rules.auto.describe()}"
    return (
        "one backward, called in each pass with ctx.needs_input_grad set for the pass "
        "(split='phase')"
    )


def _short_exc(e: BaseException, lines: int = 6) -> str:
    text = str(e).strip().splitlines()
    body = "\n".join(text[:lines]) + ("\n..." if len(text) > lines else "")
    return f"{type(e).__name__}: {body}"


class _Arguments(Generic[_R]):
    """The op's arguments, bound once by its signature, and a fresh copy of them for each check:
    which tensors are differentiated (:attr:`diff`), and calling the op on a copy."""

    def __init__(
        self, op: CustomOp[..., _R], args: tuple[object, ...], kwargs: Mapping[str, object]
    ):
        self.op = op
        self.sig = op.signature
        self.names = list(self.sig.names)
        self.values: Values = dict(zip(self.names, self.sig.bind(args, kwargs)))
        weights = self.sig.weight_set

        slots: list[_Slot] = []
        for name in self.names:
            v = self.values[name]
            if isinstance(v, torch.Tensor):
                slots.append(_Slot(name, None, name in weights))
            elif isinstance(v, (list, tuple)):
                slots.extend(
                    _Slot(name, i, name in weights)
                    for i, t in enumerate(v)
                    if isinstance(t, torch.Tensor)
                )
        tensors = [self.get(s) for s in slots]
        chosen = [s for s, t in zip(slots, tensors) if t.requires_grad]
        if not chosen:
            chosen = [s for s, t in zip(slots, tensors) if t.is_floating_point()]
        self.diff = chosen
        """The differentiated tensors: those that require grad, else every floating-point one."""

    def get(self, slot: _Slot, values: Values | None = None) -> torch.Tensor:
        v = (self.values if values is None else values)[slot.name]
        if slot.index is not None:
            assert isinstance(v, (list, tuple))  # a slot with an index is in a list argument
            v = v[slot.index]
        assert isinstance(v, torch.Tensor)
        return v

    def copy(self, *, dtype: torch.dtype | None = None, grad: bool = True) -> Values:
        """Fresh argument values: detached clones (floating-point ones in ``dtype`` unless
        None); differentiable ones are new leaves."""
        diff = {(s.name, s.index) for s in self.diff}

        def fresh(t: torch.Tensor, key: tuple[str, int | None]) -> torch.Tensor:
            c = t.detach().clone()
            if dtype is not None and c.is_floating_point():
                c = c.to(dtype)
            if grad and key in diff:
                c.requires_grad_(True)
            return c

        out: Values = {}
        for name, v in self.values.items():
            if isinstance(v, torch.Tensor):
                out[name] = fresh(v, (name, None))
            elif isinstance(v, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in v):
                items = [
                    fresh(t, (name, i)) if isinstance(t, torch.Tensor) else t
                    for i, t in enumerate(v)
                ]
                out[name] = type(v)(items) if isinstance(v, tuple) else items
            else:
                out[name] = v
        return out

    def split_call(self, values: Values) -> tuple[tuple[object, ...], Values]:
        kwonly = self.sig.kwonly_names
        args = tuple(values[n] for n in self.names if n not in kwonly)
        kwargs = {n: values[n] for n in kwonly}
        return args, kwargs

    def call(self, values: Values, fn: Callable[..., object] | None = None) -> object:
        return self.sig.call(self.op if fn is None else fn, tuple(values[n] for n in self.names))

    def with_diff(self, values: Values, tensors: Sequence[torch.Tensor]) -> Values:
        """``values`` with the differentiable slots replaced by ``tensors``."""
        out = {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in values.items()}
        for s, t in zip(self.diff, tensors):
            if s.index is None:
                out[s.name] = t
            else:
                items = out[s.name]
                assert isinstance(items, list)  # a list argument, copied into a list above
                items[s.index] = t
        return out

    @staticmethod
    def outputs(out: object) -> list[torch.Tensor]:
        """The differentiable tensors among the op's outputs."""
        return [t for t in _tensors_of(out) if t.requires_grad]


# --------------------------------------------------------------------------------------------
# Checks


class _Case(Generic[_R]):
    """The op and its arguments, with one method per check (the split and FLOPs checks share
    one run, :class:`_SplitCheck`)."""

    def __init__(
        self,
        op: CustomOp[..., _R],
        args: tuple[object, ...],
        kwargs: Mapping[str, object],
        *,
        dtype: DType,
        atol: float | None,
        rtol: float | None,
    ):
        self.op = op
        self.args = _Arguments(op, args, kwargs)
        self._atol, self._rtol = atol, rtol
        self._default = dtype is None  # float64, unless the op rejects it
        self._probed = False
        self.note = ""
        """Why the gradient checks ran in the arguments' dtypes instead of float64 (or "")."""
        self._use(torch.float64 if dtype is None else dtype)

    def _use(self, dtype: torch.dtype | Literal["own"]) -> None:
        """Run the gradient checks in ``dtype`` (``"own"``: the arguments' own dtypes)."""
        self.dtype: torch.dtype | None = None if dtype == "own" else dtype
        own = sorted({str(self.args.get(s).dtype).removeprefix("torch.") for s in self.args.diff})
        self.dtype_label = (
            str(dtype).removeprefix("torch.") if self.dtype is not None else ", ".join(own) or "own"
        )
        atol, rtol = self._atol, self._rtol
        if self.dtype == torch.float64:
            atol, rtol = (1e-7 if atol is None else atol), (1e-7 if rtol is None else rtol)
        self.split = _SplitCheck(self.args, dtype=self.dtype, atol=atol, rtol=rtol)
        self._split_outcome: dict[str, tuple[Status, str]] | None = None

    def _runs_in(self, dtype: torch.dtype | None) -> Exception | None:
        """What the op's call and a full backward raise in ``dtype`` (None: the arguments'
        own), or None."""
        try:
            values = self.args.copy(dtype=dtype)
            outs = self.args.outputs(self.args.call(values))
            leaves = [self.args.get(s, values) for s in self.args.diff]
            if outs:
                gouts = [torch.ones_like(o) for o in outs]
                torch.autograd.grad(outs, leaves, gouts, allow_unused=True)
        except Exception as e:
            return e
        return None

    def probe_float64(self) -> str | None:
        """Once, before the gradient checks: whether the op runs in float64. If it does not but
        runs in the arguments' own dtypes, the checks run there when float64 was only the
        default (:attr:`note` says so), and fail with the fix when float64 was asked for."""
        if self._probed:
            return None if self.note else self._unsupported
        self._probed = True
        self._unsupported: str | None = None
        if self.dtype != torch.float64 or not self.args.diff:
            return None
        error = self._runs_in(torch.float64)
        if error is None or self._runs_in(None) is not None:
            return None  # it runs, or it fails either way: each check reports the error itself
        if not self._default:
            self._unsupported = MSG_NO_FLOAT64.format(op=self.op.name, exc=_short_exc(error, 1))
            return self._unsupported
        self._use("own")
        self.note = MSG_RAN_OWN.format(
            dtype=self.dtype_label, op=self.op.name, exc=_short_exc(error, 1)
        )
        return None

    def run(self, name: str) -> tuple[Status, str]:
        """Run the check ``name`` (one of :data:`CHECKS`)."""
        if name in ("gradcheck", "gradgradcheck", "split", "flops"):
            unsupported = self.probe_float64()
            if unsupported is not None:
                return "failed", unsupported
        if name in ("split", "flops"):  # one run of the split answers both
            if self._split_outcome is None:
                try:
                    self._split_outcome = self.split.run()
                except Exception as e:  # e.g. no autograd registered: a failure of both
                    failed: tuple[Status, str] = ("failed", f"raised {_short_exc(e)}")
                    self._split_outcome = {"split": failed, "flops": failed}
            return self._split_outcome[name]
        check: Callable[[], tuple[Status, str]] = getattr(self, f"run_{name}")
        return check()

    # -- opcheck ------------------------------------------------------------------------------
    def run_opcheck(self) -> tuple[Status, str]:
        args, kwargs = self.args.split_call(self.args.copy())
        with _quiet():
            results = torch.library.opcheck(self.op.opoverload, args, kwargs, raise_exception=False)
        failed: list[str] = []
        not_applicable: list[str] = []
        for test, r in results.items():
            if r == "SUCCESS":
                continue
            branch = _branch_on_value(r) if isinstance(r, BaseException) else None
            if branch is not None:
                once = "runs once: " if self.op.rules.backward is not None else ""
                not_applicable.append(MSG_BRANCH.format(test=test, once=once, at=branch))
                continue
            error = wrapped_error(r, CustomGradError) if isinstance(r, BaseException) else None
            shown = _short_exc(error or r) if isinstance(r, BaseException) else str(r)
            failed.append(f"torch.library.opcheck's {test} failed: {shown}")
        if failed:
            return "failed", "\n".join(failed)
        return "passed", "\n".join(not_applicable)

    # -- fake kernel --------------------------------------------------------------------------
    def run_fake(self) -> tuple[Status, str]:
        values = self.args.copy(grad=False)
        with torch.no_grad():
            real = _tensors_of(self.args.call(values, self.op.opoverload))
        with fake_tensor_mode_type()(allow_non_fake_inputs=False) as mode:
            fake_values = {
                k: [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in v]
                if isinstance(v, list)
                else (mode.from_tensor(v) if isinstance(v, torch.Tensor) else v)
                for k, v in values.items()
            }
            try:
                fake = _tensors_of(self.args.call(fake_values, self.op.opoverload))
            except Exception as e:
                return "failed", f"the fake kernel raised {_short_exc(e)}"
        if len(real) != len(fake):
            return "failed", (
                f"the real kernel returned {len(real)} tensor(s), the fake kernel {len(fake)}. "
                + FIX_FAKE
            )
        problems: list[str] = []
        for i, (r, f) in enumerate(zip(real, fake)):
            for what, rv, fv in (
                ("shape", tuple(r.shape), tuple(f.shape)),
                ("dtype", r.dtype, f.dtype),
                ("device", r.device, f.device),
            ):
                if rv != fv:
                    problems.append(f"output {i}: real {what} {rv}, fake {what} {fv}")
            if r.shape == f.shape and not _same_significant_strides(r, f):
                problems.append(
                    f"output {i}: real strides {tuple(r.stride())}, fake strides "
                    f"{tuple(f.stride())}"
                )
        if problems:
            return "failed", "\n".join([*problems, FIX_FAKE])
        return "passed", ""

    # -- gradcheck ----------------------------------------------------------------------------
    def _fn(self) -> tuple[Callable[..., tuple[torch.Tensor, ...]], list[torch.Tensor]]:
        values = self.args.copy(dtype=self.dtype)
        leaves = [self.args.get(s, values) for s in self.args.diff]

        def fn(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
            out = self.args.call(self.args.with_diff(values, tensors))
            return tuple(t for t in _tensors_of(out) if t.is_floating_point())

        return fn, leaves

    def _tolerances(self, leaves: list[torch.Tensor]) -> dict[str, float] | str:
        """gradcheck's step and tolerances for the dtype of ``leaves``, or why it can't run."""
        dtypes = {t.dtype for t in leaves}
        if dtypes <= {torch.float64, torch.complex128}:
            return {}
        coarse = sorted(str(d).removeprefix("torch.") for d in dtypes if d.itemsize < 4)
        if coarse:
            return MSG_COARSE_DTYPE.format(dtype=coarse[0])
        return {"eps": 1e-3, "atol": 1e-2, "rtol": 1e-2}

    def _gradcheck(self, check: Callable[..., bool], fn: Callable[..., object], leaves: list[torch.Tensor],
                   tolerances: dict[str, float]) -> None:  # fmt: skip
        with warnings.catch_warnings():
            # gradcheck warns about inputs that are not float64: the tolerances say so instead.
            warnings.filterwarnings("ignore", message=".*not a double precision floating point")
            check(fn, tuple(leaves), **tolerances)

    def run_gradcheck(self) -> tuple[Status, str]:
        if not self.args.diff:
            return "skipped", "no floating-point tensor argument to differentiate"
        fn, leaves = self._fn()
        tolerances = self._tolerances(leaves)
        if isinstance(tolerances, str):
            return "skipped", tolerances
        try:
            self._gradcheck(torch.autograd.gradcheck, fn, leaves, tolerances)
        except GradcheckError as e:
            return "failed", (
                f"the backward disagrees with finite differences: {self._explain(e)}"
                f"{self._float64_note('gradcheck')}"
            )
        return "passed", ""

    def _float64_note(self, check: str) -> str:
        """Why a float64 mismatch may be the kernel's float32 arithmetic, for arguments that
        are not float64 themselves (else "")."""
        own = sorted({str(self.args.get(s).dtype).removeprefix("torch.") for s in self.args.diff})
        if self.dtype != torch.float64 or own == ["float64"]:
            return ""
        return ". " + MSG_FLOAT64_MISMATCH.format(check=check, own=", ".join(own))

    def run_gradgradcheck(self) -> tuple[Status, str]:
        if not self.args.diff:
            return "skipped", "no floating-point tensor argument to differentiate"
        declared = sorted(HALF_NAMES[h] for h in self.op.rules.nondifferentiable)
        if declared:
            return "skipped", (
                f"not applicable: the backward is registered with differentiable=False "
                f"({', '.join(declared)}; a Function's @once_differentiable backward through "
                f"from_function): double backward raises by design"
            )
        fn, leaves = self._fn()
        tolerances = self._tolerances(leaves)
        if isinstance(tolerances, str):
            return "skipped", tolerances
        outs = [o for o in fn(*leaves) if o.requires_grad]
        grads = torch.autograd.grad(
            outs, leaves, [torch.ones_like(o) for o in outs], create_graph=True, allow_unused=True
        )
        if not any(g is not None and g.requires_grad for g in grads):
            return "skipped", (
                "the backward is not differentiable (its gradients do not require grad), so "
                "double backward is not supported"
            )
        try:
            self._gradcheck(torch.autograd.gradgradcheck, fn, leaves, tolerances)
        except GradcheckError as e:
            return (
                "failed",
                f"double backward disagrees with finite differences: {self._explain(e)}"
                f"{self._float64_note('gradgradcheck')}",
            )
        except DoubleBackwardError as e:  # customgrad refuses it, saying why: by design
            return "skipped", f"not applicable: {e}"
        return "passed", ""

    def _explain(self, e: GradcheckError) -> str:
        """The first line of a gradcheck error, with input numbers replaced by argument names."""
        first = str(e).strip().splitlines()[0].rstrip(",")
        labels = [s.label() for s in self.args.diff]

        def name(m: re.Match[str]) -> str:
            i = int(m.group(1))
            return f"with respect to {labels[i]}" if i < len(labels) else m.group(0)

        return re.sub(r"with respect to input (\d+)", name, first)


class _SplitCheck(Generic[_R]):
    """The ``split`` and ``flops`` checks: the input pass then the weight pass against the full
    backward (one :class:`~customgrad._split_run.SplitRun`), every call of the op's backward
    functions watched.

    Attributes:
        flops: FLOPs per pass (``"full"``, ``"input"``, ``"weight"``) once run.
        calls: per pass, how often each backward function ran.
        launches: per pass, kernel launches by kernel.
    """

    def __init__(
        self, args: _Arguments[_R], *, dtype: torch.dtype | None, atol: float | None,
        rtol: float | None,
    ) -> None:  # fmt: skip
        self.args = args
        self.op = args.op
        self.dtype = dtype
        self.atol = atol
        self.rtol = rtol
        self.flops: dict[str, int] = {}
        self.calls: dict[Pass, dict[str, int]] = {}
        self.launches: dict[str, dict[str, int]] = {}

    def run(self) -> dict[str, tuple[Status, str]]:
        """Both checks' outcomes, from one run of the split."""
        inputs = [s for s in self.args.diff if not s.is_weight]
        weights = [s for s in self.args.diff if s.is_weight]
        if not inputs or not weights:
            what = "no weight" if not weights else "no non-weight argument"
            reason = f"nothing to split: {what} among the differentiated arguments"
            return {"split": ("skipped", reason), "flops": ("skipped", reason)}

        gen = torch.Generator().manual_seed(0)
        measured = SplitRun(record=True, launches=True)
        watch = _BackwardWatch(self.op, measured)

        def forward() -> tuple[Values, list[torch.Tensor]]:
            values = self.args.copy(dtype=self.dtype)
            return values, self.args.outputs(self.args.call(values))

        def grad(slots: list[_Slot], *, retain: bool) -> list[torch.Tensor | None]:
            leaves = [self.args.get(s, values) for s in slots]
            return list(
                torch.autograd.grad(outs, leaves, gouts, retain_graph=retain, allow_unused=True)
            )

        values, outs = forward()
        gouts = [torch.randn(o.shape, generator=gen, dtype=o.dtype).to(o.device) for o in outs]
        with watch:
            full = measured.run("full", lambda: grad(self.args.diff, retain=False))
            values, outs = forward()
            dinputs = measured.run("input", lambda: grad(inputs, retain=True))
            dweights = measured.run("weight", lambda: grad(weights, retain=False))
        self.calls = {p: dict(c) for p, c in watch.calls.items()}
        self.flops = measured.flops
        self.launches = {p: dict(c.counts) for p, c in measured.launch_counters.items()}

        # split == full
        atol, rtol = self.atol, self.rtol  # both None: torch's defaults for the dtype
        if atol is not None or rtol is not None:
            atol, rtol = atol or 0.0, rtol or 0.0
        by_slot = dict(zip(inputs, dinputs)) | dict(zip(weights, dweights))
        split_grads = [by_slot[s] for s in self.args.diff]
        like = [self.args.get(s, values) for s in self.args.diff]
        mismatches = [
            f"gradient of {self.args.diff[d.at].label()} from the "
            f"{'weight' if self.args.diff[d.at].is_weight else 'input'} pass differs from the "
            f"full backward: {d.detail}"
            for d in differences(full, split_grads, like, atol=atol, rtol=rtol)
        ]
        split: tuple[Status, str] = ("passed", "")
        auto = self.op.rules.auto
        if mismatches:
            split = ("failed", "\n".join(mismatches))
        elif isinstance(auto, AutoSplitter) and isinstance(auto.last, TracedSplit):
            split = ("passed", MSG_CAPTURE_CHECKED)
        return {"split": split, "flops": self._flops_outcome(measured, watch, auto)}

    def _flops_outcome(
        self, measured: SplitRun, watch: _BackwardWatch[_R], auto: object
    ) -> tuple[Status, str]:
        """The ``flops`` check: nothing computed twice, and a split that does less than the full
        backward explained."""
        problems: list[str] = list(watch.problems)
        f = self.flops
        if f["input"] + f["weight"] > f["full"]:
            problems.insert(
                0,
                f"the split repeats {f['input'] + f['weight'] - f['full']} FLOPs: input pass "
                f"{f['input']} + weight pass {f['weight']} > full backward {f['full']}",
            )
        counted = {p: measured.counter(p).calls or [] for p in ("input", "weight")}
        twice = _done_twice(counted["input"], counted["weight"])
        launched = {p: c.calls for p, c in measured.launch_counters.items()}
        relaunched = _launched_twice(self.launches, launched)
        if relaunched and not problems:
            problems = [*relaunched, *twice, FIX_LAUNCHED_TWICE]
        elif twice and not problems:
            problems = [*twice, FIX_TWICE]
        elif problems:
            problems = [*problems, FIX_FLOPS]
        fallback = auto.fallback() if isinstance(auto, AutoSplitter) else None
        if problems and fallback is not None:
            problems.insert(-1, f"The single backward was {fallback.describe()}.")
        if problems:
            return "failed", "\n".join(problems)
        if f["input"] + f["weight"] < f["full"] and watch.unneeded:
            names = ", ".join(repr(n) for n in watch.unneeded)
            label = next(iter(watch.unneeded.values()))
            return "passed", MSG_FULL_DOES_MORE.format(
                less=f["full"] - f["input"] - f["weight"], full=f["full"], input=f["input"],
                weight=f["weight"], label=label, names=names,
                name=next(iter(watch.unneeded)),
            )  # fmt: skip
        if f["full"] == 0 and any(self.launches.values()):
            return "passed", MSG_LAUNCHES_COUNTED.format(launches=_launch_summary(self.launches))
        if f["full"] == 0:
            ran = "; ".join(
                f"{p} pass: "
                + (", ".join(f"{k} x{v}" for k, v in sorted(self.calls[p].items())) or "nothing")
                for p in ("input", "weight")
            )
            return "skipped", MSG_NO_FLOPS.format(ran=ran)
        return "passed", ""


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence what opcheck prints or warns about failures it reports anyway: fake tensors'
    error logs of this thread only (the logger's level is left alone), and warnings."""
    from customgrad._capture import _ThisThread

    logger = logging.getLogger(FAKE_TENSOR_LOGGER)
    quiet = _ThisThread()
    logger.addFilter(quiet)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.removeFilter(quiet)


def _branch_on_value(error: BaseException) -> str | None:
    """Where the op's code branched on a tensor value (``file:line`` and the line), if that is
    what ``error`` is (torch's data-dependent errors, raised while tracing with symbolic or fake
    values): the innermost frame of the traceback outside torch and customgrad."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    if not isinstance(error, (GuardOnDataDependentSymNode, data_dependent_errors()[0])):
        return None
    inside = (os.path.dirname(torch.__file__), os.path.dirname(__file__))
    found = None
    for frame in traceback.extract_tb(error.__traceback__):
        if not frame.filename.startswith(inside):
            found = frame
    if found is None:
        return None
    line = f" (`{found.line.strip()}`)" if found.line else ""
    return f"{found.filename}:{found.lineno}{line}"


def _same_significant_strides(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Strides agree on every dimension of size > 1 (others do not affect layout)."""
    if a.numel() == 0:
        return True
    return all(
        sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride()) if n > 1
    ) and math.prod(a.shape) == math.prod(b.shape)


class _BackwardWatch(Generic[_R]):
    """Sees every call of an op's registered backward functions (through the op's autograd
    observer hook) and records, per pass of the check, how often each ran; flags a half
    running in the other half's pass and gradients returned although
    ``ctx.needs_input_grad`` said no."""

    def __init__(self, op: CustomOp[..., _R], passes: SplitRun) -> None:
        self.op = op
        self.passes = passes
        self.calls: dict[Pass, dict[str, int]] = {"full": {}, "input": {}, "weight": {}}
        self.problems: list[str] = []
        self.unneeded: dict[str, str] = {}
        """The gradients the full backward computed that nothing asked for, by argument name:
        the backward function that computed each."""
        self._scope = contextlib.ExitStack()

    def __enter__(self) -> _BackwardWatch[_R]:
        self._scope.enter_context(autograd_impl(self.op).observing(self.seen))
        return self

    def __exit__(self, *exc: object) -> None:
        self._scope.close()

    def seen(self, label: str, node_phase: str, ctx: BackwardContext, result: object) -> None:
        phase: Pass = self.passes.phase  # type: ignore[assignment]  # one of PASSES while watched
        calls = self.calls[phase]
        calls[label] = calls.get(label, 0) + 1
        wrong_half = (label == "backward_input" and phase == "weight") or (
            label == "backward_weight" and phase == "input"
        )
        if wrong_half:
            self.problems.append(f"{label} ran in the {phase} pass")
        if label != "backward_shared" and isinstance(result, dict):
            for name, g in result.items():
                if not _has_tensor(g) or _safe_needs(ctx, name):
                    continue
                if phase == "full":
                    self.unneeded.setdefault(name, label)
                else:
                    self.problems.append(
                        f"{label} computed a gradient for {name!r} in the {phase} pass, "
                        f"where ctx.needs_input_grad({name!r}) is False (it is thrown away)"
                    )


def _tensors_of(out: object) -> list[torch.Tensor]:
    """The Tensors of an op's output (a Tensor, a list of Tensors, or a tuple of those; None for
    an Optional Tensor output left out), in order."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors_of(o)]
    return []


def _done_twice(first: list[Counted], second: list[Counted]) -> list[str]:
    """The counted computations the weight pass repeats from the input pass: the same op giving
    the same result (bit for bit)."""
    found: list[str] = []
    left = list(first)
    for func, flops, out in second:
        for i, (f0, n0, o0) in enumerate(left):
            if (
                f0 is func
                and n0 == flops
                and isinstance(out, torch.Tensor)
                and isinstance(o0, torch.Tensor)
                and o0.shape == out.shape
                and o0.dtype == out.dtype
                and torch.equal(o0, out)
            ):
                del left[i]
                found.append(
                    f"the input pass and the weight pass both compute {func} giving the same "
                    f"{tuple(out.shape)} tensor ({flops} FLOPs each time): work done twice"
                )
                break
    return found


MSG_LAUNCHES_COUNTED = (
    "no FLOPs to count (torch's formulas see none of the backward's kernels); kernel launches "
    "counted instead, each computed once: {launches}"
)


def _launch_summary(launches: dict[str, dict[str, int]]) -> str:
    return "; ".join(
        f"{p} pass: " + (", ".join(f"{k} x{v}" for k, v in sorted(launches[p].items())) or "none")
        for p in ("full", "input", "weight")
        if p in launches
    )


def _launched_twice(
    counts: dict[str, dict[str, int]], calls: dict[str, list[tuple[str, list[torch.Tensor]]]]
) -> list[str]:
    """Kernels that the split launches more often than the full backward, or that compute the
    same result (bit for bit) in the input pass and again in the weight pass."""
    found: list[str] = []
    full, first, second = (counts.get(p, {}) for p in ("full", "input", "weight"))
    for name in sorted(set(first) & set(second)):
        if first[name] + second[name] > full.get(name, 0):
            found.append(
                f"the backward kernel {name} ran in both passes: input pass x{first[name]}, "
                f"weight pass x{second[name]}, full backward x{full.get(name, 0)}: launched "
                f"more often than in the full backward"
            )
    left = list(calls.get("input", []))
    for name, outs in calls.get("weight", []):
        if any(name in f for f in found):
            continue
        for i, (n0, o0) in enumerate(left):
            if (
                n0 == name
                and len(o0) == len(outs)
                and all(
                    a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
                    for a, b in zip(o0, outs)
                )
            ):
                del left[i]
                found.append(
                    f"the backward kernel {name} ran in both passes, computing the same "
                    f"result in the input pass and again in the weight pass: work done twice"
                )
                break
    return found


def _has_tensor(g: object) -> bool:
    """Whether ``g`` holds a computed gradient (a traced split hands customgrad's validation the
    trace's fake tensors for the gradients no pass computes: those were not computed)."""

    def computed(t: object) -> bool:
        return isinstance(t, torch.Tensor) and not is_fake(t)

    if computed(g):
        return True
    return isinstance(g, (list, tuple)) and any(computed(t) for t in g)


def _safe_needs(ctx: BackwardContext, name: str) -> bool:
    try:
        return bool(ctx.needs_input_grad(name))
    except Exception:  # an unknown key: customgrad's validation reports it
        return True
