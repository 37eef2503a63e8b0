"""cg.op and CustomOp: definition, kernels, autograd, torch.ops parity, ecosystem checks."""

from __future__ import annotations

import copy
import gc
import itertools
import re
import threading
import weakref
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import customgrad as cg
from tests.conftest import linear_op

_ids = itertools.count()


def unique(name: str) -> str:
    return f"test_op{next(_ids)}::{name}"


LINEAR_PAIR = linear_op("test_op::linear_pair", bias=True)
LINEAR_SINGLE = linear_op("test_op::linear_single", bias=True, backward="single")


def leaf(*shape: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype, requires_grad=True)


@pytest.mark.parametrize("op", [LINEAR_PAIR, LINEAR_SINGLE], ids=["pair", "single"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("shape", [(5, 3), (2, 4, 3)])
def test_linear_matches_reference(op, dtype, with_bias, shape) -> None:
    x, w = leaf(*shape, dtype=dtype), leaf(4, 3, dtype=dtype)
    b = leaf(4, dtype=dtype) if with_bias else None
    inputs = [t for t in (x, w, b) if t is not None]
    out = op(x, w, b)
    ref = F.linear(x, w, b)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, inputs, g)
    want = torch.autograd.grad(ref, inputs, g)
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e)


@pytest.mark.parametrize("op", [LINEAR_PAIR, LINEAR_SINGLE], ids=["pair", "single"])
def test_torch_ops_gives_same_outputs_and_gradients(op) -> None:
    x, w, b = leaf(3, 2), leaf(4, 2), leaf(4)
    ns, name = op.name.split("::")
    overload = getattr(getattr(torch.ops, ns), name).default
    assert overload is op.opoverload
    out1, out2 = op(x, w, b), overload(x, w, bias=b)
    torch.testing.assert_close(out1, out2)
    g1 = torch.autograd.grad(out1.sum(), (x, w, b))
    g2 = torch.autograd.grad(out2.sum(), (x, w, b))
    for a, e in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, e)
    assert out2.grad_fn is not None and "CustomGrad" in type(out2.grad_fn).__name__


# torch 2.14's opcheck reads .grad of a non-leaf in its own aot_dispatch test and warns (it does
# so for a plain torch.library.custom_op too); the warning is torch's, not the op's.
OPCHECK_WARNING = pytest.mark.filterwarnings(
    "ignore:The .grad attribute of a Tensor that is not a leaf Tensor:UserWarning"
)


@OPCHECK_WARNING
@pytest.mark.parametrize("op", [LINEAR_PAIR, LINEAR_SINGLE], ids=["pair", "single"])
def test_gradcheck_gradgradcheck_and_opcheck(op) -> None:
    x, w, b = leaf(3, 2), leaf(4, 2), leaf(4)
    assert torch.autograd.gradcheck(op, (x, w, b))
    assert torch.autograd.gradgradcheck(op, (x, w, b))
    assert torch.autograd.gradcheck(op.opoverload, (x, w, b))
    torch.library.opcheck(op.opoverload, (x, w, b))
    torch.library.opcheck(op.opoverload, (x.detach(), w.detach(), None))


def test_attributes_schema_and_call_binding() -> None:
    op = LINEAR_PAIR
    assert op.name == "test_op::linear_pair"
    assert op.schema == "(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor"
    assert op.weights == ("weight", "bias")
    assert isinstance(op.opoverload, torch._ops.OpOverload)
    x, w = torch.randn(2, 3), torch.randn(4, 3)
    torch.testing.assert_close(op(x, weight=w), x @ w.mT)
    torch.testing.assert_close(op(x=x, weight=w, bias=None), x @ w.mT)
    with pytest.raises(TypeError, match="missing a required argument: 'weight'"):
        op(x)


def test_meta_tensors_go_to_the_fake_kernel_on_both_call_paths() -> None:
    ran: list[str] = []

    @cg.op(unique("needs_data"))
    def needs_data(x: torch.Tensor) -> torch.Tensor:
        ran.append("kernel")
        return x * x.sum().item()

    @needs_data.register_fake
    def _(x):
        ran.append("fake")
        return torch.empty_like(x)

    x = torch.empty(3, device="meta")
    assert needs_data(x).device.type == "meta"
    assert needs_data.opoverload(x).device.type == "meta"
    assert ran == ["fake", "fake"]


def test_op_as_function_call_and_device_kernels() -> None:
    calls: list[str] = []

    def double(x: torch.Tensor) -> torch.Tensor:
        calls.append("default")
        return x * 2

    op = cg.op(unique("double"), double)
    assert op(torch.ones(2)).tolist() == [2.0, 2.0]

    @op.register_kernel("cpu")
    def _(x):
        calls.append("cpu")
        return x + x

    assert op(torch.ones(2)).tolist() == [2.0, 2.0]
    assert op.opoverload(torch.ones(2)).tolist() == [2.0, 2.0]
    assert calls == ["default", "cpu", "cpu"]

    @op.register_kernel("cpu")  # registering again replaces
    def _(x):
        calls.append("cpu2")
        return x * 2

    op.opoverload(torch.ones(1))
    op(torch.ones(1))
    assert calls[-2:] == ["cpu2", "cpu2"]


def test_registrations_after_first_call_and_replacement() -> None:
    @cg.op(unique("square"))
    def square(x: torch.Tensor) -> torch.Tensor:
        return x * x

    x = torch.tensor([3.0], requires_grad=True)
    assert square(x.detach()).item() == 9.0  # used before any autograd registration
    with pytest.raises(cg.MissingRegistrationError):
        square(x)
    square.register_fake(lambda x: torch.empty_like(x))
    square.register_save_for_backward(lambda inputs, output: inputs.x)
    square.register_backward(lambda ctx, x, g: {"x": 2 * x * g})
    (gx,) = torch.autograd.grad(square(x), x)
    assert gx.item() == 6.0
    square.register_backward(lambda ctx, x, g: {"x": 3 * x * g})  # replaces
    (gx,) = torch.autograd.grad(square(x), x)
    assert gx.item() == 9.0


def test_deepcopy_returns_the_same_op_and_modules_copy() -> None:
    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.op = LINEAR_PAIR
            self.weight = torch.nn.Parameter(torch.randn(4, 3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.op(x, self.weight)

    layer = Layer()
    clone = copy.deepcopy(layer)
    assert copy.deepcopy(LINEAR_PAIR) is LINEAR_PAIR
    assert copy.copy(LINEAR_PAIR) is LINEAR_PAIR
    assert clone.op is LINEAR_PAIR
    x = torch.randn(2, 3)
    torch.testing.assert_close(clone(x), layer(x))


def test_saved_tensors_go_through_saved_tensor_hooks() -> None:
    packed: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(tuple(t.shape))
        return t.clone()

    x, w = leaf(2, 3), leaf(4, 3)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = LINEAR_PAIR(x, w)
    assert sorted(packed) == [(2, 3), (4, 3)]
    out.sum().backward()
    torch.testing.assert_close(w.grad, torch.ones(2, 4, dtype=x.dtype).mT @ x.detach())
    first = w.grad.clone()
    w.grad = None
    with torch.autograd.graph.save_on_cpu():  # saved tensors go through its hooks too
        out = LINEAR_PAIR(x, w)
    out.sum().backward()
    torch.testing.assert_close(w.grad, first)


def test_mutating_a_saved_input_before_backward_raises() -> None:
    x, w = leaf(2, 3), leaf(4, 3)
    h = x * 1
    out = LINEAR_PAIR(h, w)
    with torch.no_grad():
        h.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def make_list_op() -> cg.CustomOp[..., Any]:
    @cg.op(unique("cat_scale"), weights=("scale",))
    def cat_scale(
        xs: list[torch.Tensor], scale: torch.Tensor, n: int = 2
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return torch.cat(xs) * scale * n, [x * 2 for x in xs]

    @cat_scale.register_fake
    def _(xs, scale, n=2):
        return torch.cat(xs) * scale, [torch.empty_like(x) for x in xs]

    @cat_scale.register_save_for_backward
    def _(inputs, output):
        return {"xs": inputs.xs, "scale": inputs.scale, "n": inputs.n}

    @cat_scale.register_backward_input
    def _(ctx, saved, g_cat, g_list):
        parts = (g_cat * saved["scale"] * saved["n"]).split([x.shape[0] for x in saved["xs"]])
        return {"xs": [p + 2 * gl for p, gl in zip(parts, g_list, strict=True)]}

    @cat_scale.register_backward_weight
    def _(ctx, saved, g_cat, g_list):
        return {"scale": (g_cat * torch.cat(saved["xs"]) * saved["n"]).sum(0, keepdim=True)}

    return cat_scale


CAT_SCALE = make_list_op()


def _flat(out: tuple[torch.Tensor, list[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    return (out[0], *out[1])


@OPCHECK_WARNING
def test_list_args_list_outputs_and_non_tensor_args() -> None:
    xs = [leaf(2, 3), leaf(4, 3)]
    s = leaf(1, 3)
    cat, doubled = CAT_SCALE(xs, s, n=3)
    assert isinstance(doubled, list) and len(doubled) == 2
    ref_cat = torch.cat(xs) * s * 3
    torch.testing.assert_close(cat, ref_cat)
    g = torch.randn_like(cat)
    got = torch.autograd.grad([cat, *doubled], [*xs, s], [g, *map(torch.ones_like, doubled)])
    want = torch.autograd.grad(
        [ref_cat, *(x * 2 for x in xs)], [*xs, s], [g, *map(torch.ones_like, doubled)]
    )
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e)
    assert torch.autograd.gradcheck(lambda a, b, s: _flat(CAT_SCALE([a, b], s)), (*xs, s))
    assert torch.autograd.gradgradcheck(lambda a, b, s: _flat(CAT_SCALE([a, b], s)), (*xs, s))
    torch.library.opcheck(CAT_SCALE.opoverload, ([x.detach() for x in xs], s.detach(), 3))


def test_list_items_without_grad_get_none() -> None:
    xs = [leaf(2, 3), torch.randn(4, 3, dtype=torch.float64)]
    s = torch.randn(1, 3, dtype=torch.float64)
    cat, _ = CAT_SCALE(xs, s)
    (g0,) = torch.autograd.grad(cat.sum(), [xs[0]])
    torch.testing.assert_close(g0, (s * 2).expand(2, 3))


def test_output_differentiability_and_multiple_outputs() -> None:
    @cg.op(unique("maxidx"), output_differentiability=[True, False])
    def max_and_index(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        v, i = x.max(dim=-1)
        return v, i.to(x.dtype)

    max_and_index.register_fake(lambda x: (x.new_empty(x.shape[:-1]), x.new_empty(x.shape[:-1])))
    max_and_index.register_save_for_backward(lambda inputs, out: (inputs.x.shape, out[1]))

    @max_and_index.register_backward
    def _(ctx, saved, g_v, g_i):
        shape, idx = saved
        gx = torch.zeros(shape, dtype=g_v.dtype).scatter(-1, idx.long()[..., None], g_v[..., None])
        return {"x": gx}

    x = leaf(3, 5)
    v, i = max_and_index(x)
    assert v.requires_grad and not i.requires_grad
    (gx,) = torch.autograd.grad(v.sum(), x)
    torch.testing.assert_close(gx, torch.autograd.grad(x.max(-1).values.sum(), x)[0])


@OPCHECK_WARNING
def test_mutates_args_bumps_version_and_refuses_grad() -> None:
    @cg.op(unique("fill_"), mutates_args=("buf",))
    def fill_(buf: torch.Tensor, value: float) -> None:
        buf.fill_(value)

    fill_.register_fake(lambda buf, value: None)
    buf = torch.zeros(3)
    v0 = buf._version
    fill_(buf, 2.0)
    assert buf.tolist() == [2.0, 2.0, 2.0]
    assert buf._version > v0
    torch.library.opcheck(fill_.opoverload, (torch.zeros(2), 1.0))


def test_ctx_phase_and_needs_input_grad_follow_the_running_pass() -> None:
    seen: list[tuple[str, bool, bool, bool]] = []
    op = linear_op(unique("linear"), bias=True, backward="single")
    inner = op.rules.backward
    assert inner is not None

    def spy(ctx, saved, grad):
        seen.append(
            (
                ctx.phase,
                ctx.needs_input_grad("x"),
                ctx.needs_input_grad("weight"),
                ctx.needs_input_grad("bias"),
            )
        )
        return inner(ctx, saved, grad)

    op.register_backward(spy, split="phase")
    x, w, b = leaf(2, 3), leaf(4, 3), leaf(4)
    h = x * 1
    out = op(h, w, b)
    torch.autograd.grad(out.sum(), [h], retain_graph=True)
    torch.autograd.grad(out.sum(), [w, b], retain_graph=True)
    torch.autograd.grad(out.sum(), [w], retain_graph=True)
    torch.autograd.grad(out.sum(), [h, w], retain_graph=True)
    out.sum().backward()
    assert seen == [
        ("input", True, False, False),
        ("weight", False, True, True),
        ("weight", False, True, False),
        ("full", True, True, False),  # some of each kind: "full", with the flags exact
        ("full", True, True, True),
    ]


def test_pair_runs_only_the_needed_half() -> None:
    calls: list[str] = []
    op = linear_op(unique("linear"), bias=True)
    bin_, bw = op.rules.backward_input, op.rules.backward_weight
    assert bin_ is not None and bw is not None
    op.register_backward_input(lambda ctx, s, g: (calls.append("I"), bin_(ctx, s, g))[1])
    op.register_backward_weight(lambda ctx, s, g: (calls.append("W"), bw(ctx, s, g))[1])
    x, w = leaf(2, 3), leaf(4, 3)
    h = x * 1
    out = op(h, w)
    torch.autograd.grad(out.sum(), [h], retain_graph=True)
    assert calls == ["I"]
    torch.autograd.grad(out.sum(), [w], retain_graph=True)
    assert calls == ["I", "W"]
    out.sum().backward()
    assert calls == ["I", "W", "I", "W"]
    out2 = op(x.detach(), w)  # x does not require grad: only W runs
    out2.sum().backward()
    assert calls[-1] == "W" and calls.count("I") == 2


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("op", [LINEAR_PAIR, CAT_SCALE], ids=["linear", "list"])
def test_torch_compile_fullgraph_matches_eager(backend, op) -> None:
    torch._dynamo.reset()
    if op is LINEAR_PAIR:
        args = (leaf(3, 2), leaf(4, 2), leaf(4))

        def f(x, w, b):
            return torch.tanh(op(x, w, b)).sum()

        params = args
    else:
        xs, s = [leaf(2, 3), leaf(4, 3)], leaf(1, 3)
        args = (xs, s)  # type: ignore[assignment]

        def f(xs, s):
            cat, doubled = op(xs, s)
            return cat.sin().sum() + sum(d.sum() for d in doubled)

        params = (*xs, s)
    eager = torch.autograd.grad(f(*args), params)
    compiled = torch.compile(f, fullgraph=True, backend=backend)
    got = torch.autograd.grad(compiled(*args), params)
    for a, e in zip(got, eager, strict=True):
        torch.testing.assert_close(a, e)


def test_threads_get_correct_gradients_on_their_own_graphs() -> None:
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def work(seed: int) -> None:
        try:
            gen = torch.Generator().manual_seed(seed)
            x = torch.randn(16, 8, generator=gen, dtype=torch.float64, requires_grad=True)
            w = torch.randn(4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
            barrier.wait()
            for _ in range(20):
                gx, gw = torch.autograd.grad(LINEAR_PAIR(x, w).pow(2).sum(), (x, w))
                ex, ew = torch.autograd.grad(F.linear(x, w).pow(2).sum(), (x, w))
                torch.testing.assert_close(gx, ex)
                torch.testing.assert_close(gw, ew)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)


def test_nothing_saved_stays_alive_after_backward() -> None:
    gc.collect()
    gc.disable()
    try:
        x = leaf(64, 32)
        w = leaf(16, 32)
        h = x * 2
        h3 = h * 3
        cat = CAT_SCALE([h, h3], torch.ones(1, 32, dtype=torch.float64))[0]
        out = LINEAR_PAIR(cat, w)
        # Every tensor a customgrad node saved (h and h3 by CAT_SCALE, cat by LINEAR_PAIR), and
        # both customgrad nodes.
        refs = [weakref.ref(t) for t in (h, h3, cat, cat.grad_fn, out.grad_fn)]
        del h, h3, cat
        out.sum().backward()
        del out
        assert all(r() is None for r in refs), "saved activations or nodes outlived backward"
    finally:
        gc.enable()


def test_definitions_are_real_dispatcher_ops_under_fake_tensor_mode() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, w = torch.empty(5, 3), torch.empty(4, 3)
        out = LINEAR_PAIR(x, w)
    assert out.shape == (5, 4)


def test_modes_and_profilers_see_the_op_despite_the_direct_kernel_path() -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[str] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    x, w = leaf(2, 3), torch.nn.Parameter(torch.randn(4, 3, dtype=torch.float64))
    with Record():
        LINEAR_PAIR(x.detach(), w.detach())  # no grad needed
        out = LINEAR_PAIR(x, w)  # under autograd
    assert seen.count("test_op.linear_pair.default") == 2
    out.sum().backward()
    torch.testing.assert_close(w.grad, torch.ones(2, 4, dtype=x.dtype).mT @ x.detach())
    with torch.profiler.profile() as prof:
        LINEAR_PAIR(x, w).sum().backward()
    assert any("test_op::linear_pair" in e.name for e in prof.events())


# -- a kernel that writes into an argument it did not declare in mutates_args ------------------


def _scaling_op(name: str, *, mutates: tuple[str, ...] = ()) -> cg.CustomOp[..., Any]:
    """``x * w`` whose kernel doubles ``xs[1]`` in place."""

    @cg.op(name, weights=("w",), mutates_args=mutates)
    def scale(x: torch.Tensor, w: torch.Tensor, xs: list[torch.Tensor]) -> torch.Tensor:
        xs[1].mul_(2)
        return x * w

    scale.register_fake(lambda x, w, xs: torch.empty_like(x))
    scale.register_save_for_backward(lambda inputs, output: (inputs.x, inputs.w))

    @scale.register_backward
    def _(ctx: Any, saved: Any, grad: torch.Tensor) -> dict[str, torch.Tensor]:
        x, w = saved
        return {"x": grad * w, "w": grad * x}

    return scale


def _mutating_linear(name: str) -> cg.CustomOp[..., Any]:
    """A linear whose kernel scales its input in place: the mistake of issue 34."""

    @cg.op(name, weights=("w",))
    def lin(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return x @ w.mT

    lin.register_fake(lambda x, w: x.new_empty(*x.shape[:-1], w.shape[0]))
    lin.register_save_for_backward(lambda inputs, output: (inputs.x, inputs.w))

    @lin.register_backward
    def _(ctx: Any, saved: Any, grad: torch.Tensor) -> dict[str, torch.Tensor]:
        x, w = saved
        return {"x": grad @ w, "w": grad.mT @ x}

    return lin


def _mutation_message(qualname: str, arg: str, name: str, before: int, after: int) -> str:
    return cg._kernels.MSG_KERNEL_MUTATED.split("(kernel defined at")[0].format(
        op=qualname, arg=arg, name=name, before=before, after=after, qualname=qualname
    )


@pytest.mark.parametrize("call", ["direct", "torch.ops", "no_grad", "torch.ops no_grad"])
def test_kernel_writing_an_undeclared_argument_raises_naming_op_argument_and_fix(
    call: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    qualname = unique("mutating_linear")
    lin = _mutating_linear(qualname)
    x = torch.randn(3, 4, dtype=torch.float64)
    w = leaf(5, 4)
    ns, opname = qualname.split("::")
    fn = getattr(getattr(torch.ops, ns), opname) if call.startswith("torch.ops") else lin
    msg = _mutation_message(qualname, "x", "x", 0, 1)
    with pytest.raises(cg.MutationError, match=re.escape(msg)):
        if call.endswith("no_grad"):
            with torch.no_grad():
                fn(x, w)
        else:
            fn(x.requires_grad_(), w)
    assert "x = x.clone()" in msg and f"@cg.op({qualname!r}, mutates_args=('x',))" in msg


def test_kernel_writing_a_list_item_names_the_item_and_a_declared_write_is_allowed() -> None:
    qualname = unique("scale_list")
    scale = _scaling_op(qualname)
    x, w = leaf(3), leaf(3)
    xs = [torch.ones(3), torch.ones(3)]
    msg = _mutation_message(qualname, "xs[1]", "xs", 0, 1)
    with pytest.raises(cg.MutationError, match=re.escape(msg)):
        scale(x, w, xs)
    # Declared in mutates_args, the same write runs, and the gradients are right.
    declared = _scaling_op(unique("scale_list_declared"), mutates=("xs",))
    xs = [torch.ones(3), torch.ones(3)]
    declared(x, w, xs).sum().backward()
    assert torch.equal(xs[1], torch.full((3,), 2.0))
    assert torch.equal(x.grad, w.detach()) and torch.equal(w.grad, x.detach())


def test_the_fix_the_mutation_error_gives_makes_the_gradients_right() -> None:
    """Cloning first (the fix the message names) gives torch's gradients."""

    @cg.op(unique("cloning_linear"), weights=("w",))
    def lin(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        x.mul_(2)
        return x @ w.mT

    lin.register_fake(lambda x, w: x.new_empty(*x.shape[:-1], w.shape[0]))
    lin.register_save_for_backward(lambda inputs, output: (inputs.x, inputs.w))

    @lin.register_backward
    def _(ctx: Any, saved: Any, grad: torch.Tensor) -> dict[str, torch.Tensor]:
        x, w = saved
        return {"x": 2 * grad @ w, "w": grad.mT @ (2 * x)}

    x, w = leaf(3, 4), leaf(5, 4)
    x0 = x.detach().clone()
    lin(x, w).sum().backward()
    xr, wr = x0.clone().requires_grad_(), w.detach().clone().requires_grad_()
    ((2 * xr) @ wr.mT).sum().backward()
    assert torch.equal(x.detach(), x0)
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(w.grad, wr.grad)


def test_inference_tensors_keep_no_version_and_the_write_check_lets_them_through(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An inference tensor has no version counter: the check of the kernel's writes skips it,
    and what happens is what torch does (under inference_mode the call runs; recorded by
    autograd, saving it is torch's own error)."""
    with torch.inference_mode():
        x, w = torch.randn(3, 4), torch.randn(4)
        torch.testing.assert_close(LINEAR_SINGLE(x, w.expand(5, 4)), x @ w.expand(5, 4).mT)
    with pytest.raises(RuntimeError, match=re.escape("Inference tensors cannot be saved")):
        LINEAR_SINGLE(x, leaf(5, 4, dtype=torch.float32))
