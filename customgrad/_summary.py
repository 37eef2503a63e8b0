"""``customgrad.summary()``: what customgrad knows about the ops of this process, as a table.

One row per registered op: how its backward splits (a registered pair, a traced single
backward, one that is not traced and runs once (the run-once rule) and why, one that ran inside
another trace, or ``split="phase"``), what every backward call of it did over the run (split,
ran once, ran whole; in how many I, W and full passes: counted by :mod:`customgrad._calls`) and
what is registered for it (kernels per device, a fake kernel, a jvp, shared work). The object
returned prints as a table, under one line that says whether any backward work was done twice
and what that answer cannot see, and keeps the rows as records for programs.

Only :func:`_registered_ops`, :func:`_registrations`, :func:`_calls` and :func:`_other_split`
read the op's internals.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from customgrad._op import CustomOp

__all__ = ["CompiledRegionRow", "OpRow", "Summary", "summary"]

_PASS = {"input": "I", "weight": "W", "full": "full"}
_KIND = {  # what the calls did, before the passes they did it in
    "split": "split in",
    "ran once": "ran once in",
    "handed": "took handed gradients in",
    "whole": "ran whole in",
    "per pass": "called per pass in",
    "split off": "ran whole with the split off in",
}


@dataclasses.dataclass(frozen=True)
class OpRow:
    """One op of :func:`summary`.

    Attributes:
        op: ``"ns::name"``.
        split: how its backward splits: ``"pair"`` (``register_backward_input``/``_weight``),
            ``"traced"`` (a single backward split automatically), ``"run once"`` (a single
            backward that is not traced: it runs once, whole, in the first pass that needs a
            gradient, and hands the later pass its gradients), ``"phase"``
            (``split="phase"``: called once per pass), ``"not run yet"`` (a single backward
            that has not run), ``"not split yet"`` (a single backward that ran only in full
            backwards, which call it as written: it is traced at its first split pass),
            ``"inside a trace"`` (its latest split pass ran inside another trace, such as
            ``torch.compile``'s AOTAutograd, ``make_fx`` or a functorch transform, which
            recorded the backward as written) or ``"none"`` (no backward registered).
        detail: in words: what the trace runs in each pass, or why it is not traced (and the
            bytes it held for the later pass).
        kernels: the device types with a kernel (``"all"``: the kernel registered for every
            device).
        registered: the other registrations, among ``"fake"``, ``"jvp"``, ``"shared"``.
        calls: what every backward call of the op did over the run, ``{kind: {pass: calls}}``
            (a call: one node's backward in one pass; ``str(summary)`` prints each count with
            its pass, ``"split in 3 I + 3 W passes"``) with passes ``"input"`` (I), ``"weight"``
            (W) and ``"full"`` (a full backward), and kinds
            ``"split"`` (the pass ran only its part), ``"ran once"`` (the whole backward, once,
            in the first pass that needed a gradient), ``"handed"`` (the later pass took the
            gradients the first one kept), ``"whole"`` (the pass needed every gradient the node
            requires: a full backward, or a node with nothing to split), ``"per pass"``
            (``split="phase"``) and ``"split off"`` (the whole backward in a pass that needed
            part of it, the split being off: repeated work). Empty before any backward.
    """

    op: str
    split: str
    detail: str
    kernels: tuple[str, ...]
    registered: tuple[str, ...]
    calls: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict, compare=False)

    @property
    def repeated(self) -> int:
        """Backward calls that did work another pass repeats (``"split off"`` calls)."""
        return sum(self.calls.get("split off", {}).values())


@dataclasses.dataclass(frozen=True)
class CompiledRegionRow:
    """One compiled region of :func:`summary`: where it comes from and how its backward split.

    Attributes:
        region: the name of the compiled module or function.
        split: ``"split"`` or ``"fell back"``.
        detail: in words.
        repeats: some pass ran its full backward where it would have split (a region that
            fell back runs it in each pass), so work was done twice.
        runs: how many times each of its graphs ran over the run: ``{"full": ..., "input":
            ..., "weight": ...}``.
    """

    region: str
    split: str
    detail: str
    repeats: bool = False
    runs: dict[str, int] = dataclasses.field(default_factory=dict, compare=False)


@dataclasses.dataclass(frozen=True)
class Summary:
    """The result of :func:`summary`: ``str(summary)`` is the table, ``ops`` and
    ``compiled_regions`` its rows.

    Attributes:
        ops: one row per registered op, sorted by name.
        compiled_regions: one row per compiled region seen.
        split_enabled: False while the split is turned off (``CUSTOMGRAD_SPLIT=0`` or
            :func:`customgrad.no_split`): every backward then runs whole in each pass.
        functions: the plain ``torch.autograd.Function`` classes (``module.QualName``) whose
            backward customgrad's split ran once in this process (a Liger-Kernel or unsloth
            kernel): they cannot split, so their weight work stays in the input pass.
        split_functions: the plain Function classes whose backward customgrad's split cut
            into an input and a weight part (captured by dynamo: input work in the input pass,
            weight work in the weight pass).
        other_split: backward calls of customgrad ops in a pass that needed only part of
            their gradients with no customgrad split planning it: torch's
            ``stage_backward_input`` / ``stage_backward_weight`` (torch's ``PipelineStage``),
            or ``autograd.grad`` asking for some of the inputs. The plain Functions of such a
            split are not seen; torch's split runs each one's whole backward in both passes.
    """

    ops: tuple[OpRow, ...]
    compiled_regions: tuple[CompiledRegionRow, ...]
    split_enabled: bool
    functions: tuple[str, ...] = ()
    split_functions: tuple[str, ...] = ()
    other_split: int = 0

    @property
    def repeated(self) -> str:
        """Whether any backward work was done twice over the run, in one line (the first line
        of ``str(summary)``): by customgrad ops, compiled regions and the plain
        ``autograd.Function``\\ s customgrad's split ran; then what it cannot see (plain
        Functions outside customgrad's split, and how many calls of customgrad ops ran in
        such a split)."""
        return _repeated_line(self)

    def __str__(self) -> str:
        lines: list[str] = [self.repeated]
        if not self.split_enabled:
            lines.append(
                "The split is off (CUSTOMGRAD_SPLIT=0 or customgrad.no_split()): every backward "
                "below runs whole in each pass that reaches it."
            )
        if not self.ops:
            lines.append("No customgrad ops are registered.")
        else:
            lines.extend(
                _table(
                    (
                        "op",
                        "backward",
                        "kernels",
                        "also registered",
                        "backward calls over the run, by pass",
                        "how it splits",
                    ),
                    [
                        (
                            r.op,
                            r.split,
                            ", ".join(r.kernels) or "-",
                            ", ".join(r.registered) or "-",
                            calls_text(r.calls),
                            r.detail,
                        )
                        for r in self.ops
                    ],
                )
            )
        if self.compiled_regions:
            lines.append("")
            lines.extend(
                _table(
                    ("compiled region", "backward", "graphs run over the run", "how it splits"),
                    [
                        (r.region, r.split, _by_pass(r.runs) or "none yet", r.detail)
                        for r in self.compiled_regions
                    ],
                )
            )
        lines.extend(_function_lines(self.functions, self.split_functions))
        return "\n".join(lines)


def summary(namespace: str | None = None) -> Summary:
    """Every registered customgrad op: how its backward splits, and what it registered.

    A single ``register_backward`` is traced and split at its first split pass (one that
    needs only the input or only the weight gradients; a full backward calls it as written), so
    run one split step before reading how it split (``"not run yet"``, then ``"not split yet"``
    after full backwards only).

    Args:
        namespace: only the ops of this namespace (``"mylib"`` for ``mylib::linear``), and no
            compiled regions.

    Returns:
        A :class:`Summary`; print it for a table.

    Example:
        >>> import customgrad
        >>> print(customgrad.summary("no_such_namespace"))
        Backward work done twice over the run: none (0 backward calls of customgrad ops). Not seen: plain autograd.Functions outside customgrad's split.
        No customgrad ops are registered.
    """
    from customgrad._switches import split_enabled

    rows = tuple(
        _op_row(op)
        for op in sorted(_registered_ops(), key=lambda o: o.name)
        if namespace is None or op.name.split("::")[0] == namespace
    )
    return Summary(
        ops=rows,
        compiled_regions=tuple(_compiled_region_rows()) if namespace is None else (),
        split_enabled=split_enabled(),
        functions=_functions_run_once() if namespace is None else (),
        split_functions=_functions_split() if namespace is None else (),
        other_split=sum(_other_split(op) for op in _registered_ops_of(rows)),
    )


def calls_text(calls: dict[str, dict[str, int]]) -> str:
    """:attr:`OpRow.calls` in words, each count named by its pass: ``"split in 4 I + 4 W
    passes; ran whole in 2 full backwards"``."""
    if not calls:
        return "none yet"
    return "; ".join(f"{_KIND[kind]} {passes_text(phases)}" for kind, phases in calls.items())


def passes_text(phases: dict[str, int]) -> str:
    """``{"input": 4, "weight": 1, "full": 2}`` as ``"4 I + 1 W passes and 2 full backwards"``."""
    split = [(n, _PASS[p]) for p, n in phases.items() if p != "full" and n]
    parts = []
    if split:
        total = sum(n for n, _ in split)
        parts.append(
            " + ".join(f"{n} {p}" for n, p in split) + (" pass" if total == 1 else " passes")
        )
    full = phases.get("full", 0)
    if full:
        parts.append(f"{full} full backward" + ("" if full == 1 else "s"))
    return " and ".join(parts)


def _by_pass(counts: dict[str, int]) -> str:
    """``{"input": 4, "weight": 4}`` as ``"I 4, W 4"``."""
    return ", ".join(f"{_PASS[p]} {n}" for p, n in counts.items())


MSG_NOT_SEEN = "Not seen: plain autograd.Functions outside customgrad's split."
MSG_OTHER_SPLIT = (
    "Not seen: plain autograd.Functions outside customgrad's split, and {n} of these calls ran "
    "in one (torch's stage_backward_input / stage_backward_weight, or autograd.grad asking for "
    "some inputs), where a plain Function runs its whole backward in each pass."
)


def _repeated_line(s: Summary) -> str:
    """The answer to "is any backward work done twice?" over the run, in one line: customgrad
    ops, compiled regions and the plain Functions customgrad's split ran, then what it cannot
    see."""
    ops = [r for r in s.ops if r.repeated]
    regions = [r for r in s.compiled_regions if r.repeats]
    calls = sum(n for r in s.ops for phases in r.calls.values() for n in phases.values())
    not_seen = MSG_OTHER_SPLIT.format(n=s.other_split) if s.other_split else MSG_NOT_SEEN
    if not ops and not regions:
        runs = sum(n for r in s.compiled_regions for n in r.runs.values())
        seen = f"{calls} backward calls of customgrad ops"
        if s.compiled_regions:
            seen += f", {runs} graph runs of compiled regions"
        functions = len(s.functions) + len(s.split_functions)
        if functions:
            seen += f", {functions} plain autograd.Function classes run once or split"
        return f"Backward work done twice over the run: none ({seen}). {not_seen}"
    named = [f"{r.op} ({r.repeated} calls with the split off)" for r in ops]
    named += [
        f"compiled region {r.region} ("
        + ("its full backward in each pass" if r.split == "fell back" else "some pass ran it whole")
        + ")"
        for r in regions
    ]
    return f"Backward work done twice over the run: {', '.join(named)}. {not_seen}"


def _functions_run_once() -> tuple[str, ...]:
    """The plain Function classes customgrad's split ran once (none before it ran)."""
    backward = sys.modules.get("customgrad.pipelining._backward")
    if backward is None:
        return ()
    return tuple(sorted(f"{c.__module__}.{c.__qualname__}" for c in backward._TOLD))


def _functions_split() -> tuple[str, ...]:
    """The plain Function classes customgrad's split split (none before it ran)."""
    split = sys.modules.get("customgrad.pipelining._function_split")
    if split is None:
        return ()
    return tuple(sorted(f"{c.__module__}.{c.__qualname__}" for c in split.SPLIT))


def _function_lines(functions: Sequence[str], split: Sequence[str]) -> list[str]:
    lines = []
    if split:
        lines += [
            "",
            "Plain autograd.Functions whose backward customgrad's split cut into an input and a "
            "weight part (captured by dynamo: input work in the input pass, weight work in the "
            "weight pass):",
            *(f"  {name}" for name in split),
        ]
    if functions:
        lines += [
            "",
            "Plain autograd.Functions customgrad's split ran once (their backward whole, in the "
            "input pass; the weight pass received the weight gradients they returned; torch's "
            "split runs them twice; the log gave each one's reason once):",
            *(f"  {name}" for name in functions),
        ]
    return lines


def _registered_ops_of(rows: Sequence[OpRow]) -> Iterable[CustomOp[..., Any]]:
    """The ops of these rows."""
    names = {r.op for r in rows}
    return (op for op in _registered_ops() if op.name in names)


def _registered_ops() -> Iterable[CustomOp[..., Any]]:
    """The ops defined in this process (the registry of :mod:`customgrad._op`)."""
    from customgrad._op import registered_ops

    return registered_ops()


def _registrations(op: CustomOp[..., Any]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The device types with a kernel, and which of fake/jvp/shared are registered."""
    devices = op._kernels.by_device
    kernels = (*(("all",) if None in devices else ()), *sorted(d for d in devices if d))
    rules = op.rules
    registered = tuple(
        name
        for name, present in (
            ("fake", op._kernels.fake is not None),
            ("jvp", rules.jvp is not None),
            ("shared", rules.backward_shared is not None),
        )
        if present
    )
    return kernels, registered


def _compiled_region_rows() -> Sequence[CompiledRegionRow]:
    """The compiled regions alive in this process (none unless :func:`customgrad.compile` ran)."""
    compiled = sys.modules.get("customgrad._compile")
    if compiled is None:
        return ()
    rows = []
    for region in compiled.regions():
        if region.status == "split":
            i, w = region.input_pass, region.weight_pass
            detail = (
                f"I computes {', '.join(i.computes) if i and i.computes else 'nothing'}; "
                f"W computes {', '.join(w.computes) if w and w.computes else 'nothing'}; "
                f"I keeps {len(region.handoff)} value(s) for W, W recomputes "
                f"{len(region.recomputed)}"
            )
            repeated = region.repeated
            if repeated:
                detail += f"; some pass ran the full backward: {repeated}"
            rows.append(
                CompiledRegionRow(region.name, "split", detail, bool(repeated), dict(region.runs))
            )
        else:
            rows.append(
                CompiledRegionRow(
                    region.name, "fell back", region.reason or "-", True, dict(region.runs)
                )
            )
    return rows


def _op_row(op: CustomOp[..., Any]) -> OpRow:
    from customgrad._autosplit import AutoSplitter, Fallback
    from customgrad._capture import INSIDE_TRACE

    rules = op.rules
    kernels, registered = _registrations(op)
    nondiff = sorted(rules.nondifferentiable)
    if rules.backward is None:
        halves = [
            name
            for name, fn in (("input", rules.backward_input), ("weight", rules.backward_weight))
            if fn is not None
        ]
        if not halves:
            split, detail = "none", "no backward registered: the op cannot be differentiated"
        else:
            split = "pair"
            detail = "registered: " + (
                "the input and weight halves" if len(halves) == 2 else f"the {halves[0]} half"
            )
    elif rules.split == "phase" or not isinstance(rules.auto, AutoSplitter):
        split = "phase"
        detail = "split='phase': called whole in each pass, ctx.needs_input_grad set for it"
    else:
        last = rules.auto.last
        if last is None and not _calls(op):
            split, detail = "not run yet", "traced and split at its first split pass"
        elif last is None:
            split = "not split yet"
            detail = (
                "only full backwards ran, each calling the function as written; traced and "
                "split at its first split pass (one that needs only the input or only the "
                "weight gradients)"
            )
        elif last is INSIDE_TRACE:
            split = "inside a trace"
            detail = (
                "its latest split pass ran inside another trace (torch.compile's AOTAutograd, "
                "make_fx or a functorch transform), which recorded the backward as written: how "
                "that splits is the trace's (a compiled region's row says)"
            )
        elif isinstance(last, Fallback):
            # The run-once rule: called once per backward, the later pass's gradients handed.
            split = "run once"
            held = rules.auto.held_bytes
            detail = f"{last.why}; runs once, whole, in the first pass that needs a gradient"
            if held is not None:
                detail += f", {held} bytes held for the later pass"
            if last.fix:
                detail += f"; fix: {last.fix}"
        else:
            split, detail = "traced", last.describe().removeprefix("split automatically (")
            detail = "latest trace: " + detail.removeprefix("traced: ").removesuffix(")")
    if nondiff:
        detail += f" (differentiable=False: {', '.join(nondiff)})"
    return OpRow(op.name, split, detail, kernels, registered, _calls(op))


def _calls(op: CustomOp[..., Any]) -> dict[str, dict[str, int]]:
    """What the op's backward calls did over the run (:class:`customgrad._calls.CallCounts`)."""
    return op._impl.calls.by_kind()


def _other_split(op: CustomOp[..., Any]) -> int:
    """The op's backward calls in a split not customgrad's
    (:attr:`customgrad._calls.CallCounts.other_split`)."""
    return op._impl.calls.other_split


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Left-aligned columns; the last column is not padded."""
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header) - 1)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join([*(c.ljust(w) for c, w in zip(cells, widths)), cells[-1]]).rstrip()

    return [line(header), line(["-" * w for w in widths] + ["-" * len(header[-1])])] + [
        line(r) for r in rows
    ]
