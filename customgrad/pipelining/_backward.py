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
  (its node's post-hook sees them all, :class:`~customgrad._handoff.HandOff` kind
  ``"gradients"``, the rule customgrad's own unsplittable ops follow). torch's split runs such
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

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, cast

import torch
from torch.autograd.graph import GradientEdge, Node

from customgrad._errors import ArgumentTypeError, ArgumentValueError
from customgrad._handoff import HandOff, record_pass
from customgrad._record import NodeRecord, record_of
from customgrad._routing import Route, routing
from customgrad._split_plan import (
    InputPassPlan,
    WeightCall,
    grad_node,
    is_leaf_accumulator,
    is_native,
    plan_input_pass,
    reach,
)
from customgrad._torch.engine import input_shape
from customgrad._torch.functions import (
    forward_cls,
    keep_graphs,
    replacing,
    run_backward,
    skipping,
)
from customgrad.pipelining._errors import SplitStateError
from customgrad.pipelining._function_split import FunctionSplit, split_input

__all__ = ["stage_backward", "stage_backward_input", "stage_backward_weight"]

log = logging.getLogger("customgrad")

_TOLD: set[type] = set()
"""The Function classes the log already named (one line per class, not per call)."""


def _tell_once(nodes: list[Node]) -> None:
    """Log, once per Function class, that its backward runs once in I under the split."""
    for node in nodes:
        cls = forward_cls(node)
        if cls is not None and cls not in _TOLD:
            _TOLD.add(cls)
            log.info(
                "customgrad.pipelining: %s.%s is a plain autograd.Function (it cannot split): "
                "its backward runs once, in the input pass, and the weight pass receives the "
                "weight gradients it returned (torch's split runs it twice). Make it a "
                "customgrad op (customgrad.from_function) to split it; "
                "run_functions_once=False runs it as torch does.",
                cls.__module__,
                cls.__qualname__,
            )


def _tell_not_split(cls: type, why: str) -> None:
    """Log, once per Function class, why its backward did not split and runs once in I."""
    if cls not in _TOLD:
        _TOLD.add(cls)
        log.info(
            "customgrad.pipelining: %s.%s is a plain autograd.Function whose backward cannot "
            "split automatically (%s): it runs once, in the input pass, and the weight pass "
            "receives the weight gradients it returned (torch's split runs it twice). Make it "
            "a customgrad op (customgrad.from_function) to split it; "
            "run_functions_once=False runs it as torch does.",
            cls.__module__,
            cls.__qualname__,
            why,
        )


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


@functools.cache
def _with_runtime_error(cls: type[Exception]) -> type[Exception]:
    """``cls`` that is also a ``RuntimeError`` (what torch's drop-ins raise)."""
    return type(cls.__name__, (cls, RuntimeError), {"__module__": cls.__module__})


@contextlib.contextmanager
def _runtime_errors() -> Iterator[None]:
    """Make every error leaving the block a ``RuntimeError`` too, keeping its own class."""
    try:
        yield
    except RuntimeError:
        raise
    except Exception as e:
        try:
            wrapped = _with_runtime_error(type(e))(*e.args)  # type: ignore[arg-type]
        except TypeError:  # a class that can't be combined with RuntimeError, or rebuilt
            raise RuntimeError(str(e)) from e
        raise wrapped.with_traceback(e.__traceback__) from e.__cause__


class _SplitState:
    """What one microbatch's I leaves for its W (the defer target of its customgrad nodes)."""

    __slots__ = (
        "asked_once", "captured", "deferred", "direct", "done", "keep", "once", "once_ids", "plan",
        "ran", "skip", "split", "split_ids", "watch",
    )  # fmt: skip

    def __init__(self) -> None:
        self.deferred: dict[NodeRecord, Any] = {}
        self.captured: dict[Node, tuple[torch.Tensor | None, ...]] = {}
        # Function nodes run once: what each returned in I (None: a weight-side gradient was
        # missing), then, per W call, their hand-offs and the nodes W asks again.
        self.ran: dict[Node, HandOff[Any] | None] = {}
        # Function nodes whose backward split in I: what their weight pass needs, until their
        # post-hook makes it their hand-off.
        self.split: dict[Node, FunctionSplit] = {}
        self.once: dict[int, list[HandOff[Any]]] = {}
        self.asked_once: dict[int, list[tuple[list[Node], list[Node]]]] = {}
        # Per W call: the Function nodes I ran that its engine calls may reach with no gradient
        # (below a node W runs again whose input edges lead to the call's weights): they
        # compute nothing there (see _skipped_below).
        self.skip: dict[int, list[Node]] = {}
        self.once_ids: frozenset[int] = frozenset()
        self.split_ids: frozenset[int] = frozenset()  # the Function nodes that split
        self.direct: dict[int, tuple[Node, int, torch.Tensor]] = {}
        self.plan = InputPassPlan()
        self.done = False
        # On torch 2.11 and 2.12, what keeps the graph alive until W (see keep_graphs).
        self.keep: list[Any] = []
        # What runs while W calls a node itself (explain_split counts its FLOPs to the node).
        self.watch: Callable[[Node], contextlib.AbstractContextManager[Any]] | None = None

    def defer(self, record: NodeRecord, work: Any) -> None:
        self.deferred[record] = work

    def clear(self) -> None:
        self.deferred = {}
        self.captured = {}
        self.ran = {}
        self.split = {}
        self.once = {}
        self.asked_once = {}
        self.skip = {}
        self.direct = {}
        self.plan = InputPassPlan()
        self.keep = []

    def __repr__(self) -> str:
        return (
            f"<customgrad split state: {len(self.deferred)} deferred customgrad weight halves, "
            f"{len(self.once)} Functions run once, "
            f"{len(self.captured)} native intermediates{', used' if self.done else ''}>"
        )


def _edge_of(out: torch.Tensor | GradientEdge) -> tuple[Node, int] | None:
    if isinstance(out, GradientEdge):
        return out.node, out.output_nr
    node = grad_node(out)
    if node is None:
        return None
    return node, (out.output_nr if out.grad_fn is not None else 0)


def _sequence(value: object, what: str, fix: str) -> Sequence[Any]:
    if isinstance(value, (torch.Tensor, GradientEdge)) or not isinstance(value, (list, tuple)):
        raise ArgumentTypeError(
            f"stage_backward_input: {what} must be a list or tuple, got "
            f"{type(value).__name__}. {fix}"
        )
    return value


def stage_backward_input(
    stage_outputs_or_loss: Sequence[torch.Tensor | GradientEdge],
    output_grads: Sequence[torch.Tensor | None] | None,
    input_values: Sequence[Any],
    weights: Iterator[torch.nn.Parameter] | Iterable[torch.Tensor],
    *,
    run_functions_once: bool = True,
    split_functions: bool = True,
) -> tuple[tuple[torch.Tensor | None, ...], list[dict[str, Any]]]:
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
    with _runtime_errors():
        return _stage_backward_input(
            stage_outputs_or_loss,
            output_grads,
            input_values,
            run_functions_once,
            split_functions,
        )


def _pair_outputs(
    stage_outputs_or_loss: Any, output_grads: Any
) -> tuple[list[torch.Tensor | GradientEdge], list[torch.Tensor], list[tuple[Node, int]]]:
    outs = _sequence(stage_outputs_or_loss, "stage_outputs_or_loss", "Pass [loss] for a loss.")
    if output_grads is not None:
        output_grads = _sequence(
            output_grads, "output_grads", "Pass one gradient per output (or None for a loss)."
        )
        if len(output_grads) != len(outs):
            raise ArgumentValueError(
                f"stage_backward_input: {len(outs)} outputs but {len(output_grads)} output "
                f"gradients. Pass one gradient (or None) per output."
            )
    outputs: list[torch.Tensor | GradientEdge] = []
    grads: list[torch.Tensor] = []
    edges: list[tuple[Node, int]] = []
    for i, out in enumerate(outs):
        if isinstance(out, GradientEdge):
            if output_grads is None:
                raise ArgumentValueError(
                    f"stage_backward_input: output {i} is a GradientEdge, which requires "
                    "output gradients; pass output_grads."
                )
        elif not isinstance(out, torch.Tensor):
            raise ArgumentTypeError(
                f"stage_backward_input: output {i} is a {type(out).__name__}; outputs must be "
                f"Tensors or GradientEdges."
            )
        elif not out.requires_grad and out.grad_fn is None:
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
        edges.append(edge)
    return outputs, grads, edges


def _stage_backward_input(
    stage_outputs_or_loss: Any,
    output_grads: Any,
    input_values: Any,
    run_once: bool,
    split_functions: bool = True,
) -> tuple[tuple[torch.Tensor | None, ...], list[dict[str, Any]]]:
    input_values = _sequence(input_values, "input_values", "Pass the stage's inputs as a list.")
    outputs, grads, out_edges = _pair_outputs(stage_outputs_or_loss, output_grads)
    inputs = [
        (i, v)
        for i, v in enumerate(input_values)
        if isinstance(v, torch.Tensor) and v.requires_grad
    ]
    input_nodes = {n for _, v in inputs if (n := grad_node(v)) is not None}
    state = _SplitState()
    plan = plan_input_pass(
        [n for n, _ in out_edges],
        input_nodes,
        lambda record: state,
        defer_native=True,
        run_once=run_once,
    )
    state.plan = plan
    state.direct = {i: (*out_edges[i], grads[i]) for i in plan.direct}
    if plan.once and not split_functions:
        _tell_once(plan.once)

    dinputs: list[torch.Tensor | None] = [None] * len(input_values)
    targets: list[torch.Tensor | GradientEdge] = [v for _, v in inputs]
    targets.extend(GradientEdge(n, 0) for n in plan.targets)
    if targets and outputs:
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
    # The Function nodes that ran once: their hand-offs go by W's call, so that nothing keeps
    # the nodes (and, through their edges, the activation side below them) alive until W.
    ran = state.ran
    split = {n for n, h in ran.items() if h is not None and isinstance(h.value, FunctionSplit)}
    state.once_ids = frozenset(id(n) for n, h in ran.items() if h is not None and n not in split)
    state.split_ids = frozenset(id(n) for n in split)
    state.split = {}
    if split_functions:  # the classes that did not split (those that did say nothing)
        _tell_once([n for n in plan.once if n not in split])
    del split
    for c, call in enumerate(plan.weight_calls):
        handed = [ho for n in call.once if (ho := ran.get(n)) is not None]
        again = [n for n in call.once if n in ran and ran[n] is None]
        if handed:
            state.once[c] = handed
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
    # Drop the output side of the graph (views cannot be detached in place; their graph goes
    # when the caller drops them), and the plan's references to nodes W does not run, which
    # would keep their saved tensors alive until W.
    plan.executed = set()
    plan.input_routes = {}
    # W reads only which nodes were deferred: their targets (this state) would make a cycle
    # (state -> plan -> state) that keeps the nodes and their saved tensors alive past an
    # aborted step until the cyclic GC runs.
    plan.deferred = dict.fromkeys(plan.deferred)  # type: ignore[assignment]
    plan.targets = []
    plan.intermediates = []
    state.keep = keep_graphs(stage_outputs_or_loss)
    for out in stage_outputs_or_loss:
        if isinstance(out, torch.Tensor) and out.grad_fn is not None and not out._is_view():
            out.detach_()
    return tuple(dinputs), [{_STATE_KEY: state}]


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
    state: _SplitState, plan: InputPassPlan, node: Node
) -> Callable[[tuple[Any, ...], tuple[Any, ...]], None]:
    """A post-hook for a Function node that runs once, in I: it keeps, for W, the gradients
    the node's backward returned along its weight-side edges (the engine hands a post-hook
    every gradient the backward returned, after summing each to its edge's shape); I drops
    them, as no node I runs wants them."""
    side = plan.weight_side_edges(node)

    def hook(grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> None:
        work = state.split.pop(node, None)
        if work is not None:  # split: its weight pass runs in W
            state.captured.pop(node, None)
            state.ran[node] = HandOff(record_pass(grad_outputs), "kept", work)
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
        state.ran[node] = HandOff(record_pass(grad_outputs), "gradients", kept)

    return hook


def _split_apply(
    state: _SplitState, plan: InputPassPlan, node: Node
) -> Callable[..., tuple[Any, ...]]:
    """What ``node`` runs in I in place of its backward: the input pass of its split backward,
    leaving the weight pass for W (:mod:`customgrad.pipelining._function_split`), or the
    backward as written where it does not split."""
    side = plan.weight_side_edges(node)

    def apply(*grads: Any) -> tuple[Any, ...]:
        found = split_input(node, side, grads, _tell_not_split)
        if found is None:
            return run_backward(node, grads)  # type: ignore[no-any-return]
        out, work = found
        state.split[node] = work
        return out

    return apply


def _found_state(param_groups: object) -> _SplitState | None:
    """The split state :func:`stage_backward_input` left in its ``param_groups``, if it is one
    (None for anything else; :func:`_state_of` raises)."""
    if isinstance(param_groups, list) and len(param_groups) == 1:
        first = param_groups[0]
        state = first.get(_STATE_KEY) if isinstance(first, dict) else None
        if isinstance(state, _SplitState):
            return state
    return None


def split_functions_of(param_groups: object) -> set[int]:
    """The ``id``\\ s of the plain Function nodes whose backward :func:`stage_backward_input`
    split (input work in I, weight work in W), read off its ``param_groups`` (empty for
    anything else)."""
    state = _found_state(param_groups)
    return set(state.split_ids) if state is not None else set()


def ran_once(param_groups: object) -> set[int]:
    """The ``id``\\ s of the plain Function nodes that :func:`stage_backward_input` ran once,
    handing the weight gradients they returned to W, read off its ``param_groups`` before W runs
    (empty for anything else)."""
    state = _found_state(param_groups)
    return set(state.once_ids) if state is not None else set()


def watch_direct_calls(
    param_groups: object, watch: Callable[[Node], contextlib.AbstractContextManager[Any]]
) -> None:
    """Have W run ``watch(node)`` around each call it makes of a node itself (outside the
    engine: no hook of the node fires), on :func:`stage_backward_input`'s ``param_groups``,
    before W runs (nothing for anything else). For tools that watch W."""
    if isinstance(param_groups, list) and len(param_groups) == 1:
        first = param_groups[0]
        state = first.get(_STATE_KEY) if isinstance(first, dict) else None
        if isinstance(state, _SplitState):
            state.watch = watch


def deferred_nodes(param_groups: object) -> set[Node]:
    """The customgrad nodes whose weight half :func:`stage_backward_input` handed to W, read
    off its ``param_groups`` before W runs (empty for anything else, such as torch's)."""
    state = _found_state(param_groups)
    return set(state.plan.deferred) if state is not None else set()


def deferred_work(param_groups: object) -> dict[NodeRecord, Any]:
    """The weight halves :func:`stage_backward_input` deferred, by node record, read off its
    ``param_groups`` before W runs (W runs the values found here then; empty for anything
    else). For tools that watch W (``explain_split`` counts their FLOPs to their nodes)."""
    state = _found_state(param_groups)
    return state.deferred if state is not None else {}


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

    Gradients accumulate into ``.grad`` through the autograd engine in one call: one
    accumulation per weight, tensor hooks and post-accumulate-grad hooks fire once each, as in
    a full backward (torch's own ``stage_backward_weight`` fires no post-accumulate-grad hooks).

    Args:
        weights: the stage's weights (e.g. ``module.parameters()``).
        param_groups: what :func:`stage_backward_input` returned; usable once.
        retain_graph: keep the graph's buffers for another backward through it.

    Returns:
        Each weight's ``.grad`` as it was when W started, as torch 2.13's
        ``stage_backward_weight`` returns it: ``None`` for a weight without a gradient yet,
        else the tensor W then accumulates into.

    Raises:
        SplitStateError: ``param_groups`` were already used, or came from somewhere else.
    """
    with _runtime_errors():
        weight_list = [w for w in weights if isinstance(w, torch.Tensor)]
        grads_before = tuple(w.grad for w in weight_list)
        state = _state_of(param_groups)
        state.done = True
        try:
            _run_weight_pass(state, retain_graph)
        finally:
            state.clear()
        return grads_before


def _run_weight_pass(state: _SplitState, retain_graph: bool) -> None:
    # Only nodes the plan deferred hand work over (their routes name this state), so every
    # piece of deferred work belongs to one of the plan's calls.
    plan = state.plan
    calls = plan.weight_calls
    last = len(calls) - 1
    with routing(plan.weight_routes):
        for i, call in enumerate(calls):
            _run_weight_call(state, i, call, retain_graph or i < last)


def _run_weight_call(state: _SplitState, index: int, call: WeightCall, retain_graph: bool) -> None:
    """W's engine call number ``index`` (see :class:`customgrad._split_plan.WeightCall`)."""
    plan = state.plan
    roots: list[GradientEdge] = []
    values: list[torch.Tensor] = []
    for group, skip_again in state.asked_once.pop(index, []):
        with skipping(skip_again):
            _run_again(state, group)
    skip = state.skip.pop(index, [])
    clamp = call.clamp
    if call.asked:
        asked = [(n, plan.weight_side_edges(n), state.captured.pop(n, ())) for n in call.asked]
        if not _ask_weight_sides(asked, roots, values, state.watch):  # else the engine, clamped
            for node, _, grads in asked:
                state.captured[node] = grads
            call = dataclasses.replace(call, intermediates=[*call.asked, *call.intermediates])
            clamp = [*call.asked, *clamp]
            skip = [n for n in skip if n not in clamp]
        del asked
    for node in call.intermediates:
        grads = state.captured.pop(node, ())
        for i, g in enumerate(grads):
            if g is not None:
                roots.append(GradientEdge(node, i))
                values.append(g)
        del grads
    for i in call.direct:
        node, nr, g = state.direct.pop(i)
        roots.append(GradientEdge(node, nr))
        values.append(g)
    for handoff in state.once.pop(index, ()):
        value, handoff.value = handoff.value, None
        if isinstance(value, FunctionSplit):
            owner = value.node()
            watching = (
                state.watch(owner)
                if state.watch is not None and owner is not None
                else contextlib.nullcontext()
            )
            del owner
            with watching, torch.no_grad():  # its weight pass, as inside the engine
                split_edges, split_grads = value.gradients()
            roots.extend(split_edges)
            values.extend(split_grads)
            del split_edges, split_grads
        else:
            roots.extend(edge for edge, _ in value)
            values.extend(grad for _, grad in value)
        del value  # send_gradients must hold the only references (see there)
    deferred = state.deferred
    if len(state.plan.weight_calls) == 1:  # all of it belongs to this call
        works = [*deferred.values()]
        deferred.clear()
    else:  # in the order I handed them over
        mine = set(call.deferred)
        works = [deferred.pop(r) for r in [r for r in deferred if r in mine]]
    for work in works:
        with torch.no_grad():  # as inside the engine: no graph of the weight halves' own ops
            edges, grads = work.gradients()
        roots.extend(edges)
        values.extend(grads)
        del edges, grads  # send_gradients must hold the only references (see there)
    if not roots:
        return

    # A plain Function or customgrad intermediate whose input edges lead to this call's leaves
    # (a weight it shares with a layer before it) sends its input gradients again: drop them
    # (I sent them already). Native ones were asked for their weight side only, above.
    handles = [n.register_hook(_weight_side_only(plan.weight_side_edges(n))) for n in clamp]
    leaves = [v for n in call.leaves if isinstance(v := getattr(n, "variable", None),
                                                     torch.Tensor)]  # fmt: skip
    try:
        with contextlib.ExitStack() as regions:
            if clamp:
                # Compiled regions among them compute only their weight side from the start:
                # a route, as customgrad nodes take.
                from customgrad._compiled_backward import region_node

                for n in clamp:
                    holder = region_node(n)
                    if holder is not None:
                        route = Route(needed=plan.weight_side_edges(n))
                        regions.enter_context(routing({holder: route}))
            regions.enter_context(skipping(skip))
            send_gradients(roots, values, inputs=leaves or None, retain_graph=retain_graph)
    finally:
        for h in handles:
            h.remove()


def _sharing_leaves(plan: InputPassPlan, nodes: list[Node]) -> list[list[Node]]:
    """``nodes`` grouped so that nodes whose weight sides reach a common leaf go together."""
    groups: list[tuple[list[Node], set[Node]]] = []
    for node in nodes:
        side = plan.weight_side_edges(node)
        mine = reach([fn for (fn, _), w in zip(node.next_functions, side) if w and fn], set())
        joined = [g for g in groups if not g[1].isdisjoint(mine)]
        merged = ([node], mine)
        for g in joined:
            groups.remove(g)
            merged[0].extend(g[0])
            merged[1].update(g[1])
        groups.append(merged)
    return [g[0] for g in groups]


def _run_again(state: _SplitState, nodes: list[Node]) -> None:
    """Run the Function nodes of I whose backward returned no gradient for a weight-side edge
    (it asks the engine what the pass needs, as a compiled region's does) again, from the
    output gradients that reached them in I, in an engine call of their own that accumulates
    only the leaves below their weight-side edges: they then compute those edges' gradients
    (W drops what they send along their other edges, which I sent already), and their input
    gradient too only where their input edges lead to those leaves as well (a layer below
    them uses the same weight: the engine cannot want one of two edges that lead to one leaf).
    The Functions the call reaches below them compute nothing (the caller skips them)."""
    roots: list[GradientEdge] = []
    values: list[torch.Tensor] = []
    starts: list[Node] = []
    handles = []
    for node in nodes:
        side = state.plan.weight_side_edges(node)
        grads = state.captured.pop(node, ())
        roots += [GradientEdge(node, i) for i, g in enumerate(grads) if g is not None]
        values += [g for g in grads if g is not None]
        starts += [fn for (fn, _), w in zip(node.next_functions, side) if w and fn is not None]
        handles.append(node.register_hook(_weight_side_only(side)))
        del grads
    leaves = [
        v
        for n in reach(starts, set())
        if is_leaf_accumulator(n) and isinstance(v := getattr(n, "variable", None), torch.Tensor)
    ]
    try:
        if roots and leaves:
            send_gradients(roots, values, inputs=leaves, retain_graph=True)
    finally:
        for h in handles:
            h.remove()


def _weight_side_only(side: tuple[bool, ...]) -> Callable[..., tuple[Any, ...]]:
    """A post-hook that drops what a node sends along the edges ``side`` does not mark."""

    def hook(grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(g if w else None for g, w in zip(grad_inputs, side))

    return hook


class _Asking(torch.autograd.Function):
    """A node whose backward runs ``ask()``: an engine call made only to run it, whose
    ``inputs=`` name the edges ``ask`` wants gradients on (see :func:`_ask_weight_sides`)."""

    @staticmethod
    def forward(ctx: Any, ask: Callable[[], None], anchor: torch.Tensor) -> torch.Tensor:
        ctx.ask = ask
        return anchor.new_zeros(())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        ctx.ask()
        return None, None


def _ask_weight_sides(
    asked: list[tuple[Node, tuple[bool, ...], tuple[torch.Tensor | None, ...]]],
    roots: list[GradientEdge],
    values: list[torch.Tensor],
    watch: Callable[[Node], contextlib.AbstractContextManager[Any]] | None = None,
) -> bool:
    """Call each node of ``asked`` (node, which of its edges lead to the weight side,
    the gradients that reached it in I) for its weight-side outputs only; append each to
    ``roots``/``values`` with its edge. False (nothing done) where torch does not say what
    shape a node on those edges takes (``_input_metadata``, read as torch's own
    ``autograd.backward`` reads it for a ``GradientEdge``).

    A native node computes an output only where the running engine call wants its edge's node
    (``task_should_compute_output``). Run inside an engine call whose ``inputs=`` are exactly
    those edges, and that reaches none of them (its only path leads to a fresh anchor), the
    node computes its weight-side outputs and nothing along its input edges, even where those
    lead to the same weights (a weight it shares with a layer before it, where an engine call
    from the node itself would compute its input gradient again, as torch's weight pass does).
    The engine reaches no node of the stage's graph: no hook fires (the nodes the outputs go
    to run later, once, in the call these gradients join), and the node's own hooks already
    fired in I. Any other output it computes anyway is dropped (I sent it already). An output
    that broadcast in the forward (a bias) is summed to its edge's shape, as the engine does
    with what a node returns (a leaf's accumulator takes it as it is: the hand-over does).
    """
    wanted: dict[tuple[Node, int], torch.Size | None] = {}
    for node, side, grads in asked:
        if not is_native(node) and any(g is None for g in grads):
            return False  # the engine would hand a Function's backward zeros there
        for (fn, nr), weight in zip(node.next_functions, side):
            if weight and fn is not None:
                if is_leaf_accumulator(fn):
                    wanted[fn, nr] = None
                else:
                    shape = input_shape(fn, nr)
                    if shape is None:
                        return False
                    wanted[fn, nr] = shape
    if not wanted:
        return True

    def ask() -> None:
        for node, side, grads in asked:
            if not any(g is not None for g in grads):
                continue
            # A customgrad node computes what its W route says; a native one what the running
            # engine call wants.
            with contextlib.nullcontext() if watch is None else watch(node):
                if is_native(node):
                    outputs = list(cast(Callable[..., Sequence[Any]], node)(*grads))
                else:
                    apply = cast(Callable[..., Sequence[Any]], getattr(node, "apply"))  # noqa: B009
                    outputs = _edge_outputs(node, apply(*grads))
            for (fn, nr), weight in zip(node.next_functions, side):
                g = outputs.pop(0)
                if weight and fn is not None and g is not None:
                    shape = wanted[fn, nr]
                    if shape is not None and g.shape != shape:
                        g = g.sum_to_size(shape)
                    roots.append(GradientEdge(fn, nr))
                    values.append(g)
                del g  # send_gradients must hold the only references (see there)

    anchor = torch.zeros((), requires_grad=True)
    with torch.enable_grad():
        out = _Asking.apply(ask, anchor)  # type: ignore[no-untyped-call]
    edges = [GradientEdge(fn, nr) for fn, nr in wanted]
    torch.autograd.grad(
        [out],
        [anchor, *edges],  # type: ignore[arg-type]
        [torch.zeros(())],
        allow_unused=True,
    )
    return True


def _edge_outputs(node: Node, outputs: Sequence[Any]) -> list[Any]:
    """What a customgrad node's backward returned, one per edge (``next_functions``): its
    backward returns one gradient per argument of its Function, the non-Tensor ones included
    (the kernel and the call first, then the flattened arguments)."""
    record = record_of(node)
    assert record is not None
    return [outputs[2 + i] for i, meta in enumerate(record.metas) if meta is not None]


class _HandOver(torch.autograd.Function):
    """A node whose backward returns gradients computed before it ran, one per leaf input.

    The autograd engine lets a leaf's ``AccumulateGrad`` keep an incoming gradient as ``.grad``
    only when nothing else references it; gradients passed to ``torch.autograd.backward`` as
    ``grad_tensors`` are referenced by the caller (and the engine's graph root), so each is
    copied into a new ``.grad``: a weight-sized copy per weight. Returned from a node's backward,
    they are not.
    """

    @staticmethod
    def forward(ctx: Any, holder: list[list[torch.Tensor]], *leaves: torch.Tensor) -> torch.Tensor:
        ctx.holder = holder
        return leaves[0].new_zeros(())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (None, *ctx.holder.pop())


def send_gradients(
    roots: list[GradientEdge],
    values: list[torch.Tensor],
    inputs: list[torch.Tensor] | None = None,
    retain_graph: bool = False,
) -> None:
    """``torch.autograd.backward(roots, values, ...)``, emptying ``values``: gradients bound for
    a leaf's accumulator become its ``.grad`` without a copy when the caller holds no other
    reference to them (see :class:`_HandOver`); hooks and accumulation are the engine's."""
    leaves: list[torch.Tensor] = []
    handed: list[torch.Tensor] = []
    other_roots: list[torch.Tensor | GradientEdge] = []
    other_values: list[torch.Tensor] = []
    grad: torch.Tensor | None = None
    for edge, grad in zip(roots, values):
        if is_leaf_accumulator(edge.node):
            leaves.append(edge.node.variable)  # type: ignore[attr-defined]
            handed.append(grad)
        else:
            other_roots.append(edge)
            other_values.append(grad)
    values.clear()
    grad = None  # no reference left here to what is handed over
    if leaves:
        with torch.enable_grad():
            out = _HandOver.apply([handed], *leaves)  # type: ignore[no-untyped-call]
        del handed
        other_roots.append(out)
        other_values.append(torch.zeros_like(out))
    if other_roots:
        torch.autograd.backward(
            other_roots,  # type: ignore[arg-type]
            grad_tensors=other_values,
            inputs=inputs,
            retain_graph=retain_graph,
        )


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
) -> tuple[torch.Tensor | None, ...]:
    """Full backward of a stage: accumulate the weights' gradients, return the inputs'.

    Args:
        stage_output: the stage's output (a tensor, edge, or nested tuple/list/dict of them),
            or its loss.
        output_grads: gradients with the same structure (``None`` for a scalar loss).
        input_values: the stage's inputs.

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
    with _runtime_errors():
        return run_stage_backward(stage_output, output_grads, input_values)


def run_stage_backward(
    stage_output: Any,
    output_grads: Any,
    input_values: Sequence[Any],
    run: Callable[[list[Any], list[Any]], None] | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """:func:`stage_backward`, with ``run(tensors, grads)`` as the backward (default: torch's)."""
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
