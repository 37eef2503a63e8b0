"""Split a stage's backward into an input pass (I) and a weight pass (W), nothing done twice.

Drop-ins for ``torch.distributed.pipelining._backward``'s ``stage_backward``,
``stage_backward_input`` and ``stage_backward_weight`` (same signatures, same return values),
written for customgrad. The plan comes from :func:`customgrad._split_plan.plan_input_pass`:

- In I, customgrad ops compute their input half and hand their weight half to W as it is
  (inputs and output gradients already in hand), so W never runs their input half again, even
  when a weight is shared (``op(relu(op(x, w)), w)``), where torch's W re-runs the outer op. A
  stage whose inputs need no gradient (the first stage) still runs its activation gradients in
  I, so that W carries only weight work, as the schedules assume.
- A plain ``autograd.Function`` with edges into the weight side (Liger-Kernel's, unsloth's,
  a ``torch.library.custom_op``) computes every gradient it returns in one backward, whatever
  the pass needs: it runs once, in I, and W sends on the weight gradients it returned there
  (its node's post-hook sees them all, the run-once rule customgrad's own unsplittable ops
  follow). torch's split runs such
  a backward again in W: twice the kernels, and wrong gradients where the backward writes its
  output gradient in place (Liger's RMSNorm) or scales a gradient it keeps (a fused loss).
  ``run_functions_once=False`` runs them as torch does. With ``split_functions`` (the
  default), I first tries to split such a backward as customgrad splits its own ops' single
  backward (:mod:`customgrad.pipelining._function_split`): captured with dynamo and cut, its
  input work runs in I and its weight work in W; one that cannot be captured (a Triton launch,
  side effects) runs once, its reason logged once per class.
- Other nodes with edges into the weight side (native ops, any opaque node) get the gradients
  that reached them in I recorded; W runs them again from those,
  in engine calls grouped so that the engine asks them for their weight-side outputs only
  (:class:`customgrad._split_plan.WeightCall`): a native layer's input gradient is not computed
  again, as under torch's split, and also not where the layer shares its weight with a layer
  before it (one ``nn.Linear`` applied twice), where torch's W computes it again: W calls such a
  layer itself, inside an engine call that wants only its weight-side edges (a customgrad op
  there too, with a route for its weight side). (A plain Function's backward computes all it
  computes, under both.)
- Where an engine call of W still reaches nodes I ran (below a Function whose backward asks the
  engine what the pass needs, run again for its weights; below a compiled region or a plain
  Function with ``run_functions_once=False``), the Functions among them compute nothing there
  (:func:`customgrad._torch.functions.skipping`): their work was done, or handed over, in I.
- Work whose weight sides meet (a shared weight) goes through the engine in one call, so
  ``.grad`` accumulation, tensor hooks and post-accumulate-grad hooks (DDP/FSDP-style) behave as
  in a full backward: one accumulation per weight, each hook once. (torch's own weight pass
  fires no post-accumulate-grad hooks.)
- What W does not need is freed after I; after W nothing of the graph is kept. (On torch 2.11
  and 2.12 the graph stays until W: there a kept handle of a Function's node does not keep the
  node alive, see :func:`customgrad._torch.functions.keep_graphs`.)

Errors raised here are also ``RuntimeError``\\ s, as torch's are (it wraps every error of these
functions in one), besides their customgrad class.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node

from customgrad._compiled_region import CompiledRegion
from customgrad._record import NodeRecord, record_of
from customgrad._routing import Routed, WeightWork, routing
from customgrad._signature import ArgKind
from customgrad._split_plan import (
    STATE_KEY,
    InputPassPlan,
    grad_node,
    plan_input_pass,
    reach,
    runs_once,
    weights_into_regions,
)
from customgrad._torch.functions import forward_cls, keep_graphs, replacing, run_backward
from customgrad.pipelining._function_split import (
    FunctionOnce,
    FunctionSplit,
    edge_arguments,
    function_label,
    split_input,
)
from customgrad.pipelining._split_state import Resend, SplitState, runtime_errors
from customgrad.pipelining._stage_io import (
    pair_outputs,
    run_stage_backward,
    sequence,
    stage_backward,
)
from customgrad.pipelining._weight_pass import Grads, stage_backward_weight

__all__ = ["run_stage_backward", "stage_backward", "stage_backward_input", "stage_backward_weight"]

log = logging.getLogger("customgrad")

_TOLD: set[type] = set()
"""The Function classes the log already named (one line per class, not per call)."""


def _tell(cls: type | None, why: str | None = None) -> None:
    """Log, once per Function class, that its backward runs once in I (``why`` it did not
    split, where splitting it was tried)."""
    if cls is None or cls in _TOLD:
        return
    _TOLD.add(cls)
    log.info(
        "customgrad.pipelining: %s.%s is a plain autograd.Function %s: it runs once, in the "
        "input pass, and the weight pass receives the weight gradients it returned (torch's "
        "split runs it twice). Make it a customgrad op (customgrad.from_function) to split "
        "it; run_functions_once=False runs it as torch does.",
        cls.__module__,
        cls.__qualname__,
        "(it cannot split)"
        if why is None
        else f"whose backward cannot split automatically ({why})",
    )


MSG_WEIGHT_IN_REGION = (
    "customgrad.pipelining: %s runs its weight work in the input pass: the gradient it returns "
    "for its argument %s goes into the compiled region %s, whose backward sends it only to the "
    "weights (%s) but which the input pass runs for its activation gradients, %s. Cast or "
    "transpose the weight inside %s (its backward then returns the weight's own gradient), or "
    "outside the compiled region (before the compiled module, or under torch.compiler.disable)."
)
WHY_OP = "and a customgrad op defers only gradients that go straight to the weight side"
WHY_NOT_ONCE = "and with run_functions_once=False the stage does not split it (the default does)"
WHY_FALLBACK = "and the region does not split (it fell back to its full backward)"
MSG_FIRST = (
    "customgrad.pipelining: %s ran its weight work in the input pass of the first backward "
    "through the compiled region %s: the gradient it returns for its argument %s goes into the "
    "region, whose backward (compiled in that first run) sends it only to the weights (%s). "
    "Later backwards through the region split it: its weight work goes to the weight pass with "
    "the region's."
)

_TOLD_REGIONS: set[tuple[object, ...]] = set()
"""The (Function class or op, compiled region) pairs :data:`MSG_WEIGHT_IN_REGION` named."""


def tell_weights_in_regions(
    plan: InputPassPlan,
    functions: bool = True,
    run_once: bool = True,
    fresh: Collection[CompiledRegion] = (),
) -> None:
    """Log, once per Function class (or customgrad op) and compiled region, the weight work of
    I's nodes that goes into a compiled region I runs (:func:`weights_into_regions`) and that
    the plan leaves in I (not :attr:`InputPassPlan.into_regions`); plain Functions' only with
    ``functions`` (the weight-gradient queue runs them whole in I anyway; ``run_once``: the
    plan's). After I, ``fresh``: the regions whose backward compiled in it (the plan could not
    read them): only theirs."""
    if not plan.regions:
        return  # (no compiled region runs in I: the common case, at no cost)
    for node in plan.executed:
        record = record_of(node)
        if record is not None:
            if node in plan.deferred:
                continue
            key: object = record.op.name
            found = weights_into_regions(plan, node, record.edge_is_weight())
            names = _op_edges(record)
            what, inside = f"customgrad op {record.label}", "the op"
            why = WHY_OP
        elif functions and runs_once(node):
            cls = forward_cls(node)
            key = cls
            found = weights_into_regions(plan, node)
            names = [repr(n) for n in edge_arguments(cls, node)]
            what = f"{function_label(cls)} (a plain autograd.Function)"
            inside = "its forward"
            why = WHY_NOT_ONCE if not run_once else WHY_FALLBACK
        else:
            continue
        into = plan.into_regions.get(node, {})
        for hit in found:
            first = hit.region in fresh
            if fresh and not first:
                continue  # (the plan saw it)
            if first and run_once and record is None and hit.region.status == "split":
                if (key, hit.region.name, "first") not in _TOLD_REGIONS:
                    _TOLD_REGIONS.add((key, hit.region.name, "first"))
                    log.info(
                        MSG_FIRST, what, hit.region.name, names[hit.edge], ", ".join(hit.weights)
                    )
                continue
            if hit.edge in into or (key, hit.region.name) in _TOLD_REGIONS:
                continue
            _TOLD_REGIONS.add((key, hit.region.name))
            log.info(
                MSG_WEIGHT_IN_REGION,
                what,
                names[hit.edge],
                hit.region.name,
                ", ".join(hit.weights),
                why,
                inside,
            )


def _op_edges(record: NodeRecord) -> list[str]:
    """The arguments of a customgrad node's op along its edges, by name (``x[1]`` for an item
    of a list)."""
    sig = record.op.signature
    lens = iter(record.lens or ())
    flat = [
        spec.name if spec.kind is not ArgKind.TENSOR_LIST else f"{spec.name}[{i}]"
        for spec in sig.args
        for i in range(next(lens) if spec.kind is ArgKind.TENSOR_LIST else 1)
    ]
    return [repr(n) for n, meta in zip(flat, record.metas) if meta is not None]


def stage_backward_input(
    stage_outputs_or_loss: Sequence[torch.Tensor | GradientEdge],
    output_grads: Sequence[torch.Tensor | None] | None,
    input_values: Sequence[object],
    weights: Iterator[torch.nn.Parameter] | Iterable[torch.Tensor],
    *,
    run_functions_once: bool = True,
    split_functions: bool = True,
) -> tuple[tuple[torch.Tensor | None, ...], list[dict[str, object]]]:
    """Compute the stage inputs' gradients (I) and set aside the weights' (W) work.

    Args:
        stage_outputs_or_loss: the stage's outputs (or ``[loss]``); tensors or
            :class:`~torch.autograd.graph.GradientEdge`\\ s. Outputs that do not require grad
            are skipped.
        output_grads: one gradient per output (``None`` for the loss: ones are used). An output
            whose gradient is ``None`` contributes nothing.
        input_values: the stage's inputs; non-tensors and tensors without grad get ``None``.
        weights: the stage's weights (e.g. ``module.parameters()``); W computes the gradients
            of every leaf of the stage that is not an input.
        run_functions_once: True (the default): a plain ``torch.autograd.Function`` whose
            node has edges into the weight side runs its backward once, here, and W receives
            the weight gradients it returned. False: W runs its backward again from the
            gradients that reached it, as torch's ``stage_backward_weight`` does (twice, and
            wrong for a backward that writes its output gradient in place).
        split_functions: True (the default), with ``run_functions_once``: such a Function's
            backward is first captured with dynamo and split as a customgrad op's single
            backward is: its input work runs here, its weight work in W. One that cannot be
            captured (a Triton launch, Python side effects) runs once, its reason logged once
            per class. False: it runs once, here, without trying.

    Returns:
        ``(dinputs, param_groups)``: the input gradients (also accumulated into each input's
        ``.grad``, as torch does; the returned tensors are not ``.grad`` itself, so later
        accumulation never changes them), and an opaque list to pass to
        :func:`stage_backward_weight`.

    Raises:
        ArgumentTypeError: an argument is not a list where one is expected (e.g. a bare loss
            tensor: pass ``[loss]``).
        ArgumentValueError: ``output_grads`` does not match the outputs.

    Example:
        >>> lin = torch.nn.Linear(3, 3)
        >>> x = torch.randn(2, 3, requires_grad=True)
        >>> dx, groups = stage_backward_input([lin(x).sum()], None, [x], lin.parameters())
        >>> lin.weight.grad is None
        True
        >>> _ = stage_backward_weight(lin.parameters(), groups)
        >>> lin.weight.grad.shape
        torch.Size([3, 3])
    """
    with runtime_errors():
        return _stage_backward_input(
            stage_outputs_or_loss,
            output_grads,
            input_values,
            run_functions_once,
            split_functions,
        )


def _stage_backward_input(
    stage_outputs_or_loss: Sequence[torch.Tensor | GradientEdge],
    output_grads: Sequence[torch.Tensor | None] | None,
    input_values: Sequence[object],
    run_once: bool,
    split_functions: bool = True,
) -> tuple[tuple[torch.Tensor | None, ...], list[dict[str, object]]]:
    input_values = sequence(input_values, "input_values", "Pass the stage's inputs as a list.")
    outputs, grads, out_edges = pair_outputs(stage_outputs_or_loss, output_grads)
    inputs = [
        (i, v)
        for i, v in enumerate(input_values)
        if isinstance(v, torch.Tensor) and v.requires_grad
    ]
    input_nodes = {n for _, v in inputs if (n := grad_node(v)) is not None}
    state = SplitState()
    plan = state.plan = plan_input_pass(
        [n for n, _ in out_edges],
        input_nodes,
        lambda record: state,
        defer_native=True,
        run_once=run_once,
    )
    if plan.once and not split_functions:
        for n in plan.once:
            _tell(forward_cls(n))
    tell_weights_in_regions(plan, run_once=run_once)
    fresh = {r.region for r in plan.regions if not r.region.reaches}
    dinputs: list[torch.Tensor | None] = [None] * len(input_values)
    targets: list[torch.Tensor | GradientEdge] = [v for _, v in inputs]
    targets.extend(GradientEdge(n, 0) for n in plan.targets)
    if targets and outputs:
        _run_input_pass(state, outputs, grads, targets, inputs, dinputs, split_functions)
        if fresh:  # (their backward compiled in this I: say what it ran there)
            tell_weights_in_regions(plan, run_once=run_once, fresh=fresh)
    direct = {i: Resend([(GradientEdge(*out_edges[i]), g)])
              for i in plan.direct if (g := grads[i]) is not None}  # fmt: skip
    _hand_to_weight_pass(state, direct, input_nodes, split_functions)
    state.keep = keep_graphs(stage_outputs_or_loss)
    for out in stage_outputs_or_loss:
        if isinstance(out, torch.Tensor) and out.grad_fn is not None and not out._is_view():
            out.detach_()
    return tuple(dinputs), [{STATE_KEY: state}]


def _run_input_pass(
    state: SplitState,
    outputs: Sequence[torch.Tensor | GradientEdge],
    grads: Sequence[torch.Tensor | None],
    targets: list[torch.Tensor | GradientEdge],
    inputs: list[tuple[int, torch.Tensor]],
    dinputs: list[torch.Tensor | None],
    split_functions: bool,
) -> None:
    """The engine call of I, with the plan's routes, the hooks that record what reached the
    nodes W runs again and what the Functions that run once returned, and the Functions'
    split input passes in place of their backward; the inputs' gradients into ``dinputs``
    (and ``.grad``)."""
    plan = state.plan
    captured = state.captured

    def capture(node: Node) -> Callable[[tuple[torch.Tensor | None, ...]], None]:
        def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            captured[node] = tuple(grad_outputs)

        return hook

    handles = [n.register_prehook(capture(n)) for n in [*plan.intermediates, *plan.once]]
    handles += [n.register_hook(_keep_weight_gradients(state, plan, n)) for n in plan.once]
    splits = [(n, _split_apply(state, plan, n)) for n in plan.once] if split_functions else []
    before = [v.grad for _, v in inputs]
    for _, v in inputs:
        v.grad = None
    try:
        with routing(plan.input_routes), replacing(splits):
            torch.autograd.backward(
                outputs,  # type: ignore[arg-type]
                grad_tensors=grads,
                inputs=targets,  # type: ignore[arg-type]
                # A Function that asks the engine what to compute may need W to ask again.
                retain_graph=bool(plan.intermediates or plan.once),
            )
    finally:
        for h in handles:
            h.remove()
        for (i, v), old in zip(inputs, before):
            g = v.grad
            dinputs[i] = g
            if g is None:
                v.grad = old
            else:
                v.grad = g.clone() if old is None else old + g


def _hand_to_weight_pass(
    state: SplitState, direct: dict[int, Resend], input_nodes: set[Node], split_functions: bool
) -> None:
    """Sort what I left into W's engine calls (the pieces of weight work of each, and the
    Function nodes each runs again), and drop the plan's references to nodes W does not run,
    which would keep their saved tensors (and the graph below them) alive until W."""
    plan = state.plan
    ran = state.ran
    split = {n for n, h in ran.items() if isinstance(h, FunctionSplit)}
    state.once_ids = frozenset(id(n) for n, h in ran.items() if h is not None and n not in split)
    state.split_ids = frozenset(id(n) for n in split)
    state.splitting = {}
    if split_functions:  # the classes that did not split (those that did say nothing)
        for n in plan.once:
            if n not in split:
                _tell(forward_cls(n))
    del split
    deferred: dict[int, list[WeightWork]] = {0: [*state.deferred.values()]}
    if len(plan.weight_calls) > 1:  # each to its call, in the order I handed them over
        call_of: dict[Routed, int] = {
            r: c for c, call in enumerate(plan.weight_calls) for r in call.deferred
        }
        deferred = {}
        for record, half in state.deferred.items():
            deferred.setdefault(call_of.get(record, 0), []).append(half)
    state.deferred = {}
    for c, call in enumerate(plan.weight_calls):
        again = [n for n in call.once if n in ran and ran[n] is None]
        work: list[WeightWork] = []  # (in the order W sends them, as the engine's roots)
        for n in call.intermediates:
            work.append(Resend.of(n, state.captured.pop(n, ())))
        work += [direct.pop(i) for i in call.direct if i in direct]
        work += [w for n in call.once if (w := ran.get(n)) is not None]
        work += deferred.pop(c, ())
        if work:
            state.work[c] = work
        if again:
            # Each group of them runs in an engine call of its own, where nothing else runs.
            state.asked_once[c] = [
                (group, _skipped_below(plan, group, set(group), input_nodes))
                for group in _sharing_leaves(plan, again)
            ]
        # Below the intermediates run again through the engine: nothing but the call's roots
        # (W calls the asked ones itself).
        runs = [*call.clamp, *call.asked]
        skip = _skipped_below(plan, runs, {*call.clamp, *call.intermediates}, input_nodes)
        if skip:
            state.skip[c] = skip
        call.once = []
    state.ran = {}
    plan.once = []
    rerun = {n for groups in state.asked_once.values() for nodes, _ in groups for n in nodes}
    plan.into_regions = {n: e for n, e in plan.into_regions.items() if n in rerun}
    # The output side of the graph goes (views cannot be detached in place; their graph goes
    # when the caller drops them); W reads only which nodes were deferred: their targets (this
    # state) would make a cycle (state -> plan -> state) that keeps the nodes and their saved
    # tensors alive past an aborted step until the cyclic GC runs.
    plan.executed = set()
    plan.input_routes = {}
    plan.regions = []
    plan.deferred = dict.fromkeys(plan.deferred)  # type: ignore[assignment]
    plan.targets = []
    plan.intermediates = []


def _skipped_below(
    plan: InputPassPlan, runs: list[Node], own: set[Node], input_nodes: set[Node]
) -> list[Node]:
    """The Function nodes (plain, customgrad's, compiled regions') that an engine call of W
    reaches with no gradient, below the nodes ``runs`` it runs again for their weight-side
    edges, and that must compute nothing there: every node I ran below their input edges but
    ``own`` (the call's roots, which run as planned).

    W runs some nodes of I again through the engine, for their weight-side edges: Functions
    whose backward asks the engine what the pass needs, and intermediates whose input edges
    lead to the call's weights (a weight they share with a layer before them). The engine then
    also runs every node between them and those weights, with no gradient (what they send
    along their input edges is dropped): a native node computes nothing, but a Function's
    backward would run whole, on zeros (Python backwards get missing gradients as zeros), and
    a customgrad node its weight half. Those nodes ran in I already, and what they returned for
    the weights was handed over, or runs in its own place.
    """
    if not runs:
        return []
    starts = [
        fn
        for node in runs
        for (fn, _), w in zip(node.next_functions, plan.weight_side_edges(node))
        if not w and fn is not None
    ]
    executed = plan.executed
    return [
        n
        for n in reach(starts, input_nodes)
        if n in executed and n not in own and forward_cls(n) is not None
    ]


def _keep_weight_gradients(
    state: SplitState, plan: InputPassPlan, node: Node
) -> Callable[[Grads, Grads], None]:
    """A post-hook for a Function node that runs once, in I: it keeps, for W, the gradients
    the node's backward returned along its weight-side edges (the engine hands a post-hook
    every gradient the backward returned, after summing each to its edge's shape); I drops
    them, as no node I runs wants them."""
    # Not along the edges into a compiled region I runs: there the engine gave them to the
    # region in I, and W sends them again with the region's other output gradients.
    side = plan.weight_side_edges(node, regions=False)

    def hook(grad_inputs: Grads, grad_outputs: Grads) -> None:
        work = state.splitting.pop(node, None)
        if work is not None:  # split: its weight pass runs in W
            state.captured.pop(node, None)
            state.ran[node] = work
            return
        kept = [
            (GradientEdge(fn, nr), g)
            for (fn, nr), g, w in zip(node.next_functions, grad_inputs, side)
            if w and g is not None and fn is not None
        ]
        if len(kept) < sum(side):
            # A weight-side gradient is missing: a backward that asks the engine what the pass
            # needs (as a compiled region's does) computes it when the engine runs it again in
            # W, from the output gradients kept for it (so does one that returns None for a
            # weight: twice, as under torch's split).
            state.ran[node] = None
            return
        state.captured.pop(node, None)
        state.ran[node] = FunctionOnce(node, kept)

    return hook


def _split_apply(
    state: SplitState, plan: InputPassPlan, node: Node
) -> Callable[..., tuple[object, ...]]:
    """What ``node`` runs in I in place of its backward: the input pass of its split backward,
    leaving the weight pass for W (:mod:`customgrad.pipelining._function_split`), or the
    backward as written where it does not split."""
    side = plan.weight_side_edges(node)

    def apply(*grads: torch.Tensor | None) -> tuple[object, ...]:
        found = split_input(node, side, grads, _tell)
        if found is None:
            return run_backward(node, grads)  # type: ignore[no-any-return]
        out, work = found
        state.splitting[node] = work
        return out

    return apply


def _sharing_leaves(plan: InputPassPlan, nodes: list[Node]) -> list[list[Node]]:
    """``nodes`` grouped so that nodes whose weight sides reach a common leaf go together."""
    groups: list[tuple[list[Node], set[Node]]] = []
    for node in nodes:
        side = plan.weight_side_edges(node, regions=False)
        mine = reach([fn for (fn, _), w in zip(node.next_functions, side) if w and fn], set())
        joined = [g for g in groups if not g[1].isdisjoint(mine)]
        merged = ([node], mine)
        for g in joined:
            groups.remove(g)
            merged[0].extend(g[0])
            merged[1].update(g[1])
        groups.append(merged)
    return [g[0] for g in groups]
