"""An expert-parallel mixture-of-experts block whose all-to-alls wait with weight work.

What a user writes to hide the expert all-to-all behind weight gradients (W): the all-to-all is
issued with ``async_op=True`` and waited for through ``queue.run_while(work, label)``, where
``queue`` is the :class:`~customgrad.pipelining.WeightGradQueue` of the pipeline stages. Inside
``queue.overlap()`` (or a schedule given to
:func:`~customgrad.pipelining.overlap_forward_backward`) that wait runs queued W while the
tokens travel; elsewhere it only waits.

The block: ``x + mlp(x)``, then ``+ moe(x)``. The MoE layer routes each token to its top-k of
``n_experts`` experts (a softmax router), sends it to the rank holding that expert (dispatch),
runs each local expert's two-layer ReLU MLP as grouped GEMMs over the tokens sorted by expert,
sends the outputs back (combine) and sums them weighted by the router's scores. The
experts are split evenly over the expert-parallel group; everything else is replicated.

Every weight is a customgrad op's (``examples::linear``; the experts' grouped GEMM
:func:`customgrad.ops.grouped_mm`, ``torch._grouped_mm``'s ``(x, w, offs)``), so every W is
queued.
:func:`reference_grads` computes the same gradients on one process, without any all-to-all.
Imported by ``tests/test_moe_overlap.py``, ``benchmarks/moe_overlap.py`` and
``benchmarks/scale.py``, which run it on 2 processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from customgrad.ops import grouped_mm
from customgrad.pipelining import WeightGradQueue
from examples.ops.linear import linear

__all__ = ["AllToAll", "Config", "MoEBlock", "reference_grads"]


# --- the all-to-all, waited for through the queue ------------------------------------------


class AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` with its gradient (the same exchange back), each waited for
    through ``queue.run_while``: inside ``queue.overlap()`` the forward's wait runs queued W."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        out_splits: list[int],
        in_splits: list[int],
        group: dist.ProcessGroup,
        queue: WeightGradQueue,
        label: str,
    ) -> Tensor:
        ctx.splits, ctx.group, ctx.queue, ctx.label = (in_splits, out_splits), group, queue, label
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        work = dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group,
                                      async_op=True)  # fmt: skip
        queue.run_while(work, label)  # W of another microbatch while the tokens travel
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        in_splits, out_splits = ctx.splits
        out = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        work = dist.all_to_all_single(out, grad.contiguous(), in_splits, out_splits,
                                      group=ctx.group, async_op=True)  # fmt: skip
        ctx.queue.run_while(work, ctx.label)  # in a backward: waits only
        return out, None, None, None, None, None


# --- the block ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    dim: int = 16
    hidden: int = 32  # the dense MLP's and each expert's width
    n_experts: int = 4  # over the whole expert-parallel group
    top_k: int = 2
    dtype: torch.dtype = torch.float64


def expert_weights(cfg: Config, block: int) -> tuple[Tensor, Tensor]:
    """Every expert's ``(w1, w2)`` of block ``block``, ``(E, dim, hidden)`` and
    ``(E, hidden, dim)``: the same on every rank (each keeps its own experts)."""
    gen = torch.Generator().manual_seed(1000 + block)
    w1 = torch.randn(cfg.n_experts, cfg.dim, cfg.hidden, generator=gen, dtype=cfg.dtype)
    w2 = torch.randn(cfg.n_experts, cfg.hidden, cfg.dim, generator=gen, dtype=cfg.dtype)
    return w1 / cfg.dim**0.5, w2 / cfg.hidden**0.5


class MoEBlock(nn.Module):
    """``x + mlp(x)``, then ``+ moe(x)``, with this rank's experts of the ``group``.

    Args:
        cfg: sizes.
        block: the block's number (seeds its weights).
        group: the expert-parallel group (its ranks hold ``n_experts / size`` experts each).
        queue: the stages' weight-gradient queue, which the all-to-alls wait through.
    """

    def __init__(
        self, cfg: Config, block: int, group: dist.ProcessGroup, queue: WeightGradQueue
    ) -> None:
        super().__init__()
        self.cfg, self.group, self.queue = cfg, group, queue
        gen = torch.Generator().manual_seed(block)
        d, h, e = cfg.dim, cfg.hidden, cfg.n_experts
        self.w_in = nn.Parameter(torch.randn(h, d, generator=gen, dtype=cfg.dtype) / d**0.5)
        self.w_out = nn.Parameter(torch.randn(d, h, generator=gen, dtype=cfg.dtype) / h**0.5)
        self.router = nn.Parameter(torch.randn(e, d, generator=gen, dtype=cfg.dtype) / d**0.5)
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        local = e // size
        w1, w2 = expert_weights(cfg, block)
        self.w1 = nn.Parameter(w1[rank * local : (rank + 1) * local].clone())
        self.w2 = nn.Parameter(w2[rank * local : (rank + 1) * local].clone())

    def forward(self, x: Tensor) -> Tensor:
        x = x + linear(torch.relu(linear(x, self.w_in)), self.w_out)
        return x + self.moe(x)

    def moe(self, x: Tensor) -> Tensor:
        cfg, group = self.cfg, self.group
        size, local = dist.get_world_size(group), self.w1.shape[0]
        scores = linear(x, self.router).softmax(-1)
        top_scores, top_experts = scores.topk(cfg.top_k, dim=-1)  # (T, k)
        order = top_experts.reshape(-1).argsort(stable=True)  # routed tokens by expert
        token = order // cfg.top_k
        counts = torch.bincount(top_experts.reshape(-1), minlength=cfg.n_experts)
        received = torch.empty_like(counts)  # per (source rank, local expert)
        dist.all_to_all_single(received, counts, group=group)
        in_splits = counts.view(size, local).sum(1).tolist()
        out_splits = received.view(size, local).sum(1).tolist()
        routed = AllToAll.apply(x[token], out_splits, in_splits, group, self.queue, "dispatch")
        # received rank-major, (rank 0: expert 0, 1, ...), (rank 1: ...): sort by expert
        per = received.view(size, local)
        starts = (per.reshape(-1).cumsum(0) - per.reshape(-1)).view(size, local)
        perm = torch.cat([torch.arange(int(starts[r, i]), int(starts[r, i] + per[r, i]))
                          for i in range(local) for r in range(size)])  # fmt: skip
        offs = per.sum(0).cumsum(0).to(torch.int32)
        hidden = torch.relu(grouped_mm(routed[perm], self.w1, offs))
        expert_out = grouped_mm(hidden, self.w2, offs)
        back = torch.zeros_like(expert_out).index_copy(0, perm, expert_out)
        out = AllToAll.apply(back, in_splits, out_splits, group, self.queue, "combine")
        weights = top_scores.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(x).index_add(0, token, out * weights)


def reference_grads(
    cfg: Config, blocks: int, batches: Sequence[tuple[Tensor, Tensor]], n_microbatches: int
) -> list[dict[str, Tensor]]:
    """Each rank's gradients, computed on one process with every expert and no all-to-all.

    ``batches[r]`` is rank ``r``'s ``(x, target)``; its loss is the mean over its microbatches
    of :func:`loss_fn` (what a schedule with ``scale_grads=True`` differentiates). A dense
    weight's gradient on rank ``r`` is that of its own loss; an expert's, on the rank holding
    it, sums what every rank's tokens sent it.
    """
    size = len(batches)
    local = cfg.n_experts // size
    params: list[dict[str, Tensor]] = []
    experts: list[tuple[Tensor, Tensor]] = []
    for b in range(blocks):
        gen = torch.Generator().manual_seed(b)
        d, h, e = cfg.dim, cfg.hidden, cfg.n_experts
        dense = {
            "w_in": torch.randn(h, d, generator=gen, dtype=cfg.dtype) / d**0.5,
            "w_out": torch.randn(d, h, generator=gen, dtype=cfg.dtype) / h**0.5,
            "router": torch.randn(e, d, generator=gen, dtype=cfg.dtype) / d**0.5,
        }
        params.append(dense)
        experts.append(expert_weights(cfg, b))
    leaves = [{k: v.clone().requires_grad_() for k, v in p.items()} for p in params]
    w_experts = [(w1.clone().requires_grad_(), w2.clone().requires_grad_()) for w1, w2 in experts]
    out: list[dict[str, Tensor]] = []
    expert_grads = [(torch.zeros_like(w1), torch.zeros_like(w2)) for w1, w2 in experts]
    for x, target in batches:
        loss = torch.zeros((), dtype=cfg.dtype)
        for xm, tm in zip(x.chunk(n_microbatches), target.chunk(n_microbatches)):
            h = xm
            for p, (w1, w2) in zip(leaves, w_experts):
                h = h + torch.relu(h @ p["w_in"].mT) @ p["w_out"].mT
                scores = (h @ p["router"].mT).softmax(-1)
                top_scores, top_experts = scores.topk(cfg.top_k, dim=-1)
                moe = torch.zeros_like(h)
                for k in range(cfg.top_k):
                    for ex in range(cfg.n_experts):
                        rows = top_experts[:, k] == ex
                        y = torch.relu(h[rows] @ w1[ex]) @ w2[ex]
                        moe = moe.index_add(0, rows.nonzero()[:, 0], y * top_scores[rows, k, None])
                h = h + moe
            loss = loss + loss_fn(h, tm) / n_microbatches
        grads = torch.autograd.grad(loss, [*(v for p in leaves for v in p.values()),
                                           *(w for pair in w_experts for w in pair)])  # fmt: skip
        n_dense = sum(len(p) for p in leaves)
        dense_grads = iter(grads[:n_dense])
        out.append({f"{b}.{k}": next(dense_grads) for b, p in enumerate(leaves) for k in p})
        for b, (g1, g2) in enumerate(zip(grads[n_dense::2], grads[n_dense + 1 :: 2])):
            expert_grads[b][0].add_(g1)
            expert_grads[b][1].add_(g2)
    for r in range(size):
        for b, (g1, g2) in enumerate(expert_grads):
            out[r][f"{b}.w1"] = g1[r * local : (r + 1) * local]
            out[r][f"{b}.w2"] = g2[r * local : (r + 1) * local]
    return out


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    return ((output - target) ** 2).mean()
