"""A torchtitan-shaped Llama, cut into pipeline stages the torchtitan way, compiled per block.

The model has torchtitan's Llama 3 structure and parameter names: ``tok_embeddings``, a
``layers`` ``ModuleDict`` of ``TransformerBlock``\\ s (``attention_norm``, ``attention`` with
``wq``/``wk``/``wv``/``wo``, rotary position embeddings and grouped-query attention,
``ffn_norm``, a SwiGLU ``feed_forward`` with ``w1``/``w2``/``w3``), ``norm`` and ``lm_head``.
Its stages are built as torchtitan's ``pipeline_module_split`` builds them: each stage is a
copy of the whole model with the layers of other stages deleted and ``tok_embeddings``,
``norm`` and ``lm_head`` set to None where they do not belong; then each block is compiled on
its own (torchtitan's ``apply_compile``), here with ``customgrad.compile``, whose compiled
backward splits into an input pass and a weight pass. The stages go into customgrad's
``PipelineStage`` and ``ScheduleZBVZeroBubble`` trains them on 2 processes (stage ``r`` and
``2w - 1 - r`` on rank ``r``: the V). The first step's gradients are checked against the same
model on one process, in float64.

    python examples/llama_stages.py                     # spawns 2 local processes (gloo)
    torchrun --nproc-per-node 2 examples/llama_stages.py
    python examples/llama_stages.py --schedule DualPipeV --backend aot_eager
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import socket
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import Tensor, nn

import customgrad
import customgrad.pipelining as cgp


@dataclass(frozen=True)
class ModelArgs:
    """torchtitan's ``TransformerModelArgs`` fields that shape the model (a tiny default)."""

    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2  # grouped-query attention: 2 query heads share each key/value head
    vocab_size: int = 128
    multiple_of: int = 32  # the SwiGLU width is rounded up to a multiple of this
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 32


def precompute_freqs_cis(head_dim: int, end: int, theta: float) -> Tensor:
    """The rotation of each position and frequency: ``(end, head_dim // 2, 2)`` of cosines and
    sines (torchtitan keeps the same numbers as complex ``cos + i sin``)."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].double() / head_dim)
    angles = torch.outer(torch.arange(end).double(), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rotary_emb(x: Tensor, freqs_cis: Tensor) -> Tensor:
    """Rotate each pair of adjacent features of ``x`` (batch, seq, heads, head_dim) by its
    position's angle: torchtitan's complex multiplication, in real arithmetic."""
    pairs = x.unflatten(-1, (-1, 2))
    rot = freqs_cis[: x.shape[1]].to(x.dtype).unsqueeze(1)  # (seq, 1, head_dim // 2, 2)
    real = pairs[..., 0] * rot[..., 0] - pairs[..., 1] * rot[..., 1]
    imag = pairs[..., 0] * rot[..., 1] + pairs[..., 1] * rot[..., 0]
    return torch.stack([real, imag], dim=-1).flatten(-2)


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """Each key/value head repeated for the ``n_rep`` query heads that share it."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=2)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = args.n_heads, args.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: Tensor, freqs_cis: Tensor) -> Tensor:
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, freqs_cis), apply_rotary_emb(xk, freqs_cis)
        n_rep = self.n_heads // self.n_kv_heads
        keys, values = repeat_kv(xk, n_rep), repeat_kv(xv, n_rep)
        out = F.scaled_dot_product_attention(
            xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, multiple_of: int) -> None:
        super().__init__()
        hidden_dim = int(2 * hidden_dim / 3)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, 4 * args.dim, args.multiple_of)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        std = 0.02 / math.sqrt(2 * (layer_id + 1))  # torchtitan's depth_init
        for linear in (self.attention.wo, self.feed_forward.w2, self.feed_forward.w3):
            nn.init.trunc_normal_(linear.weight, std=std)

    def forward(self, x: Tensor, freqs_cis: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """torchtitan's Llama 3 ``Transformer``: its forward skips the parts a stage lacks."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        head_dim = args.dim // args.n_heads
        freqs = precompute_freqs_cis(head_dim, args.max_seq_len, args.rope_theta)
        self.register_buffer("freqs_cis", freqs, persistent=True)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, args) for i in range(args.n_layers)}
        )
        self.norm: nn.RMSNorm | None = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.lm_head: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        h = self.norm(h) if self.norm is not None else h
        return self.lm_head(h) if self.lm_head is not None else h


def split_stages(model: nn.Module, stage_ids: list[int], n_stages: int) -> list[nn.Module]:
    """The stages ``stage_ids`` of ``n_stages``, as torchtitan's ``pipeline_module_split``
    makes them: a deep copy of ``model`` each, keeping an even share of ``model.layers``
    (consecutive), the embedding on the first stage and ``norm``/``lm_head`` on the last."""
    names = list(model.layers.keys())
    per = len(names) // n_stages
    stages = []
    for s in stage_ids:
        stage = copy.deepcopy(model)
        keep = set(names[s * per : (s + 1) * per])
        for name in names:
            if name not in keep:
                del stage.layers[name]
        if s != 0:
            stage.tok_embeddings = None
        if s != n_stages - 1:
            stage.norm = None
            stage.lm_head = None
        stages.append(stage)
    return stages


def compile_blocks(stage: nn.Module, **compile_kwargs: object) -> None:
    """Regional compile as torchtitan's ``apply_compile`` does it, each block on its own, with
    ``customgrad.compile`` (in place, like ``block.compile()``)."""
    for block in stage.layers.values():
        customgrad.compile(block, **compile_kwargs)


def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def stage_ids(schedule: str, rank: int, world: int) -> list[int]:
    """The stages of ``rank``: the V (``r`` and ``2w - 1 - r``) for ZBV and DualPipeV."""
    if schedule in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV"):
        return [rank, 2 * world - 1 - rank]
    return [rank, rank + world]  # looped: the interleaved schedules


class Pipeline:
    """This rank's stages of ``model`` (the same model on every rank) in ``schedule``, blocks
    compiled by ``customgrad.compile(block, backend=backend)``, on customgrad's
    ``PipelineStage``: 2 stages per rank."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        schedule: str = "ScheduleZBVZeroBubble",
        microbatches: int = 4,
        backend: str = "inductor",
    ) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        self.n_stages = 2 * world
        self.mine = stage_ids(schedule, rank, world)
        self.stages = split_stages(model.to(device), self.mine, self.n_stages)
        for stage in self.stages:
            compile_blocks(stage, backend=backend)
        stages = [
            cgp.PipelineStage(m, s, self.n_stages, device) for m, s in zip(self.stages, self.mine)
        ]
        self.schedule = getattr(pipelining, schedule)(stages, microbatches, loss_fn=loss_fn)
        self.microbatches = microbatches
        self.device = device

    def step(self, x: Tensor, y: Tensor) -> float:
        """One training step's forward and backward (gradients in ``.grad``); the loss, the
        microbatches' mean, on every rank."""
        mb_losses: list[Tensor] = []
        last = self.n_stages - 1 in self.mine
        self.schedule.step(
            *([x] if 0 in self.mine else []),
            **({"target": y, "losses": mb_losses} if last else {}),
        )
        loss = torch.zeros((), dtype=torch.float64, device=self.device)
        if mb_losses:
            loss += torch.stack(mb_losses).mean().double().detach()
        dist.all_reduce(loss)  # only the last stage's rank has it
        return float(loss.item())


def batch(
    model: nn.Module, rows: int, gen: torch.Generator, seq: int | None = None
) -> tuple[Tensor, Tensor]:
    """Random tokens (the same on every rank, from ``gen``): inputs and next tokens, ``seq``
    long (the model's rotary table's length by default)."""
    vocab = model.lm_head.out_features  # type: ignore[union-attr]
    if seq is None:
        seq = model.freqs_cis.shape[0]  # type: ignore[union-attr]
    tokens = torch.randint(vocab, (rows, seq + 1), generator=gen)
    # contiguous: torch 2.11's stage checks a microbatch's strides against the ones it inferred
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def train(
    model: nn.Module,
    device: torch.device,
    *,
    schedule: str = "ScheduleZBVZeroBubble",
    microbatches: int = 4,
    rows: int = 8,
    steps: int = 1,
    backend: str = "inductor",
    lr: float = 1e-2,
) -> tuple[float, list[float]]:
    """Train ``model`` (the same on every rank) for ``steps`` steps of one fixed batch through
    ``schedule`` on the process group's ranks (:class:`Pipeline`), with AdamW.

    Returns:
        The largest relative difference, over every rank, between the first step's gradients
        and one process's (the uncompiled model on the same microbatches), and each step's loss.
    """
    reference = copy.deepcopy(model).to(device)
    pipe = Pipeline(model, device, schedule, microbatches, backend)
    weights = [p for m in pipe.stages for p in m.parameters()]
    optimizer = torch.optim.AdamW(weights, lr=lr)
    x, y = (t.to(device) for t in batch(model, rows, torch.Generator().manual_seed(0)))
    losses, worst = [], 0.0
    for step in range(steps):
        losses.append(pipe.step(x, y))
        if step == 0:
            worst = worst_difference(pipe.stages, reference, x, y, microbatches)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return worst, losses


def worst_difference(
    stages: list[nn.Module], reference: nn.Module, x: Tensor, y: Tensor, microbatches: int
) -> float:
    """The largest relative difference between the stages' gradients and one process's, over
    every rank (the schedule averages the microbatches' losses)."""
    losses = [
        loss_fn(reference(xm), ym) for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches))
    ]
    (torch.stack(losses).mean()).backward()
    want = dict(reference.named_parameters())
    worst = 0.0
    for stage in stages:
        for name, p in stage.named_parameters():
            g, w = p.grad, want[name].grad
            if g is None or w is None:
                worst = math.inf
                continue
            worst = max(worst, ((g - w).abs().max() / w.abs().max().clamp_min(1e-300)).item())
    out = torch.tensor([worst], dtype=torch.float64, device=x.device)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return float(out.item())


def _main(args: argparse.Namespace) -> None:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world:
        device, pg_backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, pg_backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    dist.init_process_group(pg_backend, device_id=device if device.type == "cuda" else None)
    try:
        torch.manual_seed(0)  # the same model on every rank
        model = Transformer(ModelArgs()).to(torch.float64)
        worst, losses = train(
            model, device, schedule=args.schedule, steps=args.steps, backend=args.backend
        )
        if dist.get_rank() == 0:
            print(
                f"{args.schedule}, {dist.get_world_size()} ranks x 2 stages, blocks compiled by "
                f"customgrad.compile ({args.backend}), float64: first-step gradients against "
                f"one process's: max relative difference {worst:.1e}"
            )
            print("losses: " + " ".join(f"{v:.4f}" for v in losses))
        if worst > 1e-10:
            raise RuntimeError(f"gradients differ from one process's: {worst:.2e}")
    finally:
        dist.destroy_process_group()


def _spawned(local_rank: int, args: argparse.Namespace) -> None:
    os.environ.update(
        RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2"
    )
    _main(args)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schedule", default="ZBVZeroBubble", choices=["ZBVZeroBubble", "DualPipeV"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--backend", default="inductor", help="customgrad.compile's backend")
    args = p.parse_args(argv)
    args.schedule = "Schedule" + args.schedule
    if "RANK" in os.environ:  # started by torchrun
        _main(args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    mp.spawn(_spawned, args=(args,), nprocs=2)  # stops the other if one fails


if __name__ == "__main__":
    sys.exit(main())
