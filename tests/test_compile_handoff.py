"""A compiled region's I→W hand-off belongs to the pass, whatever AOTAutograd makes of the
output gradients, and whatever each argument of a shared compiled graph holds.

AOTAutograd remakes output gradients before its compiled backward runs (a contiguous copy of an
expanded or transposed gradient, zeros for a differentiable output that got none), in each pass
anew. Each case: gradients under torch's and customgrad's ``stage_backward_input`` then
``stage_backward_weight`` equal the eager module's full backward, and FLOPs(I) + FLOPs(W) equal
the eager full backward's (before: W ran the whole backward again). ``aot_eager``, float64.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.distributed.pipelining._backward as torch_split
from torch import Tensor, nn

import customgrad as cg
from customgrad._compile import regions
from customgrad._compiled_backward import region_node
from tests._skips import TORCH_SPLIT
from tests.test_compile_probe import SPLITS, flops, x_

HOW = pytest.mark.parametrize("how", [pytest.param("torch", marks=TORCH_SPLIT), "customgrad"])


def close(got: Sequence[Tensor | None], want: Sequence[Tensor | None]) -> None:
    """Equal gradients; None (eager: a weight only an unused output reaches) equals zeros
    (compiled: AOTAutograd's backward fills the unused output's gradient with zeros)."""
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a is not None or b is not None
        a = torch.zeros_like(b) if a is None else a  # type: ignore[arg-type]
        b = torch.zeros_like(a) if b is None else b
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


class Block(nn.Module):
    """Linear-ReLU-Linear with a residual: input and weight gradients share dpre."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class ThreeOut(nn.Module):
    """Three differentiable outputs (a tuple), for losses that use only some of them."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)
        self.fc3 = nn.Linear(16, 8)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        h = torch.relu(self.fc1(x))
        return self.fc2(h), self.fc3(h), h


class TransposedOut(nn.Module):
    """A transposed output: AOTAutograd copies a contiguous gradient into its strides."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.fc2(torch.relu(self.fc1(x))).t())


def compiled(module: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(eager float64 reference, compiled copy whose backward compiled in a full backward)."""
    torch.manual_seed(0)
    ref = module.double()
    m = cg.compile(copy.deepcopy(ref), backend="aot_eager")
    out = m(x_(seed=9))
    outs = out if isinstance(out, tuple) else (out,)
    sum(o.sum() for o in outs).backward()
    m.zero_grad(set_to_none=True)
    return ref, m


# A loss: the module's outputs -> (the tensors handed to stage_backward_input, their gradients)
Loss = Callable[[Any], tuple[list[Tensor], list[Tensor] | None]]


def _g(shape: tuple[int, ...], seed: int = 5) -> Tensor:
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


LAYOUTS: dict[str, tuple[Callable[[], nn.Module], Loss]] = {
    # y.sum(): the region's output gradient is SumBackward's stride-0 expand of a scalar
    "expanded (y.sum())": (Block, lambda y: ([y.sum()], None)),
    # a transposed gradient (a column-major dy, as from a matmul's backward)
    "transposed": (Block, lambda y: ([y], [_g((8, 4)).t()])),
    # a contiguous gradient for a transposed output
    "contiguous for a transposed output": (TransposedOut, lambda y: ([y], [_g((8, 4))])),
    # every other column of a wider tensor
    "non-contiguous": (Block, lambda y: ([y], [_g((4, 16))[:, ::2]])),
    # a differentiable output that receives no gradient: AOTAutograd gets zeros each pass
    "zeros for unused outputs": (ThreeOut, lambda ys: ([ys[0]], [_g((4, 8))])),
    # several outputs, only some of which get gradients (one of those expanded)
    "some outputs of several": (
        ThreeOut,
        lambda ys: ([ys[0], ys[2].sum()], [_g((4, 8)), torch.ones((), dtype=torch.float64)]),
    ),
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request: pytest.FixtureRequest) -> tuple[nn.Module, nn.Module, Loss]:
    make, loss = LAYOUTS[request.param]
    ref, m = compiled(make())
    return ref, m, loss


def split(
    m: nn.Module, loss: Loss, x: Tensor, how: str
) -> tuple[int, int, tuple[Tensor | None, ...]]:
    backward_input, backward_weight = SPLITS[how]
    params = list(m.parameters())
    outs, grads = loss(m(x))
    result: dict[str, Any] = {}
    f_i = flops(lambda: result.setdefault("i", backward_input(outs, grads, [x], iter(params))))
    f_w = flops(lambda: backward_weight(iter(params), result["i"][1]))
    return f_i, f_w, result["i"][0]


def eager(ref: nn.Module, loss: Loss, x: Tensor) -> tuple[int, Tensor | None, list[Tensor | None]]:
    ref.zero_grad(set_to_none=True)
    xr = x.detach().clone().requires_grad_()
    outs, grads = loss(ref(xr))
    full = flops(lambda: torch.autograd.backward(outs, grads))
    return full, xr.grad, [p.grad for p in ref.parameters()]


def compiled_full(m: nn.Module, loss: Loss, x: Tensor) -> int:
    """FLOPs of the compiled region's full backward (with zeros for an unused output, its
    graph computes that output's weight gradient too, which eager skips)."""
    outs, grads = loss(m(x))
    full = flops(lambda: torch.autograd.backward(outs, grads))
    m.zero_grad(set_to_none=True)
    return full


@HOW
def test_every_output_gradient_layout_splits_with_the_flops_of_the_full_backward(
    layout: tuple[nn.Module, nn.Module, Loss], how: str
) -> None:
    ref, m, loss = layout
    _, dx, dw = eager(ref, loss, x_())
    full = compiled_full(m, loss, x_())
    f_i, f_w, (got_dx,) = split(m, loss, x_(), how)
    close([got_dx], [dx])
    close([p.grad for p in m.parameters()], dw)
    assert f_i + f_w == full  # before: W ran the whole backward again (e.g. 2048 + 4096)
    assert all(r.pending() == 0 for r in regions())


@HOW
def test_two_microbatches_inputs_first_then_weights_in_reverse_order(
    layout: tuple[nn.Module, nn.Module, Loss], how: str
) -> None:
    """Each W reads its own microbatch's hand-off (the engine's gradients tell the passes
    apart, not the copies AOTAutograd makes)."""
    ref, m, loss = layout
    backward_input, backward_weight = SPLITS[how]
    full = sum(compiled_full(m, loss, x_(seed=s)) for s in (1, 2))
    ref.zero_grad(set_to_none=True)
    for s in (1, 2):
        xr = x_(seed=s)
        torch.autograd.backward(*loss(ref(xr)))
    m.zero_grad(set_to_none=True)
    params = list(m.parameters())
    groups: list[Any] = []
    total = 0

    def run_input(x: Tensor, outs: list[Tensor], grads: list[Tensor] | None) -> None:
        groups.append(backward_input(outs, grads, [x], iter(params))[1])

    def run_weight(group: Any) -> None:
        backward_weight(iter(params), group)

    for s in (1, 2):
        x = x_(seed=s)
        outs, grads = loss(m(x))  # the forward outside the counter (dynamo skips its frames)
        total += flops(lambda: run_input(x, outs, grads))  # noqa: B023
    for g in reversed(list(groups)):
        total += flops(lambda: run_weight(g))  # noqa: B023
    close([p.grad for p in m.parameters()], [p.grad for p in ref.parameters()])
    assert total == full


# --------------------------------------------------------------------------------------------
# Blocks of one class share one compiled graph, whose arguments hold activations in one block
# and tensors made from parameters in another


class Mix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: Tensor, v: Tensor) -> Tensor:
        return torch.tanh(self.fc(x) @ v)


class MixToo(nn.Module):
    """``Mix`` again, as another class: its own compiled graph for the other order."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: Tensor, v: Tensor) -> Tensor:
        return torch.tanh(self.fc(x) @ v)


class Shared(nn.Module):
    """Two blocks of one class: ``a`` is given ``latent * 1.0`` (a weight, made from a
    parameter), ``b`` an activation at the same argument.

    The backward compiles in the first backward that reaches the graph, cut by the history of
    the block it reaches first: the last block of the forward.
    """

    def __init__(self, cls: type[nn.Module], weight_block_last: bool) -> None:
        super().__init__()
        self.a = cls()
        self.b = cls()
        self.latent = nn.Parameter(torch.randn(8, 8) / 3)
        self.weight_block_last = weight_block_last

    def forward(self, x: Tensor) -> Tensor:
        x = torch.tanh(x)  # both blocks get non-leaf tensors: one graph for both
        if self.weight_block_last:
            h = self.b(x, x * 0.5)  # an activation
            return self.a(h, self.latent * 1.0)  # type: ignore[no-any-return]
        h = self.a(x, self.latent * 1.0)
        return self.b(h, h * 0.5)  # type: ignore[no-any-return]


# which block the backward reaches first (the last of the forward), whose history cuts the graph
ORDERS = {"cut for the weight block": (Mix, True), "cut for the activation block": (MixToo, False)}


@pytest.fixture(scope="module", params=list(ORDERS))
def shared(request: pytest.FixtureRequest) -> tuple[nn.Module, nn.Module]:
    cls, weight_block_last = ORDERS[request.param]
    torch.manual_seed(0)
    ref = Shared(cls, weight_block_last).double()
    m = copy.deepcopy(ref)
    cg.compile(m.a, backend="aot_eager")
    cg.compile(m.b, backend="aot_eager")
    m(x_(shape=(8, 8))).sum().backward()
    m.zero_grad(set_to_none=True)
    return ref, m


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
@HOW
def test_a_shared_graph_splits_whichever_block_its_backward_was_compiled_for(
    shared: tuple[nn.Module, nn.Module], how: str
) -> None:
    ref, m = shared
    loss: Loss = lambda y: ([y], [_g((8, 8))])  # noqa: E731
    full, dx, dw = eager(ref, loss, x_(shape=(8, 8)))
    m.zero_grad(set_to_none=True)
    before = len(regions())
    f_i, f_w, (got_dx,) = split(m, loss, x_(shape=(8, 8)), how)
    close([got_dx], [dx])
    close([p.grad for p in m.parameters()], dw)
    assert len(regions()) == before  # one compiled graph for both blocks, no recompile
    assert f_i + f_w == full  # before, cut for the activation block: 6144 + 5120 against 8192


# --------------------------------------------------------------------------------------------
# The round-3 rule still holds, and what cannot split says so


def test_an_expanded_gradient_of_another_loss_never_reads_the_handoff() -> None:
    """I with y.sum()'s gradient, then W of another loss (2 * y.sum()): W must not read I's
    hand-off (a pass of other output gradients), whatever AOTAutograd copies."""
    ref, m = compiled(Block())
    x = x_(seed=7)
    y = m(x)
    (dx,) = torch.autograd.grad(y.sum(), [x], retain_graph=True)
    dw = torch.autograd.grad((2 * y).sum(), list(m.parameters()))
    xr = x.detach().requires_grad_()
    yr = ref(xr)
    close([dx], list(torch.autograd.grad(yr.sum(), [xr], retain_graph=True)))
    close(list(dw), list(torch.autograd.grad((2 * yr).sum(), list(ref.parameters()))))
    assert all(r.pending() == 0 for r in regions())


class HookedBlock(nn.Module):
    """``Block`` as another class: its own compiled graph and region."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


def test_a_hook_that_replaces_the_gradients_in_w_makes_w_compute_its_own(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """torch's W replaces the gradients a pre-hook sees when a weight's gradient reaches it
    through two intermediates; a pass whose gradients differ from I's reruns, logged once."""
    ref, m = compiled(HookedBlock())
    x = x_(seed=8)
    y = m(x)
    g1 = _g((4, 8), seed=1)
    torch.autograd.grad(y, [x], g1, retain_graph=True)
    node = y.grad_fn
    assert node is not None
    node.register_prehook(lambda grads: (grads[0] * 2,))
    with caplog.at_level(logging.WARNING, logger="customgrad"):
        dw = torch.autograd.grad(y, list(m.parameters()), g1)
    xr = x.detach().requires_grad_()
    yr = ref(xr)
    close(list(dw), list(torch.autograd.grad(yr, list(ref.parameters()), 2 * g1)))
    (region,) = [r for r in regions() if r.name.startswith("HookedBlock")]
    assert region.repeated is not None and "other output gradients" in region.repeated
    assert "some pass ran the full backward" in region.describe()  # explain_split's text
    (row,) = [r for r in cg.summary().compiled_regions if r.region == region.name]
    assert "some pass ran the full backward: a pass needing only" in row.detail
    lines = [r.getMessage() for r in caplog.records if "would split" in r.getMessage()]
    assert len(lines) == 1


def test_a_gradient_written_to_between_i_and_w_is_another_pass() -> None:
    """The same gradient tensor, modified in place after I: W computes from its new values."""
    ref, m = compiled(HookedBlock())
    x = x_(seed=10)
    y = m(x)
    g = _g((4, 8), seed=2)
    torch.autograd.grad(y, [x], g, retain_graph=True)
    g.mul_(3)
    dw = torch.autograd.grad(y, list(m.parameters()), g)
    xr = x.detach().requires_grad_()
    close(list(dw), list(torch.autograd.grad(ref(xr), list(ref.parameters()), g)))


class PassThrough(nn.Module):
    """Returns a view of its input beside a new output: the input's node is no region's."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x.view(-1), self.fc(x)


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_the_recorder_goes_on_the_region_s_own_node_only() -> None:
    """An output that is a view of the region's input (AOTAutograd remakes it outside its
    graph) leads to the node of the region before: the pass recorder goes on this region's own
    node only (else it would keep the other node's gradients as long as that node lives)."""
    first, second = Block().double(), PassThrough().double()
    cg.compile(first, backend="aot_eager")
    cg.compile(second, backend="aot_eager")
    for _ in range(2):  # compiles, then runs compiled
        h = first(x_())
        same, y = second(h)
        (y.sum() + same.sum()).backward()
    (r,) = [r for r in regions() if r.name.startswith("PassThrough")]
    assert len(r.nodes) == 1  # its own node only (of the graph still alive)
    held = region_node(h.grad_fn)  # the node of the region before: its own state, not r's
    assert held is not None and held.region is not r and held.region.name.startswith("Block")


class MixInductor(nn.Module):
    """``Mix`` again, for inductor: its own compiled graph."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: Tensor, v: Tensor) -> Tensor:
        return torch.tanh(self.fc(x) @ v)


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
@HOW
def test_a_cut_compiled_in_a_later_backward_by_inductor_splits_exactly(how: str) -> None:
    """The cut for the activation block's graph is compiled when the weight block's pass first
    needs another pattern, inside that backward, by inductor."""
    torch.manual_seed(0)
    ref = Shared(MixInductor, weight_block_last=False).double()
    m = copy.deepcopy(ref)
    cg.compile(m.a, backend="inductor")
    cg.compile(m.b, backend="inductor")
    m(x_(shape=(8, 8))).sum().backward()
    loss: Loss = lambda y: ([y], [_g((8, 8))])  # noqa: E731
    full, dx, dw = eager(ref, loss, x_(shape=(8, 8)))
    m.zero_grad(set_to_none=True)
    f_i, f_w, (got_dx,) = split(m, loss, x_(shape=(8, 8)), how)
    close([got_dx], [dx])
    close([p.grad for p in m.parameters()], dw)
    assert f_i + f_w == full


class CompiledAutogradBlock(HookedBlock):
    """``Block`` as another class, for compiled autograd (its region is marked fallen back)."""

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


@TORCH_SPLIT
def test_compiled_autograd_is_said_to_run_the_backward_whole(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Compiled autograd runs AOTAutograd's backward graph itself, never customgrad's cut:
    right gradients, the region marked fallen back, one log line."""
    from torch._dynamo import compiled_autograd

    ref, m = compiled(CompiledAutogradBlock())
    x = x_(seed=11)
    traced = compiled_autograd._enable(torch.compile(backend="aot_eager"))
    with caplog.at_level(logging.WARNING, logger="customgrad"), traced:
        for _ in range(2):
            m.zero_grad(set_to_none=True)
            y = m(x)
            dx, groups = torch_split.stage_backward_input(
                [y], [torch.ones_like(y)], [x], iter(m.parameters())
            )
            torch_split.stage_backward_weight(iter(m.parameters()), groups)
    _, want_dx, want_dw = eager(ref, lambda y: ([y], [torch.ones_like(y)]), x)
    close([dx[0]], [want_dx])
    close([p.grad for p in m.parameters()], want_dw)
    (region,) = [r for r in regions() if r.name.startswith("CompiledAutogradBlock")]
    assert region.status == "fallback" and region.reason is not None
    assert region.reason.startswith("compiled autograd runs its backward graph itself")
    lines = [r for r in caplog.records if "compiled autograd runs" in r.getMessage()]
    assert len(lines) == 1


class Detached(nn.Module):
    """A block with a parameter that requires grad but gets no gradient (only its detached
    value is read): an input of the region whose slot no pass computes."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x) * self.scale.detach()


def test_a_full_backward_runs_the_full_graph_though_an_input_gets_no_gradient() -> None:
    # What a pass leaves for later is what it does not compute among the slots a pass can
    # compute: an input that never gets a gradient leaves nothing, so a full backward is full.
    _, m = compiled(Detached())
    (region,) = [r for r in regions() if r.name.startswith("Detached")]
    before = dict(region.runs)
    m(x_(seed=3)).sum().backward()
    assert {k: n - before[k] for k, n in region.runs.items()} == {
        "full": 1,
        "input": 0,
        "weight": 0,
    }
