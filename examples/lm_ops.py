"""The ops of a small decoder-only language model, each a customgrad op.

RMSNorm and linear register an input half and a weight half, so a zero-bubble schedule runs
each half once: the input half in I, the weight half in W. The other ops have nothing to split
and register one backward with ``split="phase"`` (called in the one pass that needs it, no
tracing): attention, SwiGLU's ``silu(a) * b`` and cross-entropy have no weights, so they run in
I; the embedding's only gradient is its weight's, so it runs in W.
``examples/zero_bubble.py`` builds the model from them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import customgrad as cg

__all__ = ["causal_attention", "cross_entropy", "embedding", "linear", "rms_norm", "silu_and_mul"]

EPS = 1e-6


@cg.op("lm::embedding", weights=("weight",))
def embedding(tokens: Tensor, weight: Tensor) -> Tensor:
    """``weight[tokens]``: one row of ``weight`` per token id."""
    return weight[tokens]


@embedding.register_fake
def _(tokens: Tensor, weight: Tensor) -> Tensor:
    return weight.new_empty((*tokens.shape, weight.shape[1]))


@embedding.register_save_for_backward
def _(inputs: Any, output: Tensor) -> Any:
    return inputs.tokens, inputs.weight


@embedding.register_backward(split="phase")
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Tensor]:
    tokens, weight = saved  # tokens take no gradient: this runs in W only
    dw = torch.zeros_like(weight).index_add_(0, tokens.flatten(), grad.flatten(0, -2))
    return {"weight": dw}


@cg.op("lm::rms_norm", weights=("weight",))
def rms_norm(x: Tensor, weight: Tensor) -> Tensor:
    """``x / rms(x) * weight`` over the last dimension."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


@rms_norm.register_fake
def _(x: Tensor, weight: Tensor) -> Tensor:
    return torch.empty_like(x)


@rms_norm.register_save_for_backward
def _(inputs: Any, output: Tensor) -> Any:
    return inputs.x, inputs.weight


def _normalized(x: Tensor) -> tuple[Tensor, Tensor]:
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    return x * rstd, rstd


@rms_norm.register_backward_input
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Tensor]:
    x, weight = saved
    x_hat, rstd = _normalized(x)
    gw = grad * weight
    return {"x": rstd * (gw - x_hat * (gw * x_hat).mean(-1, keepdim=True))}


@rms_norm.register_backward_weight
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Tensor]:
    x_hat, _ = _normalized(saved[0])
    return {"weight": (grad * x_hat).flatten(0, -2).sum(0)}


@cg.op("lm::linear", weights=("weight",))
def linear(x: Tensor, weight: Tensor) -> Tensor:
    """``x @ weight.T`` (no bias, as in most language models)."""
    return x @ weight.mT


@linear.register_fake
def _(x: Tensor, weight: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@linear.register_save_for_backward
def _(inputs: Any, output: Tensor) -> Any:
    return inputs.x, inputs.weight


@linear.register_backward_input
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Tensor]:
    return {"x": grad @ saved[1]}


@linear.register_backward_weight
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Tensor]:
    x, _ = saved
    return {"weight": grad.flatten(0, -2).mT @ x.flatten(0, -2)}


@cg.op("lm::causal_attention")
def causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Softmax attention with a causal mask; ``(batch, heads, tokens, head_dim)`` each."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@causal_attention.register_fake
def _(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return torch.empty_like(q)


@causal_attention.register_save_for_backward
def _(inputs: Any, output: Tensor) -> Any:
    return inputs.q, inputs.k, inputs.v


@causal_attention.register_backward(split="phase")
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Tensor]:
    # Recompute the attention probabilities (as flash attention does) instead of keeping them.
    q, k, v = saved
    scale = q.shape[-1] ** -0.5
    scores = (q @ k.mT) * scale
    n = scores.shape[-1]
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
    p = scores.masked_fill(mask, float("-inf")).softmax(-1)
    dp = grad @ v.mT
    ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * scale
    return {"q": ds @ k, "k": ds.mT @ q, "v": p.mT @ grad}


@cg.op("lm::silu_and_mul")
def silu_and_mul(x: Tensor) -> Tensor:
    """SwiGLU's gate: ``silu(a) * b`` for ``a, b = x.chunk(2, -1)``."""
    a, b = x.chunk(2, -1)
    return F.silu(a) * b


@silu_and_mul.register_fake
def _(x: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@silu_and_mul.register_save_for_backward
def _(inputs: Any, output: Tensor) -> Any:
    return inputs.x


@silu_and_mul.register_backward(split="phase")
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Tensor]:
    a, b = saved.chunk(2, -1)
    sig = torch.sigmoid(a)
    da = grad * b * sig * (1 + a * (1 - sig))
    return {"x": torch.cat([da, grad * a * sig], -1)}


@cg.op("lm::cross_entropy")
def cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy of ``logits`` (..., vocab) against integer ``targets`` (...)."""
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


@cross_entropy.register_fake
def _(logits: Tensor, targets: Tensor) -> Tensor:
    return logits.new_empty(())


@cross_entropy.register_save_for_backward
def _(inputs: Any, output: Tensor) -> Any:
    return inputs.logits, inputs.targets


@cross_entropy.register_backward(split="phase")
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Tensor]:
    logits, targets = saved
    probs = logits.softmax(-1)
    probs.scatter_add_(-1, targets.unsqueeze(-1), torch.full_like(probs[..., :1], -1.0))
    return {"logits": probs * (grad / targets.numel())}
