"""``examples::linear_cross_entropy``: the language-model head and its loss in one op, as
Liger-Kernel's fused linear cross-entropy computes them, without ever keeping the logits.

``loss = cross_entropy(_input @ weight.T + bias, target)`` over a vocabulary of ``V`` rows.
Facts carried over from Liger's ``LigerFusedLinearCrossEntropyFunction``:

- the ``(N, V)`` logits are the largest tensor of a small model's step; the forward computes
  them chunk by chunk of tokens, and with ``reduction="mean"`` or ``"sum"`` (a scalar loss, so
  the incoming gradient is one number) it also computes **the gradients** then, chunk by chunk:
  ``grad_input``, ``grad_weight`` and ``grad_bias``; the backward only scales them;
- tokens whose target is ``ignore_index`` count for nothing, and ``"mean"`` divides by the number
  of the others;
- the z-loss ``lse_square_scale * logsumexp(logits)**2`` is added to each token's loss, and with
  ``return_z_loss=True`` returned as a second output for logging (not differentiable);
- the argument is named ``_input`` (customgrad takes any name ``torch.library`` takes).

In customgrad:

- the gradients computed in the forward are **residuals** (``residuals=("grad_input",
  "grad_weight", "grad_bias")``), not extra outputs: autograd never builds zero cotangents for
  them. They are ``Tensor?`` (None with ``reduction="none"``, ``grad_bias`` None without a bias),
  and so is the second output: the op gives its schema with ``schema=``;
- with ``reduction="none"`` the incoming gradient is one number per token, so nothing can be
  computed ahead: the backward recomputes the logits (the forward kept none) and turns them into
  ``dlogits``, which both halves need (``dx = dlogits @ W``, ``dW = dlogits.T @ x``). That is
  **shared work**, registered once with ``register_backward_shared`` and handed from I to W:
  the pair would otherwise recompute the logits matmul in each half (1.33x the backward's FLOPs).
  The hand-off keeps ``dlogits`` (N, V) alive from I until W: the memory it trades for FLOPs.

The backward uses tensors computed in the forward (the gradients), so it is registered
``differentiable=False``: double backward raises a clear error.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

import customgrad as cg

__all__ = ["linear_cross_entropy"]


@cg.op(
    "examples::linear_cross_entropy",
    weights=("weight", "bias"),
    residuals=("grad_input", "grad_weight", "grad_bias"),
    output_differentiability=(True, False),
    schema=(
        "(Tensor _input, Tensor weight, Tensor target, Tensor? bias=None, int ignore_index=-100, "
        'float lse_square_scale=0.0, str reduction="mean", bool return_z_loss=False) '
        "-> (Tensor, Tensor?, Tensor?, Tensor?, Tensor?)"
    ),
)
def linear_cross_entropy(
    _input: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    ignore_index: int = -100,
    lse_square_scale: float = 0.0,
    reduction: str = "mean",
    return_z_loss: bool = False,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """Cross-entropy of ``_input @ weight.T + bias`` against ``target``.

    Args:
        _input: ``(N, H)`` hidden states.
        weight: ``(V, H)`` output embedding.
        target: ``(N,)`` class indices.
        bias: ``(V,)`` or None.
        ignore_index: targets that contribute neither loss nor gradient.
        lse_square_scale: weight of the z-loss.
        reduction: ``"mean"`` (over the tokens not ignored), ``"sum"`` or ``"none"``.
        return_z_loss: also return the z-loss (for logging).

    Returns:
        ``(loss, z_loss or None)``, then the residuals: the gradients of the loss (``None`` with
        ``reduction="none"``). ``loss`` is in float32 (float64 for float64 inputs).
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    n = _input.shape[0]
    losses = _input.new_zeros(n, dtype=_stats_dtype(_input))
    z_losses = torch.zeros_like(losses)
    ahead = reduction != "none"  # a scalar loss: compute the gradients now
    grad_input = torch.zeros_like(_input) if ahead else None
    grad_weight = torch.zeros_like(weight) if ahead else None
    grad_bias = torch.zeros_like(bias) if ahead and bias is not None else None
    divisor = max(int((target != ignore_index).sum()), 1) if reduction == "mean" else 1

    for rows in _chunks(n, weight.shape[0], _input.shape[1]):
        x, t = _input[rows], target[rows]
        logits = _logits(x, weight, bias)
        lse = torch.logsumexp(logits, dim=-1)
        valid = t != ignore_index
        picked = logits.gather(1, t.clamp(min=0)[:, None])[:, 0]
        z_losses[rows] = torch.where(valid, lse_square_scale * lse**2, 0.0)
        losses[rows] = torch.where(valid, lse - picked, 0.0) + z_losses[rows]
        if grad_input is not None and grad_weight is not None:  # reduction "mean" or "sum"
            dlogits = _dlogits(logits, lse, t, valid, lse_square_scale) / divisor
            grad_input[rows] = dlogits.to(x.dtype) @ weight
            grad_weight += (dlogits.mT @ x.to(dlogits.dtype)).to(weight.dtype)
            if grad_bias is not None:
                grad_bias += dlogits.sum(0).to(grad_bias.dtype)

    loss, z_loss = _reduce(losses, divisor, reduction), _reduce(z_losses, divisor, reduction)
    return loss, (z_loss if return_z_loss else None), grad_input, grad_weight, grad_bias


def _stats_dtype(t: Tensor) -> torch.dtype:
    """Logits and losses are float32 (float64 for float64 inputs)."""
    return torch.promote_types(t.dtype, torch.float32)


def _chunks(n: int, vocab: int, hidden: int) -> list[slice]:
    """Token chunks whose logits are about as large as the input (Liger's heuristic)."""
    size = max(1, n // max(1, -(-vocab // hidden)))
    size = 1 << (size - 1).bit_length()  # a power of two
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def _logits(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    logits = x @ weight.mT
    if bias is not None:
        logits = logits + bias
    return logits.to(_stats_dtype(x))


def _dlogits(logits: Tensor, lse: Tensor, target: Tensor, valid: Tensor, z_scale: float) -> Tensor:
    """d(per-token loss) / d logits: ``softmax * (1 + 2 * z_scale * lse) - onehot(target)``;
    zero for ignored tokens."""
    d = torch.exp(logits - lse[:, None]) * (1 + 2 * z_scale * lse)[:, None]
    d = d.scatter_add(1, target.clamp(min=0)[:, None], -torch.ones_like(d[:, :1]))
    return torch.where(valid[:, None], d, 0.0)


def _reduce(losses: Tensor, divisor: int, reduction: str) -> Tensor:
    if reduction == "none":
        return losses
    total = losses.sum()
    return total / divisor if reduction == "mean" else total


@linear_cross_entropy.register_fake
def _(
    _input: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    ignore_index: int = -100,
    lse_square_scale: float = 0.0,
    reduction: str = "mean",
    return_z_loss: bool = False,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    shape = (_input.shape[0],) if reduction == "none" else ()
    loss = _input.new_empty(shape, dtype=_stats_dtype(_input))
    z_loss = torch.empty_like(loss) if return_z_loss else None
    if reduction == "none":
        return loss, z_loss, None, None, None
    grad_bias = torch.empty_like(bias) if bias is not None else None
    return loss, z_loss, torch.empty_like(_input), torch.empty_like(weight), grad_bias


class GradsAhead(NamedTuple):
    """Saved with reduction="mean" or "sum": the gradients the forward computed."""

    grad_input: Tensor
    grad_weight: Tensor
    grad_bias: Tensor | None


class Recompute(NamedTuple):
    """Saved with reduction="none": what the backward recomputes the logits from."""

    x: Tensor
    weight: Tensor
    bias: Tensor | None
    target: Tensor
    ignore_index: int
    lse_square_scale: float


@linear_cross_entropy.register_save_for_backward
def _(inputs: Any, output: Any, residuals: Any) -> GradsAhead | Recompute:
    if inputs.reduction != "none":  # keep the gradients, not the inputs
        return GradsAhead(residuals.grad_input, residuals.grad_weight, residuals.grad_bias)
    return Recompute(
        inputs._input,
        inputs.weight,
        inputs.bias,
        inputs.target,
        inputs.ignore_index,
        inputs.lse_square_scale,
    )


@linear_cross_entropy.register_backward_shared  # read only with reduction="none"
def _(ctx: cg.BackwardContext, saved: Recompute, grad: Tensor, grad_z: Any) -> Tensor:
    """``dlogits`` (N, V): the logits recomputed (one matmul), times each token's gradient."""
    logits = _logits(saved.x, saved.weight, saved.bias)
    lse = torch.logsumexp(logits, dim=-1)
    valid = saved.target != saved.ignore_index
    return _dlogits(logits, lse, saved.target, valid, saved.lse_square_scale) * grad[:, None]


@linear_cross_entropy.register_backward_input(differentiable=False)
def _(
    ctx: cg.BackwardContext, saved: GradsAhead | Recompute, grad: Tensor, grad_z: Any
) -> dict[str, Tensor | None]:
    if isinstance(saved, GradsAhead):  # grad is the scalar loss's gradient
        return {"_input": saved.grad_input * grad.to(saved.grad_input.dtype)}
    dlogits = ctx.shared
    return {"_input": (dlogits @ saved.weight.to(dlogits.dtype)).to(saved.x.dtype)}


@linear_cross_entropy.register_backward_weight(differentiable=False)
def _(
    ctx: cg.BackwardContext, saved: GradsAhead | Recompute, grad: Tensor, grad_z: Any
) -> dict[str, Tensor | None]:
    if isinstance(saved, GradsAhead):
        scale = grad.to(saved.grad_weight.dtype)
        grad_bias = saved.grad_bias * scale if saved.grad_bias is not None else None
        return {"weight": saved.grad_weight * scale, "bias": grad_bias}
    dlogits = ctx.shared
    grad_weight = (dlogits.mT @ saved.x.to(dlogits.dtype)).to(saved.weight.dtype)
    grad_bias = dlogits.sum(0).to(saved.bias.dtype) if saved.bias is not None else None
    return {"weight": grad_weight, "bias": grad_bias}
