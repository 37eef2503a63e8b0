"""Split a stage's backward into an input pass (I) and a weight pass (W), nothing done twice.

Drop-ins for ``torch.distributed.pipelining._backward``'s ``stage_backward``,
``stage_backward_input`` and ``stage_backward_weight`` (same signatures, same return values),
written for customgrad:

- In I, customgrad ops compute their input half and hand their weight half to W as it is
  (inputs and output gradients already in hand), so W never runs their input half again, even
  when a weight is shared (``op(relu(op(x, w)), w)``), where torch's W re-runs the outer op.
- Other nodes with edges into the weight side (native ops, plain ``autograd.Function``\\ s) get
  the gradients that reached them in I recorded; W runs them again from those, one group of
  nodes that share weights at a time, exactly once per group (correct for shared weights and
  multi-output nodes, where their own work may repeat as it does under torch).
- W sends every weight gradient through the autograd engine in one call, so ``.grad``
  accumulation, post-accumulate-grad hooks (DDP/FSDP-style) and shared weights behave as in a
  full backward: one accumulation per weight.
- What W does not need is freed after I (when no native intermediate needs the graph again, I
  does not retain it at all); after W nothing of the graph is kept, no hooks stay registered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node

from customgrad import _autograd
from customgrad._errors import ArgumentTypeError, ArgumentValueError
from customgrad.pipelining._errors import SplitStateError
from customgrad.pipelining._graph import analyse, grad_node

__all__ = ["stage_backward", "stage_backward_input", "stage_backward_weight"]

_STATE_KEY = "customgrad_split"

MSG_REUSED_STATE = """\
stage_backward_weight: these param_groups were already used by an earlier \
stage_backward_weight call; each stage_backward_input result runs W once. Call \
stage_backward_input again for a new microbatch:

    dinputs, param_groups = stage_backward_input(outputs, grads, inputs, weights)
    stage_backward_weight(weights, param_groups)      # once per param_groups
"""

MSG_FOREIGN_STATE = """\
stage_backward_weight: param_groups did not come from \
customgrad.pipelining.stage_backward_input (got {got}). Pass the second value that \
customgrad.pipelining.stage_backward_input returned; torch's own stage_backward_input \
results go to torch's stage_backward_weight.
"""


class _SplitState:
    """What one microbatch's I leaves for its W."""

    __slots__ = ("captured", "deferred", "deferred_nodes", "direct", "done", "groups")

    def __init__(self) -> None:
        self.deferred: list[Callable[[], None]] = []
        self.deferred_nodes: set[Node] = set()
        self.captured: dict[Node, tuple[torch.Tensor | None, ...]] = {}
        self.groups: list[tuple[list[Node], list[Node]]] = []
        self.direct: list[tuple[Node, int, torch.Tensor]] = []
        self.done = False

    def defer(self, node: Any, run: Callable[[], None]) -> None:
        self.deferred.append(run)
        self.deferred_nodes.add(node)

    def clear(self) -> None:
        self.deferred = []
        self.deferred_nodes = set()
        self.captured = {}
        self.groups = []
        self.direct = []

    def __repr__(self) -> str:
        return (
            f"<customgrad split state: {len(self.deferred)} deferred customgrad weight halves, "
            f"{len(self.groups)} native groups{', used' if self.done else ''}>"
        )


class _Drop:
    """A defer target that throws the work away: its weight half was already handed to W."""

    def defer(self, node: Any, run: Callable[[], None]) -> None:
        del node, run


_DROP = _Drop()


def _edge_of(out: torch.Tensor | GradientEdge) -> tuple[Node, int] | None:
    if isinstance(out, GradientEdge):
        return out.node, out.output_nr
    node = grad_node(out)
    if node is None:
        return None
    return node, (out.output_nr if out.grad_fn is not None else 0)


def stage_backward_input(
    stage_outputs_or_loss: Sequence[torch.Tensor | GradientEdge],
    output_grads: Sequence[torch.Tensor | None] | None,
    input_values: Sequence[Any],
    weights: Iterator[torch.nn.Parameter] | Iterable[torch.Tensor],
) -> tuple[tuple[torch.Tensor | None, ...], list[dict[str, Any]]]:
    """Compute the stage inputs' gradients (I) and set aside the weights' (W) work.

    Args:
        stage_outputs_or_loss: the stage's outputs (or its loss); tensors or
            :class:`~torch.autograd.graph.GradientEdge`\\ s. Outputs that do not require grad
            are skipped.
        output_grads: one gradient per output (``None`` for the loss: ones are used). An output
            whose gradient is ``None`` contributes nothing.
        input_values: the stage's inputs; non-tensors and tensors without grad get ``None``.
        weights: the stage's weights (e.g. ``module.parameters()``).

    Returns:
        ``(dinputs, param_groups)``: the input gradients (also accumulated into each input's
        ``.grad``, as torch does), and an opaque list to pass to :func:`stage_backward_weight`.

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
    weight_list = [w for w in weights if isinstance(w, torch.Tensor)]
    outputs: list[torch.Tensor | GradientEdge] = []
    grads: list[torch.Tensor] = []
    out_edges: list[tuple[Node, int]] = []
    for i, out in enumerate(stage_outputs_or_loss):
        if isinstance(out, GradientEdge):
            if output_grads is None:
                raise ArgumentValueError(
                    f"stage_backward_input: output {i} is a GradientEdge, which requires "
                    "output gradients; pass output_grads."
                )
        elif not isinstance(out, torch.Tensor) or (not out.requires_grad and out.grad_fn is None):
            continue
        grad: torch.Tensor | None = None
        if output_grads is not None:
            grad = output_grads[i]
        elif isinstance(out, torch.Tensor):
            grad = torch.ones_like(out)
        edge = _edge_of(out)
        if grad is None or edge is None:
            continue
        outputs.append(out)
        grads.append(grad)
        out_edges.append(edge)

    inputs_with_grad = [
        (i, v)
        for i, v in enumerate(input_values)
        if isinstance(v, torch.Tensor) and v.requires_grad
    ]
    input_nodes = {n for _, v in inputs_with_grad if (n := grad_node(v)) is not None}
    weight_nodes = {n for w in weight_list if (n := grad_node(w)) is not None}
    analysis = analyse([n for n, _ in out_edges], input_nodes, weight_nodes)

    state = _SplitState()
    state.groups = [(nodes, accs) for nodes, accs in analysis.groups if accs]
    state.direct = [(*out_edges[i], grads[i]) for i in analysis.direct]
    deferrable = analysis.deferrable

    dinputs: list[torch.Tensor | None] = [None] * len(input_values)
    if inputs_with_grad and outputs:
        captured = state.captured

        def capture(node: Node) -> Callable[[tuple[torch.Tensor | None, ...]], None]:
            def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
                captured[node] = tuple(grad_outputs)

            return hook

        def resolve(node: Any) -> _autograd.DeferTarget | None:
            return state if node in deferrable else None

        handles = [n.register_prehook(capture(n)) for nodes, _ in state.groups for n in nodes]
        _autograd.DEFER_RESOLVERS.insert(0, resolve)
        try:
            found = torch.autograd.grad(
                outputs,  # type: ignore[arg-type]
                [v for _, v in inputs_with_grad],
                grad_outputs=grads,
                retain_graph=bool(state.groups),
                allow_unused=True,
            )
        finally:
            _autograd.DEFER_RESOLVERS.remove(resolve)
            for h in handles:
                h.remove()
            del handles, capture, resolve
        missing = deferrable - state.deferred_nodes
        if missing:
            raise RuntimeError(
                f"customgrad internal error: {len(missing)} customgrad node(s) did not hand "
                "their weight half to the split; please report this with the model."
            )
        for (i, v), g in zip(inputs_with_grad, found):
            dinputs[i] = g
            if g is not None:
                if v.grad is None:
                    v.grad = g
                else:
                    v.grad += g
    if not state.groups:
        state.deferred_nodes = set()  # only W's drop resolver needs them

    # Drop the output side of the graph (views cannot be detached in place; their graph goes
    # when the caller drops them).
    for out in stage_outputs_or_loss:
        if isinstance(out, torch.Tensor) and out.grad_fn is not None and not out._is_view():
            out.detach_()
    return tuple(dinputs), [{_STATE_KEY: state}]


def _state_of(param_groups: object) -> _SplitState:
    state = None
    if isinstance(param_groups, list) and len(param_groups) == 1:
        first = param_groups[0]
        if isinstance(first, dict):
            state = first.get(_STATE_KEY)
    if not isinstance(state, _SplitState):
        got = type(param_groups).__name__
        raise SplitStateError(MSG_FOREIGN_STATE.format(got=got)) from None
    if state.done:
        raise SplitStateError(MSG_REUSED_STATE)
    return state


def stage_backward_weight(
    weights: Iterator[torch.nn.Parameter] | Iterable[torch.Tensor],
    param_groups: list[dict[str, Any]],
    retain_graph: bool = False,
) -> tuple[torch.Tensor | None, ...]:
    """Compute the weights' gradients (W) that :func:`stage_backward_input` set aside.

    Gradients accumulate into ``.grad`` through the autograd engine, one accumulation per
    weight (post-accumulate-grad hooks fire once, as in a full backward).

    Args:
        weights: the stage's weights (e.g. ``module.parameters()``).
        param_groups: what :func:`stage_backward_input` returned; usable once.
        retain_graph: keep the graph's buffers for another backward through it.

    Returns:
        Each weight's ``.grad`` as it was when W started, as torch 2.13's
        ``stage_backward_weight`` returns it: ``None`` for a weight without a gradient yet,
        else the tensor W then accumulates into in place.

    Raises:
        SplitStateError: ``param_groups`` were already used, or came from somewhere else.
    """
    weight_list = [w for w in weights if isinstance(w, torch.Tensor)]
    grads_before = tuple(w.grad for w in weight_list)
    state = _state_of(param_groups)
    state.done = True
    try:
        roots: list[GradientEdge] = []
        values: list[torch.Tensor] = []
        if state.groups:
            _run_groups(state, roots, values)
        for node, nr, g in state.direct:
            roots.append(GradientEdge(node, nr))
            values.append(g)
        for run in state.deferred:
            gradients = getattr(run, "gradients", None)
            if gradients is None:
                run()  # an older core: it sends its gradients itself
                continue
            edges, grads = gradients()
            roots.extend(edges)
            values.extend(grads)
        if roots:
            torch.autograd.backward(roots, grad_tensors=values, retain_graph=retain_graph)
    finally:
        state.clear()
    return grads_before


def _run_groups(state: _SplitState, roots: list[GradientEdge], values: list[torch.Tensor]) -> None:
    """Run each group's intermediates again from the gradients I captured, up to its weights."""
    deferred = state.deferred_nodes

    def resolve(node: Any) -> _autograd.DeferTarget | None:
        return _DROP if node in deferred else None

    _autograd.DEFER_RESOLVERS.insert(0, resolve)
    try:
        for nodes, accs in state.groups:
            edges: list[GradientEdge] = []
            grads: list[torch.Tensor] = []
            for node in nodes:
                for i, g in enumerate(state.captured.get(node, ())):
                    if g is not None:
                        edges.append(GradientEdge(node, i))
                        grads.append(g)
            if not edges:
                continue
            # A node reached both as a root and through another root would add up twice:
            # pin every intermediate of the group to what I saw arrive there.
            handles = []
            if len(nodes) > 1:
                for node in nodes:
                    pinned = state.captured.get(node)
                    if pinned is not None:
                        handles.append(node.register_prehook(lambda _g, p=pinned: p))
            try:
                found = torch.autograd.grad(
                    edges,
                    [GradientEdge(a, 0) for a in accs],
                    grad_outputs=grads,
                    retain_graph=True,
                    allow_unused=True,
                )
            finally:
                for h in handles:
                    h.remove()
            for acc, g in zip(accs, found):
                if g is not None:
                    roots.append(GradientEdge(acc, 0))
                    values.append(g)
    finally:
        _autograd.DEFER_RESOLVERS.remove(resolve)


def _flatten_outputs(
    stage_output: Any, output_grads: Any
) -> tuple[list[torch.Tensor | GradientEdge], list[torch.Tensor | None]]:
    """Pair every output tensor (or edge) that takes a gradient with its gradient."""
    tensors: list[torch.Tensor | GradientEdge] = []
    grads: list[torch.Tensor | None] = []
    stack: list[tuple[Any, Any]] = [(stage_output, output_grads)]
    while stack:
        out, grad = stack.pop()
        if isinstance(out, GradientEdge):
            if grad is None:
                raise ArgumentValueError(
                    "stage_backward: a GradientEdge output requires an output gradient."
                )
            tensors.append(out)
            grads.append(grad)
        elif isinstance(out, torch.Tensor):
            if not out.requires_grad and out.grad_fn is None:
                continue
            if not isinstance(grad, (torch.Tensor, type(None))):
                raise ArgumentTypeError(
                    f"stage_backward: expected a Tensor or None gradient, got {type(grad).__name__}."
                )
            tensors.append(out)
            grads.append(grad)
        elif isinstance(out, (tuple, list)):
            if grad is None:
                continue
            if not isinstance(grad, (tuple, list)) or len(grad) != len(out):
                raise ArgumentValueError(
                    f"stage_backward: gradients for a {type(out).__name__} of {len(out)} outputs "
                    f"must be a tuple or list of the same length, got {grad!r:.80}."
                )
            stack.extend(reversed(list(zip(out, grad))))
        elif isinstance(out, dict):
            if grad is None:
                continue
            if not isinstance(grad, dict) or set(grad) != set(out):
                raise ArgumentValueError(
                    f"stage_backward: gradients for a dict of outputs must be a dict with keys "
                    f"{sorted(map(str, out))}, got {grad!r:.80}."
                )
            stack.extend(reversed([(out[k], grad[k]) for k in out]))
    return tensors, grads


def stage_backward(
    stage_output: Any,
    output_grads: Any,
    input_values: Sequence[Any],
    outputs_with_grads_idxs: list[int] | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """Full backward of a stage: accumulate the weights' gradients, return the inputs'.

    Args:
        stage_output: the stage's output (a tensor, edge, or nested tuple/list/dict of them),
            or its loss.
        output_grads: gradients with the same structure (``None`` for a scalar loss).
        input_values: the stage's inputs.
        outputs_with_grads_idxs: deprecated; selects outputs and gradients by index.

    Returns:
        One gradient per input value (``None`` for non-tensors); inputs' ``.grad`` are reset
        to ``None`` so that the next microbatch does not add to them.

    Example:
        >>> lin = torch.nn.Linear(3, 3)
        >>> x = torch.randn(2, 3, requires_grad=True)
        >>> (dx,) = stage_backward(lin(x).sum(), None, [x])
        >>> dx.shape, x.grad
        (torch.Size([2, 3]), None)
    """
    return _stage_backward(stage_output, output_grads, input_values, outputs_with_grads_idxs)


def _stage_backward(
    stage_output: Any,
    output_grads: Any,
    input_values: Sequence[Any],
    outputs_with_grads_idxs: list[int] | None = None,
    run: Callable[[list[Any], list[Any]], None] | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """:func:`stage_backward`, with ``run(tensors, grads)`` as the backward (default: torch's)."""
    if outputs_with_grads_idxs is not None:
        stage_output = [stage_output[i] for i in outputs_with_grads_idxs]
        output_grads = [output_grads[i] for i in outputs_with_grads_idxs]
    tensors, grads = _flatten_outputs(stage_output, output_grads)
    if tensors:
        if run is None:
            torch.autograd.backward(tensors, grad_tensors=grads)  # type: ignore[arg-type]
        else:
            run(tensors, grads)
    result: list[torch.Tensor | None] = []
    for v in input_values:
        if isinstance(v, torch.Tensor):
            result.append(v.grad)
            v.grad = None
        else:
            result.append(None)
    return tuple(result)
