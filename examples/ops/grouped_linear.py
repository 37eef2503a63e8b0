"""``examples::grouped_linear``: one linear layer per expert over consecutive token groups, as
TransformerEngine's ``GroupedLinear`` computes a mixture-of-experts layer.

Facts carried over from TransformerEngine: the tokens arrive sorted by expert, ``m_splits[i]``
of them for expert ``i`` (possibly zero); expert ``i`` has its own weight ``(out, in)``; the
forward is one grouped GEMM and so is each half of the backward (``dgrad``: input gradients,
``wgrad``: weight gradients). TransformerEngine defers ``wgrad`` for zero-bubble schedules
(``delay_wgrad_compute=True``, then ``backward_dw()``); here the weight half is that step.

The weights are a **list argument** (``weights: list[Tensor]``, named in ``weights=``): the
weight half returns a list of gradients, one per expert, ``None`` for a frozen expert.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

import customgrad as cg

__all__ = ["grouped_linear"]


@cg.op("examples::grouped_linear", weights=("weights",))
def grouped_linear(inp: Tensor, m_splits: list[int], weights: list[Tensor]) -> Tensor:
    """``inp`` (sum(m_splits), in) split into groups; group ``i`` times ``weights[i].T``."""
    groups = inp.split(m_splits)
    return torch.cat([x @ w.mT for x, w in zip(groups, weights)])


@grouped_linear.register_fake
def _(inp: Tensor, m_splits: list[int], weights: list[Tensor]) -> Tensor:
    return inp.new_empty((inp.shape[0], weights[0].shape[0]))


@grouped_linear.register_save_for_backward
def _(inputs: Any, output: Tensor) -> Any:
    return inputs.inp, inputs.m_splits, inputs.weights


@grouped_linear.register_backward_input  # dgrad
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Any]:
    _, m_splits, weights = saved
    return {"inp": torch.cat([g @ w for g, w in zip(grad.split(m_splits), weights)])}


@grouped_linear.register_backward_weight  # wgrad
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Any]:
    inp, m_splits, weights = saved
    groups = zip(grad.split(m_splits), inp.split(m_splits), weights)
    return {"weights": [g.mT @ x if w.requires_grad else None for g, x, w in groups]}
