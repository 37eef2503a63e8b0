"""unsloth's LoRA MLP and LoRA_W Functions, ported for the tests (unsloth cannot be imported on a
CPU-only machine: it needs CUDA and unsloth_zoo at import).

Ported from unsloth 2026.10.9 (Apache-2.0, https://github.com/unslothai/unsloth),
``unsloth/kernels/fast_lora.py`` (``LoRA_MLP`` and ``LoRA_W``, their unquantized path without
dropout or biases, with unsloth's ``torch_amp_custom_fwd``/``_bwd`` decorators;
``matmul_lora`` with ``W_quant=None`` is ``X @ W.t() + s * (X @ A.t()) @ B.t()``) and
``unsloth/kernels/swiglu.py`` (``_DWf_DW_dfg_kernel``, here in torch ops with the same stores).
What matters here is kept as unsloth writes it: the SwiGLU backward writes ``h``, ``df`` and
``de`` over ``DW`` and the *saved* ``e`` and ``g`` (so a second backward reads its own
results: every LoRA A/B gradient wrong), and with ``inplace=True`` (its default) ``dX`` is
written into the saved input ``X`` (``torch.matmul(..., out=X)``: a second backward fails with
torch's "modified by an inplace operation").
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn


def _matmul_lora(x: Tensor, w: Tensor, a: Tensor, b: Tensor, s: float) -> Tensor:
    return x @ w.t() + s * ((x @ a.t()) @ b.t())


def swiglu_fg(e: Tensor, g: Tensor) -> Tensor:
    return nn.functional.silu(e) * g


def swiglu_DWf_DW_dfg(dw: Tensor, e: Tensor, g: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``_DWf_DW_dfg_kernel``: h over DW, df over e, de over g (in place, as its stores do)."""
    ef = e.float()
    se = torch.sigmoid(ef)
    f = (se * ef).to(dw.dtype)
    h = f * g
    df = dw * f
    dg = dw * g
    de = (dg.float() * se * (1.0 + ef * (1.0 - se))).to(dw.dtype)
    dw.data.copy_(h)  # Triton stores: no version counter sees them
    e.data.copy_(df)
    g.data.copy_(de)
    return dw, e, g


class LoRA_MLP(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        X: Tensor,
        gateW: Tensor,
        gateA: Tensor,
        gateB: Tensor,
        gateS: float,
        upW: Tensor,
        upA: Tensor,
        upB: Tensor,
        upS: float,
        downW: Tensor,
        downA: Tensor,
        downB: Tensor,
        downS: float,
        inplace: bool = True,
    ) -> Tensor:
        e = _matmul_lora(X, gateW, gateA, gateB, gateS)
        g = _matmul_lora(X, upW, upA, upB, upS)
        h = swiglu_fg(e, g)
        i = _matmul_lora(h, downW, downA, downB, downS)
        ctx.custom_saved_tensors = (gateW, gateS, upW, upS, downW, downS)
        ctx.save_for_backward(gateA, gateB, upA, upB, downA, downB, X, e, g)
        ctx.inplace = inplace
        return i

    @staticmethod
    def backward(ctx: Any, dY: Tensor) -> tuple[Tensor | None, ...]:
        gateW, gateS, upW, upS, downW, downS = ctx.custom_saved_tensors
        gateA, gateB, upA, upB, downA, downB, X, e, g = ctx.saved_tensors
        batch, seq_len, hd = X.shape
        dY = dY.reshape(-1, dY.shape[-1])
        X = X.view(-1, X.shape[-1])
        e = e.view(-1, e.shape[-1])
        g = g.view(-1, g.shape[-1])
        gateA, gateB, upA, upB, downA, downB = (
            gateA.t(), gateB.t(), upA.t(), upB.t(), downA.t(), downB.t(),
        )  # fmt: skip
        # matmul_lora(dY, downW.t(), downB, downA, downS), the A and B above transposed
        DW = dY @ downW + downS * ((dY @ downB.t()) @ downA.t())
        DW, e, g = swiglu_DWf_DW_dfg(DW, e, g)
        h, df, de = DW, e, g
        d_downA = torch.empty_like(downA)
        d_downB = torch.empty_like(downB)
        d_gateA = torch.empty_like(gateA)
        d_gateB = torch.empty_like(gateB)
        d_upA = torch.empty_like(upA)
        d_upB = torch.empty_like(upB)
        d_downA.addmm_(h.t(), dY @ downB.t(), alpha=downS, beta=0)
        d_downB.addmm_(downA.t() @ h.t(), dY, alpha=downS, beta=0)
        up_dB = df @ upB.t()
        gate_dB = de @ gateB.t()
        d_upA.addmm_(X.t(), up_dB, alpha=upS, beta=0)
        d_upB.addmm_(upA.t() @ X.t(), df, alpha=upS, beta=0)
        d_gateA.addmm_(X.t(), gate_dB, alpha=gateS, beta=0)
        d_gateB.addmm_(gateA.t() @ X.t(), de, alpha=gateS, beta=0)
        dX = torch.matmul(df, upW, out=X if ctx.inplace else None)
        dX.addmm_(up_dB, upA.t(), alpha=upS)
        dX.addmm_(de, gateW)
        dX.addmm_(gate_dB, gateA.t(), alpha=gateS)
        return (
            dX.view(batch, seq_len, hd),
            None, d_gateA.t(), d_gateB.t(), None,
            None, d_upA.t(), d_upB.t(), None,
            None, d_downA.t(), d_downB.t(), None,
            None,
        )  # fmt: skip


torch_amp_custom_fwd = torch.amp.custom_fwd(device_type="cuda")
torch_amp_custom_bwd = torch.amp.custom_bwd(device_type="cuda")


class LoRA_W(torch.autograd.Function):
    """One LoRA projection: ``X @ W.t() + S * (X @ A.t()) @ B.t()``; what forward keeps on ctx
    besides the saved tensors is a tuple of a tensor, None (no quantization state) and a float."""

    @staticmethod
    @torch_amp_custom_fwd
    def forward(
        ctx: Any, X: Tensor, W: Tensor, W_quant: Any, A: Tensor, B: Tensor, S: float
    ) -> Tensor:
        XW = _matmul_lora(X, W, A, B, S)
        ctx.custom_saved_tensors = (W, W_quant, S)
        ctx.save_for_backward(A, B, X)
        return XW

    @staticmethod
    @torch_amp_custom_bwd
    def backward(ctx: Any, dY: Tensor) -> tuple[Tensor | None, ...]:
        W, _W_quant, S = ctx.custom_saved_tensors  # no quantization state here
        A, B, X = ctx.saved_tensors
        batch, seq_len, hd = X.shape
        dY = dY.reshape(-1, dY.shape[-1])
        X = X.reshape(-1, X.shape[-1])
        A, B = A.t(), B.t()
        d_A = torch.empty_like(A)
        d_B = torch.empty_like(B)
        d_A.addmm_(X.t(), dY @ B.t(), alpha=S, beta=0)
        d_B.addmm_(A.t() @ X.t(), dY, alpha=S, beta=0)
        W = W.t()  # fast_dequantize(W.t(), W_quant): W.t() without a quantization state
        dX = dY @ W.t()
        dX.addmm_(dY @ B.t(), A.t(), alpha=S)
        return dX.view(batch, seq_len, hd), None, None, d_A.t(), d_B.t(), None


class LoraMLP(nn.Module):
    """A Llama MLP with frozen base weights and LoRA adapters, through ``LoRA_MLP``."""

    def __init__(self, hidden: int = 8, inter: int = 16, rank: int = 2, inplace: bool = True):
        super().__init__()
        self.inplace = inplace
        self.gate = nn.Parameter(torch.randn(inter, hidden) / 3, requires_grad=False)
        self.up = nn.Parameter(torch.randn(inter, hidden) / 3, requires_grad=False)
        self.down = nn.Parameter(torch.randn(hidden, inter) / 4, requires_grad=False)
        self.gate_A = nn.Parameter(torch.randn(rank, hidden) / 3)
        self.gate_B = nn.Parameter(torch.randn(inter, rank) / 2)
        self.up_A = nn.Parameter(torch.randn(rank, hidden) / 3)
        self.up_B = nn.Parameter(torch.randn(inter, rank) / 2)
        self.down_A = nn.Parameter(torch.randn(rank, inter) / 4)
        self.down_B = nn.Parameter(torch.randn(hidden, rank) / 2)

    def forward(self, x: Tensor) -> Tensor:
        # unsloth calls it on the RMSNorm's output, a fresh tensor (dX may go into its memory)
        out: Tensor = LoRA_MLP.apply(
            x * 1.0,
            self.gate, self.gate_A, self.gate_B, 2.0,
            self.up, self.up_A, self.up_B, 2.0,
            self.down, self.down_A, self.down_B, 2.0,
            self.inplace,
        )  # fmt: skip
        return x + out


# --- ScheduleZBVZeroBubble on two processes (run by tests._mp_workers.spawn) -----------------

STAGES, MICROBATCHES = 4, 2


def _modules(inplace: bool) -> list[LoraMLP]:
    torch.manual_seed(0)
    return [LoraMLP(inplace=inplace) for _ in range(STAGES)]


def _batch() -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(2 * MICROBATCHES, 3, 8, generator=gen), torch.randn(
        2 * MICROBATCHES, 3, 8, generator=gen
    )


def _loss(out: Tensor, target: Tensor) -> Tensor:
    return ((out - target) ** 2).mean() / MICROBATCHES


class _Counted:
    """Counts ``LoRA_MLP.backward`` calls while installed."""

    def __init__(self) -> None:
        self.calls = 0
        self.original = LoRA_MLP.backward

    def __enter__(self) -> _Counted:
        def counted(ctx: Any, dy: Tensor) -> Any:
            self.calls += 1
            return self.original(ctx, dy)

        LoRA_MLP.backward = staticmethod(counted)  # type: ignore[method-assign,assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        LoRA_MLP.backward = staticmethod(self.original)  # type: ignore[method-assign,assignment]


def zbv_reference(inplace: bool) -> tuple[dict[str, Tensor], int]:
    """One process's gradients of the step, and its LoRA_MLP backward calls."""
    mods = _modules(inplace)
    x, target = _batch()
    with _Counted() as counted:
        for xm, tm in zip(x.chunk(MICROBATCHES), target.chunk(MICROBATCHES)):
            h = xm
            for m in mods:
                h = m(h)
            _loss(h, tm).backward()
    grads = {
        f"{i}.{n}": p.grad
        for i, m in enumerate(mods)
        for n, p in m.named_parameters()
        if p.grad is not None
    }
    return grads, counted.calls


def run_zbv(out_path: str, inplace: bool) -> None:
    """Two ScheduleZBVZeroBubble steps of the LoRA stages on this rank (of two), the second
    counted: rank 0 writes the gradients' mismatches and every rank's backward calls."""
    import pickle
    from pathlib import Path

    import torch.distributed as dist
    from torch.distributed.pipelining import ScheduleZBVZeroBubble

    import customgrad.pipelining as cgp

    rank, world = dist.get_rank(), dist.get_world_size()
    mods = _modules(inplace)
    mine = sorted({rank, 2 * world - 1 - rank})
    cpu = torch.device("cpu")
    stages = [cgp.PipelineStage(mods[s], s, STAGES, cpu) for s in mine]
    schedule = ScheduleZBVZeroBubble(stages, MICROBATCHES, loss_fn=_loss, scale_grads=False)
    x, target = _batch()
    kwargs = {"target": target} if STAGES - 1 in mine else {}
    schedule.step(*([x] if 0 in mine else []), **kwargs)  # the first step infers shapes too
    for m in mods:
        m.zero_grad(set_to_none=True)
    with _Counted() as counted:
        schedule.step(*([x] if 0 in mine else []), **kwargs)
    ref, _ = zbv_reference(inplace)
    problems = [
        f"stage {s} {n}"
        for s in mine
        for n, p in mods[s].named_parameters()
        if p.requires_grad and not torch.allclose(p.grad, ref[f"{s}.{n}"], rtol=1e-4, atol=1e-6)
    ]
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, (problems, counted.calls))
    if rank == 0:
        out = {
            "problems": [p for ps, _ in everyone for p in ps],
            "calls": sum(c for _, c in everyone),
        }
        Path(out_path).write_bytes(pickle.dumps(out))
