"""customgrad.compile probed as a hostile user would: each case against eager, float64.

Per case: gradients under torch's and customgrad's ``stage_backward_input`` then
``stage_backward_weight`` equal the eager module's full backward, and FLOPs(I) + FLOPs(W)
equal the eager full backward's (counted around backwards only: dynamo does not compile a frame
that runs under a dispatch mode). ``aot_eager`` throughout (the cut is the backend's own).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.distributed.pipelining._backward as torch_split
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

import customgrad as cg
import customgrad.pipelining as cg_split
from customgrad._compile import regions
from customgrad.graph import explain_split
from tests._skips import FREEZE_RECOMPILES, TORCH_SPLIT

SPLITS = {
    "torch": (torch_split.stage_backward_input, torch_split.stage_backward_weight),
    "customgrad": (cg_split.stage_backward_input, cg_split.stage_backward_weight),
}
HOW = pytest.mark.parametrize("how", [pytest.param("torch", marks=TORCH_SPLIT), "customgrad"])
# dynamo itself reads .grad of a non-leaf tensor argument (torch.compile alike)
NON_LEAF = pytest.mark.filterwarnings(
    "ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning"
)


def flops(fn: Callable[[], Any]) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def x_(seed: int = 1, shape: tuple[int, ...] = (4, 8)) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=torch.float64, generator=g).requires_grad_()


def close(got: Sequence[Tensor | None], want: Sequence[Tensor | None]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def compiled_pair(module: nn.Module, *example: Any) -> tuple[nn.Module, nn.Module]:
    """(eager float64 reference, compiled copy whose backward already compiled)."""
    ref = module.double()
    m = cg.compile(copy.deepcopy(ref), backend="aot_eager")
    out = m(*example)
    outs = out.values() if isinstance(out, dict) else out if isinstance(out, tuple) else [out]
    sum(o.sum() for o in outs if o.requires_grad).backward()  # type: ignore[union-attr]
    m.zero_grad(set_to_none=True)
    return ref, m


def differentiable(out: Any) -> list[Tensor]:
    outs = out.values() if isinstance(out, dict) else out if isinstance(out, tuple) else [out]
    return [o for o in outs if isinstance(o, Tensor) and o.requires_grad]


def check_split(
    ref: nn.Module,
    m: nn.Module,
    make_inputs: Callable[[], tuple[Any, ...]],
    how: str,
    *,
    seed: int = 3,
    stage_inputs: Callable[[tuple[Any, ...]], list[Tensor]] | None = None,
) -> tuple[int, int, int]:
    """Split backward of ``m`` against the eager full backward of ``ref``; (I, W, full) FLOPs."""
    pick = stage_inputs or (
        lambda args: [a for a in args if isinstance(a, Tensor) and a.requires_grad]
    )
    ref.zero_grad(set_to_none=True)
    m.zero_grad(set_to_none=True)
    ref_args = make_inputs()
    torch.manual_seed(seed)
    ref_out = differentiable(ref(*ref_args))
    dys = [torch.randn_like(o) for o in ref_out]
    full = flops(lambda: torch.autograd.backward(ref_out, dys))
    args = make_inputs()
    torch.manual_seed(seed)
    out = differentiable(m(*args))
    backward_input, backward_weight = SPLITS[how]
    params = list(m.parameters())
    result: dict[str, Any] = {}
    f_i = flops(lambda: result.setdefault("i", backward_input(out, dys, pick(args), iter(params))))
    f_w = flops(lambda: backward_weight(iter(params), result["i"][1]))
    close([p.grad for p in m.parameters()], [p.grad for p in ref.parameters()])
    close(list(result["i"][0]), [a.grad for a in pick(ref_args)])
    return f_i, f_w, full


# --------------------------------------------------------------------------------------------
# A weight that reaches the region as a plain tensor (cast, transposed) goes to W, as in eager


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: Tensor, w: Tensor) -> Tensor:
        return torch.tanh(self.fc(x) @ w)


class CastOutside(nn.Module):
    """The stage casts its weight before the compiled head (mixed precision, tied heads)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = Head()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(x, self.w.t() * 0.5)


@pytest.fixture(
    scope="module",
    params=["aot_eager", "inductor", "aot_eager, dynamic", "inductor, dynamic"],
)
def cast_outside(request: pytest.FixtureRequest) -> tuple[nn.Module, nn.Module]:
    """With dynamic shapes AOTAutograd compiles the backward ahead of the first one."""
    torch.manual_seed(0)
    ref = CastOutside().double()
    m = copy.deepcopy(ref)
    backend, _, dynamic = request.param.partition(", ")
    cg.compile(m.head, backend=backend, dynamic=bool(dynamic))
    m(x_()).sum().backward()
    return ref, m


@NON_LEAF
@HOW
def test_weight_made_from_a_parameter_outside_the_region_is_computed_in_w(
    cast_outside: tuple[nn.Module, nn.Module], how: str
) -> None:
    ref, m = cast_outside
    f_i, f_w, full = check_split(ref, m, lambda: (x_(),), how)
    assert f_i + f_w == full  # before: W ran the whole graph again (1.75x)
    eager_i, eager_w, _ = check_split(ref, copy.deepcopy(ref), lambda: (x_(),), how)
    assert (f_i, f_w) == (eager_i, eager_w)


class Activation(nn.Module):
    """The compiled head of ``CastOutside`` where its second input is an activation."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.head = head

    def forward(self, x: Tensor, v: Tensor) -> Tensor:
        return self.head(x, v.t() * 0.5)  # type: ignore[no-any-return]


@NON_LEAF
@HOW
def test_the_same_graph_with_an_activation_where_a_weight_was_splits_too(
    cast_outside: tuple[nn.Module, nn.Module], how: str
) -> None:
    ref, m = cast_outside
    heads = [r for r in regions() if r.name.startswith("Head")]

    def make() -> tuple[Tensor, Tensor]:
        return x_(), x_(seed=2, shape=(8, 8))

    f_i, f_w, full = check_split(Activation(ref.head), Activation(m.head), make, how)
    assert [r for r in regions() if r.name.startswith("Head")] == heads  # no recompile
    assert f_i + f_w == full  # before: the full graph in I and again in W


# --------------------------------------------------------------------------------------------
# Buffers, RNG, outputs, frozen parameters, token ids, tied weights, views


class BatchNormBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.bn(self.fc(x)))


@HOW
def test_batchnorm_in_train_mode_splits_and_updates_running_stats_as_eager(how: str) -> None:
    torch.manual_seed(0)
    ref, m = compiled_pair(BatchNormBlock(), x_(seed=9))
    ref(x_(seed=9))  # the same forwards as the compiled copy saw
    f_i, f_w, full = check_split(ref, m, lambda: (x_(),), how)
    assert f_i + f_w == full
    close(list(m.buffers())[:2], list(ref.buffers())[:2])


class DropoutBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(nn.functional.dropout(self.fc1(x), 0.5, self.training))


@HOW
def test_dropout_mask_is_the_same_in_i_and_w(how: str) -> None:
    torch.manual_seed(0)
    ref, m = compiled_pair(DropoutBlock(), x_())
    f_i, f_w, full = check_split(ref, m, lambda: (x_(),), how)  # same seed: same mask
    assert f_i + f_w == full


class Outputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        h = torch.tanh(self.fc1(x))
        return h, self.fc2(h), x > 0  # the last needs no gradient


class DictOutputs(Outputs):
    def forward(self, x: Tensor) -> dict[str, Tensor]:  # type: ignore[override]
        h, y, _ = super().forward(x)
        return {"h": h, "y": y}


@HOW
@pytest.mark.parametrize("cls", [Outputs, DictOutputs])
def test_several_outputs_tuple_or_dict_one_without_grad(cls: type[nn.Module], how: str) -> None:
    torch.manual_seed(0)
    ref, m = compiled_pair(cls(), x_())
    f_i, f_w, full = check_split(ref, m, lambda: (x_(),), how)
    assert f_i + f_w == full


class Lora(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8).requires_grad_(False)
        self.a = nn.Parameter(torch.randn(8, 2))
        self.b = nn.Parameter(torch.randn(2, 8))

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.fc(x) + x @ self.a @ self.b)


@HOW
def test_frozen_parameters(how: str) -> None:
    torch.manual_seed(0)
    ref, m = compiled_pair(Lora(), x_())
    f_i, f_w, full = check_split(ref, m, lambda: (x_(),), how)
    assert f_i + f_w == full
    assert all(p.grad is None for p in m.fc.parameters())


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.fc = nn.Linear(8, 8)

    def forward(self, ids: Tensor) -> Tensor:
        return torch.tanh(self.fc(self.emb(ids)))


def test_first_stage_token_ids_all_in_w() -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, 10, (4, 3))
    ref, m = compiled_pair(Embed(), ids)
    f_i, f_w, full = check_split(ref, m, lambda: (ids,), "customgrad")
    assert (f_i, f_w) == (0, full)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(torch.tanh(self.fc(x)))


class ViewInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.fc(x.t()))


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 8)

    def inner(self, h: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.fc1(h)))

    def forward(self, x: Tensor) -> Tensor:
        return checkpoint(self.inner, x, use_reentrant=False)  # type: ignore[no-any-return]


class InPlaceInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        h.relu_()
        return h * 2


class TensorKwargAndUnusedInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 8)

    def forward(self, x: Tensor, unused: Tensor, *, scale: Tensor) -> Tensor:
        return torch.tanh(self.fc(x)) * scale


class Kwargs(nn.Module):
    """Calls its compiled child with a tensor keyword argument that requires grad."""

    def __init__(self) -> None:
        super().__init__()
        self.child = TensorKwargAndUnusedInput()

    def forward(self, x: Tensor, unused: Tensor, scale: Tensor) -> Tensor:
        return self.child(x, unused, scale=scale)  # type: ignore[no-any-return]


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple[Tensor, ...]]]] = {
    "tied weight": (Tied, lambda: (x_(),)),
    "view input": (ViewInput, lambda: (x_(shape=(8, 4)),)),
    "checkpoint inside": (Checkpointed, lambda: (x_(),)),
    "in-place inside": (InPlaceInside, lambda: (x_(),)),
    "tensor kwarg, unused input": (Kwargs, lambda: (x_(), x_(seed=4), x_(seed=5))),
}


@HOW
@pytest.mark.parametrize("case", list(CASES))
def test_tied_weight_view_input_checkpoint_in_place_kwargs(case: str, how: str) -> None:
    make_module, make_inputs = CASES[case]
    torch.manual_seed(0)
    module = make_module()
    if isinstance(module, Kwargs):
        ref = module.double()
        m = copy.deepcopy(ref)
        cg.compile(m.child, backend="aot_eager")
        m(*make_inputs()).sum().backward()
    else:
        ref, m = compiled_pair(module, *make_inputs())
    f_i, f_w, full = check_split(ref, m, make_inputs, how)
    assert f_i + f_w == full


# --------------------------------------------------------------------------------------------
# Passes, modes and hooks around a region


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


@pytest.fixture(scope="module")
def block() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    return compiled_pair(Block(), x_())


def test_post_accumulate_grad_hooks_fire_once_per_weight(
    block: tuple[nn.Module, nn.Module],
) -> None:
    _, m = block
    fired: dict[str, int] = {}
    handles = [
        p.register_post_accumulate_grad_hook(
            lambda p, n=n: fired.__setitem__(n, fired.get(n, 0) + 1)
        )
        for n, p in m.named_parameters()
    ]
    try:
        x = x_()
        out = m(x)
        params = list(m.parameters())
        _, groups = cg_split.stage_backward_input([out], [torch.ones_like(out)], [x], iter(params))
        assert fired == {}  # nothing accumulated in I
        cg_split.stage_backward_weight(iter(params), groups)
    finally:
        for h in handles:
            h.remove()
        m.zero_grad(set_to_none=True)
    assert fired == {n: 1 for n, _ in m.named_parameters()}


@HOW
def test_microbatches_inputs_first_then_weights_in_any_order_accumulate_as_eager(
    block: tuple[nn.Module, nn.Module], how: str
) -> None:
    ref, m = block
    ref.zero_grad(set_to_none=True)
    m.zero_grad(set_to_none=True)
    backward_input, backward_weight = SPLITS[how]
    params = list(m.parameters())
    (region,) = [r for r in regions() if r.name.startswith("Block")][-1:]
    done = []
    for k in range(3):
        x = x_(seed=k)
        out = m(x)
        dy = torch.full_like(out, k + 1.0)
        done.append(backward_input([out], [dy], [x], iter(params)))
        ref(x_(seed=k)).backward(dy)
    assert region.pending() == 3  # one hand-off per microbatch
    for k in (2, 0, 1):
        backward_weight(iter(params), done[k][1])
    assert region.pending() == 0
    close([p.grad for p in m.parameters()], [p.grad for p in ref.parameters()])


@HOW
def test_no_grad_forward_and_eval_toggle_then_split(
    block: tuple[nn.Module, nn.Module], how: str
) -> None:
    ref, m = block
    with torch.no_grad():
        torch.testing.assert_close(m(x_()), ref(x_()))
    m.eval()
    ref.eval()
    try:
        f_i, f_w, full = check_split(ref, m, lambda: (x_(),), how)
    finally:
        m.train()
        ref.train()
    assert f_i + f_w == full
    f_i, f_w, full = check_split(ref, m, lambda: (x_(),), how)
    assert f_i + f_w == full


def autocast_split(module: nn.Module, how: str) -> tuple[int, int, list[Tensor | None], Tensor]:
    backward_input, backward_weight = SPLITS[how]
    x = x_().float().detach().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = module(x)
    params = list(module.parameters())
    result: dict[str, Any] = {}
    f_i = flops(
        lambda: result.setdefault(
            "i", backward_input([out], [torch.ones_like(out)], [x], iter(params))
        )
    )
    f_w = flops(lambda: backward_weight(iter(params), result["i"][1]))
    return f_i, f_w, [p.grad for p in params], result["i"][0][0]


@HOW
def test_autocast_bf16_forward_splits_with_flops_of_the_full_backward(
    block: tuple[nn.Module, nn.Module], how: str
) -> None:
    ref, m = block
    counted = []
    for module in (ref, m):
        module.zero_grad(set_to_none=True)
        module.float()
        try:
            counted.append(autocast_split(module, how))
        finally:
            module.double()
    (ri, rw, rgrads, rdx), (ci, cw, cgrads, cdx) = counted
    assert (ci, cw) == (ri, rw)
    for a, b in zip([*cgrads, cdx], [*rgrads, rdx]):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    m.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)


def test_no_split_around_the_input_pass_computes_everything_there(
    block: tuple[nn.Module, nn.Module],
) -> None:
    ref, m = block
    ref.zero_grad(set_to_none=True)
    m.zero_grad(set_to_none=True)
    x = x_()
    out = m(x)
    params = list(m.parameters())
    with cg.no_split():
        _, groups = cg_split.stage_backward_input([out], [torch.ones_like(out)], [x], iter(params))
    cg_split.stage_backward_weight(iter(params), groups)
    ref(x_()).sum().backward()
    close([p.grad for p in m.parameters()], [p.grad for p in ref.parameters()])
    m.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)


def test_double_backward_is_torch_compiles_own_limit(block: tuple[nn.Module, nn.Module]) -> None:
    _, m = block
    x = x_()
    (dx,) = torch.autograd.grad(m(x).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="does not currently support double backward"):
        dx.pow(2).sum().backward()
    m.zero_grad(set_to_none=True)


def test_explain_split_on_frozen_weights_and_token_ids() -> None:
    torch.manual_seed(0)
    _, lora = compiled_pair(Lora(), x_())
    x = x_()
    report = str(explain_split(lora(x), [x], lora.named_parameters()))
    assert "Nothing computes twice." in report
    assert "W runs a graph of" in report and "for a, b;" in report
    _, embed = compiled_pair(Embed(), torch.randint(0, 10, (4, 3)))
    report = str(explain_split(embed(torch.randint(0, 10, (4, 3))), [], embed.named_parameters()))
    assert "Nothing computes twice." in report
    assert "I runs a graph of 0 ops for no input" in report


# --------------------------------------------------------------------------------------------
# Several regions: never more work than the eager module under the same split


class TanhLinear(nn.Module):
    def __init__(self, fc: nn.Linear) -> None:
        super().__init__()
        self.fc = fc

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.fc(x))


class TiedAcrossRegions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        fc = nn.Linear(8, 8)
        self.a = TanhLinear(fc)
        self.b = TanhLinear(fc)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.a(x))  # type: ignore[no-any-return]


class CalledTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()

    def forward(self, x: Tensor) -> Tensor:
        return self.block(self.block(x))  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("cls", "how"),
    [
        pytest.param(TiedAcrossRegions, "torch", marks=TORCH_SPLIT),
        (TiedAcrossRegions, "customgrad"),
        # torch's split raises on a module called twice, eager alike (its W frees the graph)
        (CalledTwice, "customgrad"),
    ],
)
def test_weight_shared_by_two_regions_costs_no_more_than_the_eager_split(
    cls: type[nn.Module], how: str
) -> None:
    torch.manual_seed(0)
    ref = cls().double()
    m = copy.deepcopy(ref)
    for child in m.children():
        cg.compile(child, backend="aot_eager")
    m(x_()).sum().backward()
    compiled = check_split(ref, m, lambda: (x_(),), how)
    eager = check_split(ref, copy.deepcopy(ref), lambda: (x_(),), how)
    assert compiled[0] == eager[0]  # I: input gradients only
    assert compiled[0] + compiled[1] <= eager[0] + eager[1]


@HOW
def test_inductor_dropout_split_equals_its_full_backward_with_the_same_seed(how: str) -> None:
    """Inductor draws its own masks (not eager's): I and W read the one the forward saved."""
    torch.manual_seed(0)
    m = cg.compile(DropoutBlock().double(), backend="inductor")
    m(x_()).sum().backward()

    def step(split: str | None) -> tuple[list[Tensor], Tensor]:
        m.zero_grad(set_to_none=True)
        x = x_()
        torch.manual_seed(7)
        out = m(x)
        dy = torch.ones_like(out)
        if split is None:
            out.backward(dy)
            dx = x.grad
        else:
            backward_input, backward_weight = SPLITS[split]
            params = list(m.parameters())
            (dx,), groups = backward_input([out], [dy], [x], iter(params))
            backward_weight(iter(params), groups)
        assert dx is not None
        return [p.grad for p in m.parameters() if p.grad is not None] + [dx], out.detach()

    full, out = step(None)
    got, out_split = step(how)
    torch.testing.assert_close(out_split, out, rtol=0, atol=0)
    close(got, full)


def test_state_dict_load_and_deepcopy_of_a_compiled_module(
    block: tuple[nn.Module, nn.Module],
) -> None:
    ref, m = block
    assert list(m.state_dict()) == list(ref.state_dict())  # no "_orig_mod." prefix
    torch.manual_seed(11)
    other = Block().double()
    saved = copy.deepcopy(m.state_dict())
    try:
        m.load_state_dict(other.state_dict())
        torch.testing.assert_close(m(x_()), other(x_()))  # the compiled call reads the new values
        f_i, f_w, full = check_split(other, m, lambda: (x_(),), "customgrad")
        assert f_i + f_w == full
    finally:
        m.load_state_dict(saved)
        m.zero_grad(set_to_none=True)
    twin = copy.deepcopy(m)
    assert twin._compiled_call_impl is None  # as nn.Module.compile: compile the copy (documented)
    torch.testing.assert_close(twin(x_()), m(x_()))


class TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = Block()
        self.b = Block()

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.a(x))  # type: ignore[no-any-return]


@HOW
def test_stage_compiled_over_blocks_compiled_on_their_own(how: str) -> None:
    torch.manual_seed(0)
    ref = TwoBlocks().double()
    m = copy.deepcopy(ref)
    for module in (m.a, m.b, m):
        cg.compile(module, backend="aot_eager")
    m(x_()).sum().backward()
    f_i, f_w, full = check_split(ref, m, lambda: (x_(),), how)
    assert f_i + f_w == full


@FREEZE_RECOMPILES
@HOW
def test_freezing_a_weight_between_steps_recompiles_and_splits(
    block: tuple[nn.Module, nn.Module], how: str
) -> None:
    ref, m = block
    try:
        for module in (ref, m):
            module.fc1.weight.requires_grad_(False)  # type: ignore[union-attr, operator]
        f_i, f_w, full = check_split(ref, m, lambda: (x_(),), how)
        assert f_i + f_w == full
        assert m.fc1.weight.grad is None  # type: ignore[union-attr]
    finally:
        for module in (ref, m):
            module.fc1.weight.requires_grad_(True)  # type: ignore[union-attr, operator]
    f_i, f_w, full = check_split(ref, m, lambda: (x_(),), how)
    assert f_i + f_w == full
