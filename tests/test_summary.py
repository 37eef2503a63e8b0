"""``customgrad.summary()``: every registered op, how its backward splits, what it registered.

Each printed cell is pinned: :func:`_cells` reads the table back by its columns (the dashes
under the header), so every test below says what a user reads in each column.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor

import customgrad as cg
from customgrad import OpRow
from customgrad.pipelining import stage_backward_input, stage_backward_weight
from tests._skips import TORCH_SPLIT

HEADER = (
    "op",
    "backward",
    "kernels",
    "also registered",
    "backward calls over the run, by pass",
    "how it splits",
)
NOT_SEEN = "Not seen: plain autograd.Functions outside customgrad's split."


def _linear(name: str, namespace: str = "test_summary", **kwargs: Any) -> Any:
    @cg.op(f"{namespace}::{name}", weights=("w",), **kwargs)
    def linear(x: Tensor, w: Tensor) -> Tensor:
        return x @ w.mT

    @linear.register_fake
    def _(x: Tensor, w: Tensor) -> Tensor:
        return x.new_empty((*x.shape[:-1], w.shape[0]))

    @linear.register_save_for_backward
    def _(inputs: Any, output: Tensor) -> Any:
        return inputs.x, inputs.w

    return linear


def _backward(ctx: Any, saved: Any, g: Tensor) -> dict[str, Tensor]:
    x, w = saved
    return {"x": g @ w, "w": g.mT @ x}


def _branching(ctx: Any, saved: Any, g: Tensor) -> dict[str, Tensor]:
    x, w = saved
    if g.sum() > 0:  # a branch on a tensor value: not traceable
        g = g * 1.0
    return {"x": g @ w, "w": g.mT @ x}


def _run(op: Any) -> None:
    x = torch.randn(2, 3, requires_grad=True)
    w = torch.randn(4, 3, requires_grad=True)
    op(x, w).sum().backward()


def _row(name: str, namespace: str = "test_summary") -> OpRow:
    (row,) = [r for r in cg.summary(namespace).ops if r.op == f"{namespace}::{name}"]
    return row


def _cells(text: str, header: tuple[str, ...] = HEADER) -> dict[str, tuple[str, ...]]:
    """The table of ``str(summary)`` that starts with ``header``, read back by its columns:
    ``{first cell: the row's cells}``."""
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(header[0] + " "))
    starts = [
        i
        for i, c in enumerate(lines[at + 1])
        if c == "-" and (i == 0 or lines[at + 1][i - 1] == " ")
    ]
    assert len(starts) == len(header), lines[at + 1]
    bounds = [*zip(starts, [*starts[1:], None])]
    read = [tuple(line[a:b].strip() for a, b in bounds) for line in lines[at:]]
    assert read[0] == header
    rows = {}
    for cells in read[2:]:
        if not any(cells):
            break
        rows[cells[0]] = cells
    return rows


def _printed(name: str, namespace: str = "test_summary") -> tuple[str, ...]:
    """The printed cells of ``namespace::name``'s row."""
    return _cells(str(cg.summary(namespace)))[f"{namespace}::{name}"]


def test_a_single_backward_is_not_run_yet_then_traced() -> None:
    op = _linear("traced")
    op.register_backward(_backward)
    assert _row("traced") == OpRow(
        "test_summary::traced",
        "not run yet",
        "traced and split at its first split pass",
        ("all",),
        ("fake",),
    )
    _run(op)  # a full backward: the function as written, nothing traced
    row = _row("traced")
    assert row == OpRow(
        "test_summary::traced",
        "not split yet",
        "only full backwards ran, each calling the function as written; traced and split at its "
        "first split pass (one that needs only the input or only the weight gradients)",
        ("all",),
        ("fake",),
    )
    assert row.calls == {"whole": {"full": 1}}  # a full backward: one call, every gradient
    assert _printed("traced")[1:5] == (
        "not split yet",
        "all",
        "fake",
        "ran whole in 1 full backward",
    )
    _split_step(op, torch.randn(2, 3, requires_grad=True), torch.randn(4, 3, requires_grad=True))
    row = _row("traced")
    assert row == OpRow(
        "test_summary::traced",
        "traced",
        "latest trace: 3 ops; the input pass runs 1, the weight pass 2; 0 tensor(s) handed from "
        "the input pass to the weight pass, 0 op(s) recomputed there",
        ("all",),
        ("fake",),
    )
    assert row.calls == {"split": {"input": 1, "weight": 1}, "whole": {"full": 1}}
    assert _printed("traced") == (
        "test_summary::traced",
        "traced",
        "all",
        "fake",
        "split in 1 I + 1 W passes; ran whole in 1 full backward",
        "latest trace: 3 ops; the input pass runs 1, the weight pass 2; 0 tensor(s) handed from "
        "the input pass to the weight pass, 0 op(s) recomputed there",
    )


def test_a_row_before_any_backward() -> None:
    op = _linear("not_run")
    op.register_backward(_backward)
    assert _printed("not_run") == (
        "test_summary::not_run",
        "not run yet",
        "all",
        "fake",
        "none yet",
        "traced and split at its first split pass",
    )


def test_a_backward_that_cannot_be_traced_fell_back_and_says_why() -> None:
    op = _linear("branching")
    op.register_backward(_branching)
    _run(op)  # a full backward calls it as written: no trace tried yet
    assert _row("branching").split == "not split yet"
    _split_step(op, torch.randn(2, 3, requires_grad=True), torch.randn(4, 3, requires_grad=True))
    row = _row("branching")
    assert row.split == "run once"
    assert row.calls == {"ran once": {"input": 1}, "handed": {"weight": 1}, "whole": {"full": 1}}
    lines, first = inspect.getsourcelines(_branching)
    at = f"{inspect.getsourcefile(_branching)}:{first + 2} (`{lines[2].strip()}`)"
    assert row.detail == (  # held: w's 4x3 float32 gradient, for W
        f"it branches on tensor values in Python at {at}; runs once, whole, in the first pass "
        "that needs a gradient, 48 bytes held for the later pass; fix: compute with tensor ops "
        "instead (torch.where, masks), so the same ops run for every value"
    )
    assert _printed("branching") == (
        "test_summary::branching",
        "run once",
        "all",
        "fake",
        "ran once in 1 I pass; took handed gradients in 1 W pass; ran whole in 1 full backward",
        row.detail,
    )


def test_a_backward_whose_latest_pass_ran_inside_make_fx_says_so() -> None:
    # Inside another trace (make_fx here; AOTAutograd under torch.compile) the backward runs as
    # written, for that trace to record: neither traced by customgrad nor run once by it.
    from torch.fx.experimental.proxy_tensor import make_fx

    op = _linear("inside_make_fx", "test_summary_make_fx")
    op.register_backward(_backward)

    def input_grad(x: Tensor, w: Tensor) -> tuple[Tensor, ...]:
        return torch.autograd.grad(op(x, w).sum(), [x])

    make_fx(input_grad)(
        torch.randn(2, 3, requires_grad=True), torch.randn(4, 3, requires_grad=True)
    )
    row = _row("inside_make_fx", "test_summary_make_fx")
    assert row.split == "inside a trace"
    assert row.calls == {"whole": {"input": 1}}  # the whole backward, for an input pass
    assert _printed("inside_make_fx", "test_summary_make_fx") == (
        "test_summary_make_fx::inside_make_fx",
        "inside a trace",
        "all",
        "fake",
        "ran whole in 1 I pass",
        "its latest split pass ran inside another trace (torch.compile's AOTAutograd, make_fx "
        "or a functorch transform), which recorded the backward as written: how that splits "
        "is the trace's (a compiled region's row says)",
    )


def test_pair_phase_none_and_registrations() -> None:
    pair = _linear("pair")
    pair.register_backward_input(lambda ctx, saved, g: {"x": g @ saved[1]})
    pair.register_backward_weight(
        lambda ctx, saved, g: {"w": g.mT @ saved[0]}, differentiable=False
    )
    pair.register_backward_shared(lambda ctx, saved, g: None)
    pair.register_jvp(lambda inputs, output, tangents: output)
    pair.register_kernel("cpu", lambda x, w: x @ w.mT)
    phase = _linear("phase")
    phase.register_backward(_backward, split="phase")
    _linear("none")
    assert _row("pair") == OpRow(
        "test_summary::pair",
        "pair",
        "registered: the input and weight halves (differentiable=False: weight)",
        ("all", "cpu"),
        ("fake", "jvp", "shared"),
    )
    assert _row("phase") == OpRow(
        "test_summary::phase",
        "phase",
        "split='phase': called whole in each pass, ctx.needs_input_grad set for it",
        ("all",),
        ("fake",),
    )
    assert _row("none").split == "none"
    cells = _cells(str(cg.summary("test_summary")))
    assert cells["test_summary::pair"] == (
        "test_summary::pair",
        "pair",
        "all, cpu",
        "fake, jvp, shared",
        "none yet",
        "registered: the input and weight halves (differentiable=False: weight)",
    )
    assert cells["test_summary::phase"][1:5] == ("phase", "all", "fake", "none yet")
    assert cells["test_summary::none"] == (
        "test_summary::none",
        "none",
        "all",
        "fake",
        "none yet",
        "no backward registered: the op cannot be differentiated",
    )


def test_the_table() -> None:
    @cg.op("test_summary_table::scale")
    def scale(x: Tensor) -> Tensor:
        return 2 * x

    scale.register_save_for_backward(lambda inputs, output: ())
    scale.register_backward_input(lambda ctx, saved, g: {"x": 2 * g})
    scale(torch.ones(2, requires_grad=True)).sum().backward()
    assert str(cg.summary("test_summary_table")).splitlines() == [
        "Backward work done twice over the run: none (1 backward calls of customgrad ops). "
        + NOT_SEEN,
        "op                         backward  kernels  also registered  "
        "backward calls over the run, by pass  how it splits",
        "-------------------------  --------  -------  ---------------  "
        "------------------------------------  -------------",
        "test_summary_table::scale  pair      all      -                "
        "ran whole in 1 full backward          registered: the input half",
    ]


def test_the_table_says_when_the_split_is_off_and_when_there_is_nothing() -> None:
    with cg.no_split():
        text = str(cg.summary("test_summary_nothing_here"))
    assert text.splitlines() == [
        "Backward work done twice over the run: none (0 backward calls of customgrad ops). "
        + NOT_SEEN,
        "The split is off (CUSTOMGRAD_SPLIT=0 or customgrad.no_split()): every backward below "
        "runs whole in each pass that reaches it.",
        "No customgrad ops are registered.",
    ]
    assert "split is off" not in str(cg.summary("test_summary_nothing_here"))


def _split_step(op: Any, x: Tensor, w: Tensor) -> None:
    """One microbatch through customgrad's split: I (stage_backward_input), then W."""
    out = op(x, w)
    _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], [w])
    stage_backward_weight([w], groups)


def test_every_call_over_the_run_is_counted_not_only_the_latest_trace() -> None:
    # Rank 0 of a ZBV run holds the first stage (its input does not require grad: nothing to
    # split, a full backward that calls the function as written) and the last (split into I
    # and W, through the trace). The counts say both, over the run.
    op = _linear("over_the_run")
    op.register_backward(_backward)
    w = torch.randn(4, 3, requires_grad=True)
    for _ in range(3):
        _split_step(op, torch.randn(2, 3, requires_grad=True), w)
        op(torch.randn(2, 3), w).sum().backward()  # the first stage: only the weight
    row = _row("over_the_run")
    assert row.calls == {"split": {"input": 3, "weight": 3}, "whole": {"full": 3}}
    assert row.detail == (
        "latest trace: 3 ops; the input pass runs 1, the weight pass 2; 0 tensor(s) handed from "
        "the input pass to the weight pass, 0 op(s) recomputed there"
    )
    # each count named by its pass: 3 split backwards are 3 I passes and 3 W passes
    assert _printed("over_the_run")[4] == "split in 3 I + 3 W passes; ran whole in 3 full backwards"
    text = str(cg.summary("test_summary"))
    assert text.splitlines()[0].startswith("Backward work done twice over the run: none (")


def test_run_once_counts_the_pass_that_ran_and_the_pass_it_handed_to() -> None:
    op = _linear("run_once_calls")
    op.register_backward(_branching)
    w = torch.randn(4, 3, requires_grad=True)
    for _ in range(2):
        _split_step(op, torch.randn(2, 3, requires_grad=True), w)
    assert _row("run_once_calls").calls == {
        "ran once": {"input": 2},
        "handed": {"weight": 2},
    }
    assert _printed("run_once_calls")[1:5] == (
        "run once",
        "all",
        "fake",
        "ran once in 2 I passes; took handed gradients in 2 W passes",
    )


def test_pair_and_phase_calls_by_pass() -> None:
    pair = _linear("pair_calls")
    pair.register_backward_input(lambda ctx, saved, g: {"x": g @ saved[1]})
    pair.register_backward_weight(lambda ctx, saved, g: {"w": g.mT @ saved[0]})
    phase = _linear("phase_calls")
    phase.register_backward(_backward, split="phase")
    w = torch.randn(4, 3, requires_grad=True)
    for op in (pair, phase):
        _split_step(op, torch.randn(2, 3, requires_grad=True), w)
    assert _row("pair_calls").calls == {"split": {"input": 1, "weight": 1}}
    assert _row("phase_calls").calls == {"per pass": {"input": 1, "weight": 1}}
    assert _printed("pair_calls")[4] == "split in 1 I + 1 W passes"
    assert _printed("phase_calls")[4] == "called per pass in 1 I + 1 W passes"


def test_the_first_line_says_which_op_repeated_work_with_the_split_off() -> None:
    op = _linear("split_off_calls")
    op.register_backward_input(lambda ctx, saved, g: {"x": g @ saved[1]})
    op.register_backward_weight(lambda ctx, saved, g: {"w": g.mT @ saved[0]})
    w = torch.randn(4, 3, requires_grad=True)
    with cg.no_split():
        _split_step(op, torch.randn(2, 3, requires_grad=True), w)
    row = _row("split_off_calls")
    assert row.calls == {"split off": {"input": 1, "weight": 1}}
    assert row.repeated == 2
    summary = cg.summary("test_summary")
    assert summary.repeated.startswith("Backward work done twice over the run: ")
    assert "test_summary::split_off_calls (2 calls with the split off)" in summary.repeated
    assert summary.repeated.endswith(f"calls with the split off). {NOT_SEEN}")
    assert str(summary).splitlines()[0] == summary.repeated
    assert _printed("split_off_calls")[4] == "ran whole with the split off in 1 I + 1 W passes"


def test_the_fallback_fix_applied_splits() -> None:
    # The row's fix for a branch on a tensor value: "compute with tensor ops instead
    # (torch.where, masks), so the same ops run for every value". Applied, the op is traced and
    # every call splits.
    op = _linear("where_fix")

    @op.register_backward
    def _(ctx: Any, saved: Any, g: Tensor) -> dict[str, Tensor]:
        x, w = saved
        g = torch.where(g.sum() > 0, g * 1.0, g)  # was: if g.sum() > 0: g = g * 1.0
        return {"x": g @ w, "w": g.mT @ x}

    w = torch.randn(4, 3, requires_grad=True)
    x = torch.randn(2, 3, requires_grad=True)
    _split_step(op, x, w)
    row = _row("where_fix")
    assert row.split == "traced"
    assert row.calls == {"split": {"input": 1, "weight": 1}}
    torch.testing.assert_close((x.grad, w.grad), (torch.ones(2, 4) @ w.detach(),
                                                  torch.ones(4, 2) @ x.detach()))  # fmt: skip


def test_the_first_line_names_a_compiled_region_that_repeated_work() -> None:
    from customgrad import CompiledRegionRow, Summary

    split = CompiledRegionRow("Block (graph 0)", "split", "I computes ...", False, {"input": 2})
    fell = CompiledRegionRow("Other (graph 0)", "fell back", "CUDA graphs", True, {"full": 4})
    assert Summary((), (split,), True).repeated == (
        "Backward work done twice over the run: none (0 backward calls of customgrad ops, 2 "
        f"graph runs of compiled regions). {NOT_SEEN}"
    )
    assert Summary((), (split, fell), True).repeated == (
        "Backward work done twice over the run: compiled region Other (graph 0) (its full "
        f"backward in each pass). {NOT_SEEN}"
    )


def test_compiled_regions_count_their_graph_runs() -> None:
    from torch import nn

    class SummaryCountedBlock(nn.Sequential):  # a name no other test's region has
        pass

    m = SummaryCountedBlock(nn.Linear(4, 4), nn.Tanh())
    cg.compile(m, backend="aot_eager")
    x = torch.randn(2, 4, requires_grad=True)
    for _ in range(2):
        out = m(x)
        params = list(m.parameters())
        _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], params)
        stage_backward_weight(params, groups)
    (row,) = [r for r in cg.summary().compiled_regions if "SummaryCountedBlock" in r.region]
    assert row.split == "split" and not row.repeats
    assert row.runs == {"full": 0, "input": 2, "weight": 2}
    header = ("compiled region", "backward", "graphs run over the run", "how it splits")
    (cells,) = [c for n, c in _cells(str(cg.summary()), header).items() if "SummaryCounted" in n]
    assert cells[:3] == (row.region, "split", "full 0, I 2, W 2")
    assert cells[3] == row.detail and cells[3].startswith("I computes ")


def test_the_first_line_counts_the_plain_functions_customgrads_split_ran() -> None:
    from customgrad import Summary

    assert Summary((), (), True, functions=("m.A",), split_functions=("m.B",)).repeated == (
        "Backward work done twice over the run: none (0 backward calls of customgrad ops, 2 "
        f"plain autograd.Function classes run once or split). {NOT_SEEN}"
    )


@TORCH_SPLIT
def test_the_first_line_says_what_it_cannot_see_under_torchs_split() -> None:
    # torch's own split runs a plain Function's backward in I and again in W; customgrad does
    # not see the Function, but its ops on the same stage tell that a split not customgrad's ran.
    from torch.distributed.pipelining import _backward as torchs

    from tests.conftest import function_linear

    calls: list[str] = []
    fn = function_linear(lambda half, phase: calls.append(half))
    op = _linear("under_torchs_split", "test_summary_torch")
    op.register_backward_input(lambda ctx, saved, g: {"x": g @ saved[1]})
    op.register_backward_weight(lambda ctx, saved, g: {"w": g.mT @ saved[0]})
    x = torch.randn(2, 3, requires_grad=True)
    w1, w2 = torch.randn(3, 3, requires_grad=True), torch.randn(4, 3, requires_grad=True)
    out = op(fn(x, w1), w2)
    _, groups = torchs.stage_backward_input([out], [torch.ones_like(out)], [x], iter([w1, w2]))
    torchs.stage_backward_weight(iter([w1, w2]), groups)
    assert calls == ["fn", "fn"]  # the plain Function's whole backward, twice
    assert _row("under_torchs_split", "test_summary_torch").calls == {
        "split": {"input": 1, "weight": 1}
    }
    summary = cg.summary("test_summary_torch")
    assert summary.other_split == 2
    (first, *_) = str(summary).splitlines()
    assert (
        first
        == summary.repeated
        == (
            "Backward work done twice over the run: none (2 backward calls of customgrad ops). "
            "Not seen: plain autograd.Functions outside customgrad's split, and 2 "
            "of these calls ran in one (torch's stage_backward_input / stage_backward_weight, or "
            "autograd.grad asking for some inputs), where a plain Function runs its whole backward "
            "in each pass."
        )
    )


def test_customgrads_split_is_not_counted_as_another_split() -> None:
    op = _linear("not_other_split", "test_summary_own_split")
    op.register_backward_input(lambda ctx, saved, g: {"x": g @ saved[1]})
    op.register_backward_weight(lambda ctx, saved, g: {"w": g.mT @ saved[0]})
    _split_step(op, torch.randn(2, 3, requires_grad=True), torch.randn(4, 3, requires_grad=True))
    x, w = torch.randn(2, 3, requires_grad=True), torch.randn(4, 3, requires_grad=True)
    op(x, w).sum().backward()
    summary = cg.summary("test_summary_own_split")
    (row,) = summary.ops
    assert row.calls == {"split": {"input": 1, "weight": 1}, "whole": {"full": 1}}
    assert summary.other_split == 0
    torch.autograd.grad(op(x, w).sum(), [x])  # a pass that asks for part of the gradients
    assert cg.summary("test_summary_own_split").other_split == 1
