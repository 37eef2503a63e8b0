"""What ``tests/test_llama_stages.py`` runs on 2 processes: the torchtitan-shaped example's
stages (or torchtitan's own Llama 3), compiled per block, through a V-shaped schedule."""

from __future__ import annotations

import copy
import pickle
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from customgrad._compile import regions
from customgrad._flops import FlopCounter
from examples import llama_stages as ex

STEPS, MICROBATCHES, ROWS = 3, 4, 8


@dataclass
class Result:
    worst: float
    """The first step's largest relative gradient difference from one process's."""
    losses: list[float]
    runs: dict[str, int]
    """Compiled backward graphs run in the last step, over both ranks, by kind."""
    split: bool
    """Every compiled region split (none fell back)."""
    flops: int
    """FLOPs of the last step, over both ranks."""
    reference_flops: int
    """FLOPs of one process's forward and full backward of the same microbatches."""


SEQ = 32


def torchtitan_model() -> nn.Module:
    """torchtitan's own Llama 3 (``Llama3Model``, torchtitan 0.3.0) in a tiny configuration,
    built from its config as torchtitan builds it. Its language-model attention backends take
    per-document masks (flex, varlen); the blocks here use torchtitan's causal
    ``ScaledDotProductAttention`` instead, so a stage takes tokens or activations only."""
    import dataclasses

    from torchtitan.models.common import Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.rope import ComplexRoPE
    from torchtitan.models.llama3 import Llama3Model
    from torchtitan.models.llama3 import _build_llama3_layers as build_layers

    dim, vocab, heads = 64, 128, 4
    rope = ComplexRoPE.Config(dim=dim // heads, max_seq_len=SEQ, theta=10000.0)
    layers = build_layers(
        n_layers=4, dim=dim, n_heads=heads, n_kv_heads=2, hidden_dim=96, rope=rope,
        attn_backend="flex",
    )  # fmt: skip
    for layer in layers:
        sdpa = ScaledDotProductAttention.Config()
        layer.attention = dataclasses.replace(layer.attention, inner_attention=sdpa)
    config = Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim),
        norm=RMSNorm.Config(normalized_shape=dim),
        lm_head=Linear.Config(in_features=dim, out_features=vocab),
        layers=layers,
    )
    model: nn.Module = config.build()
    model.init_states()  # type: ignore[operator]
    return model


def run(out_path: str, schedule: str, which: str) -> None:
    torch.manual_seed(0)  # the same model on every rank
    model = torchtitan_model() if which == "torchtitan" else ex.Transformer(ex.ModelArgs())
    model = model.to(torch.float64)
    device = torch.device("cpu")
    reference = copy.deepcopy(model)
    pipe = ex.Pipeline(model, device, schedule, MICROBATCHES, backend="aot_eager")
    x, y = ex.batch(model, ROWS, torch.Generator().manual_seed(0), SEQ)
    weights = [p for m in pipe.stages for p in m.parameters()]
    optimizer = torch.optim.AdamW(weights, lr=1e-2)
    losses = [pipe.step(x, y)]  # compiles every region
    worst = ex.worst_difference(pipe.stages, reference, x, y, MICROBATCHES)
    for _ in range(STEPS - 1):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        before = _runs()
        with FlopCounter() as counter:
            losses.append(pipe.step(x, y))
        runs = {k: n - before[k] for k, n in _runs().items()}
    with FlopCounter() as ref:
        ex.worst_difference([], reference, x, y, MICROBATCHES)  # forward and full backward
    flops = torch.tensor([counter.total])
    dist.all_reduce(flops)
    everyone: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (runs, all(r.status == "split" for r in regions())))
    if dist.get_rank() == 0:
        total = {k: sum(r[0][k] for r in everyone) for k in runs}  # type: ignore[index]
        split = all(r[1] for r in everyone)  # type: ignore[index]
        result = Result(worst, losses, total, split, int(flops.item()), ref.total)
        Path(out_path).write_bytes(pickle.dumps(result))


def _runs() -> dict[str, int]:
    total = {"full": 0, "input": 0, "weight": 0}
    for region in regions():
        for k, n in region.runs.items():
            total[k] += n
    return total
