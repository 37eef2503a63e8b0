"""A Llama block of Liger-Kernel's ``torch.autograd.Function``\\ s, unmodified, for the tests.

What ``apply_liger_kernel_to_llama`` puts in a Hugging Face Llama at its defaults: RMSNorm with
``in_place=True`` (its backward writes dX over dY), SwiGLU, rope, and the fused linear cross
entropy whose backward scales the gradients it computed in the forward by the loss's output
gradient, here with the loss divided by the microbatch count (torchtitan's rescale). The block
is an equivalent of a tiny ``transformers`` Llama's decoder layer and head (built here rather
than from ``LlamaConfig``, whose model is slower on the shared CPU than the kernels under
Triton's interpreter). Kernels run on CPU in Triton's interpreter
(:mod:`tests._triton_support`); importing this module needs liger-kernel (tests skip without
it, naming it).
"""

from __future__ import annotations

import contextlib
import pickle
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._skips import optional_package

# the suite imports every module (doctests): without liger-kernel this one is skipped, named
pytest.importorskip("liger_kernel", reason=optional_package("liger-kernel"))

from liger_kernel.ops import cross_entropy as _ce
from liger_kernel.ops import fused_linear_cross_entropy as _flce
from liger_kernel.ops import rms_norm as _rms
from liger_kernel.ops import rope as _rope
from liger_kernel.ops import swiglu as _swiglu
from torch import Tensor, nn

from tests._triton_support import count_launches, interpreter_shims

HIDDEN, HEADS, INTER, VOCAB, SEQ, BATCH = 16, 2, 32, 24, 4, 2
MICROBATCHES = 2
DTYPE = torch.float32

BACKWARD_KERNELS = (
    _rms._rms_norm_backward_kernel,
    _swiglu._swiglu_backward_kernel,
    _rope._triton_rope,
    _flce.element_mul_kernel,
)
"""Every Triton kernel the block's backward launches (rope's runs both ways; it is counted in
backward only)."""


@contextlib.contextmanager
def liger_kernels() -> Iterator[None]:
    """Liger's kernels under Triton's interpreter on CPU (its libdevice imports shimmed)."""
    with interpreter_shims(_rms, _ce):
        yield


@contextlib.contextmanager
def backward_launches() -> Iterator[dict[str, int]]:
    """Count the launches of the block's backward kernels in the ``with`` block."""
    with count_launches(*BACKWARD_KERNELS) as counts:
        yield counts


def _rms_norm(x: Tensor, w: Tensor) -> Tensor:
    out: Tensor = _rms.LigerRMSNormFunction.apply(x, w, 1e-6, 0.0, "llama", True)
    return out


class LigerLayer(nn.Module):
    """A Llama decoder layer as Liger runs it: RMSNorm, rope attention, RMSNorm, SwiGLU MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = nn.Parameter(1 + 0.1 * torch.randn(HIDDEN))
        self.q_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.k_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.v_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.o_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.post_attention_layernorm = nn.Parameter(1 + 0.1 * torch.randn(HIDDEN))
        self.gate_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.up_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.down_proj = nn.Linear(INTER, HIDDEN, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        d = HIDDEN // HEADS
        h = _rms_norm(x, self.input_layernorm)
        q = self.q_proj(h).view(b, t, HEADS, d).transpose(1, 2)
        k = self.k_proj(h).view(b, t, HEADS, d).transpose(1, 2)
        v = self.v_proj(h).view(b, t, HEADS, d).transpose(1, 2)
        pos = torch.arange(t, dtype=DTYPE)[:, None] / (10000 ** (torch.arange(0, d, 2) / d))
        emb = torch.cat([pos, pos], -1)[None]
        q, k = _rope.LigerRopeFunction.apply(q, k, emb.cos(), emb.sin())
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, t, HIDDEN))
        h = _rms_norm(x, self.post_attention_layernorm)
        mlp = _swiglu.LigerSiLUMulFunction.apply(self.gate_proj(h), self.up_proj(h))
        return x + self.down_proj(mlp)


class LigerHead(nn.Module):
    """The final RMSNorm and lm_head with Liger's fused linear cross entropy; the loss divided
    by the microbatch count (torchtitan's rescale)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.Parameter(1 + 0.1 * torch.randn(HIDDEN))
        self.lm_head = nn.Parameter(torch.randn(VOCAB, HIDDEN) / HIDDEN**0.5)

    def forward(self, x: Tensor, target: Tensor) -> Tensor:
        h = _rms_norm(x, self.norm).reshape(-1, HIDDEN)
        out = _flce.LigerFusedLinearCrossEntropyFunction.apply(h, self.lm_head, target.reshape(-1))
        loss: Tensor = out[0] if isinstance(out, tuple) else out
        return loss / MICROBATCHES


class LastStage(nn.Module):
    """A last pipeline stage: a layer and the head, returning the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = LigerLayer()
        self.head = LigerHead()

    def forward(self, x: Tensor, target: Tensor) -> Tensor:
        out: Tensor = self.head(self.layer(x), target)
        return out


def build(seed: int = 0) -> tuple[LigerLayer, LastStage]:
    """Two stages' modules, the same for every process: a layer, then a layer and the head."""
    torch.manual_seed(seed)
    return LigerLayer(), LastStage()


def batch(seed: int = 1) -> tuple[Tensor, Tensor]:
    """Hidden states (the embedding's output) and next-token targets for every microbatch."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH * MICROBATCHES, SEQ, HIDDEN, generator=gen)
    target = torch.randint(0, VOCAB, (BATCH * MICROBATCHES, SEQ), generator=gen)
    return x, target


def reference(first: nn.Module, last: nn.Module) -> dict[str, Tensor]:
    """One process's full backward of the whole step, microbatch by microbatch."""
    x, target = batch()
    for xm, tm in zip(x.chunk(MICROBATCHES), target.chunk(MICROBATCHES)):
        last(first(xm), tm).backward()
    return gradients(first, last)


def gradients(first: nn.Module, last: nn.Module) -> dict[str, Any]:
    return {
        f"{i}.{n}": p.grad for i, m in enumerate((first, last)) for n, p in m.named_parameters()
    }


# --- ScheduleZBVZeroBubble on two processes (run by tests._mp_workers.spawn) -----------------

STAGES = 4
PIPELINE_KERNELS = ("_rms_norm_backward_kernel", "_swiglu_backward_kernel", "element_mul_kernel")
"""The kernels counted in a pipeline step: those that run in backward only (rope's kernel also
runs in the forwards the schedule makes to infer shapes)."""


class PipelineLast(nn.Module):
    """The last stage of the pipeline: a layer; its head runs in the schedule's loss_fn (the
    fused linear cross entropy takes hidden states, not logits), as a submodule of the stage."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = LigerLayer()
        self.head = LigerHead()

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.layer(x)
        return out


def pipeline_modules(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    mods: list[nn.Module] = [LigerLayer() for _ in range(STAGES - 1)]
    return [*mods, PipelineLast()]


def pipeline_reference() -> tuple[dict[str, Tensor], Counter[str]]:
    """One process's gradients of the step, and its backward kernel launches."""
    mods = pipeline_modules()
    x, target = batch()
    counts: Counter[str] = Counter()
    for xm, tm in zip(x.chunk(MICROBATCHES), target.chunk(MICROBATCHES)):
        h = xm
        for m in mods:
            h = m(h)
        loss = mods[-1].head(h, tm)  # type: ignore[operator]
        with backward_launches() as launched:
            loss.backward()
        counts.update({k: launched[k] for k in PIPELINE_KERNELS})
    grads = {f"{i}.{n}": p.grad for i, m in enumerate(mods) for n, p in m.named_parameters()}
    return grads, counts  # type: ignore[return-value]


def pipeline_reference_in_interpreter() -> tuple[dict[str, Tensor], Counter[str]]:
    """:func:`pipeline_reference` with Liger's kernels under the interpreter's shims."""
    with liger_kernels():
        return pipeline_reference()


def run_zbv(out_path: str, run_once: bool) -> None:
    """A ScheduleZBVZeroBubble step of the Liger stages on this rank (of two): rank 0 writes
    the gradients' mismatches against one process's and the launches of every rank."""
    import torch.distributed as dist
    from torch.distributed.pipelining import ScheduleZBVZeroBubble

    import customgrad.pipelining as cgp

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    with liger_kernels():
        mods = pipeline_modules()
        mine = sorted({rank, 2 * world - 1 - rank})
        stages = [
            cgp.PipelineStage(mods[s], s, STAGES, device, run_functions_once=run_once) for s in mine
        ]
        head = mods[-1].head  # type: ignore[union-attr]

        def loss_fn(output: Tensor, target: Tensor) -> Tensor:
            out: Tensor = head(output, target)
            return out

        schedule = ScheduleZBVZeroBubble(stages, MICROBATCHES, loss_fn=loss_fn, scale_grads=False)
        x, target = batch()
        kwargs = {"target": target} if STAGES - 1 in mine else {}
        # The first step also infers shapes (torch 2.13 runs a forward and a backward of each
        # stage for it): count the second.
        schedule.step(*([x] if 0 in mine else []), **kwargs)
        for m in mods:
            m.zero_grad(set_to_none=True)
        with backward_launches() as launched:
            schedule.step(*([x] if 0 in mine else []), **kwargs)
        ref, _ = pipeline_reference()
        problems = []
        for s in mine:
            for n, p in mods[s].named_parameters():
                want = ref[f"{s}.{n}"]
                if p.grad is None or not torch.allclose(p.grad, want, rtol=1e-4, atol=1e-6):
                    err = None if p.grad is None else float((p.grad - want).abs().max())
                    problems.append(f"stage {s} {n}: max error {err}")
        mine_counts = {k: launched[k] for k in PIPELINE_KERNELS}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, (problems, mine_counts))
    if rank == 0:
        total: Counter[str] = Counter()
        for _, c in everyone:
            total.update(c)
        out = {"problems": [p for ps, _ in everyone for p in ps], "launches": dict(total)}
        Path(out_path).write_bytes(pickle.dumps(out))
