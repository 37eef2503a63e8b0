"""customgrad.compile(block, **kw) takes what block.compile(**kw) takes: hooks dynamo must not
trace (FSDP2's, any ``torch._dynamo.disable``\\ d one) run outside the graph, with
``fullgraph=True``, whichever is added first; a region is named after the compiled module.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed.pipelining._backward as torch_split
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

import customgrad as cg
from customgrad._compile import region_of, regions
from customgrad._torch.dynamo import compile_options, compiled_autograd_on, compiling_locals
from customgrad._torch.functions import is_aot_node
from tests._skips import TORCH_SPLIT


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc(self.norm(x))


CALLS: list[str] = []


@torch._dynamo.disable
def untraceable_pre_hook(module: nn.Module, args: Any) -> None:
    """Like FSDP2's pre-forward hook: dynamo must not trace it (here: a Python side effect)."""
    CALLS.append(type(module).__name__)


@TORCH_SPLIT
@pytest.mark.parametrize("order", ["hook, then compile", "compile, then hook"])
def test_fullgraph_with_a_dynamo_disabled_pre_hook_splits(order: str) -> None:
    torch.manual_seed(0)
    ref = Block().double()
    m = copy.deepcopy(ref)
    if order == "hook, then compile":
        m.register_forward_pre_hook(untraceable_pre_hook)
        cg.compile(m, backend="aot_eager", fullgraph=True)
    else:
        cg.compile(m, backend="aot_eager", fullgraph=True)
        m.register_forward_pre_hook(untraceable_pre_hook)
    CALLS.clear()
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    out = m(x)  # before: torch._dynamo.exc.Unsupported (dynamo traced _call_impl into the hook)
    assert CALLS == ["Block"]  # the hook ran, once, outside the graph
    dy = torch.randn_like(out)
    params = list(m.parameters())
    with FlopCounterMode(display=False) as counter:
        dx, groups = torch_split.stage_backward_input([out], [dy], [x], iter(params))
        torch_split.stage_backward_weight(iter(params), groups)
    xr = x.detach().requires_grad_()
    outr = ref(xr)
    with FlopCounterMode(display=False) as full:
        outr.backward(dy)
    torch.testing.assert_close(dx[0], xr.grad)
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    assert counter.get_total_flops() == full.get_total_flops()


class Head(nn.Module):
    """A tied head: no weight of its own, given the embedding's as an argument."""

    def forward(self, x: Tensor, w: Tensor) -> Tensor:
        return torch.tanh(x) @ w.t()


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.head = Head()

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.emb(tokens), self.emb.weight)  # type: ignore[no-any-return]


# dynamo itself reads .grad of a non-leaf tensor argument (torch.compile alike)
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_a_region_is_named_after_the_compiled_module_not_a_weight_owner() -> None:
    m = Tied()
    cg.compile(m.emb, backend="aot_eager")  # every module compiled, the embedding too
    cg.compile(m.head, backend="aot_eager")
    before = {id(r) for r in regions()}
    m(torch.randint(0, 16, (2, 3))).sum().backward()
    names = sorted(r.name.split(" (")[0] for r in regions() if id(r) not in before)
    assert names == ["Embedding", "Head"], names  # before: ["Embedding", "Embedding"]


def test_torch_internals_compile_adapters() -> None:
    """The private torch names the compiled regions read, pinned: AOTAutograd's node and the
    module dynamo compiles."""
    seen: list[Any] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        seen.append(compiling_locals().get("self"))
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)

    m = Block()
    m._compiled_call_impl = torch.compile(m._call_impl, backend=backend)
    out = m(torch.randn(2, 8, requires_grad=True))
    assert seen == [m]
    assert compiling_locals() == {}  # outside a compile
    assert is_aot_node(out.grad_fn)
    assert not is_aot_node((out * 2).grad_fn)

    lin = nn.Linear(2, 2)
    lin.compile(mode="max-autotune-no-cudagraphs", fullgraph=True, dynamic=False)
    found = compile_options(lin._compiled_call_impl)
    assert found is not None and found["backend"] == "inductor"
    assert (found["fullgraph"], found["dynamic"]) == (True, False)
    assert found["options"] and found["options"].get("max_autotune") is True
    wrapped = torch.compile(nn.Linear(2, 2), backend="aot_eager")
    assert compile_options(wrapped) == {"fullgraph": False, "dynamic": None, "backend": "aot_eager"}
    assert compile_options(lambda: None) is None

    from torch._dynamo import compiled_autograd

    assert not compiled_autograd_on()
    with compiled_autograd._enable(torch.compile(backend="eager")):
        assert compiled_autograd_on()


@pytest.fixture
def one_process_group() -> Any:
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
@pytest.mark.parametrize("order", ["fully_shard, then compile", "compile, then fully_shard"])
def test_fullgraph_under_fsdp2_in_either_order(order: str, one_process_group: Any) -> None:
    """FSDP2's pre-forward hook is ``torch._dynamo.disable``\\ d: torchtitan's own compile call
    (``fullgraph=True``) with customgrad.compile swapped in, one process (a 1-rank mesh)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    ref = Block().double()
    m = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (1,))
    if order == "fully_shard, then compile":
        fully_shard(m, mesh=mesh, reshard_after_forward=False)
        cg.compile(m, backend="aot_eager", fullgraph=True)
    else:
        cg.compile(m, backend="aot_eager", fullgraph=True)
        fully_shard(m, mesh=mesh, reshard_after_forward=False)
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    out = m(x)  # before: torch._dynamo.exc.Unsupported (FSDP2's pre-forward hook traced)
    dy = torch.randn_like(out)
    out.backward(dy)  # FSDP2 reduces its gradients in a full backward's post-backward
    xr = x.detach().requires_grad_()
    ref(xr).backward(dy)
    torch.testing.assert_close(x.grad, xr.grad)
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad)  # type: ignore[union-attr]
    region = region_of(out.grad_fn)
    assert region is not None and region.status == "split"
    assert region.name.startswith("Block (graph "), region.name  # was "RMSNorm (graph 0)"
