"""The one split program: traced and compiled backwards cut, kept and handed over alike.

A customgrad op's captured backward and a compiled region's AOTAutograd backward are both a
:class:`~customgrad._split_program.SplitProgram`: the same clean-up (CSE), the same cut, the
same typed kept values (:class:`~customgrad._handoff.Kept`) in the same hand-off store, read by
the same ownership rule.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import Tensor, nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.flop_counter import FlopCounterMode

import customgrad as cg
from customgrad._autosplit import AutoSplitter, TracedSplit
from customgrad._compiled_backward import region_node
from customgrad._handoff import Kept
from customgrad._record import record_of
from customgrad._routing import Route, routing
from customgrad._split_plan import grad_node, plan_input_pass
from customgrad._split_program import ProgramCut, SplitProgram
from customgrad.pipelining import stage_backward_input, stage_backward_weight

DT = torch.float64
_ids = itertools.count()


def scaled_op() -> cg.CustomOp[..., Tensor]:
    """``x @ w.mT`` whose single backward computes ``g * 3`` for both gradients: the automatic
    split runs it once, in I, and keeps it for W."""

    @cg.op(f"test_split_program{next(_ids)}::scaled", weights=("w",))
    def scaled(x: Tensor, w: Tensor) -> Tensor:
        return x @ w.mT * 3

    scaled.register_fake(lambda x, w: x.new_empty((*x.shape[:-1], w.shape[0])))
    scaled.register_save_for_backward(lambda i, o: (i.x, i.w))
    scaled.register_backward(
        lambda ctx, s, g: {"x": (g * 3) @ s[1], "w": (g * 3).mT @ s[0]}  # g * 3 shared
    )
    return scaled


class Block(nn.Module):
    """Linear-ReLU-Linear with a residual: input and weight gradients share dpre."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 7, dtype=DT)
        self.fc2 = nn.Linear(7, 5, dtype=DT)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


def flops(fn: Any) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def test_one_hand_off_store_serves_an_op_and_a_compiled_region_in_one_stage() -> None:
    """customgrad's split of a stage made of a traced op and a compiled block: both keep their
    values in I as the same typed ``Kept``, on their nodes' holders, and W takes them (the
    compiled region routed to its weight side, as customgrad nodes are)."""
    torch.manual_seed(0)
    op = scaled_op()
    block = Block()
    ref = Block()
    ref.load_state_dict(block.state_dict())
    cg.compile(block, backend="aot_eager")
    x = torch.randn(4, 3, dtype=DT, requires_grad=True)
    w = torch.randn(5, 3, dtype=DT, requires_grad=True)
    g = torch.randn(4, 5, dtype=DT)
    params = [w, *block.parameters()]

    def stage(m: nn.Module) -> tuple[Tensor, Tensor]:
        y = op(x, w)
        return y, m(y)

    _, out_ref = stage(ref)
    want = torch.autograd.grad(out_ref, [x, w, *ref.parameters()], g)
    _, out_ref = stage(ref)
    full = flops(lambda: torch.autograd.grad(out_ref, [x, w, *ref.parameters()], g))

    y, out = stage(block)
    record = record_of(y.grad_fn)
    assert record is not None
    node = out.grad_fn  # (the split detaches the stage's outputs)
    result: list[Any] = []
    f_i = flops(lambda: result.extend(stage_backward_input([out], [g], [x], iter(params))))  # I
    dx, param_groups = result
    torch.testing.assert_close(dx[0], want[0])
    held = region_node(node)
    assert held is not None
    region = held.region
    holders = {"op": record, "compiled region": held}
    for holder in holders.values():
        handoff = holder.handoff
        assert handoff is not None and handoff.kind == "kept" and handoff.next is None
        kept = handoff.value
        assert isinstance(kept, Kept) and isinstance(kept.cut, ProgramCut)
        assert isinstance(kept.cut.program, SplitProgram) and kept.values
    auto = op.rules.auto
    assert isinstance(auto, AutoSplitter) and isinstance(auto.last, TracedSplit)
    assert record.handoff is not None and isinstance(record.handoff.value, Kept)
    assert record.handoff.value.cut.program is auto.last.program
    assert region.pending() == 1

    f_w = flops(lambda: stage_backward_weight(iter(params), param_groups))  # W
    assert record.handoff is None and held.handoff is None and region.pending() == 0
    assert f_i + f_w == full  # nothing computed twice, across both kinds of node
    assert region.runs == {"full": 0, "input": 1, "weight": 1}
    for p, want_p in zip(params, want[1:]):
        torch.testing.assert_close(p.grad, want_p)


def test_a_compiled_program_runs_work_written_twice_once() -> None:
    """A backward graph that computes ``g @ w2`` twice (once per gradient, as unsloth's LoRA
    writes ``dY @ B.t()``): the program's clean-up merges it, the input pass computes it once
    and keeps it, the weight pass does not compute it again."""

    def backward(x: Tensor, w: Tensor, w2: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
        dx = (g @ w2) @ w
        dw = (g @ w2).mT @ x
        return dx, dw

    x, w, w2, g = (torch.randn(s, dtype=DT) for s in [(4, 3), (6, 3), (5, 6), (4, 5)])
    gm = make_fx(backward)(x, w, w2, g)
    mms = [n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default]
    assert len(mms) == 4  # written twice

    def boxed(g: torch.fx.GraphModule, examples: list[Any]) -> Any:
        return lambda args: g(*args)  # a compiled region's calling convention (boxed)

    program = SplitProgram(gm, [0, 1], "from_inputs", boxed, [x, w, w2, g])
    merged = program.graph_module.graph.nodes
    assert sum(n.target is torch.ops.aten.mm.default for n in merged) == 3  # g @ w2 once
    cut = program.cut(frozenset({1}))  # W computes dw
    assert [h.target for h in cut.kept] == [torch.ops.aten.mm.default]
    out: list[Any] = []
    f_i = flops(lambda: out.extend(cut.input_pass.fn([x, w, w2, g])))
    (dx, kept) = out
    f_w = flops(lambda: out.extend(cut.weight_pass.fn([x, w, w2, g, kept])))
    (dw,) = out[2:]
    shared = 2 * 4 * 5 * 6
    assert f_i == shared + 2 * 4 * 6 * 3  # g @ w2, then dx
    assert f_w == 2 * 6 * 4 * 3  # dw only: g @ w2 is not run again
    torch.testing.assert_close(dx, (g @ w2) @ w)
    torch.testing.assert_close(dw, (g @ w2).mT @ x)
    assert program.cut(frozenset({1})) is cut  # the pass cache


def test_a_compiled_region_takes_its_kept_values_only_from_its_own_pass() -> None:
    """The one ownership rule on a compiled region's node: a weight pass with other output
    gradients than its input pass computes for itself, and each pass's values stay for that
    pass until a pass frees the graph."""
    torch.manual_seed(0)
    block = Block()
    cg.compile(block, backend="aot_eager")
    x = torch.randn(4, 5, dtype=DT, requires_grad=True)
    g = torch.randn(4, 5, dtype=DT)
    out = block(x)
    torch.autograd.grad(out, [x], g, retain_graph=True)  # I
    node = region_node(out.grad_fn)
    assert node is not None and node.handoff is not None
    region = node.region
    runs = dict(region.runs)

    def ran() -> dict[str, int]:
        return {k: region.runs[k] - runs[k] for k in runs}

    other = g.clone()
    dw = torch.autograd.grad(out, list(block.parameters()), other, retain_graph=True)
    # the other pass split the other way (its W computes x's gradient) and kept its own values;
    # the first pass's values stay for their own W
    assert node.handoff is not None and node.handoff.next is not None
    assert node.handoff.made_by((other,)) and node.handoff.next.made_by((g,))
    assert region.repeated is not None
    want = torch.autograd.grad(
        block.fc2(torch.relu(block.fc1(x))) + x, list(block.parameters()), other
    )
    for a, b in zip(dw, want):
        torch.testing.assert_close(a, b)
    assert ran() == {"full": 0, "input": 1, "weight": 0}  # it split the other way
    torch.autograd.grad(out, list(block.parameters()), g)  # its own W
    assert ran() == {"full": 0, "input": 1, "weight": 1}  # it read what its own I kept
    assert node.handoff is None  # and the graph is freed: no pass comes for the other's


def test_a_compiled_region_takes_its_orders_through_a_route() -> None:
    """A planned backward tells a compiled region's node which edges the pass uses with a route,
    as it tells customgrad nodes: asked by the engine for every gradient, the node computes the
    weight side only (its W, reading what I kept), and the input edge gets nothing."""
    torch.manual_seed(0)
    block = Block()
    cg.compile(block, backend="aot_eager")
    params = list(block.parameters())
    x = torch.randn(4, 5, dtype=DT, requires_grad=True)
    g = torch.randn(4, 5, dtype=DT)
    out = block(x)
    (dx,) = torch.autograd.grad(out, [x], g, retain_graph=True)  # I
    node = region_node(out.grad_fn)
    assert node is not None and out.grad_fn is not None
    runs = dict(node.region.runs)
    leaves = {id(p) for p in params}
    side = tuple(
        fn is not None and id(getattr(fn, "variable", None)) in leaves
        for fn, _ in out.grad_fn.next_functions
    )
    assert side.count(True) == len(params) and not all(side)
    with routing({node: Route(needed=side)}):
        got = torch.autograd.grad(out, [x, *params], g, allow_unused=True)
    assert got[0] is None  # the route, not the engine, said what the pass needs
    assert node.region.runs["weight"] == runs["weight"] + 1 and node.handoff is None
    xr = x.detach().requires_grad_()
    want = torch.autograd.grad(block.fc2(torch.relu(block.fc1(xr))) + xr, [xr, *params], g)
    torch.testing.assert_close(dx, want[0])
    for a, b in zip(got[1:], want[1:]):
        torch.testing.assert_close(a, b)


def test_the_split_planner_routes_a_compiled_region_as_it_routes_customgrad_nodes() -> None:
    """One plan for both kinds of routed node: the stage's plan gives a compiled region's node
    a route in I (its activation edge only) and, as a node W runs again, a route in W (its
    weight side only), exactly as it routes the customgrad node before it."""
    torch.manual_seed(0)
    op = scaled_op()
    block = Block()
    cg.compile(block, backend="aot_eager")
    x = torch.randn(4, 3, dtype=DT, requires_grad=True)
    w = torch.randn(5, 3, dtype=DT, requires_grad=True)
    y = op(x, w)
    out = block(y)
    assert out.grad_fn is not None and y.grad_fn is not None
    region = region_node(out.grad_fn)
    record = record_of(y.grad_fn)
    assert region is not None and record is not None

    class Target:
        def defer(self, record: Any, work: Any) -> None:
            raise AssertionError("planning defers nothing")

    target = Target()
    x_node = grad_node(x)
    assert x_node is not None
    plan = plan_input_pass([out.grad_fn], {x_node}, lambda r: target, defer_native=True)
    edges = [fn for fn, _ in out.grad_fn.next_functions]
    activation = tuple(fn is y.grad_fn for fn in edges)
    assert activation.count(True) == 1
    assert plan.input_routes[region] == Route(needed=activation)
    assert plan.weight_routes[region] == Route(needed=tuple(fn is not None and not a
                                                            for fn, a in zip(edges, activation)))  # fmt: skip
    assert out.grad_fn in plan.intermediates
    # The customgrad node, by the same rule: its input edge now, its weight half deferred.
    op_edges = [fn for fn, _ in y.grad_fn.next_functions]
    assert plan.input_routes[record] == Route(
        needed=tuple(fn is x_node for fn in op_edges), defer=target
    )
    assert plan.weight_routes[record] == Route(needed=(False,) * len(op_edges))


def test_two_losses_through_one_compiled_node_each_find_their_own_values() -> None:
    """torch's order I(loss 1), I(loss 2), W(loss 1), W(loss 2) through one compiled region's
    node: the node keeps both passes' values (as a customgrad node does), each W reads its own
    and computes nothing of its input pass again."""
    torch.manual_seed(0)
    block = Block()
    cg.compile(block, backend="aot_eager")
    params = list(block.parameters())
    x = torch.randn(4, 5, dtype=DT, requires_grad=True)
    g1, g2 = torch.randn(4, 5, dtype=DT), torch.randn(4, 5, dtype=DT)
    out = block(x)
    node = out.grad_fn
    torch.autograd.grad(out, [x], g1, retain_graph=True)
    torch.autograd.grad(out, [x], g2, retain_graph=True)
    held = region_node(node)
    assert held is not None and held.region.pending() >= 2
    runs = dict(held.region.runs)
    w1 = torch.autograd.grad(out, params, g1, retain_graph=True)
    w2 = torch.autograd.grad(out, params, g2)
    assert held.region.runs["weight"] == runs["weight"] + 2  # both read what their I kept
    assert held.region.runs["input"] == runs["input"] and held.handoff is None
    ref = block.fc2(torch.relu(block.fc1(x))) + x
    for got, g in ((w1, g1), (w2, g2)):
        for a, b in zip(got, torch.autograd.grad(ref, params, g, retain_graph=True)):
            torch.testing.assert_close(a, b)
