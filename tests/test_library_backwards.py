"""Backwards written the way Liger-Kernel, flash-linear-attention, unsloth, xformers and LoRA
implementations write them are captured by dynamo and split (issue 30, item 2; issue 34, item 2).

Each op keeps its library's shape of code: a ``torch.autograd.Function`` whose ``forward`` and
``backward`` carry Liger's ``@ensure_contiguous`` or flash-linear-attention's ``@input_guard``
(decorators that wrap with ``functools.wraps``), ``@once_differentiable`` (what ``check_op``
advises), a backward that reads a module-level class (unsloth) or dict (LoRA), calls its class's
staticmethod (a grouped linear) or is a method of an object (xformers). Torch-level bodies run
on CPU. For each: the gradients equal the Function's own; the automatic split is "traced" in
``summary()``; FLOPs(I) + FLOPs(W) == FLOPs(full backward), the weight-only work in W (W's FLOPs
are those of the weight gradients, or, for the norms, whose work FlopCounterMode does not
count, the weight pass runs ops).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.utils.flop_counter import FlopCounterMode

import customgrad as cg
from customgrad._autosplit import TracedSplit
from customgrad.pipelining import stage_backward_input, stage_backward_weight

DT = torch.float64
_ids = iter(range(10**6))


def ensure_contiguous(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Liger-Kernel's decorator (liger_kernel/ops/utils.py)."""

    @functools.wraps(fn)
    def wrapper(ctx: Any, *args: Any, **kwargs: Any) -> Any:
        def maybe_to_contiguous(x: Any) -> Any:
            return x.contiguous() if isinstance(x, torch.Tensor) else x

        args = tuple(maybe_to_contiguous(arg) for arg in args)
        kwargs = {k: maybe_to_contiguous(v) for k, v in kwargs.items()}
        return fn(ctx, *args, **kwargs)

    return wrapper


def input_guard(fn: Callable[..., Any]) -> Callable[..., Any]:
    """flash-linear-attention's decorator (fla/utils.py), without the device context."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        contiguous_args = (i if not isinstance(i, torch.Tensor) else i.contiguous() for i in args)
        contiguous_kwargs = {
            k: (v if not isinstance(v, torch.Tensor) else v.contiguous()) for k, v in kwargs.items()
        }
        return fn(*contiguous_args, **contiguous_kwargs)

    return wrapper


# -- Liger-Kernel ----------------------------------------------------------------------------------


class LigerRMSNormFunction(torch.autograd.Function):
    @staticmethod
    @ensure_contiguous
    def forward(ctx: Any, X: Tensor, W: Tensor, eps: float) -> Tensor:
        rstd = torch.rsqrt(X.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(X, W, rstd)
        return X * rstd * W

    @staticmethod
    @once_differentiable
    @ensure_contiguous
    def backward(ctx: Any, dY: Tensor) -> Any:
        X, W, rstd = ctx.saved_tensors
        x_hat = X * rstd
        m = dY * W
        dX = rstd * (m - x_hat * (m * x_hat).mean(-1, keepdim=True))
        dW = (dY * x_hat).reshape(-1, W.shape[-1]).sum(0)
        return dX, dW, None


class LigerLayerNormFunction(torch.autograd.Function):
    @staticmethod
    @ensure_contiguous
    def forward(ctx: Any, X: Tensor, W: Tensor, B: Tensor, eps: float) -> Tensor:
        mean = X.mean(-1, keepdim=True)
        rstd = torch.rsqrt((X - mean).pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(X, W, mean, rstd)
        return (X - mean) * rstd * W + B

    @staticmethod
    @ensure_contiguous
    def backward(ctx: Any, dY: Tensor) -> Any:
        X, W, mean, rstd = ctx.saved_tensors
        x_hat = (X - mean) * rstd
        wdy = W * dY
        c1 = (x_hat * wdy).mean(-1, keepdim=True)
        c2 = wdy.mean(-1, keepdim=True)
        dX = (wdy - (x_hat * c1 + c2)) * rstd
        dW = (dY * x_hat).reshape(-1, W.shape[0]).sum(0)
        dB = dY.reshape(-1, W.shape[0]).sum(0)
        return dX, dW, dB, None


class LigerFusedLinearCrossEntropyFunction(torch.autograd.Function):
    """The fused head, with its gradients computed in the backward (``reduction="sum"``)."""

    @staticmethod
    @ensure_contiguous
    def forward(ctx: Any, _input: Tensor, weight: Tensor, target: Tensor) -> Tensor:
        logits = _input @ weight.t()
        ctx.save_for_backward(_input, weight, target)
        return F.cross_entropy(logits, target, reduction="sum")

    @staticmethod
    @ensure_contiguous
    def backward(ctx: Any, grad_output: Tensor) -> Any:
        _input, weight, target = ctx.saved_tensors
        logits = _input @ weight.t()
        d = (torch.softmax(logits, -1) - F.one_hot(target, weight.shape[0])) * grad_output
        return d @ weight, d.t() @ _input, None


# -- flash-linear-attention ------------------------------------------------------------------------


class FLARMSNormFunction(torch.autograd.Function):
    @staticmethod
    @input_guard
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return x * rstd * weight

    @staticmethod
    @input_guard
    def backward(ctx: Any, dy: Tensor) -> Any:
        x, weight, rstd = ctx.saved_tensors
        x_hat = x * rstd
        m = dy * weight
        dx = rstd * (m - x_hat * (m * x_hat).mean(-1, keepdim=True))
        return dx, (dy * x_hat).reshape(-1, weight.shape[-1]).sum(0), None


# -- unsloth: a backward reading a module-level class ----------------------------------------------


class _UnslothConfig:
    GEMMA = False  # unsloth's Fast_RMS_Layernorm reads whether the norm is Gemma's (1 + W)


class FastRMSLayernorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, X: Tensor, W: Tensor, eps: float) -> Tensor:
        rstd = torch.rsqrt(X.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(X, W, rstd)
        return X * rstd * (1 + W if _UnslothConfig.GEMMA else W)

    @staticmethod
    def backward(ctx: Any, dY: Tensor) -> Any:
        X, W, rstd = ctx.saved_tensors
        scale = 1 + W if _UnslothConfig.GEMMA else W
        x_hat = X * rstd
        m = dY * scale
        dX = rstd * (m - x_hat * (m * x_hat).mean(-1, keepdim=True))
        return dX, (dY * x_hat).reshape(-1, W.shape[-1]).sum(0), None


# -- a grouped linear calling its class's staticmethod ---------------------------------------------


class GroupedLinear(torch.autograd.Function):
    @staticmethod
    def _weight_grads(dy: Tensor, x: Tensor, groups: int) -> Tensor:
        return torch.stack([g.t() @ i for g, i in zip(dy.chunk(groups), x.chunk(groups))])

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(x, w)
        return torch.cat([i @ wi.t() for i, wi in zip(x.chunk(w.shape[0]), w)])

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> Any:
        x, w = ctx.saved_tensors
        dx = torch.cat([g @ wi for g, wi in zip(dy.chunk(w.shape[0]), w)])
        return dx, GroupedLinear._weight_grads(dy, x, w.shape[0])


# -- xformers' SwiGLU: the backward a method of an object ------------------------------------------


class SwiGLUOp:
    """xformers' ``SwiGLU`` op object: its backward is a method (``self`` holds its options)."""

    def __init__(self) -> None:
        self.op = cg.op(f"test_library{next(_ids)}::swiglu", weights=("w1", "w2", "w3"))(
            self.forward
        )
        self.op.register_fake(lambda x, w1, w2, w3: x.new_empty(x.shape[0], w3.shape[0]))
        self.op.register_save_for_backward(lambda i, o: (i.x, i.w1, i.w2, i.w3))
        self.op.register_backward(self.backward)

    @staticmethod
    def forward(x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor) -> Tensor:
        return (F.silu(x @ w1.t()) * (x @ w2.t())) @ w3.t()

    def backward(self, ctx: Any, saved: Any, dy: Tensor) -> dict[str, Tensor]:
        x, w1, w2, w3 = saved
        a, b = x @ w1.t(), x @ w2.t()
        sig = torch.sigmoid(a)
        h = a * sig * b
        dh = dy @ w3
        da = dh * b * sig * (1 + a * (1 - sig))
        db = dh * a * sig
        return {
            "x": da @ w1 + db @ w2,
            "w1": da.t() @ x,
            "w2": db.t() @ x,
            "w3": dy.t() @ h,
        }


# -- LoRA: a backward reading a module-level dict --------------------------------------------------

LORA_CONFIG = {"scaling": 2.0}


class LoRALinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, W: Tensor, A: Tensor, B: Tensor) -> Tensor:
        ctx.save_for_backward(x, W, A, B)
        return x @ W.t() + LORA_CONFIG["scaling"] * (x @ A.t()) @ B.t()

    @staticmethod
    def backward(ctx: Any, dY: Tensor) -> Any:
        x, W, A, B = ctx.saved_tensors
        s = LORA_CONFIG["scaling"]
        dYB = dY @ B
        return dY @ W + s * dYB @ A, dY.t() @ x, s * dYB.t() @ x, s * dY.t() @ (x @ A.t())


# --------------------------------------------------------------------------------------------


def r(*shape: int) -> Tensor:
    return torch.randn(*shape, dtype=DT)


# name: (the op, the Function to compare with (None: the op's forward under autograd), the
# arguments, the inputs, the weights, FLOPs of the weight gradients or None for the norms)
def cases() -> dict[str, Any]:
    swiglu = SwiGLUOp()
    return {
        "liger_rms_norm": (
            cg.from_function(
                LigerRMSNormFunction,
                f"test_library{next(_ids)}::rms",
                weights=("W",),
                schema="(Tensor X, Tensor W, float eps) -> Tensor",
            ),
            LigerRMSNormFunction.apply,
            lambda: (r(6, 8), r(8), 1e-6),
            (0,),
            (1,),
            None,
        ),
        "liger_layer_norm": (
            cg.from_function(
                LigerLayerNormFunction,
                f"test_library{next(_ids)}::ln",
                weights=("W", "B"),
                schema="(Tensor X, Tensor W, Tensor B, float eps) -> Tensor",
            ),
            LigerLayerNormFunction.apply,
            lambda: (r(6, 8), r(8), r(8), 1e-5),
            (0,),
            (1, 2),
            None,
        ),
        "liger_fused_linear_cross_entropy": (
            cg.from_function(
                LigerFusedLinearCrossEntropyFunction,
                f"test_library{next(_ids)}::flce",
                weights=("weight",),
                schema="(Tensor _input, Tensor weight, Tensor target) -> Tensor",
            ),
            LigerFusedLinearCrossEntropyFunction.apply,
            lambda: (r(6, 8), r(10, 8), torch.randint(10, (6,))),
            (0,),
            (1,),
            2 * 6 * 10 * 8,  # d.t() @ _input
        ),
        "fla_rms_norm": (
            cg.from_function(
                FLARMSNormFunction,
                f"test_library{next(_ids)}::fla_rms",
                weights=("weight",),
                schema="(Tensor x, Tensor weight, float eps) -> Tensor",
            ),
            FLARMSNormFunction.apply,
            lambda: (r(6, 8), r(8), 1e-6),
            (0,),
            (1,),
            None,
        ),
        "unsloth_rms_norm": (
            cg.from_function(
                FastRMSLayernorm,
                f"test_library{next(_ids)}::unsloth_rms",
                weights=("W",),
                schema="(Tensor X, Tensor W, float eps) -> Tensor",
            ),
            FastRMSLayernorm.apply,
            lambda: (r(6, 8), r(8), 1e-6),
            (0,),
            (1,),
            None,
        ),
        "grouped_linear": (
            cg.from_function(
                GroupedLinear,
                f"test_library{next(_ids)}::grouped",
                weights=("w",),
                schema="(Tensor x, Tensor w) -> Tensor",
            ),
            GroupedLinear.apply,
            lambda: (r(6, 4), r(3, 5, 4)),
            (0,),
            (1,),
            3 * 2 * 5 * 2 * 4,
        ),
        "xformers_swiglu": (
            swiglu.op,
            SwiGLUOp.forward,
            lambda: (r(6, 4), r(5, 4), r(5, 4), r(3, 5)),
            (0,),
            (1, 2, 3),
            2 * (2 * 5 * 6 * 4) + 2 * 3 * 6 * 5,
        ),
        "lora": (
            cg.from_function(
                LoRALinear,
                f"test_library{next(_ids)}::lora",
                weights=("W", "A", "B"),
                schema="(Tensor x, Tensor W, Tensor A, Tensor B) -> Tensor",
            ),
            LoRALinear.apply,
            lambda: (r(6, 4), r(5, 4), r(2, 4), r(5, 2)),
            (0,),
            (1, 2, 3),
            # dY.t() @ x, dYB.t() @ x (dYB = dY @ B: shared, made in I), x @ A.t(), then dY.t() @ it
            2 * 5 * 6 * 4 + 2 * 2 * 6 * 4 + 2 * 6 * 4 * 2 + 2 * 5 * 6 * 2,
        ),
    }


CASES = cases()


def flops(fn: Callable[[], Any]) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


@pytest.mark.parametrize("name", list(CASES))
def test_library_backward_is_captured_and_split_exactly(name: str) -> None:
    op, reference, make, inputs_at, weights_at, weight_flops = CASES[name]
    torch.manual_seed(0)
    values = make()

    def leaves() -> list[Any]:
        return [
            v.clone().requires_grad_() if i in inputs_at + weights_at else v
            for i, v in enumerate(values)
        ]

    def split(args: list[Any]) -> tuple[int, int]:
        out = op(*args)
        g = torch.ones_like(out)
        inputs, weights = [args[i] for i in inputs_at], [args[i] for i in weights_at]
        got: list[Any] = []
        i_flops = flops(lambda: got.append(stage_backward_input([out], [g], inputs, weights)))
        w_flops = flops(lambda: stage_backward_weight(weights, got[0][1]))
        for i, t in zip(inputs_at, got[0][0]):
            args[i].grad = t
        return i_flops, w_flops

    split(leaves())  # the first backward captures it
    auto = op.rules.auto
    assert isinstance(auto.last, TracedSplit), auto.describe()
    args = leaves()
    i_flops, w_flops = split(args)
    full = leaves()
    out = op(*full)
    full_flops = flops(lambda: out.backward(torch.ones_like(out)))
    ref = leaves()
    reference(*ref).backward(torch.ones_like(out))
    for i in inputs_at + weights_at:
        torch.testing.assert_close(args[i].grad, ref[i].grad)
        torch.testing.assert_close(full[i].grad, ref[i].grad)
    assert i_flops + w_flops == full_flops
    row = next(row for row in cg.summary().ops if row.op == op.name)
    assert row.split == "traced", row.detail
    split_plan = auto.last
    assert isinstance(split_plan, TracedSplit)
    if weight_flops is None:  # norms: FlopCounterMode counts no elementwise work
        assert "the weight pass 0" not in split_plan.describe()
        assert "nothing to split" not in split_plan.describe()
    else:
        assert w_flops == weight_flops


def test_once_differentiable_keeps_the_split_and_refuses_double_backward() -> None:
    """check_op's advice (@once_differentiable for a backward that is not twice
    differentiable) keeps the automatic split: torch's wrapper is traced through."""
    op = CASES["liger_rms_norm"][0]
    x, w = r(6, 8).requires_grad_(), r(8).requires_grad_()
    out = op(x, w, 1e-6)
    _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], [w])
    stage_backward_weight([w], groups)
    assert isinstance(op.rules.auto.last, TracedSplit)
    assert next(row.split for row in cg.summary().ops if row.op == op.name) == "traced"
    out = op(x, w, 1e-6)
    (dx,) = torch.autograd.grad(out.sum(), [x], create_graph=True)
    with pytest.raises(cg.UnsupportedError, match="cannot be differentiated again"):
        torch.autograd.grad(dx.sum(), [x])
