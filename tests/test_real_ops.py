"""The six real ops of ``examples/ops`` against native PyTorch, with exact FLOPs.

For each op: ``check_op`` passes; outputs and gradients equal a native PyTorch reference in
float64; through ``customgrad.pipelining.stage_backward_input``/``stage_backward_weight``,
FLOPs(I) + FLOPs(W) == FLOPs(full backward), each half runs once, in its own pass, and a full
backward does the work both halves share once (checked against the FLOPs of the native
reference's backward, with what the op recomputes by design named). FLOPs are counted with
``torch.utils.flop_counter.FlopCounterMode`` entered after the forward.

The same ops written with one naive backward (every gradient, as in ``autograd.Function``) are
split automatically with the same exact FLOPs. ``test_hand_off_flop_table`` prints the LoRA MLP
and cross-entropy head FLOPs before hand-off (each half recomputing the shared work) and after:
``pytest -s tests/test_real_ops.py -k flop_table``.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.flop_counter import FlopCounterMode

import customgrad as cg
from customgrad._autosplit import TracedSplit
from customgrad._op import autograd_impl
from customgrad.pipelining import stage_backward_input, stage_backward_weight
from customgrad.testing import CHECKS, check_op
from examples.ops import (
    grouped_linear,
    linear_cross_entropy,
    lora_linear,
    lora_mlp,
    rms_norm,
    silu_and_mul,
    varlen_attention,
    varlen_attention_backward,
)
from examples.ops.linear_cross_entropy import GradsAhead

ONCE_DIFFERENTIABLE = [c for c in CHECKS if c != "gradgradcheck"]

# -- native references (float64, differentiated by autograd) --------------------------------------


def silu_and_mul_ref(x: Tensor) -> Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float = 1e-6, offset: float = 0.0) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (offset + weight)


def linear_cross_entropy_ref(
    _input: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    ignore_index: int = -100,
    lse_square_scale: float = 0.0,
    reduction: str = "mean",
    return_z_loss: bool = False,
) -> tuple[Tensor, Tensor | None]:
    logits = F.linear(_input, weight, bias)
    valid = target != ignore_index
    z = torch.where(valid, lse_square_scale * torch.logsumexp(logits, -1) ** 2, 0.0)
    losses = F.cross_entropy(logits, target, ignore_index=ignore_index, reduction="none") + z
    if reduction == "mean":
        n = valid.sum().clamp(min=1)
        loss, z = losses.sum() / n, z.sum() / n
    elif reduction == "sum":
        loss, z = losses.sum(), z.sum()
    else:
        loss = losses
    return loss, (z.detach() if return_z_loss else None)


def lora_ref(
    x: Tensor, weight: Tensor, lora_a: Tensor, lora_b: Tensor, scaling: float = 1.0
) -> Tensor:
    a, b = lora_a.to(x.dtype), lora_b.to(x.dtype)
    return F.linear(x, weight) + scaling * F.linear(F.linear(x, a), b)


def lora_mlp_ref(x: Tensor, scaling: float = 1.0, **weights: Tensor) -> Tensor:
    def proj(name: str, inp: Tensor) -> Tensor:
        w = [weights[f"{name}_{part}"] for part in ("weight", "a", "b")]
        return lora_ref(inp, *w, scaling)

    return proj("down", F.silu(proj("gate", x)) * proj("up", x))


def bottom_right_mask(lq: int, lk: int, causal: bool, window: tuple[int, int]) -> Tensor:
    """flash-attention's mask, built with tril/triu (independently of the op's kernel)."""
    left, right = window
    right = 0 if causal else right
    mask = torch.ones(lq, lk, dtype=torch.bool)
    if right >= 0:
        mask = mask.tril(diagonal=lk - lq + right)
    if left >= 0:
        mask = mask.triu(diagonal=lk - lq - left)
    return mask


def varlen_attention_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
) -> Tensor:
    """Each sequence through ``F.scaled_dot_product_attention`` (math backend, GQA)."""
    outs = []
    bq, bk = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for q0, q1, k0, k1 in zip(bq, bq[1:], bk, bk[1:]):
        mask = bottom_right_mask(q1 - q0, k1 - k0, causal, window_size)
        o = F.scaled_dot_product_attention(
            q[q0:q1].transpose(0, 1),
            k[k0:k1].transpose(0, 1),
            v[k0:k1].transpose(0, 1),
            attn_mask=mask,
            scale=softmax_scale,
            enable_gqa=True,
        )
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


def grouped_linear_ref(inp: Tensor, m_splits: list[int], weights: list[Tensor]) -> Tensor:
    return torch.cat([F.linear(x, w) for x, w in zip(inp.split(m_splits), weights)])


# -- the cases ---------------------------------------------------------------------------------


@dataclass
class Case:
    """An op, a native reference, and how to make arguments (float64 leaves) for it.

    ``make(gen)`` returns the arguments by name; ``diff`` names the ones that require grad
    (tensor arguments or lists of them).
    """

    op: cg.CustomOp[..., Any]
    reference: Callable[..., Any]
    make: Callable[[torch.Generator], dict[str, Any]]
    diff: tuple[str, ...]
    once_differentiable: bool

    def args(self, seed: int, dtype: torch.dtype = torch.float64) -> dict[str, Any]:
        values = self.make(torch.Generator().manual_seed(seed))
        out: dict[str, Any] = {}
        for name, v in values.items():
            if isinstance(v, Tensor) and v.is_floating_point():
                v = v.to(dtype).requires_grad_(name in self.diff)
            elif isinstance(v, list) and v and isinstance(v[0], Tensor):
                v = [t.to(dtype).requires_grad_(name in self.diff) for t in v]
            out[name] = v
        return out

    def leaves(self, args: dict[str, Any], weights: bool) -> list[Tensor]:
        """The differentiable tensors among the inputs (``weights=False``) or the weights."""
        found: list[Tensor] = []
        for name in self.diff:
            if (name in self.op.weights) == weights:
                v = args[name]
                found.extend(v if isinstance(v, list) else [v])
        return found

    def checks(self) -> list[str]:
        return ONCE_DIFFERENTIABLE if self.once_differentiable else list(CHECKS)


def randn(g: torch.Generator, *shape: int) -> Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float64)


N, H, INNER, RANK, VOCAB = 6, 8, 12, 2, 11
TARGET = torch.tensor([1, 4, -100, 2, 10, 3])
CU_SEQLENS = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
CU_SEQLENS_K = torch.tensor([0, 5, 10, 12], dtype=torch.int32)


def lora_mlp_args(g: torch.Generator) -> dict[str, Any]:
    shapes = {"gate": (INNER, H), "up": (INNER, H), "down": (H, INNER)}
    args: dict[str, Any] = {"x": randn(g, 2, 3, H)}
    for proj, (out_f, in_f) in shapes.items():
        args[f"{proj}_weight"] = randn(g, out_f, in_f) / in_f**0.5
        args[f"{proj}_a"] = randn(g, RANK, in_f) / in_f**0.5
        args[f"{proj}_b"] = randn(g, out_f, RANK)
    args["scaling"] = 0.5
    return args


def ce_args(reduction: str) -> Callable[[torch.Generator], dict[str, Any]]:
    def make(g: torch.Generator) -> dict[str, Any]:
        return {
            "_input": randn(g, N, H),
            "weight": randn(g, VOCAB, H),
            "target": TARGET,
            "bias": randn(g, VOCAB),
            "lse_square_scale": 1e-2,
            "reduction": reduction,
            "return_z_loss": True,
        }

    return make


ADAPTERS = ("gate_a", "gate_b", "up_a", "up_b", "down_a", "down_b")

CASES: dict[str, Case] = {
    "silu_and_mul": Case(
        silu_and_mul, silu_and_mul_ref, lambda g: {"x": randn(g, 2, 3, 2 * H)}, ("x",), False
    ),
    "rms_norm": Case(
        rms_norm,
        rms_norm_ref,
        lambda g: {"x": randn(g, 2, 3, H), "weight": randn(g, H), "eps": 1e-5, "offset": 1.0},
        ("x", "weight"),
        True,
    ),
    "linear_cross_entropy_mean": Case(
        linear_cross_entropy,
        linear_cross_entropy_ref,
        ce_args("mean"),
        ("_input", "weight", "bias"),
        True,
    ),
    "linear_cross_entropy_none": Case(
        linear_cross_entropy,
        linear_cross_entropy_ref,
        ce_args("none"),
        ("_input", "weight", "bias"),
        True,
    ),
    "lora_linear": Case(
        lora_linear,
        lora_ref,
        lambda g: {
            "x": randn(g, 2, 3, H),
            "weight": randn(g, INNER, H),
            "lora_a": randn(g, RANK, H),
            "lora_b": randn(g, INNER, RANK),
            "scaling": 0.5,
        },
        ("x", "lora_a", "lora_b"),  # the base weight is frozen
        False,
    ),
    "lora_mlp": Case(lora_mlp, lora_mlp_ref, lora_mlp_args, ("x", *ADAPTERS), True),
    "varlen_attention": Case(
        varlen_attention,
        varlen_attention_ref,
        lambda g: {
            "q": randn(g, 10, 4, 3),
            "k": randn(g, 12, 2, 3),
            "v": randn(g, 12, 2, 3),
            "cu_seqlens_q": CU_SEQLENS,
            "cu_seqlens_k": CU_SEQLENS_K,
            "max_seqlen_q": 5,
            "max_seqlen_k": 5,
            "causal": True,
            "window_size": (3, -1),
        },
        ("q", "k", "v"),
        True,
    ),
    "grouped_linear": Case(
        grouped_linear,
        grouped_linear_ref,
        lambda g: {
            "inp": randn(g, 7, H),
            "m_splits": [3, 0, 4],
            "weights": [randn(g, 5, H) for _ in range(3)],
        },
        ("inp", "weights"),
        False,
    ),
}


def first_output(out: Any) -> Tensor:
    """The differentiable output (the loss of the CE head, which also returns the z-loss)."""
    return out[0] if isinstance(out, tuple) else out


# -- check_op and the native reference ------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_check_op(name: str) -> None:
    case = CASES[name]
    report = check_op(case.op, checks=case.checks(), **case.args(0))
    assert report.ok, str(report)
    if case.op.weights:
        # the shared work (if any) runs in the input pass only; nothing runs twice
        assert report.calls["input"].get("backward_input") == 1
        assert report.calls["weight"] == {"backward_weight": 1}
        assert report.flops["input"] + report.flops["weight"] == report.flops["full"]


@pytest.mark.parametrize("name", list(CASES))
def test_outputs_and_gradients_equal_native_pytorch(name: str) -> None:
    case = CASES[name]
    args, ref_args = case.args(1), case.args(1)
    out, ref = case.op(**args), case.reference(**ref_args)
    for o, r in zip(_tensors(out), _tensors(ref)):
        torch.testing.assert_close(o, r)
    y, y_ref = first_output(out), first_output(ref)
    grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(2), dtype=y.dtype)
    leaves = case.leaves(args, False) + case.leaves(args, True)
    ref_leaves = case.leaves(ref_args, False) + case.leaves(ref_args, True)
    got = torch.autograd.grad(y, leaves, grad)
    want = torch.autograd.grad(y_ref, ref_leaves, grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def _tensors(out: Any) -> list[Tensor]:
    items = out if isinstance(out, tuple) else (out,)
    return [t for t in items if isinstance(t, Tensor)]


def test_residuals_are_not_outputs() -> None:
    x, w = torch.randn(2, 3, H), torch.randn(H)
    assert isinstance(rms_norm(x, w), Tensor)
    assert isinstance(torch.ops.examples.rms_norm.default(x, w), Tensor)
    loss, z_loss = linear_cross_entropy(torch.randn(N, H), torch.randn(VOCAB, H), TARGET)
    assert loss.shape == () and z_loss is None
    assert (
        rms_norm.schema == "(Tensor x, Tensor weight, float eps=1e-06, float offset=0.0) -> Tensor"
    )


def test_lora_linear_fp32_adapter_with_bf16_activations() -> None:
    """unsloth's setting: the adapter in float32, activations and the base weight in bfloat16.
    The adapter's gradients come back in float32, as autograd gives them."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, H, generator=g).bfloat16().requires_grad_()
    weight = torch.randn(INNER, H, generator=g).bfloat16()
    a = torch.randn(RANK, H, generator=g).requires_grad_()
    b = torch.randn(INNER, RANK, generator=g).requires_grad_()
    grads = torch.autograd.grad(lora_linear(x, weight, a, b, 0.5).float().sum(), (x, a, b))
    assert [t.dtype for t in grads] == [torch.bfloat16, torch.float32, torch.float32]
    want = torch.autograd.grad(lora_ref(x, weight, a, b, 0.5).float().sum(), (x, a, b))
    for got, ref in zip(grads, want):
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)


def test_grouped_linear_frozen_expert_gets_no_gradient() -> None:
    g = torch.Generator().manual_seed(4)
    inp = torch.randn(7, H, generator=g, requires_grad=True)
    weights = [torch.randn(5, H, generator=g, requires_grad=i != 1) for i in range(3)]
    grouped_linear(inp, [3, 2, 2], weights).sum().backward()
    assert weights[1].grad is None
    assert weights[0].grad is not None and weights[2].grad is not None


def test_varlen_attention_lse_and_fully_masked_rows() -> None:
    """The residual is flash-attention's logsumexp; a query with no key (causal, more queries
    than keys) gets lse = +inf and a zero output, and no NaN reaches the gradients."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(4, 2, 3, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 3, generator=g, requires_grad=True) for _ in range(2))
    cu_q, cu_k = torch.tensor([0, 4], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32)
    out, lse = varlen_attention.__wrapped__(q, k, v, cu_q, cu_k, 4, 2, None, True, (-1, -1))
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(3)
    mask = bottom_right_mask(4, 2, True, (-1, -1))  # rows 0 and 1 have no key
    torch.testing.assert_close(
        lse[:, 2:], scores[:, 2:].masked_fill(~mask[2:], -math.inf).logsumexp(-1)
    )
    assert torch.isposinf(lse[:, :2]).all() and (out[:2] == 0).all()
    varlen_attention(q, k, v, cu_q, cu_k, 4, 2, causal=True).sum().backward()
    assert all(t.grad is not None and t.grad.isfinite().all() for t in (q, k, v))
    assert (q.grad[:2] == 0).all()  # type: ignore[index]


# -- the split through customgrad.pipelining, with exact FLOPs -------------------------------------


@dataclass
class Split:
    """FLOPs of the input pass, the weight pass and a full backward, and the backward
    functions that ran in each."""

    flops: dict[str, int]
    calls: dict[str, Counter[str]]


def measure_split(case: Case, op: cg.CustomOp[..., Any] | None = None, seed: int = 6) -> Split:
    """Run ``op`` (default: the case's) and its backward three ways: stage_backward_input,
    then stage_backward_weight, then (on a fresh forward) a full backward; compare gradients."""
    op = case.op if op is None else op
    calls: dict[str, Counter[str]] = {"I": Counter(), "W": Counter(), "full": Counter()}
    phase = "full"

    def seen(label: str, *_: Any) -> None:
        calls[phase][label] += 1

    def forward() -> tuple[dict[str, Any], Tensor, Tensor]:
        args = case.args(seed)
        y = first_output(op(**args))
        grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(7), dtype=y.dtype)
        return args, y, grad

    # An automatic split traces the backward (on fake tensors) at its first split pass: a FLOP
    # counter active then would count the trace too. Measure the steady state.
    args, y, grad = forward()
    _, groups = stage_backward_input([y], [grad], case.leaves(args, False),
                                     iter(case.leaves(args, True)))  # fmt: skip
    stage_backward_weight(iter(case.leaves(args, True)), groups)

    flops: dict[str, int] = {}
    with autograd_impl(op).observing(seen):
        args, y, grad = forward()
        inputs, weights = case.leaves(args, False), case.leaves(args, True)
        phase = "I"
        with FlopCounterMode(display=False) as counter:
            _, groups = stage_backward_input([y], [grad], inputs, iter(weights))
        flops["I"] = counter.get_total_flops()
        phase = "W"
        with FlopCounterMode(display=False) as counter:
            stage_backward_weight(iter(weights), groups)
        flops["W"] = counter.get_total_flops()

        full_args, y, grad = forward()
        phase = "full"
        with FlopCounterMode(display=False) as counter:
            torch.autograd.backward(y, grad)
        flops["full"] = counter.get_total_flops()

    full_leaves = case.leaves(full_args, False) + case.leaves(full_args, True)
    for split_leaf, full_leaf in zip(inputs + weights, full_leaves):
        torch.testing.assert_close(split_leaf.grad, full_leaf.grad)
    return Split(flops, calls)


def reference_backward_flops(case: Case, seed: int = 6) -> int:
    """FLOPs of the native reference's backward (autograd keeps what it needs from the
    forward)."""
    args = case.args(seed)
    y = first_output(case.reference(**args))
    grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(7), dtype=y.dtype)
    with FlopCounterMode(display=False) as counter:
        torch.autograd.backward(y, grad)
    return int(counter.get_total_flops())


def count_flops(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    with FlopCounterMode(display=False) as counter:
        fn(*args, **kwargs)
    return int(counter.get_total_flops())


def mm(n: int, k: int, m: int) -> int:
    """FLOPs of an (n, k) @ (k, m) product."""
    return 2 * n * k * m


@pytest.mark.parametrize("name", list(CASES))
def test_split_through_stage_backward_has_exact_flops(name: str) -> None:
    case = CASES[name]
    split = measure_split(case)
    f = split.flops
    assert f["I"] + f["W"] == f["full"], f
    if case.op.weights:
        assert split.calls["I"]["backward_input"] == 1 and split.calls["I"]["backward_weight"] == 0
        assert split.calls["W"] == Counter({"backward_weight": 1})
    else:  # a weightless op: the input half is its whole backward
        assert split.calls["I"] == Counter({"backward_input": 1}) and f["W"] == 0
    if case.op.rules.backward_shared is not None and f["full"]:
        # shared work once in a split and once in a full backward
        assert split.calls["full"]["backward_shared"] == 1
        assert split.calls["I"]["backward_shared"] == 1 and split.calls["W"]["backward_shared"] == 0


def test_full_backward_flops_against_native_pytorch() -> None:
    """A full backward does the shared work once: the op's FLOPs are the native reference's
    backward plus exactly what the op recomputes instead of keeping from the forward."""
    n = 2 * 3  # tokens of the (2, 3, H) inputs
    lora = measure_split(CASES["lora_linear"]).flops["full"]
    # recomputed: x @ A.T for dB (autograd keeps it)
    assert lora == reference_backward_flops(CASES["lora_linear"]) + mm(n, H, RANK)

    mlp = measure_split(CASES["lora_mlp"]).flops["full"]
    # recomputed: x @ A.T for the gate and up adapters' dB, h @ A.T for the down adapter's
    recomputed = 2 * mm(n, H, RANK) + mm(n, INNER, RANK)
    assert mlp == reference_backward_flops(CASES["lora_mlp"]) + recomputed

    grouped = measure_split(CASES["grouped_linear"]).flops["full"]
    assert grouped == reference_backward_flops(CASES["grouped_linear"]) == 2 * mm(7, H, 5)

    # reduction="none": the logits, recomputed once (not once per half)
    ce_none = measure_split(CASES["linear_cross_entropy_none"]).flops["full"]
    assert ce_none == reference_backward_flops(CASES["linear_cross_entropy_none"]) + mm(N, H, VOCAB)


def test_cross_entropy_mean_does_its_backward_in_the_forward() -> None:
    """reduction="mean": the kernel's FLOPs are the native forward plus backward (three
    matmuls), and the op's backward only scales (no FLOPs)."""
    case = CASES["linear_cross_entropy_mean"]
    args = case.args(8)
    kernel = count_flops(linear_cross_entropy.__wrapped__, **args)
    ref_forward = count_flops(linear_cross_entropy_ref, **case.args(8))
    assert ref_forward == mm(N, H, VOCAB)
    assert kernel == ref_forward + reference_backward_flops(case, seed=8) == 3 * mm(N, H, VOCAB)
    assert measure_split(case).flops == {"I": 0, "W": 0, "full": 0}


def test_varlen_attention_backward_kernel_flops() -> None:
    """The backward kernel is an opaque op (zero FLOPs to a counter, as a flash kernel): its own
    FLOPs are the four products of an attention backward (dV, dP, dQ, dK) plus the scores it
    recomputes from the logsumexp, five products of one size per head. (Counted from first
    principles: torch's FLOP formula for SDPA's backward changed between 2.13 and 2.14.)"""
    case = CASES["varlen_attention"]
    args = case.args(9)
    out, lse = varlen_attention.__wrapped__(**args)
    dout = torch.randn_like(out)
    rest = {k: args[k] for k in list(args)[3:]}
    q, k, v = args["q"], args["k"], args["v"]
    kernel = count_flops(varlen_attention_backward.__wrapped__, dout, q, k, v, out, lse, **rest)
    seqs = list(
        zip(
            CU_SEQLENS.tolist(),
            CU_SEQLENS.tolist()[1:],
            CU_SEQLENS_K.tolist(),
            CU_SEQLENS_K.tolist()[1:],
        )
    )
    scores = sum(
        mm(4 * (q1 - q0), 3, k1 - k0) for q0, q1, k0, k1 in seqs
    )  # heads * (Lq, D) @ (D, Lk); dV, dP, dQ and dK are products of the same size
    assert kernel == 5 * scores
    assert measure_split(case).flops == {"I": 0, "W": 0, "full": 0}


# -- before and after the hand-off ----------------------------------------------------------------


class _OwnShared:
    """A backward context whose ``shared`` the half computed itself."""

    def __init__(self, ctx: cg.BackwardContext, shared: Any) -> None:
        self._ctx = ctx
        self.shared = shared

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)


_ids = itertools.count()


def twin(op: cg.CustomOp[..., Any], tag: str) -> cg.CustomOp[..., Any]:
    """``op`` defined again under another name: same kernel, fake kernel and save; no backward."""
    sig = op.signature
    new = cg.op(
        f"test_real_ops_{tag}{next(_ids)}::{op.__name__}",
        op.__wrapped__,
        weights=op.weights,
        residuals=op.residuals,
        schema=sig.kernel_schema,
        output_differentiability=sig.output_differentiability,
    )
    new.register_fake(op._kernels.fake)
    assert op.rules.save is not None
    new.register_save_for_backward(op.rules.save)
    return new


def recomputing_pair(op: cg.CustomOp[..., Any]) -> cg.CustomOp[..., Any]:
    """``op`` as written before the hand-off: each half computes the shared work itself."""
    before = twin(op, "before")
    rules = op.rules
    shared, bwd_in, bwd_w = rules.backward_shared, rules.backward_input, rules.backward_weight
    assert shared is not None and bwd_in is not None and bwd_w is not None

    def own(half: Callable[..., Any]) -> Callable[..., Any]:
        def run(ctx: cg.BackwardContext, saved: Any, *grads: Any) -> Any:
            return half(_OwnShared(ctx, shared(ctx, saved, *grads)), saved, *grads)

        return run

    before.register_backward_input(own(bwd_in), differentiable=False)
    before.register_backward_weight(own(bwd_w), differentiable=False)
    return before


def lora_mlp_shared_flops(n: int, hidden: int = H, inner: int = INNER, rank: int = RANK) -> int:
    """dY @ B_down, dY @ W_down, (dY @ B_down) @ A_down, de @ B_gate, dg @ B_up."""
    return mm(n, hidden, rank) + mm(n, hidden, inner) + mm(n, rank, inner) + 2 * mm(n, inner, rank)


@pytest.mark.parametrize("name", ["lora_mlp", "linear_cross_entropy_none", "lora_linear"])
def test_hand_off_flop_table(name: str) -> None:
    case = CASES[name]
    after = measure_split(case).flops
    before = measure_split(case, recomputing_pair(case.op)).flops
    shared = {
        "lora_mlp": lora_mlp_shared_flops(6),
        "linear_cross_entropy_none": mm(N, H, VOCAB),
        "lora_linear": mm(6, INNER, RANK),
    }[name]
    assert after["I"] + after["W"] == after["full"]
    assert before["I"] + before["W"] == before["full"]  # the pair: both halves in full too
    assert before["full"] == after["full"] + shared  # the shared work, twice
    assert before["I"] == after["I"] and before["W"] == after["W"] + shared
    print(
        f"\n{name}: before hand-off I {before['I']} + W {before['W']} = full {before['full']}; "
        f"after I {after['I']} + W {after['W']} = full {after['full']}; "
        f"{before['full'] / after['full']:.3f}x"
    )


def test_hand_off_flop_table_at_model_shapes() -> None:
    """The before/after ratios at a transformer's proportions (64 tokens, hidden 256, inner 688,
    rank 16, vocabulary 4096): the figures quoted in the docs."""
    g = torch.Generator().manual_seed(10)
    n, hidden, inner, rank, vocab = 64, 256, 688, 16, 4096

    def r(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64) / shape[-1] ** 0.5

    mlp: dict[str, Any] = {"x": r(n, hidden), "scaling": 0.5}
    for proj, (out_f, in_f) in (("gate", (inner, hidden)), ("up", (inner, hidden)),
                                ("down", (hidden, inner))):  # fmt: skip
        mlp |= {f"{proj}_weight": r(out_f, in_f), f"{proj}_a": r(rank, in_f)}
        mlp[f"{proj}_b"] = r(out_f, rank)
    target = torch.randint(vocab, (n,), generator=g)
    ce = {"_input": r(n, hidden), "weight": r(vocab, hidden), "target": target, "reduction": "none"}

    shared = {
        "examples::lora_mlp": lora_mlp_shared_flops(n, hidden, inner, rank),
        "examples::linear_cross_entropy": mm(n, hidden, vocab),
    }
    for op, values, diff in (
        (lora_mlp, mlp, ("x", *ADAPTERS)),
        (linear_cross_entropy, ce, ("_input", "weight")),
    ):
        case = Case(op, op, lambda _, v=values: dict(v), diff, once_differentiable=True)
        after = measure_split(case).flops
        before = measure_split(case, recomputing_pair(op)).flops
        assert after["I"] + after["W"] == after["full"]
        assert before["full"] == after["full"] + shared[op.name]
        print(
            f"\n{op.name} ({n} tokens): before hand-off I {before['I']:,} + W {before['W']:,} = "
            f"{before['full']:,}; after I {after['I']:,} + W {after['W']:,} = {after['full']:,}; "
            f"{before['full'] / after['full']:.3f}x"
        )


# -- the same ops with one naive backward, split automatically -------------------------------------


def naive_rms_norm(ctx: Any, saved: Any, grad: Tensor) -> dict[str, Any]:
    x, weight, offset, rstd = saved
    x_hat = x * rstd
    m = grad * (offset + weight)
    return {
        "x": rstd * (m - x_hat * (m * x_hat).mean(-1, keepdim=True)),
        "weight": (grad * x_hat).reshape(-1, weight.shape[-1]).sum(0),
    }


def naive_silu_and_mul(ctx: Any, x: Tensor, grad: Tensor) -> dict[str, Any]:
    gate, up = x.chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    return {"x": torch.cat([grad * up * sig * (1 + gate * (1 - sig)), grad * gate * sig], -1)}


def naive_cross_entropy(ctx: Any, saved: Any, grad: Tensor, grad_z: Any) -> dict[str, Any]:
    if isinstance(saved, GradsAhead):
        bias = saved.grad_bias * grad if saved.grad_bias is not None else None
        return {
            "_input": saved.grad_input * grad,
            "weight": saved.grad_weight * grad,
            "bias": bias,
        }
    x, weight, bias, target, ignore_index, z_scale = saved
    logits = F.linear(x, weight, bias)
    lse = logits.logsumexp(-1)
    d = torch.softmax(logits, -1) * (1 + 2 * z_scale * lse)[:, None] - F.one_hot(
        target.clamp(min=0), weight.shape[0]
    )
    d = torch.where((target != ignore_index)[:, None], d, 0.0) * grad[:, None]
    return {
        "_input": d @ weight,
        "weight": d.mT @ x,
        "bias": d.sum(0) if bias is not None else None,
    }


def naive_lora_linear(ctx: Any, saved: Any, grad: Tensor) -> dict[str, Any]:
    x, weight, a, b, s = saved
    xs, g = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
    gb = g @ b
    return {
        "x": (g @ weight + s * gb @ a).reshape(x.shape),
        "weight": g.mT @ xs,
        "lora_a": s * gb.mT @ xs,
        "lora_b": s * g.mT @ (xs @ a.mT),
    }


def naive_lora_mlp(ctx: Any, saved: Any, grad: Tensor) -> dict[str, Any]:
    x, gate, up, down, s, e, g = saved
    xs, dy = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
    e, g = e.reshape(-1, e.shape[-1]), g.reshape(-1, g.shape[-1])
    h = F.silu(e) * g
    dy_b = dy @ down.b
    dh = dy @ down.weight + s * dy_b @ down.a
    sig = torch.sigmoid(e)
    de, dg = dh * g * sig * (1 + e * (1 - sig)), dh * e * sig
    de_b, dg_b = de @ gate.b, dg @ up.b
    dx = de @ gate.weight + s * de_b @ gate.a + dg @ up.weight + s * dg_b @ up.a
    grads = {"x": dx.reshape(x.shape)}
    for name, inp, proj, d, d_b in (
        ("gate", xs, gate, de, de_b),
        ("up", xs, up, dg, dg_b),
        ("down", h, down, dy, dy_b),
    ):
        grads[f"{name}_weight"] = d.mT @ inp
        grads[f"{name}_a"] = s * d_b.mT @ inp
        grads[f"{name}_b"] = s * d.mT @ (inp @ proj.a.mT)
    return grads


def naive_varlen_attention(ctx: Any, saved: Any, grad: Tensor) -> dict[str, Any]:
    q, k, v, out, lse, *args = saved
    dq, dk, dv = varlen_attention_backward(grad, q, k, v, out, lse, *args)
    return {"q": dq, "k": dk, "v": dv}


def naive_grouped_linear(ctx: Any, saved: Any, grad: Tensor) -> dict[str, Any]:
    inp, m_splits, weights = saved
    gs, xs = grad.split(m_splits), inp.split(m_splits)
    return {
        "inp": torch.cat([g @ w for g, w in zip(gs, weights)]),
        "weights": [g.mT @ x for g, x in zip(gs, xs)],
    }


NAIVE: dict[str, Callable[..., dict[str, Any]]] = {
    "silu_and_mul": naive_silu_and_mul,
    "rms_norm": naive_rms_norm,
    "linear_cross_entropy_mean": naive_cross_entropy,
    "linear_cross_entropy_none": naive_cross_entropy,
    "lora_linear": naive_lora_linear,
    "lora_mlp": naive_lora_mlp,
    "varlen_attention": naive_varlen_attention,
    "grouped_linear": naive_grouped_linear,
}


@pytest.fixture(scope="module")
def naive_ops() -> dict[str, cg.CustomOp[..., Any]]:
    """Each op again, with the naive backward instead of its pair."""
    ops = {}
    for name, backward in NAIVE.items():
        ops[name] = twin(CASES[name].op, "naive")
        ops[name].register_backward(backward)
    return ops


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
@pytest.mark.parametrize("name", list(NAIVE))
def test_naive_single_backward_splits_with_exact_flops(
    name: str, naive_ops: dict[str, cg.CustomOp[..., Any]]
) -> None:
    case = CASES[name]
    naive = naive_ops[name]
    split = measure_split(case, naive)
    if case.leaves(case.args(0), True):
        assert isinstance(naive.rules.auto.last, TracedSplit), naive.rules.auto.describe()
    else:  # no weight: every pass needs every gradient and calls the function as written
        assert naive.rules.auto.last is None, naive.rules.auto.describe()
    pair = measure_split(case).flops  # what the hand-written pair does
    # I and W run the capture: the pair's work, nothing twice, nothing no gradient needs
    assert (split.flops["I"], split.flops["W"]) == (pair["I"], pair["W"]), split.flops
    # A full backward calls the function as written: its FLOPs are the written code's (with
    # the gradients of arguments that do not require grad, as LoRA's frozen base weight: the
    # validation drops them), counted here through the same function under split="phase".
    written = twin(case.op, "written")
    written.register_backward(NAIVE[name], split="phase")
    assert split.flops["full"] == measure_split(case, written).flops["full"], split.flops
    assert split.flops["full"] >= pair["full"] == pair["I"] + pair["W"]
    report = check_op(naive, checks=["gradcheck", "split", "flops"], **case.args(0))
    assert report.ok, str(report)
