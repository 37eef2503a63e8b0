"""The models the benchmarks measure, each in customgrad ops, plain Functions and native ops.

- :class:`MLP` (``split.py``, ``split_memory.py``): ``x @ weight.mT`` as a customgrad op
  (separate input and weight halves), as a plain ``autograd.Function`` and as
  ``nn.functional.linear``.
- :class:`Block` (``pipeline.py``): a pre-norm MLP block, RMSNorm and two linears with bias.
- :class:`MoEBlock` (``gpu_check.py``): a mixture-of-experts block (router, dispatch, grouped
  experts through ``customgrad.ops.grouped_mm``, combine, shared expert), without torchtitan.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

import customgrad as cg


@cg.op("benchmarks::linear", weights=("weight",))
def cg_linear(x: Tensor, weight: Tensor) -> Tensor:
    return x @ weight.mT


@cg_linear.register_fake
def _(x: Tensor, weight: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@cg_linear.register_save_for_backward
def _(inputs: Any, output: Tensor) -> Any:
    return inputs.x, inputs.weight


@cg_linear.register_backward_input
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Any]:
    return {"x": grad @ saved[1]}


@cg_linear.register_backward_weight
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Any]:
    return {"weight": grad.mT @ saved[0]}


class FnLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(x, weight)
        return x @ weight.mT

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        x, weight = ctx.saved_tensors
        gx = grad @ weight if ctx.needs_input_grad[0] else None
        gw = grad.mT @ x if ctx.needs_input_grad[1] else None
        return gx, gw


LAYERS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "customgrad op": cg_linear,
    "autograd.Function": FnLinear.apply,
    "nn.Linear": lambda x, w: nn.functional.linear(x, w),
}


class MLP(nn.Module):
    """``depth`` square linear layers of ``kind`` (a key of ``LAYERS``), each followed by ``act``."""

    def __init__(
        self, kind: str, width: int, depth: int, act: Callable[[Tensor], Tensor] = torch.relu
    ) -> None:
        super().__init__()
        self.layer = LAYERS[kind]
        self.act = act
        self.ws = nn.ParameterList(
            nn.Parameter(torch.randn(width, width) / width**0.5) for _ in range(depth)
        )

    def forward(self, x: Tensor) -> Tensor:
        for w in self.ws:
            x = self.act(self.layer(x, w))
        return x


# --- the pipeline benchmark's block: pre-norm MLP, in three kinds of op ---------------------

EPS = 1e-6


@cg.op("benchmarks::biased_linear", weights=("weight", "bias"))
def cg_biased_linear(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    return torch.addmm(bias, x.flatten(0, -2), weight.mT).unflatten(0, x.shape[:-1])


@cg_biased_linear.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@cg_biased_linear.register_save_for_backward
def _(inputs: Any, output: Tensor) -> Any:
    return inputs.x, inputs.weight


@cg_biased_linear.register_backward_input
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Any]:
    return {"x": grad @ saved[1]}


@cg_biased_linear.register_backward_weight
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Any]:
    g, x = grad.flatten(0, -2), saved[0].flatten(0, -2)
    return {"weight": g.mT @ x, "bias": g.sum(0)}


@cg.op("benchmarks::rms_norm", weights=("weight",))
def cg_rms_norm(x: Tensor, weight: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


@cg_rms_norm.register_fake
def _(x: Tensor, weight: Tensor) -> Tensor:
    return torch.empty_like(x)


@cg_rms_norm.register_save_for_backward
def _(inputs: Any, output: Tensor) -> Any:
    rstd = torch.rsqrt(inputs.x.pow(2).mean(-1, keepdim=True) + EPS)
    return inputs.x * rstd, rstd, inputs.weight


@cg_rms_norm.register_backward_input
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Any]:
    x_hat, rstd, weight = saved
    gw = grad * weight
    return {"x": rstd * (gw - x_hat * (gw * x_hat).mean(-1, keepdim=True))}


@cg_rms_norm.register_backward_weight
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Any]:
    return {"weight": (grad * saved[0]).flatten(0, -2).sum(0)}


class FnBiasedLinear(torch.autograd.Function):
    """The same linear as a plain ``autograd.Function``: its backward does both halves."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        ctx.save_for_backward(x, weight)
        return torch.addmm(bias, x.flatten(0, -2), weight.mT).unflatten(0, x.shape[:-1])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        g, xs = grad.flatten(0, -2), x.flatten(0, -2)
        need_x, need_w, need_b = ctx.needs_input_grad  # fixed at forward time
        return (
            grad @ weight if need_x else None,
            g.mT @ xs if need_w else None,
            g.sum(0) if need_b else None,
        )


class FnRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor) -> Tensor:
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
        ctx.save_for_backward(x * rstd, rstd, weight)
        return x * rstd * weight

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        x_hat, rstd, weight = ctx.saved_tensors
        gw = grad * weight
        gx = rstd * (gw - x_hat * (gw * x_hat).mean(-1, keepdim=True))
        return gx, (grad * x_hat).flatten(0, -2).sum(0)


def _native_rms_norm(x: Tensor, weight: Tensor) -> Tensor:
    return nn.functional.rms_norm(x, x.shape[-1:], weight, EPS)


BLOCK_OPS: dict[str, tuple[Callable[..., Tensor], Callable[[Tensor, Tensor], Tensor]]] = {
    "customgrad": (cg_biased_linear, cg_rms_norm),
    "native": (nn.functional.linear, _native_rms_norm),
    "function": (FnBiasedLinear.apply, FnRMSNorm.apply),
}
"""Linear (with bias) and RMSNorm of each kind: customgrad ops, torch's own (``nn.Linear``'s
and ``nn.RMSNorm``'s functions), plain ``autograd.Function``\\ s."""


class Block(nn.Module):
    """``x + fc2(relu(fc1(rms_norm(x))))`` in the ops of ``impl`` (a key of ``BLOCK_OPS``).

    The same ``generator`` state gives the same parameters for every ``impl``.
    """

    def __init__(self, dim: int, hidden: int, impl: str, generator: torch.Generator) -> None:
        super().__init__()
        self.linear, self.rms_norm = BLOCK_OPS[impl]

        def param(*shape: int, scale: float) -> nn.Parameter:
            return nn.Parameter(torch.randn(*shape, generator=generator) * scale)

        self.norm = param(dim, scale=0.1)
        with torch.no_grad():
            self.norm += 1.0
        self.w1, self.b1 = param(hidden, dim, scale=dim**-0.5), param(hidden, scale=0.02)
        self.w2, self.b2 = param(dim, hidden, scale=hidden**-0.5), param(dim, scale=0.02)

    def forward(self, x: Tensor) -> Tensor:
        h = self.linear(self.rms_norm(x, self.norm), self.w1, self.b1)
        return x + self.linear(torch.relu(h), self.w2, self.b2)


class MoEBlock(nn.Module):
    """``x + moe(rms_norm(x)) + shared(rms_norm(x))``: a mixture-of-experts block as torchtitan's
    ``MoE`` computes it, without torchtitan (the GPU check runs where it is not installed).

    A softmax router picks each token's ``top_k`` of ``experts`` experts; the tokens are sorted
    by expert (the dispatch), each expert's SwiGLU runs as three grouped GEMMs in bfloat16
    (``customgrad.ops.grouped_mm``, or ``grouped_mm`` given; weights ``w1``/``w3`` ``(E, F, D)``
    and ``w2`` ``(E, D, F)``, passed transposed as torchtitan passes them), the outputs are
    weighted by the router's scores and summed back per token (the combine), and a shared
    expert (a SwiGLU of ``nn.Linear``\\ s) is added. The same ``generator`` state gives the same
    parameters.
    """

    def __init__(
        self, dim: int, hidden: int, experts: int, top_k: int, generator: torch.Generator,
        grouped_mm: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        import customgrad.ops

        self.grouped_mm = grouped_mm or customgrad.ops.grouped_mm
        self.experts, self.top_k = experts, top_k

        def param(*shape: int, scale: float) -> nn.Parameter:
            return nn.Parameter(torch.randn(*shape, generator=generator) * scale)

        self.norm = param(dim, scale=0.1)
        with torch.no_grad():
            self.norm += 1.0
        self.router = param(experts, dim, scale=dim**-0.5)
        self.w1 = param(experts, hidden, dim, scale=dim**-0.5)
        self.w3 = param(experts, hidden, dim, scale=dim**-0.5)
        self.w2 = param(experts, dim, hidden, scale=hidden**-0.5)
        self.shared = nn.ModuleList(nn.Linear(dim, hidden, bias=False) for _ in range(2))
        self.shared_out = nn.Linear(hidden, dim, bias=False)
        for linear in (*self.shared, self.shared_out):
            with torch.no_grad():
                linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator))
                linear.weight.mul_(linear.in_features**-0.5)

    def forward(self, x: Tensor) -> Tensor:
        h = _native_rms_norm(x, self.norm)
        scores = torch.softmax((h @ self.router.mT).float(), dim=-1)
        top_scores, top_ids = scores.topk(self.top_k, dim=-1)
        order = top_ids.flatten().argsort(stable=True)  # the routed rows, sorted by expert
        counts = torch.bincount(top_ids.flatten(), minlength=self.experts)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        tokens = order // self.top_k
        routed = h[tokens].bfloat16()

        def mm(a: Tensor, w: Tensor) -> Tensor:
            return self.grouped_mm(a, w.bfloat16().transpose(-2, -1), offs)

        out = mm(torch.nn.functional.silu(mm(routed, self.w1)) * mm(routed, self.w3), self.w2)
        out = out.float() * top_scores.flatten()[order].unsqueeze(-1)
        moe = torch.zeros_like(h).index_add(0, tokens, out.to(h.dtype))
        gate, up = (linear(h) for linear in self.shared)
        return x + moe + self.shared_out(torch.nn.functional.silu(gate) * up)
