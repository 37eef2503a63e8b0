"""The automatic split of a single backward (``register_backward``, ``split="auto"``).

A backward that returns every gradient is traced once per input signature and cut into an input
and a weight pass. Checked against references written with native ops (float64): gradients of
the input pass (I), the weight pass (W) and a full backward; exact FLOPs with torch's
``FlopCounterMode``: FLOPs(I) + FLOPs(W) == FLOPs(full) == FLOPs of the backward called as
written; shared work done once and handed from I to W; the fallback for untraceable backwards;
the trace cache; torch.compile, double backward, functorch; lists, several outputs, None.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
import re
import sys
import threading
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.pipelining import _backward as torch_backward
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import customgrad as cg
from customgrad._autosplit import (
    MSG_FALLBACK,
    NOT_SPLIT_YET,
    AutoSplitter,
    Fallback,
    TracedSplit,
)
from customgrad._errors import where
from customgrad._handoff import Kept
from customgrad._record import record_of
from customgrad._torch import dynamo
from customgrad.graph import explain_split
from customgrad.pipelining import stage_backward_input, stage_backward_weight
from customgrad.testing import MSG_CAPTURE_CHECKED, check_op
from tests._skips import TORCH_SPLIT

_ids = itertools.count()
DT = torch.float64


def unique(name: str) -> str:
    return f"test_autosplit{next(_ids)}::{name}"


def auto_of(op: cg.CustomOp[..., Any]) -> AutoSplitter:
    auto = op.rules.auto
    assert isinstance(auto, AutoSplitter)
    return auto


def randn(*shape: int, grad: bool = True, seed: int | None = None) -> Tensor:
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=DT, generator=gen).requires_grad_(grad)


# --------------------------------------------------------------------------------------------
# Ops, each with one naive backward that computes every gradient


def make_linear(split: str = "auto") -> cg.CustomOp[..., Tensor]:
    """``x @ weight.mT + bias`` with an Optional bias; the backward ignores needs_input_grad."""

    @cg.op(unique("linear"), weights=("weight", "bias"))
    def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        out = x @ weight.mT
        return out if bias is None else out + bias

    linear.register_fake(lambda x, weight, bias=None: x.new_empty((*x.shape[:-1], weight.shape[0])))
    linear.register_save_for_backward(lambda i, o: (i.x, i.weight, i.bias is not None))

    @linear.register_backward(split=split)  # type: ignore[call-overload]
    def _(ctx: cg.BackwardContext, saved: Any, g: Tensor) -> dict[str, Any]:
        x, w, has_bias = saved
        gs, xs = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        return {"x": g @ w, "weight": gs.mT @ xs, "bias": gs.sum(0) if has_bias else None}

    return linear


def ref_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    out = x @ weight.mT
    return out if bias is None else out + bias


def make_mlp(split: str = "auto", recompute: str = "none") -> cg.CustomOp[..., Tensor]:
    """``silu(x @ up.mT) @ down.mT``: the input and the ``up`` gradients share ``dy @ down`` and
    the activation's derivative (as in a LoRA MLP)."""

    @cg.op(unique("mlp"), weights=("up", "down"))
    def mlp(x: Tensor, up: Tensor, down: Tensor) -> Tensor:
        return F.silu(x @ up.mT) @ down.mT

    mlp.register_fake(lambda x, up, down: x.new_empty((x.shape[0], down.shape[0])))
    mlp.register_save_for_backward(lambda i, o: (i.x, i.up, i.down))

    @mlp.register_backward(split=split, recompute=recompute)  # type: ignore[call-overload]
    def _(ctx: cg.BackwardContext, saved: Any, g: Tensor) -> dict[str, Any]:
        x, up, down = saved
        h = x @ up.mT
        s = torch.sigmoid(h)
        dh = (g @ down) * (s * (1 + h * (1 - s)))  # shared by x and up
        return {"x": dh @ up, "up": dh.mT @ x, "down": g.mT @ (h * s)}

    return mlp


def ref_mlp(x: Tensor, up: Tensor, down: Tensor) -> Tensor:
    return F.silu(x @ up.mT) @ down.mT


# --------------------------------------------------------------------------------------------
# Measuring: gradients and FLOPs of I, W and a full backward


Splitter = tuple[Callable[..., Any], Callable[..., Any]]
SPLITTERS: dict[str, Splitter] = {
    "customgrad": (stage_backward_input, stage_backward_weight),
    "torch": (torch_backward.stage_backward_input, torch_backward.stage_backward_weight),
}


def grad_for(out: Tensor) -> Tensor:
    """The output gradient :func:`measure` uses."""
    return torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(3))


def flops_of(fn: Callable[[], Any]) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def measure(
    op: Callable[..., Tensor],
    args: Callable[[], tuple[list[Tensor], list[Tensor], tuple[Any, ...]]],
    splitter: str = "customgrad",
) -> tuple[dict[str, int], list[Tensor | None], list[Tensor | None]]:
    """FLOPs of I, W and a full backward of ``op(*call_args)`` (after a warm-up split, which
    captures), and the split and full gradients of inputs then weights.

    ``args()`` returns fresh ``(inputs, weights, call_args)``.
    """
    backward_input, backward_weight = SPLITTERS[splitter]
    inputs, weights, call = args()
    out = op(*call)
    g = grad_for(out)
    _, groups = backward_input([out], [g], inputs, iter(weights))  # warm-up: captures
    backward_weight(iter(weights), groups)

    inputs, weights, call = args()
    out = op(*call)
    flops = {}
    groups: Any = None

    def run_i() -> None:
        nonlocal groups
        _, groups = backward_input([out], [g], inputs, iter(weights))

    flops["I"] = flops_of(run_i)
    flops["W"] = flops_of(lambda: backward_weight(iter(weights), groups))
    split = [t.grad for t in inputs + weights]

    inputs, weights, call = args()
    out = op(*call)
    flops["full"] = flops_of(lambda: torch.autograd.backward(out, g))
    full = [t.grad for t in inputs + weights]
    return flops, split, full


def assert_grads(got: list[Tensor | None], want: tuple[Tensor, ...]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a is not None
        torch.testing.assert_close(a, b)


class CountOps(TorchDispatchMode):
    """Counts the aten ops dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


# --------------------------------------------------------------------------------------------
# Gradients and exact FLOPs


@pytest.mark.parametrize("splitter", ["customgrad", pytest.param("torch", marks=TORCH_SPLIT)])
@pytest.mark.parametrize("shape", [(6, 5), (2, 3, 5)], ids=["2d", "3d"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "bias=None"])
def test_naive_linear_splits_with_exact_flops(
    splitter: str, shape: tuple[int, ...], with_bias: bool
) -> None:
    linear, naive = make_linear(), make_linear(split="phase")

    def args() -> tuple[list[Tensor], list[Tensor], tuple[Any, ...]]:
        x, w = randn(*shape, seed=0), randn(4, 5, seed=1)
        b = randn(4, seed=2) if with_bias else None
        weights = [w] if b is None else [w, b]
        return [x], weights, (x, w, b)

    flops, split, full = measure(linear, args, splitter)
    inputs, weights, call = args()
    out = ref_linear(*call)
    want = torch.autograd.grad(out, inputs + weights, grad_for(out))
    assert_grads(split, want)
    assert_grads(full, want)

    rows = 1 if len(shape) == 2 else shape[0]
    mm = 2 * rows * shape[-2] * 5 * 4  # one matmul of the backward
    assert flops == {"I": mm, "W": mm, "full": 2 * mm}
    naive_flops, _, naive_full = measure(naive, args, splitter)
    assert naive_flops["full"] == flops["full"]  # the backward called as written
    assert naive_flops["I"] + naive_flops["W"] == 2 * flops["full"]  # called whole in each pass
    assert_grads(naive_full, want)


@pytest.mark.parametrize("splitter", ["customgrad", pytest.param("torch", marks=TORCH_SPLIT)])
@pytest.mark.parametrize("recompute", ["none", "cheap"])
def test_shared_work_is_done_once_and_handed_to_the_weight_pass(
    splitter: str, recompute: str
) -> None:
    mlp, naive = make_mlp(recompute=recompute), make_mlp(split="phase")

    def args() -> tuple[list[Tensor], list[Tensor], tuple[Any, ...]]:
        x, up, down = randn(8, 6, seed=0), randn(5, 6, seed=1), randn(4, 5, seed=2)
        return [x], [up, down], (x, up, down)

    flops, split, full = measure(mlp, args, splitter)
    inputs, weights, call = args()
    out = ref_mlp(*call)
    want = torch.autograd.grad(out, inputs + weights, grad_for(out))
    assert_grads(split, want)
    assert_grads(full, want)

    naive_flops, _, _ = measure(naive, args, splitter)
    # h = x @ up.mT (480), dy @ down (320), dx (480), d_up (480), d_down (320)
    assert flops["full"] == naive_flops["full"] == 2080
    assert flops["I"] + flops["W"] == flops["full"]
    assert flops == {"I": 1280, "W": 800, "full": 2080}


def test_a_full_backward_and_the_split_run_each_matmul_once() -> None:
    mlp, naive = make_mlp(), make_mlp(split="phase")
    x, up, down = randn(8, 6), randn(5, 6), randn(4, 5)
    g = torch.randn(8, 4, dtype=DT)
    for op in (mlp, naive):
        torch.autograd.backward(op(x, up, down), g)  # traces
    counts = {}
    for name, op in (("auto", mlp), ("naive", naive)):
        with CountOps() as full:
            torch.autograd.backward(op(x, up, down), g)
        counts[name] = full.ops["aten.mm"]
    out = mlp(x, up, down)
    with CountOps() as i_pass:
        _, groups = stage_backward_input([out], [g], [x], iter([up, down]))
    with CountOps() as w_pass:
        stage_backward_weight(iter([up, down]), groups)
    mm = counts["naive"]  # the forward is one call of the op: its matmuls are not seen
    assert counts["auto"] == mm == 5
    assert i_pass.ops["aten.mm"] + w_pass.ops["aten.mm"] == mm
    assert (i_pass.ops["aten.mm"], w_pass.ops["aten.mm"]) == (3, 2)


def test_the_hand_off_lives_until_the_weight_pass_and_is_freed_after() -> None:
    for recompute, kept in (("none", 3), ("cheap", 2)):
        mlp = make_mlp(recompute=recompute)
        x, up, down = randn(8, 6), randn(5, 6), randn(4, 5)
        g = torch.randn(8, 4, dtype=DT)
        out = mlp(x, up, down)
        record = record_of(out.grad_fn)
        assert record is not None
        (gx,) = torch.autograd.grad(out, [x], g, retain_graph=True)  # I
        handoff = record.handoff
        assert handoff is not None and handoff.kind == "kept"
        assert isinstance(handoff.value, Kept)
        cut, values = handoff.value
        assert handoff.made_by((g,)) and not handoff.made_by((g.clone(),))
        split = auto_of(mlp).last
        assert isinstance(split, TracedSplit) and cut.program is split.program
        assert cut.weight == split._slots(frozenset({"up", "down"}))
        # recompute="cheap" keeps the two matmul results (h and dy @ down) and recomputes the
        # elementwise work; "none" also keeps dh, which the up gradient needs.
        assert len(values) == kept
        gw = torch.autograd.grad(out, [up, down], g)  # W
        assert record.handoff is None
        want = torch.autograd.grad(ref_mlp(x, up, down), [x, up, down], g)
        assert_grads([gx, *gw], want)


def test_a_full_backward_after_an_input_pass_frees_the_hand_off() -> None:
    # A retained graph: I keeps values for W, then a full backward (the function as written)
    # computes every gradient itself and frees what was kept.
    mlp = make_mlp()
    x, up, down = randn(8, 6), randn(5, 6), randn(4, 5)
    g = torch.randn(8, 4, dtype=DT)
    out = mlp(x, up, down)
    record = record_of(out.grad_fn)
    assert record is not None
    (gx,) = torch.autograd.grad(out, [x], g, retain_graph=True)  # I
    assert record.handoff is not None and record.handoff.kind == "kept"
    got = torch.autograd.grad(out, [x, up, down], g)  # full
    assert record.handoff is None
    want = torch.autograd.grad(ref_mlp(x, up, down), [x, up, down], g)
    assert_grads([gx], want[:1])
    assert_grads(list(got), want)


def test_dead_code_is_dropped_in_the_split_passes_and_runs_in_a_full_backward() -> None:
    @cg.op(unique("scale"), weights=("w",))
    def scale(x: Tensor, w: Tensor) -> Tensor:
        return x * w

    scale.register_fake(lambda x, w: torch.empty_like(x))
    scale.register_save_for_backward(lambda i, o: (i.x, i.w))

    @scale.register_backward
    def _(ctx: cg.BackwardContext, saved: Any, g: Tensor) -> dict[str, Any]:
        x, w = saved
        unused = x.mT @ x  # computed, never returned
        del unused
        return {"x": g * w, "w": (g * x).sum(0)}

    x, w = randn(4, 3), randn(3)
    g = torch.ones(4, 3, dtype=DT)
    # The split passes run the capture: the unused matmul is dropped from both.
    for _ in range(2):  # the first captures, the second reuses the capture
        out = scale(x, w)
        i_flops = flops_of(lambda o=out: torch.autograd.grad(o, [x], g, retain_graph=True))
        w_flops = flops_of(lambda o=out: torch.autograd.grad(o, [w], g))
        assert (i_flops, w_flops) == (0, 0)
    assert auto_of(scale).traces == 1
    # A full backward calls the function as written: its matmul (3x4 @ 4x3) runs.
    out = scale(x, w)
    assert flops_of(lambda: torch.autograd.backward(out, g)) == 2 * 3 * 4 * 3
    torch.testing.assert_close(x.grad, (g * w).detach())
    torch.testing.assert_close(w.grad, (g * x).sum(0).detach())


# --------------------------------------------------------------------------------------------
# Traced once per input signature


def test_traced_once_per_input_signature(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="test_autosplit.calls")

    @cg.op(unique("mul"), weights=("w",))
    def mul(x: Tensor, w: Tensor) -> Tensor:
        return x * w

    mul.register_fake(lambda x, w: torch.empty_like(x))
    mul.register_save_for_backward(lambda i, o: (i.x, i.w))

    @mul.register_backward
    def _(ctx: cg.BackwardContext, saved: Any, g: Tensor) -> dict[str, Any]:
        x, w = saved
        return {"x": g * w, "w": g * x}

    auto = auto_of(mul)

    def step(n: int, dtype: torch.dtype = DT, grad: str = "ones") -> None:
        """One step split in two passes (I then W): the passes that capture."""
        x = torch.randn(n, dtype=dtype, requires_grad=True)
        w = torch.randn(n, dtype=dtype, requires_grad=True)
        out = mul(x, w)
        if grad == "sum":  # an expanded gradient: other strides
            out = out.sum()
        g = torch.ones_like(out)
        (gx,) = torch.autograd.grad(out, [x], g, retain_graph=True)
        (gw,) = torch.autograd.grad(out, [w], g)
        torch.testing.assert_close(gx, w.detach())
        torch.testing.assert_close(gw, x.detach())

    # A full backward calls the function as written: nothing is captured for it.
    x, w = randn(3), randn(3)
    mul(x, w).backward(torch.ones(3, dtype=DT))
    torch.testing.assert_close(x.grad, w.detach())
    assert auto.traces == 0 and auto.last is None
    assert auto.describe() == NOT_SPLIT_YET  # check_op's and explain_split's words for it
    step(3)
    step(3)
    assert auto.traces == 1
    step(5)
    assert auto.traces == 2
    step(3)
    step(5)
    assert auto.traces == 2
    step(3, torch.float32)
    assert auto.traces == 3
    step(3, grad="sum")
    assert auto.traces == 4
    # Full backwards after the captures need none either.
    x, w = randn(3), randn(3)
    mul(x, w).backward(torch.ones(3, dtype=DT))
    assert auto.traces == 4


def test_phase_split_calls_the_function_per_pass_and_auto_only_to_trace(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="test_autosplit.calls")

    def backward(ctx: cg.BackwardContext, saved: Any, g: Tensor) -> dict[str, Any]:
        # Logging reads process state: the automatic split calls it as written, once per
        # backward (the run-once rule), with every gradient asked for.
        logging.getLogger("test_autosplit.calls").info("%s", ctx.phase)
        x, w, _ = saved
        return {"x": g @ w, "weight": g.mT @ x}

    ops = {}
    for split in ("auto", "phase"):
        op = make_linear()
        op.register_backward(backward, split=split)  # type: ignore[call-overload]
        ops[split] = op
    for split, op in ops.items():
        caplog.clear()
        for _ in range(3):
            x, w = randn(4, 3), randn(2, 3)
            out = op(x, w)
            _, groups = stage_backward_input([out], [torch.ones(4, 2, dtype=DT)], [x], [w])
            stage_backward_weight([w], groups)
        expected = {"full": 3} if split == "auto" else {"input": 3, "weight": 3}
        counts = Counter(r.getMessage() for r in caplog.records if r.name.endswith(".calls"))
        assert dict(counts) == expected


def test_threads_trace_and_split_concurrently() -> None:
    import threading

    mlp = make_mlp()
    errors: list[BaseException] = []
    start = threading.Barrier(6)

    def work(rows: int) -> None:
        try:
            start.wait()
            for seed in range(3):
                x, up, down = randn(rows, 6, seed=seed), randn(5, 6, seed=9), randn(4, 5, seed=8)
                g = torch.randn(rows, 4, dtype=DT)
                out = mlp(x, up, down)
                (gx,), groups = stage_backward_input([out], [g], [x], [up, down])
                stage_backward_weight([up, down], groups)
                want = torch.autograd.grad(ref_mlp(x, up, down), [x, up, down], g)
                assert_grads([gx, up.grad, down.grad], want)
        except BaseException as e:  # reported below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(rows,)) for rows in (2, 3, 2, 3, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert auto_of(mlp).traces == 2  # one per shape, however many threads asked at once


# --------------------------------------------------------------------------------------------
# The fallback


def branchy(ctx: cg.BackwardContext, saved: Any, g: Tensor) -> dict[str, Any]:
    x, w, _ = saved
    if g.sum() > 0:  # Python control flow on a tensor value
        return {"x": g @ w, "weight": g.mT @ x}
    return {"x": g @ w, "weight": g.mT @ x}


def pointer(ctx: cg.BackwardContext, saved: Any, g: Tensor) -> dict[str, Any]:
    x, w, _ = saved
    if g.data_ptr() == 0:  # what a raw kernel launch does with its arguments
        raise RuntimeError("null pointer")
    return {"x": g @ w, "weight": g.mT @ x}


def at_line(fn: Callable[..., Any], text: str) -> str:
    """``file:line (`text`)`` of the line of ``fn`` that starts with ``text``."""
    lines, first = inspect.getsourcelines(fn)
    (i,) = (i for i, line in enumerate(lines) if line.strip().startswith(text))
    return f"{inspect.getsourcefile(fn)}:{first + i} (`{lines[i].strip()}`)"


@pytest.mark.parametrize(
    ("backward", "why"),
    [
        (branchy, lambda: "it branches on tensor values in Python at "
                          + at_line(branchy, "if g.sum() > 0")),
        (pointer, lambda: "dynamo cannot capture it at " + at_line(pointer, "if g.data_ptr()")
                          + ": Dynamo can only trace data pointer comparisons when it can "
                            "prove both operands have the same data pointer"
                          if dynamo.refuses_data_pointer_comparisons()
                          else "it reads a tensor's data_ptr(), and this release's dynamo (torch "
                               "2.11 and 2.12) captures a data pointer comparison as False "
                               "whatever the tensors"),
    ],
    ids=["branch", "data_ptr"],
)  # fmt: skip
def test_untraceable_backward_falls_back_with_one_log_line(
    backward: Callable[..., Any], why: Callable[[], str], caplog: pytest.LogCaptureFixture
) -> None:
    """What dynamo cannot capture runs once, and the log line gives dynamo's reason with the
    line it could not trace."""
    op = make_linear()
    op.register_backward(backward)
    caplog.set_level(logging.WARNING, logger="customgrad")
    for _ in range(2):
        x, w = randn(4, 3), randn(2, 3)
        g = torch.randn(4, 2, dtype=DT)
        out = op(x, w)
        (gx,), groups = stage_backward_input([out], [g], [x], [w])
        stage_backward_weight([w], groups)
        want = torch.autograd.grad(ref_linear(x, w), [x, w], g)
        assert_grads([gx, w.grad], want)
    records = [r for r in caplog.records if r.name == "customgrad"]
    assert len(records) == 1
    message = records[0].getMessage()
    assert message.startswith(f"{op.name}: the single backward cannot be split automatically: ")
    why = why()
    assert why in message
    assert "register_backward(fn, split='phase')" in message
    fallback = auto_of(op).last
    assert isinstance(fallback, Fallback) and fallback.why == why
    report = check_op(op, torch.randn(4, 3), torch.randn(2, 3), raise_on_failure=False)
    assert report.backward.startswith(f"one backward, not split automatically ({why})")
    # The run-once rule: nothing is computed twice, the split check passes.
    assert report["flops"].status == "passed"
    assert "runs once, whole, in the first pass that needs a gradient" in report.backward


def test_in_place_ops_in_the_backward_are_traced_functionalized() -> None:
    op = make_linear()

    @op.register_backward
    def _(ctx: cg.BackwardContext, saved: Any, g: Tensor) -> dict[str, Any]:
        x, w, _ = saved
        gx = g @ w
        gx.mul_(2).div_(2)  # in place, on tensors the backward created
        gw = torch.zeros_like(w)
        gw.add_(g.mT @ x)
        return {"x": gx, "weight": gw}

    def args() -> tuple[list[Tensor], list[Tensor], tuple[Any, ...]]:
        x, w = randn(4, 3, seed=0), randn(2, 3, seed=1)
        return [x], [w], (x, w)

    flops, split, full = measure(op, args)
    assert isinstance(auto_of(op).last, TracedSplit)
    assert flops == {"I": 48, "W": 48, "full": 96}
    inputs, weights, call = args()
    out = ref_linear(*call)
    want = torch.autograd.grad(out, inputs + weights, grad_for(out))
    assert_grads(split, want)
    assert_grads(full, want)


def test_writing_into_a_saved_tensor_is_still_refused(caplog: pytest.LogCaptureFixture) -> None:
    op = make_linear()

    @op.register_backward
    def bwd(ctx: cg.BackwardContext, saved: Any, g: Tensor) -> dict[str, Any]:
        x, w, _ = saved
        return {"x": g @ w.mul_(1), "weight": g.mT @ x}

    x, w = randn(4, 3), randn(2, 3)
    with pytest.raises(cg.MutationError, match="modified saved tensor 1 in place"):
        op(x, w).sum().backward()  # a full backward: the function as written
    assert auto_of(op).last is None
    with pytest.raises(cg.MutationError, match="modified saved tensor 1 in place"):
        torch.autograd.grad(op(x, w).sum(), [x])  # a split pass: refused by the capture too
    assert isinstance(auto_of(op).last, Fallback)


# --------------------------------------------------------------------------------------------
# Arguments and outputs


def test_list_arguments() -> None:
    @cg.op(unique("weighted_sum"), weights=("scales",))
    def weighted_sum(xs: list[Tensor], scales: list[Tensor]) -> Tensor:
        return sum((x @ s for x, s in zip(xs, scales)), torch.zeros(()))

    weighted_sum.register_fake(
        lambda xs, scales: xs[0].new_empty(xs[0].shape[0], scales[0].shape[1])
    )
    weighted_sum.register_save_for_backward(lambda i, o: (i.xs, i.scales))

    @weighted_sum.register_backward
    def _(ctx: cg.BackwardContext, saved: Any, g: Tensor) -> dict[str, Any]:
        xs, scales = saved
        return {"xs": [g @ s.mT for s in scales], "scales": [x.mT @ g for x in xs]}

    def args() -> tuple[list[Tensor], list[Tensor], tuple[Any, ...]]:
        xs = [randn(4, 3, seed=0), randn(4, 2, seed=1)]
        ss = [randn(3, 5, seed=2), randn(2, 5, seed=3)]
        return xs, ss, (xs, ss)

    flops, split, full = measure(weighted_sum, args)
    xs, ss, _ = args()
    out = xs[0] @ ss[0] + xs[1] @ ss[1]
    want = torch.autograd.grad(out, xs + ss, grad_for(out))
    assert_grads(split, want)
    assert_grads(full, want)
    mm = 2 * 4 * 5 * (3 + 2)
    assert flops == {"I": mm, "W": mm, "full": 2 * mm}


def test_several_outputs() -> None:
    @cg.op(unique("two"), weights=("w",))
    def two(x: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
        return x @ w, torch.tanh(x) @ w

    two.register_fake(lambda x, w: (x.new_empty(x.shape[0], w.shape[1]),) * 2)
    two.register_save_for_backward(lambda i, o: (i.x, i.w))

    @two.register_backward
    def _(ctx: cg.BackwardContext, saved: Any, g1: Tensor, g2: Tensor) -> dict[str, Any]:
        x, w = saved
        t = torch.tanh(x)
        return {"x": g1 @ w.mT + (g2 @ w.mT) * (1 - t * t), "w": x.mT @ g1 + t.mT @ g2}

    x, w = randn(4, 3), randn(3, 2)
    g1, g2 = torch.randn(4, 2, dtype=DT), torch.randn(4, 2, dtype=DT)
    a, b = two(x, w)
    (gx,), groups = stage_backward_input([a, b], [g1, g2], [x], [w])
    stage_backward_weight([w], groups)
    want = torch.autograd.grad([x @ w, torch.tanh(x) @ w], [x, w], [g1, g2])
    assert_grads([gx, w.grad], want)
    # Only one output used: the other's gradient is zeros.
    (gx, gw) = torch.autograd.grad(two(x, w)[1].sum(), [x, w])
    want = torch.autograd.grad((torch.tanh(x) @ w).sum(), [x, w])
    assert_grads([gx, gw], want)
    assert isinstance(auto_of(two).last, TracedSplit)


def test_opaque_kernels_stay_one_call_in_their_pass() -> None:
    calls: list[str] = []

    @cg.op(unique("opaque_mm"))
    def opaque_mm(a: Tensor, b: Tensor) -> Tensor:
        calls.append("mm")
        return a @ b

    opaque_mm.register_fake(lambda a, b: a.new_empty(a.shape[0], b.shape[1]))
    op = make_linear()

    @op.register_backward
    def _(ctx: cg.BackwardContext, saved: Any, g: Tensor) -> dict[str, Any]:
        x, w, _ = saved
        return {"x": opaque_mm(g, w), "weight": opaque_mm(g.mT, x)}

    x, w = randn(4, 3), randn(2, 3)
    op(x, w).sum().backward()
    assert calls == ["mm", "mm"]  # a full backward: the function as written, nothing captured
    assert auto_of(op).last is None
    for _ in range(2):  # the first I captures (with the fake kernel), the second reuses it
        calls.clear()
        out = op(x, w)
        _, groups = stage_backward_input([out], [torch.ones(4, 2, dtype=DT)], [x], [w])
        assert calls == ["mm"]
        stage_backward_weight([w], groups)
        assert calls == ["mm", "mm"]
    assert auto_of(op).traces == 1
    graph = auto_of(op).last
    assert isinstance(graph, TracedSplit)
    targets = [str(n.target) for n in graph.graph_module.graph.nodes if n.op == "call_function"]
    assert targets.count(f"{opaque_mm.name.replace('::', '.')}.default") == 2


# --------------------------------------------------------------------------------------------
# Inside other traces and transforms


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(backend: str) -> None:
    torch._dynamo.reset()
    mlp = make_mlp()
    x, up, down = randn(8, 6), randn(5, 6), randn(4, 5)

    def f(x: Tensor, up: Tensor, down: Tensor) -> Tensor:
        return torch.tanh(mlp(x, up, down)).sum()

    got = torch.autograd.grad(torch.compile(f, fullgraph=True, backend=backend)(x, up, down),
                              [x, up, down])  # fmt: skip
    want = torch.autograd.grad(torch.tanh(ref_mlp(x, up, down)).sum(), [x, up, down])
    assert_grads(list(got), want)


def test_double_backward() -> None:
    mlp = make_mlp()
    x, up, down = randn(8, 6), randn(5, 6), randn(4, 5)
    g = torch.randn(8, 4, dtype=DT)
    mlp(x, up, down).backward(g)  # a traced split exists for this signature
    for op in (mlp, ref_mlp):
        (gx,) = torch.autograd.grad(op(x, up, down), [x], g, create_graph=True)
        got = torch.autograd.grad((gx * gx).sum(), [x, up, down])
        if op is mlp:
            result = got
        else:
            want = got
    assert_grads(list(result), want)
    torch.autograd.gradgradcheck(lambda *a: mlp(*a), (x, up, down))


def test_not_differentiable_backward_still_refuses_double_backward() -> None:
    op = make_linear()

    @op.register_backward(differentiable=False)
    def _(ctx: cg.BackwardContext, saved: Any, g: Tensor) -> dict[str, Any]:
        x, w, _ = saved
        return {"x": g @ w, "weight": g.mT @ x}

    x, w = randn(4, 3), randn(2, 3)
    op(x, w).sum().backward()  # traced
    (gx,) = torch.autograd.grad(op(x, w).sum(), [x], create_graph=True)
    with pytest.raises(cg.UnsupportedError, match="registered with differentiable=False"):
        torch.autograd.grad(gx.sum(), [w])


def test_functorch_and_make_fx_get_the_backward_as_written(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    mlp = make_mlp()
    x, up, down = randn(8, 6), randn(5, 6), randn(4, 5)

    def loss(x: Tensor, up: Tensor, down: Tensor) -> Tensor:
        return torch.tanh(mlp(x, up, down)).sum()

    want = torch.autograd.grad(torch.tanh(ref_mlp(x, up, down)).sum(), [x, up, down])
    caplog.set_level(logging.WARNING, logger="customgrad")
    got = torch.func.grad(loss, argnums=(0, 1, 2))(x, up, down)
    assert_grads(list(got), want)
    traced = make_fx(lambda *a: torch.autograd.grad(loss(*a), a))(x, up, down)
    assert_grads(list(traced(x, up, down)), want)
    assert auto_of(mlp).last is None  # full backwards: the function as written, no capture
    # A split pass inside make_fx: the trace records the function as written too.
    traced_input = make_fx(lambda *a: torch.autograd.grad(loss(*a), a[:1]))(x, up, down)
    assert_grads(list(traced_input(x, up, down)), want[:1])
    assert "called inside another trace" in auto_of(mlp).describe()
    assert not [r for r in caplog.records if r.name == "customgrad"]


# --------------------------------------------------------------------------------------------
# Reports


def test_check_op_and_explain_split_say_how_the_backward_split() -> None:
    mlp = make_mlp()
    report = check_op(mlp, torch.randn(8, 6), torch.randn(5, 6), torch.randn(4, 5))
    assert report.backward == (
        "one backward, split automatically (traced: 15 ops; the input pass runs 10, the weight "
        "pass 5; 3 tensor(s) handed from the input pass to the weight pass, 0 op(s) recomputed "
        "there)"
    )
    assert f"  backward: {report.backward}" in str(report)
    # the full backward is the function as written; the passes ran its capture, checked
    # against it
    assert report.calls == {
        "full": {"backward": 1},
        "input": {"backward (traced input part)": 1},
        "weight": {"backward (traced weight part)": 1},
    }
    (split,) = [r for r in report.results if r.name == "split"]
    assert (split.status, split.detail) == ("passed", MSG_CAPTURE_CHECKED)
    assert f"[ok  ] split (float64): {MSG_CAPTURE_CHECKED}" in str(report)
    x, up, down = randn(8, 6), randn(5, 6), randn(4, 5)
    explained = explain_split(mlp(x, up, down), [x], {"up": up, "down": down})
    (node,) = [n for n in explained.nodes if n.kind == "customgrad"]
    # explain_split runs the node's I and W after its full backward: the node's split is the
    # capture's, described as check_op described it
    assert node.auto_split == report.backward.removeprefix("one backward, ")
    assert f"  - {mlp.name}: {node.auto_split}." in str(explained)
    assert explained.repeated_flops == 0


def test_reports_of_a_pair_and_of_split_phase() -> None:
    phase = make_linear(split="phase")
    report = check_op(phase, torch.randn(4, 3), torch.randn(2, 3), checks=["split"])
    assert report.backward == (
        "one backward, called in each pass with ctx.needs_input_grad set for the pass "
        "(split='phase')"
    )
    x, w = randn(4, 3), randn(2, 3)
    (node,) = [n for n in explain_split(phase(x, w), [x], [w]).nodes if n.kind == "customgrad"]
    assert node.auto_split is None


# --------------------------------------------------------------------------------------------
# Round 3: a traced backward gives what calling it gives, or it is not traced


def split_grads(op: Callable[..., Tensor], x: Tensor, w: Tensor, g: Tensor) -> list[Any]:
    """Gradients of x then w through customgrad's I and W passes (None where not asked)."""
    out = op(x, w)
    inputs = [x] if x.requires_grad else []
    (*gx,), groups = stage_backward_input([out], [g], inputs, [w] if w.requires_grad else [])
    stage_backward_weight([w] if w.requires_grad else [], groups)
    return [gx[0] if gx else None, w.grad]


def test_a_backward_reading_requires_grad_of_saved_tensors_gets_gradients() -> None:
    # The pattern of TransformerEngine's and Liger's backwards: gradients only where asked by
    # the saved tensors' requires_grad. Traced on fakes without it, every gradient was None.
    op = make_linear()

    @op.register_backward
    def _(ctx: cg.BackwardContext, saved: Any, g: Tensor) -> dict[str, Any]:
        x, w, _ = saved
        return {
            "x": g @ w if x.requires_grad else None,
            "weight": g.mT @ x if w.requires_grad else None,
        }

    for x_grad, w_grad in [(True, True), (True, False), (False, True), (True, True)]:
        x, w, g = randn(4, 3, grad=x_grad), randn(2, 3, grad=w_grad), torch.randn(4, 2, dtype=DT)
        want = torch.autograd.grad(
            ref_linear(x, w), [t for t in (x, w) if t.requires_grad], g, allow_unused=True
        )
        got = split_grads(op, x, w, g)
        assert_grads([t for t, a in zip(got, (x, w)) if a.requires_grad], want)
        x.grad = w.grad = None
        op(x, w).backward(g)  # a full backward
        assert_grads([t.grad for t in (x, w) if t.requires_grad], want)
    assert isinstance(auto_of(op).last, TracedSplit)


CONFIG: dict[str, Any] = {"scale": 1.0, "clip": None}


def test_a_backward_reading_a_global_dict_is_captured_and_guarded() -> None:
    op = make_linear()

    @op.register_backward
    def _(ctx: cg.BackwardContext, saved: Any, g: Tensor) -> dict[str, Any]:
        x, w, _ = saved
        gx = g @ w * CONFIG["scale"]
        if CONFIG["clip"] is not None:
            gx = gx.clamp(-CONFIG["clip"], CONFIG["clip"])
        return {"x": gx, "weight": g.mT @ x}

    try:
        for scale, clip in [(1.0, None), (2.0, None), (2.0, 0.1), (1.0, None)]:
            CONFIG.update(scale=scale, clip=clip)
            x, w, g = randn(4, 3), randn(2, 3), torch.randn(4, 2, dtype=DT)
            gx, gw = torch.autograd.grad(ref_linear(x, w), [x, w], g)
            gx = gx * scale if clip is None else (gx * scale).clamp(-clip, clip)
            assert_grads(split_grads(op, x, w, g), (gx, gw))
            assert isinstance(auto_of(op).last, TracedSplit)
    finally:
        CONFIG.update(scale=1.0, clip=None)
    # dynamo guards the dict's values: each new value captured once, the first one reused
    assert auto_of(op).traces == 3


def test_a_closure_rebound_or_a_list_it_reads_resized_gives_the_gradient_of_a_call() -> None:
    # The length of a closure list decides how many gradients the backward returns: a frozen
    # capture would return the old length without any error. Checked in split passes (I then
    # W: the passes that run the capture) and in full backwards (the function as written).
    @cg.op(unique("sum_all"), weights=("w",))
    def sum_all(xs: list[Tensor], w: Tensor) -> Tensor:
        return torch.stack([x.sum() for x in xs]).sum() + w.sum()

    sum_all.register_fake(lambda xs, w: xs[0].new_empty(()))
    sum_all.register_save_for_backward(lambda i, o: (i.xs, i.w))
    live = [1, 1]
    factor = 1.0

    @sum_all.register_backward
    def _(ctx: cg.BackwardContext, saved: Any, g: Tensor) -> dict[str, Any]:
        xs, w = saved
        return {"xs": [g.expand_as(x) * factor for x, _ in zip(xs, live)], "w": g.expand_as(w)}

    def split_step() -> list[Tensor]:
        xs, w = [randn(3), randn(2)], randn(2)
        out = sum_all(xs, w)
        gxs = torch.autograd.grad(out, xs, retain_graph=True)  # I
        (gw,) = torch.autograd.grad(out, [w])  # W
        assert_grads([gw], (torch.ones(2, dtype=DT),))
        return list(gxs)

    def full_step() -> list[Tensor | None]:
        xs, w = [randn(3), randn(2)], randn(2)
        sum_all(xs, w).backward()
        return [t.grad for t in xs]

    for step in (split_step, full_step):
        assert_grads(step(), (torch.ones(3, dtype=DT), torch.ones(2, dtype=DT)))
    factor = 3.0
    for step in (split_step, full_step):
        assert_grads(step(), (torch.full((3,), 3.0, dtype=DT), torch.full((2,), 3.0, dtype=DT)))
    live.pop()  # now it returns one gradient for two tensors: customgrad's error, as called
    for step in (split_step, full_step):
        with pytest.raises(
            cg.GradientValueError,
            match=re.escape("returned 1 gradients for 'xs', but the input list has 2 items"),
        ):
            step()
    assert auto_of(sum_all).traces == 3  # the closure's value and the list's length guarded


def test_a_backward_reading_an_object_is_captured_and_guarded() -> None:
    op = make_linear()
    scaler = torch.nn.Linear(1, 1)  # an object whose state a trace would freeze

    @op.register_backward
    def bwd(ctx: cg.BackwardContext, saved: Any, g: Tensor) -> dict[str, Any]:
        x, w, _ = saved
        return {"x": g @ w * scaler.in_features, "weight": g.mT @ x}

    for features in (1, 3):
        scaler.in_features = features
        x, w, g = randn(4, 3), randn(2, 3), torch.randn(4, 2, dtype=DT)
        gx, gw = torch.autograd.grad(ref_linear(x, w), [x, w], g)
        assert_grads(split_grads(op, x, w, g), (gx * features, gw))
        assert isinstance(auto_of(op).last, TracedSplit)
    assert auto_of(op).traces == 2


def test_a_backward_with_a_side_effect_runs_once_and_keeps_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    op = make_linear()
    seen: list[str] = []

    @op.register_backward
    def bwd(ctx: cg.BackwardContext, saved: Any, g: Tensor) -> dict[str, Any]:
        seen.append(ctx.phase)  # a Python side effect: it happens on every call as written
        x, w, _ = saved
        return {"x": g @ w, "weight": g.mT @ x}

    for _ in range(3):
        x, w, g = randn(4, 3), randn(2, 3), torch.randn(4, 2, dtype=DT)
        assert_grads(split_grads(op, x, w, g), torch.autograd.grad(ref_linear(x, w), [x, w], g))
    fallback = auto_of(op).last
    assert isinstance(fallback, Fallback) and fallback.why.startswith(
        "it changes state outside itself ("
    )
    assert "which dynamo replays after the graph and a split pass would not" in fallback.why
    assert seen == ["full", "full", "full"]  # run once per backward, every gradient asked for
    assert [r.getMessage() for r in caplog.records if r.name == "customgrad"] == [
        MSG_FALLBACK.format(op=op.name, why=fallback.why, fix=fallback.fix, loc=where(bwd))
    ]


def test_ambient_state_selects_the_trace() -> None:
    # The first split pass under autocast baked its casts into the capture: later float32
    # passes ran in bfloat16.
    op = make_linear()

    @op.register_backward
    def _(ctx: cg.BackwardContext, saved: Any, g: Tensor) -> dict[str, Any]:
        x, w, _ = saved
        scale = torch.ones((), dtype=torch.get_default_dtype())  # reads the default dtype
        return {"x": (g @ w).to(x.dtype) * scale.to(x.dtype), "weight": (g.mT @ x).to(w.dtype)}

    def run() -> tuple[Tensor, Tensor, Tensor]:
        """A step split in two passes (I then W: the passes that run the capture)."""
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0), requires_grad=True)
        w = torch.randn(2, 3, generator=torch.Generator().manual_seed(1), requires_grad=True)
        g = torch.randn(4, 2, generator=torch.Generator().manual_seed(2))
        out = op(x, w)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            (gx,) = torch.autograd.grad(out, [x], g, retain_graph=True)
            (gw,) = torch.autograd.grad(out, [w], g)
        return gx, gw, (g @ w).detach()

    autocast = True
    gx, _, exact = run()
    assert not torch.equal(gx, exact)  # bfloat16 matmul
    autocast = False
    gx, _, exact = run()
    torch.testing.assert_close(gx, exact, rtol=0, atol=0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        gx, _, exact = run()
    finally:
        torch.set_default_dtype(default)
    torch.testing.assert_close(gx, exact, rtol=0, atol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert auto_of(op).traces == 3
    assert auto_of(op).traces == 3


_WHILE_TRACING: list[Callable[[], None]] = []


@torch.library.custom_op("test_autosplit::traced_hook", mutates_args=())
def traced_hook(t: Tensor) -> Tensor:
    """The identity; its fake kernel runs the hooks: code that runs only while a backward is
    traced, in a backward that reads nothing but its arguments and an op (so it is traced)."""
    return t.clone()


@traced_hook.register_fake
def _(t: Tensor) -> Tensor:
    for fn in _WHILE_TRACING:
        fn()
    return torch.empty_like(t)


@contextlib.contextmanager
def on_record(fn: Callable[[], None]) -> Iterator[None]:
    _WHILE_TRACING.append(fn)
    try:
        yield
    finally:
        _WHILE_TRACING.remove(fn)


def hooked_linear() -> cg.CustomOp[..., Tensor]:
    op = make_linear()

    @op.register_backward
    def _(ctx: cg.BackwardContext, saved: Any, g: Tensor) -> dict[str, Any]:
        x, w, _ = saved
        return {"x": traced_hook(g) @ w, "weight": g.mT @ x}

    return op


def test_two_ops_traced_at_once_on_two_threads_are_both_traced() -> None:
    # make_fx is not thread-safe: one trace at a time in the process (a per-op lock let two
    # ops trace at once, and the failure stayed as a permanent fallback).
    first, second = hooked_linear(), make_linear()
    errors: list[BaseException] = []

    def other() -> None:
        try:
            x, w, g = randn(4, 3), randn(2, 3), torch.randn(4, 2, dtype=DT)
            want = torch.autograd.grad(ref_linear(x, w), [x, w], g)
            assert_grads(split_grads(second, x, w, g), want)
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=other)
    waited: list[bool] = []

    def start_the_other_thread() -> None:  # while the first op is being traced
        if thread.ident is None:
            thread.start()
            thread.join(timeout=0.5)
            waited.append(thread.is_alive())  # its trace waits for this one to end

    with on_record(start_the_other_thread):
        x, w, g = randn(4, 3), randn(2, 3), torch.randn(4, 2, dtype=DT)
        assert_grads(split_grads(first, x, w, g), torch.autograd.grad(ref_linear(x, w), [x, w], g))
        thread.join()
    assert not errors, errors
    assert waited == [True]
    assert isinstance(auto_of(first).last, TracedSplit)
    assert isinstance(auto_of(second).last, TracedSplit)


def test_tracing_leaves_warnings_filters_and_loggers_alone() -> None:
    fake_logger = logging.getLogger("torch._subclasses.fake_tensor")
    before = (list(warnings.filters), fake_logger.level, fake_logger.filters[:])
    during: list[Any] = []
    with on_record(lambda: during.append((list(warnings.filters), fake_logger.level))):
        x, w, g = randn(4, 3), randn(2, 3), torch.randn(4, 2, dtype=DT)
        split_grads(hooked_linear(), x, w, g)
    # what other threads see while this one captures (dynamo, then the lowering by make_fx)
    assert during and during == [before[:2]] * len(during)
    assert (list(warnings.filters), fake_logger.level, fake_logger.filters) == before


def test_a_gradient_for_an_argument_without_grad_is_checked_on_every_call() -> None:
    op = make_linear()

    @op.register_backward
    def _(ctx: cg.BackwardContext, saved: Any, g: Tensor) -> dict[str, Any]:
        _, w, _ = saved
        return {"x": g @ w, "weight": torch.zeros(5, dtype=g.dtype)}  # wrong shape

    for _ in range(3):
        x, w = randn(4, 3), randn(2, 3, grad=False)
        with pytest.raises(cg.GradientValueError, match=re.escape("of shape (5,)")):
            op(x, w).sum().backward()


def test_an_optional_output_that_is_none() -> None:
    # A None output gradient after the tensors: the pass was called with it (TypeError).
    @cg.op(
        unique("maybe_two"),
        weights=("w",),
        schema="(Tensor x, Tensor w, bool two) -> (Tensor, Tensor?)",
    )
    def maybe_two(x: Tensor, w: Tensor, two: bool) -> tuple[Tensor, Tensor | None]:
        return x * w, (x + w if two else None)

    maybe_two.register_fake(
        lambda x, w, two: (torch.empty_like(x), torch.empty_like(x) if two else None)
    )
    maybe_two.register_save_for_backward(lambda i, o: (i.x, i.w))

    @maybe_two.register_backward
    def _(ctx: cg.BackwardContext, saved: Any, g: Tensor, g2: Tensor | None) -> dict[str, Any]:
        x, w = saved
        if g2 is None:
            return {"x": g * w, "w": (g * x).sum(0)}
        return {"x": g * w + g2, "w": (g * x).sum(0) + g2.sum(0)}

    for two in (False, True, False):
        x, w, g = randn(3, 4), randn(4), torch.randn(3, 4, dtype=DT)
        out, _ = maybe_two(x, w, two)
        want = torch.autograd.grad(x * w, [x, w], g)
        (gx,), groups = stage_backward_input([out], [g], [x], [w])
        stage_backward_weight([w], groups)
        assert_grads([gx, w.grad], want)
    assert isinstance(auto_of(maybe_two).last, TracedSplit)


def test_matmul_of_a_vector_is_traced() -> None:
    # torch.matmul with a 1-D operand squeezes its result in place (aten.squeeze_): a metadata
    # write on a tensor the trace made, not a write into the backward's inputs.
    @cg.op(unique("mv"), weights=("w",))
    def mv(x: Tensor, w: Tensor) -> Tensor:
        return w @ x

    mv.register_fake(lambda x, w: x.new_empty(w.shape[0]))
    mv.register_save_for_backward(lambda i, o: (i.x, i.w))

    @mv.register_backward
    def _(ctx: cg.BackwardContext, saved: Any, g: Tensor) -> dict[str, Any]:
        x, w = saved
        return {"x": torch.matmul(g, w), "w": torch.outer(g, x)}

    def args() -> tuple[list[Tensor], list[Tensor], tuple[Any, ...]]:
        x, w = randn(4, seed=0), randn(3, 4, seed=1)
        return [x], [w], (x, w)

    flops, split, full = measure(mv, args)
    assert isinstance(auto_of(mv).last, TracedSplit)
    assert flops["I"] + flops["W"] == flops["full"] == 24 + 0  # mm (1x3 @ 3x4); outer: no formula
    inputs, weights, call = args()
    out = call[1] @ call[0]
    want = torch.autograd.grad(out, inputs + weights, grad_for(out))
    assert_grads(split, want)
    assert_grads(full, want)


def test_an_out_variant_custom_op_in_the_backward_runs_once() -> None:
    name = unique("scale_out")
    runs = Counter[str]()

    @torch.library.custom_op(name, mutates_args=("out",))
    def scale_out(x: Tensor, s: float, out: Tensor) -> None:
        runs["kernel"] += 1
        out.copy_(x * s)

    op = make_linear()

    @op.register_backward
    def _(ctx: cg.BackwardContext, saved: Any, g: Tensor) -> dict[str, Any]:
        x, w, _ = saved
        g2 = torch.empty_like(g)
        scale_out(g, 2.0, g2)  # writes into a tensor the backward made; both gradients read it
        return {"x": g2 @ w, "weight": g2.mT @ x}

    for _ in range(2):
        x, w, g = randn(4, 3), randn(2, 3), torch.randn(4, 2, dtype=DT)
        want = torch.autograd.grad(ref_linear(x, w), [x, w], 2 * g)
        runs.clear()
        assert_grads(split_grads(op, x, w, g), want)
        assert runs["kernel"] == 1  # in I, handed to W (called per pass it ran twice)
    assert isinstance(auto_of(op).last, TracedSplit)


def test_a_dataclass_config_read_by_the_backward_gives_the_gradient_of_a_call() -> None:
    import dataclasses

    @dataclasses.dataclass
    class Config:
        scale: float

    cfg = Config(scale=1.0)
    op = make_linear()

    @op.register_backward
    def _(ctx: cg.BackwardContext, saved: Any, g: Tensor) -> dict[str, Any]:
        x, w, _ = saved
        return {"x": g @ w * cfg.scale, "weight": g.mT @ x}

    for scale in (1.0, 3.0):
        cfg.scale = scale  # a mutable config object, changed in place
        x, w, g = randn(4, 3), randn(2, 3), torch.randn(4, 2, dtype=DT)
        gx, gw = torch.autograd.grad(ref_linear(x, w), [x, w], g)
        assert_grads(split_grads(op, x, w, g), (gx * scale, gw))
    # dynamo guards the field it read: captured again for the new value
    assert isinstance(auto_of(op).last, TracedSplit) and auto_of(op).traces == 2


def test_a_trace_failing_for_an_unknown_reason_is_tried_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A failure caused by something outside the backward (another thread's make_fx) must not
    # stay as a permanent fallback.
    from torch.fx.experimental import proxy_tensor

    make_fx = proxy_tensor.make_fx
    failures = [RuntimeError("state left by a concurrent trace")]

    def flaky(*args: Any, **kwargs: Any) -> Any:
        if failures:
            raise failures.pop()
        return make_fx(*args, **kwargs)

    monkeypatch.setattr(proxy_tensor, "make_fx", flaky)
    op = make_linear()
    for _ in range(2):
        x, w, g = randn(4, 3), randn(2, 3), torch.randn(4, 2, dtype=DT)
        assert_grads(split_grads(op, x, w, g), torch.autograd.grad(ref_linear(x, w), [x, w], g))
    assert isinstance(auto_of(op).last, TracedSplit) and auto_of(op).traces == 2


SCALE = 1.0


def scaled_by_global(t: Tensor) -> Tensor:
    return t * SCALE


class Scaler:
    k = 1.0

    def __call__(self, ctx: cg.BackwardContext, saved: Any, g: Tensor) -> dict[str, Any]:
        x, w, _ = saved
        return {"x": g @ w * self.k, "weight": g.mT @ x}


def test_other_ways_to_read_python_state_give_the_gradient_of_a_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # (backward, how to change what it reads, traced?)
    opts = {"k": 1.0}

    def with_default(ctx: Any, saved: Any, g: Tensor, opts: dict[str, float] = opts) -> Any:
        x, w, _ = saved
        return {"x": g @ w * opts["k"], "weight": g.mT @ x}

    def with_helper(ctx: Any, saved: Any, g: Tensor) -> Any:
        x, w, _ = saved
        return {"x": scaled_by_global(g @ w), "weight": g.mT @ x}

    scaler = Scaler()

    def set_k(k: float) -> None:
        opts["k"] = k
        monkeypatch.setattr(sys.modules[__name__], "SCALE", k)
        scaler.k = k

    # A dict default, a helper reading a global float, a call object's field: dynamo guards
    # each, and the backward is captured again when it changes.
    for backward, traced in [(with_default, True), (with_helper, True), (scaler, True)]:
        op = make_linear()
        op.register_backward(backward)
        for k in (1.0, 3.0):
            set_k(k)
            x, w, g = randn(4, 3), randn(2, 3), torch.randn(4, 2, dtype=DT)
            gx, gw = torch.autograd.grad(ref_linear(x, w), [x, w], g)
            assert_grads(split_grads(op, x, w, g), (gx * k, gw))
        assert isinstance(auto_of(op).last, TracedSplit) is traced
        assert auto_of(op).traces == 2


class LoRA_W(torch.autograd.Function):
    """unsloth's LoRA_W pattern: the backward computes ``dY @ B`` for dA and again for dX."""

    @staticmethod
    def forward(ctx: Any, X: Tensor, W: Tensor, A: Tensor, B: Tensor, s: float) -> Tensor:
        ctx.save_for_backward(X, W, A, B)
        ctx.s = s
        return X @ W.t() + s * (X @ A.t()) @ B.t()

    @staticmethod
    def backward(ctx: Any, dY: Tensor) -> tuple[Tensor | None, ...]:
        X, W, A, B = ctx.saved_tensors
        s = ctx.s
        dA = s * (dY @ B).t() @ X
        dB = s * dY.t() @ (X @ A.t())
        dX = dY @ W + s * (dY @ B) @ A
        return dX, dY.t() @ X, dA, dB, None


def test_work_a_backward_writes_twice_is_computed_once_and_handed_to_w() -> None:
    op = cg.from_function(
        LoRA_W,
        unique("lora"),
        weights=("W", "A", "B"),
        schema="(Tensor X, Tensor W, Tensor A, Tensor B, float s) -> Tensor",
    )
    X, W, A, B = torch.randn(6, 4), torch.randn(5, 4), torch.randn(2, 4), torch.randn(5, 2)
    report = check_op(op, X, W, A, B, 0.5)
    assert report.ok
    # dY @ B (6x5 by 5x2: 120 FLOPs) once, in I, handed to W
    assert "1 tensor(s) handed from the input pass to the weight pass" in report.backward
