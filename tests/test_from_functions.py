"""``from_function`` on Functions without annotations (the schema, outputs and
``output_differentiability`` read from the first call), and ``from_functions``, which makes every
``Function.apply`` call of a library reach its op: Liger-Kernel's Functions (under Triton's
interpreter on CPU) and unsloth's LoRA MLP, through customgrad's split."""

from __future__ import annotations

import itertools
import re
from typing import Any

import pytest
import torch
from torch import Tensor

import customgrad as cg
import customgrad.pipelining as cgp
from tests._skips import optional_package
from tests._unsloth_port import LoRA_MLP, LoraMLP

_ids = itertools.count()


def unique() -> str:
    return f"test_from_functions{next(_ids)}"


class RMSNorm(torch.autograd.Function):
    """No annotations, as Liger's, fla's and unsloth's Functions are written."""

    @staticmethod
    def forward(ctx, x, weight, eps=1e-5, bias=None, mode="llama", in_place=False):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.has_bias = eps, bias is not None
        out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
        return out if bias is None else out + bias

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        x, weight = ctx.saved_tensors
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + ctx.eps)
        xhat = x * rstd
        gx = grad * weight
        dx = rstd * (gx - xhat * (gx * xhat).mean(-1, keepdim=True))
        dweight = (grad * xhat).reshape(-1, x.shape[-1]).sum(0)
        dbias = grad.reshape(-1, x.shape[-1]).sum(0) if ctx.has_bias else None
        return dx, dweight, None, dbias, None, None


def _grads(fn: Any, *args: Any) -> tuple[Tensor, ...]:
    tensors = [a for a in args if isinstance(a, Tensor) and a.requires_grad]
    out = fn(*args)
    return torch.autograd.grad(out.pow(2).sum(), tensors)


def torch_apply(cls: type[torch.autograd.Function]) -> Any:
    """torch's own ``Function.apply`` bound to ``cls`` (a Python classmethod up to torch 2.13, a
    C one from 2.14: compared by ``==``, which both bind the same way)."""
    return vars(torch.autograd.Function)["apply"].__get__(None, cls)


def test_schema_is_inferred_from_the_first_call_and_gradients_equal_the_function_s() -> None:
    op = cg.from_function(RMSNorm, f"{unique()}::rms", weights=("weight", "bias"))
    assert isinstance(op, cg.DeferredFunctionOp) and op.schema is None
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    b = torch.randn(8, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(_grads(op, x, w), _grads(RMSNorm.apply, x, w))
    assert op.schema == (
        "(Tensor x, Tensor weight, float eps=1e-05, Tensor? bias=None, "
        'str mode="llama", bool in_place=False) -> Tensor'
    )
    # a tensor for the optional one, a number for the float, by keyword too
    torch.testing.assert_close(
        _grads(lambda x, w, b: op(x, w, bias=b, eps=1e-3), x, w, b),
        _grads(lambda *a: RMSNorm.apply(*a[:2], 1e-3, a[2]), x, w, b),
    )


def test_a_call_whose_argument_kinds_differ_from_the_inferred_schema_is_refused() -> None:
    op = cg.from_function(RMSNorm, f"{unique()}::rms", weights=("weight",))
    x, w = torch.randn(3, 8), torch.randn(8)
    op(x, w, 1e-5, None, "llama")
    with pytest.raises(
        cg.UnsupportedError,
        match=re.escape(
            f"{op.name}: argument 'mode' got int, but the op's schema, inferred from the first "
            f"call, says str ((Tensor x, Tensor weight, float eps=1e-05, Tensor? bias=None, str "
            f'mode="llama", bool in_place=False) -> Tensor). Give the schema that covers both '
            f'calls: cg.from_function(..., schema="(Tensor x, Tensor weight, float eps, Tensor? '
            f'bias, str mode, bool in_place) -> Tensor"). (forward defined at'
        ),
    ):
        op(x, w, 1e-5, None, 3)
    with pytest.raises(cg.UnsupportedError, match=re.escape("argument 'x' got None")):
        op(None, w)
    op(x, w, 1)  # an int where a float is inferred: as torch.library takes it


def test_an_object_that_no_schema_type_fits_is_refused_at_the_first_call() -> None:
    class Config:
        pass

    class Scaled(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, config):  # type: ignore[no-untyped-def]
            return x * 2

        @staticmethod
        def backward(ctx, grad):  # type: ignore[no-untyped-def]
            return grad * 2, None

    op = cg.from_function(Scaled, f"{unique()}::scaled")
    got = f"{Config.__module__}.{Config.__qualname__}"
    with pytest.raises(
        cg.DefinitionError,
        match=re.escape(
            f"{op.name}: cannot infer a schema type for argument 'config' from the value of the "
            f"first call, a {got}: a customgrad op takes tensors"
        ),
    ):
        op(torch.ones(2), Config())
    assert op.op is None


class WithIndices(torch.autograd.Function):
    """Outputs a float, an integer tensor, a float it marks non-differentiable, and None."""

    @staticmethod
    def forward(ctx, x, w):  # type: ignore[no-untyped-def]
        y = x * w
        stats = y.detach().mean(-1)
        ctx.mark_non_differentiable(stats)
        ctx.save_for_backward(x, w)
        return y, y.argmax(-1), stats, None

    @staticmethod
    def backward(ctx, grad, grad_idx, grad_stats, grad_none):  # type: ignore[no-untyped-def]
        assert grad_none is None  # as autograd hands it
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum(0)


def test_outputs_and_their_differentiability_are_inferred() -> None:
    op = cg.from_function(WithIndices, f"{unique()}::with_indices", weights=("w",))
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, requires_grad=True)
    y, idx, stats, none = op(x, w)
    assert op.schema == "(Tensor x, Tensor w) -> (Tensor, Tensor, Tensor)"
    assert none is None and idx.dtype == torch.int64 and not stats.requires_grad
    ry, ridx, rstats, _ = WithIndices.apply(x, w)
    torch.testing.assert_close((y, idx, stats), (ry, ridx, rstats))
    got = torch.autograd.grad(y.pow(2).sum(), (x, w))
    torch.testing.assert_close(got, torch.autograd.grad(ry.pow(2).sum(), (x, w)))


class Rotate(torch.autograd.Function):
    """As Liger's rope: writes its inputs in place and returns them."""

    @staticmethod
    def forward(ctx, q, k, c):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(c)
        q.mul_(c)
        k.mul_(c)
        return q, k

    @staticmethod
    def backward(ctx, dq, dk):  # type: ignore[no-untyped-def]
        (c,) = ctx.saved_tensors
        return dq.mul_(c), dk.mul_(c), None  # in place on the output gradients, too


def test_outputs_written_into_inputs_become_new_tensors() -> None:
    op = cg.from_function(Rotate, f"{unique()}::rotate")
    q, k, c = torch.randn(2, 3), torch.randn(2, 3), torch.randn(3)
    ql, kl = q.clone().requires_grad_(), k.clone().requires_grad_()
    got_q, got_k = op(ql * 1, kl * 1, c)
    want_q, want_k = Rotate.apply(ql * 1, kl * 1, c)
    torch.testing.assert_close((got_q, got_k), (want_q, want_k))
    loss = (got_q * 2 + got_k).sum()
    torch.testing.assert_close(
        torch.autograd.grad(loss, (ql, kl)), (2 * c.expand(2, 3), c.expand(2, 3))
    )
    q_in = q.clone()
    op(q_in, k.clone(), c)
    torch.testing.assert_close(q_in, q)  # the op's input is left as it was (a copy is written)


def _lora_grads(m: LoraMLP, x: Tensor, split: bool) -> list[Tensor]:
    params = [p for p in m.parameters() if p.requires_grad]
    for t in (x, *params):
        t.grad = None
    out = m(x)
    if split:
        dx, groups = cgp.stage_backward_input([out], [torch.ones_like(out)], [x], params)
        cgp.stage_backward_weight(params, groups)
        return [dx[0], *(p.grad for p in params)]
    out.sum().backward()
    return [x.grad, *(p.grad for p in params)]


LORA_WEIGHTS = {
    LoRA_MLP: ("gateW", "gateA", "gateB", "upW", "upA", "upB", "downW", "downA", "downB")
}


@pytest.mark.parametrize("inplace", [True, False])
def test_unsloth_lora_mlp_through_from_functions_and_the_split(inplace: bool) -> None:
    torch.manual_seed(0)
    m = LoraMLP(inplace=inplace)
    x = torch.randn(2, 3, 8, requires_grad=True)
    want = [g.clone() for g in _lora_grads(m, x, split=False)]  # the raw Function
    with cg.from_functions(LoRA_MLP, weights=LORA_WEIGHTS, namespace=unique()) as patch:
        (op,) = patch.ops.values()
        for split in (False, True):
            got = _lora_grads(m, x, split)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b)
    assert LoRA_MLP.apply == torch_apply(LoRA_MLP)  # restored
    assert list(patch.ops) == ["tests._unsloth_port.LoRA_MLP"]
    (row,) = cg.summary(op.name.split("::")[0]).ops
    assert row.split == "run once"  # the capture refuses this backward: once, whole, in I
    assert row.calls["ran once"] == {"input": 1} and row.calls["handed"] == {"weight": 1}


def test_from_functions_leaves_subclasses_alone_and_refuses_bad_names() -> None:
    class Sub(RMSNorm):
        pass

    ns = unique()
    with cg.from_functions(RMSNorm, weights={"RMSNorm": ("weight",)}, namespace=ns) as patch:
        x = torch.randn(2, 4)
        RMSNorm.apply(x, torch.ones(4))
        assert patch.ops[f"{__name__}.RMSNorm"].op is not None
        assert Sub.apply == torch_apply(Sub)
        with pytest.raises(
            cg.DefinitionError,
            match=re.escape(
                f"from_functions: {__name__}.RMSNorm is already wrapped by another "
                f"from_functions; restore that one first (or leave its with block)."
            ),
        ):
            cg.from_functions(RMSNorm, namespace=ns)
    assert "apply" not in vars(RMSNorm)
    with pytest.raises(
        cg.DefinitionError,
        match=re.escape(
            "from_functions: weights names ['RMSNrom'], which are not among the Functions "
            "wrapped (RMSNorm)."
        ),
    ):
        cg.from_functions(RMSNorm, weights={"RMSNrom": ("weight",)}, namespace=ns)
    assert "apply" not in vars(RMSNorm)


def test_liger_block_through_from_functions_and_the_split() -> None:
    # liger_kernel first: a failed import of tests._liger_block can stay half-made in
    # sys.modules (the doctest collection imports it too)
    pytest.importorskip("liger_kernel", reason=optional_package("liger-kernel"))
    L = pytest.importorskip("tests._liger_block", reason=optional_package("liger-kernel"))
    import liger_kernel.ops

    weights = {
        "LigerRMSNormFunction": ("W",),
        "LigerFusedLinearCrossEntropyFunction": ("weight", "bias"),
    }
    with L.liger_kernels():
        first, last = L.build()
        x, target = L.batch()
        xm, tm = x[: L.BATCH], target[: L.BATCH]

        def step(split: bool) -> dict[str, Tensor]:
            for p in (*first.parameters(), *last.parameters()):
                p.grad = None
            h = first(xm)
            h_in = h.detach().requires_grad_()
            loss = last(h_in, tm)
            if split:
                (dh,), groups = cgp.stage_backward_input([loss], None, [h_in], last.parameters())
                cgp.stage_backward_weight(last.parameters(), groups)
                _, groups = cgp.stage_backward_input([h], [dh], [], first.parameters())
                cgp.stage_backward_weight(first.parameters(), groups)
            else:
                loss.backward()
                h.backward(h_in.grad)
            return L.gradients(first, last)

        want = {k: v.clone() for k, v in step(split=False).items()}
        ns = unique()
        with cg.from_functions(liger_kernel.ops, weights=weights, namespace=ns) as patch:
            for split in (False, True):
                got = step(split)
                for name in want:
                    torch.testing.assert_close(got[name], want[name], msg=name)
    rows = {r.op: r for r in cg.summary(ns).ops if r.calls}
    used = {k.rsplit(".", 1)[1]: op for k, op in patch.ops.items() if op.name in rows}
    assert set(used) == {
        "LigerRMSNormFunction", "LigerRopeFunction", "LigerSiLUMulFunction",
        "LigerFusedLinearCrossEntropyFunction",
    }  # fmt: skip
    assert used["LigerRopeFunction"].schema == (
        "(Tensor q, Tensor k, Tensor cos, Tensor sin, Tensor? position_ids=None, "
        "SymInt unsqueeze_dim=1, Tensor? rotary_dim=None) -> (Tensor, Tensor)"
    )
    rms = rows[used["LigerRMSNormFunction"].name]
    assert rms.split == "run once"  # a raw Triton launch: once, whole, in I; W takes its dW
    # 5 RMSNorms a step: the full step's run whole; in the split, 4 run once in I and W takes
    # their dW, and the first (on the stage's input, which needs no gradient) runs in W alone
    assert rms.calls == {"whole": {"full": 6}, "ran once": {"input": 4}, "handed": {"weight": 4}}
    assert not any("split off" in r.calls for r in rows.values())


class SumScaled(torch.autograd.Function):
    """``setup_context`` style; a list of tensors, and a tuple default torch's schema can't
    write (left out of the schema; the call still gets it)."""

    @staticmethod
    def forward(x, scales, dims=(0,)):  # type: ignore[no-untyped-def]
        return sum((x * s for s in scales), torch.zeros_like(x)).sum(dims)

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[no-untyped-def]
        x, scales, ctx.dims = inputs
        ctx.save_for_backward(x, *scales)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        x, *scales = ctx.saved_tensors
        g = grad.unsqueeze(ctx.dims[0]).expand_as(x)
        return g * sum(scales), None, None  # a list is no tensor input to autograd


def test_lists_of_tensors_and_setup_context() -> None:
    op = cg.from_function(SumScaled, f"{unique()}::sum_scaled")
    x = torch.randn(2, 3, requires_grad=True)
    scales = [torch.randn(3) for _ in range(2)]
    got = torch.autograd.grad(op(x, scales).pow(2).sum(), x)
    want = torch.autograd.grad(SumScaled.apply(x, scales).pow(2).sum(), x)
    torch.testing.assert_close(got, want)
    assert op.schema == "(Tensor x, Tensor[] scales, SymInt[] dims) -> Tensor"


class MainGrad(torch.autograd.Function):
    """As Megatron's linear: backward accumulates the weight gradient into ``w.main_grad``."""

    @staticmethod
    def forward(ctx, x, w):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(x, w)
        return x @ w.mT

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        x, w = ctx.saved_tensors
        w.main_grad.add_(grad.mT @ x)
        return grad @ w, None


def test_a_saved_weight_is_handed_as_itself_with_its_attributes() -> None:
    op = cg.from_function(MainGrad, f"{unique()}::main_grad")
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(5, 4))
    w.main_grad = torch.zeros(5, 4)  # type: ignore[attr-defined]
    for _ in range(2):  # the first backward (which learns what it writes) and the next
        op(x, w).sum().backward()
    torch.testing.assert_close(w.main_grad, 2 * torch.ones(3, 5).mT @ x.detach())  # type: ignore[attr-defined]


def test_a_backward_of_torch_ops_splits_through_from_functions() -> None:
    ns = unique()
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    want = torch.autograd.grad(RMSNorm.apply(x, w).pow(2).sum(), (x, w))
    with cg.from_functions(RMSNorm, weights={RMSNorm: ("weight", "bias")}, namespace=ns):
        out = RMSNorm.apply(x, w)
        (dx,), groups = cgp.stage_backward_input([out.pow(2).sum()], None, [x], [w])
        cgp.stage_backward_weight([w], groups)
    torch.testing.assert_close((dx, w.grad), want)
    (row,) = cg.summary(ns).ops
    assert row.split == "traced"  # dx in I, dweight in W: nothing twice
    assert row.calls == {"split": {"input": 1, "weight": 1}}
