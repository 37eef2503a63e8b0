"""torchtitan 0.3.0's mixture-of-experts models for the tests, tiny, and the pieces the MoE tests
share: a reference grouped GEMM, the same GEMM written as a plain ``autograd.Function``, Qwen3-MoE
and DeepSeek-V3 with a grouped GEMM swapped in through torchtitan's seam, and their pipeline
stages cut as torchtitan cuts them.

- :func:`reference_grouped_mm`: one matmul per expert in plain torch ops (autograd
  differentiates it): what every grouped GEMM is checked against.
- :class:`LoopGroupedMM`: the grouped GEMM a team brings as a plain ``autograd.Function`` (a
  loop over the experts): forward and backward read the experts' row bounds as Python ints
  (``offs.tolist()``), the backward computes dX and dW together. torch's stage runs that
  backward in I and again in W; customgrad's captures it once for every routing and splits it.
  :class:`CtxLoopGroupedMM` keeps the bounds on ``ctx`` as ints instead: each routing is a new
  constant to the capture.
- :func:`model`: torchtitan's ``Qwen3Model`` (router top-k, softmax scores, grouped experts, no
  shared expert) or ``DeepSeekV3Model`` (MLA attention, a dense first layer, a shared expert),
  built from torchtitan's own config builders, shrunk, with ``ScaledDotProductAttention`` (CPU;
  torchtitan's default FlexAttention compiles with inductor) and the experts' grouped GEMM
  chosen by ``kernel`` (:data:`KERNELS`) the way torchtitan's MXFP8 converter swaps it: a
  ``GroupedExperts`` subclass overriding ``_grouped_mm``, put in the model config.
- :func:`stages`: this rank's stages, by torchtitan's own ``pipeline_parallel`` helpers (the
  module names per stage, ``_split_module``'s copies, the V mapping of ranks to stages).
- :func:`load_balancing_hook`: torchtitan's auxiliary-loss-free load balancing (its optimizer
  pre-step hook updates each MoE layer's expert bias from the tokens it routed), which changes
  the routing from one step to the next.

torchtitan is imported only by the functions that need it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

import customgrad.ops

__all__ = [
    "KERNELS",
    "MODELS",
    "CtxLoopGroupedMM",
    "LoopGroupedMM",
    "load_balancing_hook",
    "model",
    "reference_grouped_mm",
    "stage_ids",
    "stages",
]

GroupedMM = Callable[[Tensor, Tensor, Tensor], Tensor]


def reference_grouped_mm(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """``x`` ``(M, K)``, ``w`` ``(E, K, N)``: rows ``offs[e-1]:offs[e]`` times ``w[e]``, rows past
    ``offs[-1]`` zero; plain torch ops, differentiated by autograd."""
    pieces = [x[s:t] @ w[e] for e, (s, t) in enumerate(_bounds(offs))]
    return torch.cat([*pieces, x.new_zeros((x.shape[0] - int(offs[-1]), w.shape[2]))])


class LoopGroupedMM(torch.autograd.Function):
    """A grouped GEMM as a plain ``autograd.Function``: one matmul per expert.

    Forward and backward read the experts' row bounds on the host (``offs.tolist()``) and loop
    over them as Python ints, which change with every routing."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
        ctx.save_for_backward(x, w, offs)
        out = x.new_zeros((x.shape[0], w.shape[2]))
        for e, (start, end) in enumerate(_bounds(offs)):
            out[start:end] = x[start:end] @ w[e]
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        x, w, offs = ctx.saved_tensors
        dx, dw = torch.zeros_like(x), torch.zeros_like(w)
        for e, (start, end) in enumerate(_bounds(offs)):
            dx[start:end] = grad[start:end] @ w[e].mT
            dw[e] = x[start:end].mT @ grad[start:end]
        return dx, dw, None


class CtxLoopGroupedMM(torch.autograd.Function):
    """:class:`LoopGroupedMM` with the row bounds read once, in the forward, and kept on ``ctx``
    as Python ints for the backward (no second host read): what the backward reads then changes
    with every routing as a constant, not as a tensor's values."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
        ctx.groups = _bounds(offs)
        ctx.save_for_backward(x, w)
        out = x.new_zeros((x.shape[0], w.shape[2]))
        for e, (start, end) in enumerate(ctx.groups):
            out[start:end] = x[start:end] @ w[e]
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        x, w = ctx.saved_tensors
        dx, dw = torch.zeros_like(x), torch.zeros_like(w)
        for e, (start, end) in enumerate(ctx.groups):
            dx[start:end] = grad[start:end] @ w[e].mT
            dw[e] = x[start:end].mT @ grad[start:end]
        return dx, dw, None


def _bounds(offs: Tensor) -> list[tuple[int, int]]:
    """Each expert's ``(start, end)`` rows, as Python ints."""
    ends = offs.tolist()
    return list(zip([0, *ends[:-1]], ends))


def loop_grouped_mm(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    out: Tensor = LoopGroupedMM.apply(x, w, offs)
    return out


def ctx_loop_grouped_mm(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    out: Tensor = CtxLoopGroupedMM.apply(x, w, offs)
    return out


KERNELS: dict[str, GroupedMM | None] = {
    "native": None,  # torchtitan's own: torch._grouped_mm
    "customgrad": customgrad.ops.grouped_mm,
    "triton": customgrad.ops.triton_grouped_mm,
    "function": loop_grouped_mm,
    "function_ctx": ctx_loop_grouped_mm,
}
"""The experts' grouped GEMM, by name; ``"native"`` leaves torchtitan's ``_grouped_mm``."""

MODELS = ("qwen3", "deepseek_v3")

DIM, VOCAB, SEQ, LAYERS, EXPERTS, TOP_K, EXPERT_DIM = 32, 64, 16, 4, 4, 2, 16


@functools.cache
def _swapped_experts_class() -> type:
    """torchtitan's ``GroupedExperts`` with its ``_grouped_mm`` seam overridden (as its MXFP8
    converter overrides it), the kernel named by the config."""
    from torchtitan.models.common.moe import GroupedExperts

    class SwappedGroupedExperts(GroupedExperts):  # type: ignore[misc]
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(GroupedExperts.Config):  # type: ignore[misc]
            kernel: str = "customgrad"

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.kernel = config.kernel

        def _grouped_mm(self, *, A: Tensor, B_t: Tensor, offs: Tensor) -> Tensor:
            mm = KERNELS[self.kernel]
            assert mm is not None
            return mm(A, B_t, offs)

    return SwappedGroupedExperts


def swap_grouped_mm(model_config: Any, kernel: str) -> None:
    """Every ``GroupedExperts.Config`` of ``model_config`` becomes the swapped class's, in place
    (torchtitan's ``MXFP8GroupedExpertsConverter.convert``, with another kernel)."""
    from torchtitan.models.common.moe import GroupedExperts

    cls = _swapped_experts_class()
    for _, config, parent, attr in list(model_config.traverse(GroupedExperts.Config)):
        fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        setattr(parent, attr, cls.Config(**fields, kernel=kernel))


def _sdpa(layers: list[Any]) -> None:
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()


def _qwen3_config() -> Any:
    from torchtitan.models import qwen3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear

    head_dim = 8
    layers = qwen3._build_qwen3_moe_layers(
        n_layers=LAYERS, dim=DIM, n_heads=4, n_kv_heads=2, head_dim=head_dim,
        moe_hidden_dim=EXPERT_DIM, num_experts=EXPERTS, top_k=TOP_K, attn_backend="flex",
        moe_comm_backend="standard",
        rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=SEQ, theta=1000000.0),
    )  # fmt: skip
    _sdpa(layers)
    return qwen3.Qwen3Model.Config(
        vocab_size=VOCAB, dim=DIM, norm=qwen3._qwen3_norm(DIM),
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=DIM, param_init=qwen3._EMBEDDING_INIT
        ),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=qwen3._LINEAR_INIT),
        layers=layers,
    )  # fmt: skip


def _deepseek_v3_config() -> Any:
    from torchtitan.models import deepseek_v3 as dsv3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    rope_dim = 8
    layers = dsv3._build_dsv3_layers(
        n_layers=LAYERS, n_dense_layers=1, dim=DIM, n_heads=2, q_lora_rank=0, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=rope_dim, v_head_dim=8, mscale=0.70,
        dense_hidden_dim=64, moe_hidden_dim=EXPERT_DIM, num_experts=EXPERTS,
        num_shared_experts=1, router_top_k=TOP_K, router_score_func="softmax",
        attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(
            dim=rope_dim, max_seq_len=SEQ, theta=10000.0, scaling="yarn", rope_factor=40.0,
            beta_fast=32.0, beta_slow=1.0, original_seq_len=4096,
        ),
    )  # fmt: skip
    _sdpa(layers)
    return dsv3.DeepSeekV3Model.Config(
        vocab_size=VOCAB, dim=DIM,
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=DIM, param_init=dsv3._EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=dsv3._NORM_INIT),
        lm_head=Linear.Config(
            in_features=DIM, out_features=VOCAB, param_init=dsv3._output_linear_init(DIM)
        ),
        layers=layers,
    )  # fmt: skip


def model(name: str, kernel: str = "native", seed: int = 0) -> nn.Module:
    """torchtitan's ``name`` model (one of :data:`MODELS`), tiny, its experts' grouped GEMM
    ``kernel`` (a key of :data:`KERNELS`), initialized by torchtitan from ``seed``: the same
    weights for every kernel."""
    config = _qwen3_config() if name == "qwen3" else _deepseek_v3_config()
    if kernel != "native":
        swap_grouped_mm(config, kernel)
    torch.manual_seed(seed)
    built: nn.Module = config.build()
    built.init_states()  # type: ignore[operator]
    return built


def stage_ids(schedule: str, rank: int, world: int) -> tuple[int, ...]:
    """The stages of ``rank`` under ``schedule`` (torchtitan's mapping: the V for ZBV and
    DualPipeV, a loop otherwise)."""
    from torchtitan.distributed.pipeline_parallel import _get_pp_rank_to_stage_indices_mapping

    name = schedule.removeprefix("Schedule")  # torchtitan's config names schedules so
    ids: tuple[int, ...] = _get_pp_rank_to_stage_indices_mapping(rank, world, name, 2 * world)
    return ids


def stages(whole: nn.Module, schedule: str, rank: int, world: int) -> dict[int, nn.Module]:
    """This rank's stages of ``whole``, 2 per rank, cut by torchtitan's helpers: its module
    names per stage (the embedding and the head weighted as one layer each) and a copy of the
    whole model per stage with the other stages' modules deleted (``_split_module``)."""
    from torchtitan.distributed.pipeline_parallel import (
        _generate_llm_fqn_per_model_part,
        _split_module,
    )

    n_layers = len(whole.layers)  # type: ignore[arg-type]
    names = _generate_llm_fqn_per_model_part(2 * world, n_layers, 1, 1)
    return {s: _split_module(whole, names[s]) for s in stage_ids(schedule, rank, world)}


def load_balancing_hook(
    optimizer: torch.optim.Optimizer, model_parts: list[nn.Module], world: int
) -> None:
    """torchtitan's MoE load-balancing hook on ``optimizer`` for ``model_parts`` (pipeline
    parallel over ``world`` ranks, no data parallelism: each stage balances its own layers)."""
    from torchtitan.components.optimizer import register_moe_load_balancing_hook
    from torchtitan.distributed import ParallelDims

    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=world, ep=1, world_size=world)
    register_moe_load_balancing_hook(optimizer, model_parts, dims)  # type: ignore[arg-type]
