"""``examples::varlen_attention``: attention over packed variable-length sequences, with the
interface of flash-attention's ``flash_attn_varlen_func`` and a plain PyTorch kernel.

Facts carried over from flash-attention:

- sequences are packed along the first dimension: ``q`` is ``(total_q, heads, head_dim)``,
  ``k`` and ``v`` are ``(total_k, heads_k, head_dim)``, and sequence ``b`` spans
  ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` (int32 cumulative lengths, starting at 0);
  ``heads`` is a multiple of ``heads_k`` (grouped-query attention);
- ``softmax_scale`` defaults to ``1 / sqrt(head_dim)``; ``causal`` masks are aligned to the
  bottom-right corner when a sequence has more keys than queries; ``window_size=(left, right)``
  limits local attention, ``-1`` meaning unlimited;
- the forward keeps the row-wise ``logsumexp`` of the scores, ``(heads, total_q)`` in float32
  (``+inf`` for a query that may attend to no key, whose output is 0), and the backward
  recomputes the probabilities from it instead of keeping them;
- the backward is its own kernel (``_flash_attn_varlen_backward``, an opaque op under
  ``torch.compile``), computing ``dq``, ``dk`` and ``dv`` together.

In customgrad: the logsumexp is a **residual** (``residuals=("lse",)``), so callers get the
output alone; the op has **no weights**, so it registers only the input half; its backward calls
``examples::varlen_attention_backward``, itself a customgrad op with a fake kernel, so the
backward traces under ``torch.compile`` even though the kernel reads ``cu_seqlens`` as Python
ints. ``window_size``'s tuple default is not something annotations can express to
``torch.library``, so the op gives its schema with ``schema=``.

The kernels loop over sequences in Python: a readable reference, not a fast one.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

import customgrad as cg

__all__ = ["varlen_attention", "varlen_attention_backward"]

_ARGS = (
    "Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, "
    "float? softmax_scale=None, bool causal=False, int[2] window_size=[-1, -1]"
)


@cg.op(
    "examples::varlen_attention",
    residuals=("lse",),
    schema=f"(Tensor q, Tensor k, Tensor v, {_ARGS}) -> (Tensor, Tensor)",
)
def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] | list[int] = (-1, -1),
) -> tuple[Tensor, Tensor]:
    """``softmax(q @ k.T * scale + mask) @ v`` per sequence; returns the output, then ``lse``."""
    scale = _scale(q, softmax_scale)
    out = torch.empty_like(q)
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=_stats_dtype(q))
    for rows, cols, mask in _sequences(cu_seqlens_q, cu_seqlens_k, causal, window_size):
        qs, ks, vs = q[rows], _repeat_heads(k[cols], q), _repeat_heads(v[cols], q)
        scores = torch.einsum("qhd,khd->hqk", qs, ks).to(lse.dtype) * scale
        scores = scores.masked_fill(~mask, -math.inf)
        # a query with no key to attend to gets lse = +inf (as in flash-attention): p = 0, out = 0
        lse_s = torch.logsumexp(scores, dim=-1).nan_to_num(neginf=math.inf)  # (heads, L_q)
        p = torch.exp(scores - lse_s[..., None])
        out[rows] = torch.einsum("hqk,khd->qhd", p.to(q.dtype), vs)
        lse[:, rows] = lse_s
    return out, lse


@varlen_attention.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=_stats_dtype(q))


@varlen_attention.register_save_for_backward
def _(inputs: Any, output: Tensor, residuals: Any) -> Any:
    return (inputs.q, inputs.k, inputs.v, output, residuals.lse, *inputs[3:])


@varlen_attention.register_backward_input(differentiable=False)  # no weights: the whole backward
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Tensor | None]:
    q, k, v, out, lse, *args = saved
    dq, dk, dv = varlen_attention_backward(grad, q, k, v, out, lse, *args)
    return {"q": dq, "k": dk, "v": dv}


# -- the backward kernel, an op of its own ---------------------------------------------------------
@cg.op(
    "examples::varlen_attention_backward",
    schema=(
        "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        f"{_ARGS}) -> (Tensor, Tensor, Tensor)"
    ),
)
def varlen_attention_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] | list[int] = (-1, -1),
) -> tuple[Tensor, Tensor, Tensor]:
    """``dq, dk, dv`` from the output gradient, recomputing the probabilities from ``lse``."""
    scale = _scale(q, softmax_scale)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    # D = rowsum(dout * out): flash-attention's preprocessing step
    delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1).mT  # (heads, total_q)
    for rows, cols, mask in _sequences(cu_seqlens_q, cu_seqlens_k, causal, window_size):
        qs, ks, vs = q[rows], _repeat_heads(k[cols], q), _repeat_heads(v[cols], q)
        dos = dout[rows]
        scores = torch.einsum("qhd,khd->hqk", qs, ks).to(lse.dtype) * scale
        p = torch.exp(scores.masked_fill(~mask, -math.inf) - lse[:, rows, None])
        dp = torch.einsum("qhd,khd->hqk", dos, vs).to(lse.dtype)
        ds = (p * (dp - delta[:, rows, None])).to(q.dtype)
        dq[rows] = torch.einsum("hqk,khd->qhd", ds, ks) * scale
        dk[cols] = _sum_heads(torch.einsum("hqk,qhd->khd", ds, qs) * scale, k)
        dv[cols] = _sum_heads(torch.einsum("hqk,qhd->khd", p.to(q.dtype), dos), v)
    return dq, dk, dv


@varlen_attention_backward.register_fake
def _(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any) -> Any:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


# -- helpers -----------------------------------------------------------------------------------
def _scale(q: Tensor, softmax_scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale


def _stats_dtype(q: Tensor) -> torch.dtype:
    """The dtype of the softmax statistics: float32 (float64 for float64 inputs)."""
    return torch.promote_types(q.dtype, torch.float32)


def _sequences(
    cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, causal: bool, window_size: Any
) -> Iterator[tuple[slice, slice, Tensor]]:
    """For each packed sequence: its query rows, its key rows, and the ``(L_q, L_k)`` mask of
    the keys each query may attend to."""
    left, right = window_size
    if causal:
        right = 0
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for q0, q1, k0, k1 in zip(starts_q, starts_q[1:], starts_k, starts_k[1:]):
        i = torch.arange(q1 - q0, device=cu_seqlens_q.device)[:, None] + (k1 - k0) - (q1 - q0)
        j = torch.arange(k1 - k0, device=cu_seqlens_q.device)[None, :]
        mask = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool, device=cu_seqlens_q.device)
        if right >= 0:
            mask &= j <= i + right
        if left >= 0:
            mask &= j >= i - left
        yield slice(q0, q1), slice(k0, k1), mask


def _repeat_heads(kv: Tensor, q: Tensor) -> Tensor:
    """Grouped-query attention: each key/value head serves ``heads // heads_k`` query heads."""
    return kv.repeat_interleave(q.shape[1] // kv.shape[1], dim=1)


def _sum_heads(grad: Tensor, kv: Tensor) -> Tensor:
    """The gradient of :func:`_repeat_heads`: sum over the query heads of each group."""
    total, heads, dim = grad.shape
    return grad.view(total, kv.shape[1], heads // kv.shape[1], dim).sum(2)
