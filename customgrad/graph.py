"""Explain how a stage's backward splits into an input pass (I) and a weight pass (W), and draw it.

:func:`explain_split` runs the backward of a stage three ways on the same graph, watching every
autograd node: once in full, then split the way pipeline schedules split it (I with
``stage_backward_input``, then W with ``stage_backward_weight``). For every node it reports in
which pass it ran and the FLOPs it did in each (counted with torch's formulas), and it names the
nodes that **compute twice**: plain ``torch.autograd.Function``\\ s and ``torch.library.custom_op``\\ s
run their whole backward in both passes, and any node whose I and W FLOPs add up to more than
its full-backward FLOPs.

Reading the report:

- ``I``: the node ran in the input pass only; ``W``: in the weight pass only;
- ``I+W``: it ran in both; fine for native nodes and customgrad ops, which compute only what the
  pass needs, and flagged ``TWICE`` for nodes that cannot (or measurably did not);
- customgrad's deferred weight work runs outside the engine in W; its FLOPs count to the node
  that deferred it, so every FLOP is on a node's (and a module's) row.

``str(report)`` groups the nodes by the module that made them (named from the weights' names:
pass ``module.named_parameters()``), one row per module; ``report.table("node")`` lists every
node. A compiled region's row says what its input pass keeps for W, named by module and source
line. Ops whose FLOPs the formulas cannot see (opaque kernels, attention variants without a
formula) are named under the totals.
"""

from __future__ import annotations

import collections
import contextlib
import html
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch.autograd.graph import GradientEdge, Node
from torch.utils.hooks import RemovableHandle

from customgrad import _render
from customgrad._autosplit import describe_node
from customgrad._compile import region_of
from customgrad._errors import ArgumentTypeError, ArgumentValueError
from customgrad._flops import FlopCounter
from customgrad._origin import ValueOrigin
from customgrad._record import record_of
from customgrad._split_plan import children, grad_node
from customgrad._split_run import PASSES, SplitRun, differences
from customgrad._torch.functions import custom_op_of, forward_cls

if TYPE_CHECKING:
    from customgrad.pipelining._streams import WeightWork

__all__ = ["ModuleInfo", "NodeInfo", "NodeKind", "SplitExplanation", "explain_split"]

NodeKind = Literal[
    "customgrad", "native", "function", "custom_op", "compiled", "input", "weight", "leaf"
]
"""What an autograd node is: a customgrad op, a native (C++) node, a plain
``autograd.Function``, a ``torch.library.custom_op``, a region compiled by
:func:`customgrad.compile`, the leaf of a stage input or weight, or another leaf."""


@dataclass(frozen=True)
class NodeInfo:
    """One node of the stage's autograd graph and what it did in each pass.

    Attributes:
        label: a readable name, e.g. ``"mylib::linear"``, ``"MyFn (autograd.Function)"``,
            ``"AddmmBackward0"``; repeated names get ``#2``, ``#3``, ...
        kind: see :data:`NodeKind`.
        phases: the passes of the split it ran in, a subset of ``{"input", "weight"}``.
        flops: FLOPs it did in the ``"full"`` backward and in the ``"input"`` and ``"weight"``
            passes.
        depth: distance from the stage outputs (0 for the node that produced an output).
        computes_twice: it ran in both passes and cannot restrict itself to what each pass
            needs (a plain ``autograd.Function`` or ``custom_op``), or its I and W FLOPs add up
            to more than its full FLOPs.
        deferred: a customgrad op whose weight half the I pass set aside for W (customgrad's
            split); that work runs outside the engine in W, and its FLOPs count to this node.
        auto_split: for a customgrad op with one backward split automatically
            (``split="auto"``): what each pass runs, or why it was not split (it then runs
            whole in each pass that needs a gradient). None for other nodes.
        compiled: for a region compiled by :func:`customgrad.compile`: which graph runs in
            I and which in W and what I keeps for W, or why it fell back to its full
            backward. None for other nodes.
        module: the path of the module whose forward made the node (``"layers.0.attn"``;
            ``""`` for the stage's own code or when unknown). Told from the weights' names and
            the order the forward made the nodes in: a module owns the nodes made between
            the first and the last use of its parameters, so the ops a module runs before its
            first parameter (an RMSNorm's statistics) count to the module around it.
        kept: for a compiled region: the values its input pass keeps for W, with where the
            forward code made each (module path, source line).
    """

    label: str
    kind: NodeKind
    phases: frozenset[str]
    flops: dict[str, int]
    depth: int
    computes_twice: bool
    deferred: bool = False
    auto_split: str | None = None
    compiled: str | None = None
    module: str = ""
    kept: tuple[ValueOrigin, ...] = ()

    @property
    def repeated_flops(self) -> int:
        """FLOPs done in I and W beyond those of the full backward (0 when none)."""
        return max(0, self.flops["input"] + self.flops["weight"] - self.flops["full"])

    @property
    def runs_in(self) -> str:
        """``"I"``, ``"W"``, ``"I+W"`` or ``"-"`` (did not run)."""
        return {
            frozenset(): "-",
            frozenset({"input"}): "I",
            frozenset({"weight"}): "W",
        }.get(self.phases, "I+W (W deferred)" if self.deferred else "I+W")

    @property
    def color_key(self) -> str:
        if self.computes_twice:
            return "twice"
        return {"-": "none", "I": "input", "W": "weight"}.get(self.runs_in, "both")

    def advice(self) -> str:
        """What to do about a node that computes twice."""
        if self.kind == "customgrad":
            return (
                "a customgrad op re-entered by the weight pass (shared weights under torch's "
                "split: use customgrad.pipelining's split) or whose backward ignores "
                "ctx.needs_input_grad (check it with customgrad.testing.check_op)"
            )
        if self.kind == "compiled":
            if self.compiled is not None and self.compiled.startswith("fell back"):
                return (
                    "a compiled region that runs its full backward in each pass (see why "
                    "below); remove the cause, or leave this block uncompiled"
                )
            return (
                "a compiled region run again by the weight pass from the gradients that "
                "reached it in I, because a node it sends input gradients to runs in W too "
                "(the split runs the layers between them again, as for native layers); "
                "compile the stage as one region (customgrad.compile(stage)) so that the "
                "split is planned inside it"
            )
        if self.kind in ("function", "custom_op"):
            return (
                "its backward runs whole in both passes; make it a customgrad op "
                "(register_backward_input/_weight)"
            )
        return "it does more work split than in a full backward"


@dataclass(frozen=True)
class ModuleInfo:
    """The nodes of one module, added up (a row of ``str(report)``).

    Attributes:
        module: the module's path (``""`` for the stage's own code).
        nodes: the module's nodes (not leaves), outputs first.
        flops: FLOPs of its nodes in the ``"full"`` backward and in the ``"input"`` and
            ``"weight"`` passes.
        repeated_flops: FLOPs its nodes repeat in I + W beyond the full backward.
    """

    module: str
    nodes: tuple[NodeInfo, ...]
    flops: dict[str, int]
    repeated_flops: int

    @property
    def runs_in(self) -> str:
        """How many of its nodes run in each pass: ``"3 I, 2 W, 4 I+W"``."""
        counts = collections.Counter(n.runs_in.split(" ")[0] for n in self.nodes)
        return ", ".join(f"{counts[k]} {k}" for k in ("I", "W", "I+W", "-") if counts[k])

    @property
    def computes_twice(self) -> bool:
        """Some of its nodes compute twice."""
        return any(n.computes_twice for n in self.nodes)


@dataclass
class SplitExplanation:
    """What :func:`explain_split` found. ``str()`` gives a table; see also :meth:`to_dot` and
    :meth:`draw`.

    Attributes:
        nodes: every node of the graph, outputs first.
        edges: ``(i, j)`` pairs: node ``i`` sends a gradient to node ``j``.
        flops: total FLOPs of the ``"full"`` backward and of the ``"input"`` and ``"weight"``
            passes, including work done outside any node.
        outside_flops: per pass, FLOPs done outside every node of the graph and outside
            customgrad's deferred weight work (which counts to its node): zero unless
            something else ran inside the passes (a hook doing work, another thread).
        splitter: the module whose ``stage_backward_input``/``stage_backward_weight`` ran.
        uncounted: per pass, calls of ops that may do FLOPs the formulas cannot see (an
            opaque kernel, an op without a formula), by op name: the totals leave them out.
        weight_names: the weights' names in the order given (they order :attr:`modules`).
        ran_once: the labels of the plain ``autograd.Function`` / ``custom_op`` nodes whose
            backward ran once, in I, W receiving the weight gradients it returned
            (customgrad's split; see :attr:`functions`).
        split_functions: the labels of the plain ``autograd.Function`` nodes whose backward
            customgrad's split captured and split: input work in I, weight work in W.
        gradient_errors: per input or weight (by name) whose split gradient differs from the
            full backward's: the largest difference relative to the largest full gradient.
            Empty when the split's gradients equal the full backward's; None when they could
            not be compared: a second full backward of the graph differs from the first (a
            Function's backward changes what it saved, as Liger's fused linear cross entropy
            scales its kept gradients in place), so a backward after the first is no
            reference.
    """

    nodes: list[NodeInfo]
    edges: list[tuple[int, int]]
    flops: dict[str, int]
    outside_flops: dict[str, int] = field(default_factory=dict)
    splitter: str = ""
    uncounted: dict[str, dict[str, int]] = field(default_factory=dict)
    weight_names: tuple[str, ...] = ()
    ran_once: frozenset[str] = frozenset()
    gradient_errors: dict[str, float] | None = field(default_factory=dict)
    split_functions: frozenset[str] = frozenset()

    @property
    def functions(self) -> list[FunctionRun]:
        """The stage's plain ``autograd.Function`` and ``custom_op`` nodes, one entry per
        class and module, with how their backward ran under the split."""
        return _function_runs(self)

    @property
    def modules(self) -> list[ModuleInfo]:
        """The nodes grouped by :attr:`NodeInfo.module` (leaves left out), in the order the
        modules' weights were given (``named_parameters()``: definition order), each module
        before its submodules."""
        groups: dict[str, list[NodeInfo]] = {}
        for n in self.nodes:
            if n.kind not in ("input", "weight", "leaf"):
                groups.setdefault(n.module, []).append(n)

        def rank(module: str) -> tuple[int, int]:
            first = next(
                (
                    i
                    for i, w in enumerate(self.weight_names)
                    if not module or w.startswith(module + ".")
                ),
                len(self.weight_names),
            )
            return first, module.count(".") + bool(module)

        return [
            ModuleInfo(
                name,
                tuple(ns),
                {p: sum(n.flops[p] for n in ns) for p in PASSES},
                sum(n.repeated_flops for n in ns),
            )
            for name, ns in sorted(groups.items(), key=lambda item: rank(item[0]))
        ]

    def table(self, by: Literal["module", "node"] = "module") -> str:
        """The explanation as text: one row per module (``by="module"``, what ``str()`` gives)
        or per autograd node (``by="node"``), then the FLOP totals, what computes twice and
        what each compiled region keeps for W.

        Args:
            by: ``"module"`` or ``"node"``. Without module names (weights given without
                names, or all in one module) the table lists nodes either way.

        Raises:
            ValueError: ``by`` is neither.
        """
        if by not in ("module", "node"):
            raise ArgumentValueError(
                f"SplitExplanation.table: by must be 'module' or 'node', got {by!r}."
            )
        return _render.table(self, by)

    @property
    def input_only(self) -> list[NodeInfo]:
        """Nodes that ran in the input pass only."""
        return [n for n in self.nodes if n.runs_in == "I"]

    @property
    def weight_only(self) -> list[NodeInfo]:
        """Nodes that ran in the weight pass only."""
        return [n for n in self.nodes if n.runs_in == "W"]

    @property
    def both(self) -> list[NodeInfo]:
        """Nodes that ran in both passes."""
        return [n for n in self.nodes if n.runs_in == "I+W"]

    @property
    def computes_twice(self) -> list[NodeInfo]:
        """Nodes that compute (some of) their backward in both passes."""
        return [n for n in self.nodes if n.computes_twice]

    @property
    def repeated_flops(self) -> int:
        """FLOPs of I + W beyond those of the full backward, over the whole stage."""
        return max(0, self.flops["input"] + self.flops["weight"] - self.flops["full"])

    def __str__(self) -> str:
        return _render.table(self, "module") + _functions_section(self)

    def to_dot(self) -> str:
        """The graph in Graphviz DOT: nodes colored by pass, edges in the gradient's direction.

        Returns:
            DOT source; render it with ``dot -Tsvg`` where Graphviz is installed, or use
            :meth:`draw`, which needs only matplotlib.
        """
        return _render.dot(self)

    def draw(self, path: str | Path) -> Path:
        """Draw the graph to a PNG or SVG file, laid out in layers by depth (matplotlib only).

        Args:
            path: where to write; the suffix picks the format (``.png`` or ``.svg``).

        Returns:
            The path written.

        Raises:
            ValueError: the suffix is neither ``.png`` nor ``.svg``.
        """
        return _render.draw(self, Path(path))

    def _repr_html_(self) -> str:
        return f"<pre>{html.escape(str(self))}</pre>"


def _node_kind_and_label(node: Node) -> tuple[NodeKind, str]:
    record = record_of(node)
    if record is not None:
        return "customgrad", record.op.name
    region = region_of(node)
    if region is not None:
        return "compiled", region.name
    cls = forward_cls(node)
    if cls is None:
        return "native", node.name()
    custom_op = custom_op_of(node)
    if custom_op is not None:
        return "custom_op", custom_op.removeprefix("GeneratedBackwardFor_")
    return "function", f"{cls.__qualname__} (autograd.Function)"


def _splitter(name: str | None) -> tuple[str, Any, Any]:
    # Any: the two splitters' types are pipelining/_backward.py's and torch's (untyped)
    if name in (None, "customgrad"):
        try:
            from customgrad import pipelining

            return (
                "customgrad.pipelining",
                pipelining.stage_backward_input,
                pipelining.stage_backward_weight,
            )
        except (ImportError, AttributeError):
            if name == "customgrad":
                raise
    if name not in (None, "torch"):
        raise ArgumentValueError(
            f"explain_split: unknown splitter {name!r}. Use 'customgrad' or 'torch' (or None "
            f"for customgrad's when available)."
        )
    from customgrad._torch.pipelining import torch_split

    return ("torch.distributed.pipelining", *torch_split())


def explain_split(
    outputs: torch.Tensor | Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    weights: Iterable[torch.Tensor]
    | Iterable[tuple[str, torch.Tensor]]
    | Mapping[str, torch.Tensor],
    grad_outputs: Sequence[torch.Tensor] | None = None,
    *,
    splitter: Literal["customgrad", "torch"] | None = None,
) -> SplitExplanation:
    """Explain how a stage's backward splits into the input pass (I) and the weight pass (W).

    Runs the backward three times on the same graph: in full, then I, then W (``.grad`` of
    ``inputs`` and ``weights`` is restored afterwards), and watches every autograd node. The
    graph is used up the way a training step uses it; run the forward again to train.

    Args:
        outputs: the stage outputs (or the loss of the last stage).
        inputs: the stage inputs, usually leaves that require grad.
        weights: the stage parameters, e.g. ``module.parameters()``; give
            ``module.named_parameters()`` (or a dict) to see their names in the report.
        grad_outputs: gradients of ``outputs`` (ones when omitted).
        splitter: whose ``stage_backward_input``/``stage_backward_weight`` to run:
            ``"customgrad"`` (:mod:`customgrad.pipelining`) or ``"torch"``
            (``torch.distributed.pipelining``). By default customgrad's when it is available.

    Returns:
        A :class:`SplitExplanation`.

    Examples:
        >>> import torch
        >>> from customgrad.graph import explain_split
        >>> class Twice(torch.autograd.Function):
        ...     @staticmethod
        ...     def forward(ctx, x, w):
        ...         ctx.save_for_backward(x, w)
        ...         return x @ w
        ...     @staticmethod
        ...     def backward(ctx, g):
        ...         x, w = ctx.saved_tensors
        ...         return g @ w.T, x.T @ g
        >>> x = torch.randn(4, 3, requires_grad=True)
        >>> w = torch.randn(3, 3, requires_grad=True)
        >>> report = explain_split(Twice.apply(x, w), [x], [w])
        >>> [n.label for n in report.computes_twice]  # customgrad's split runs it once
        []
        >>> report.repeated_flops
        0
    """
    outs = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
    for what, value in (("inputs", inputs), ("grad_outputs", grad_outputs)):
        if value is not None and not isinstance(value, (list, tuple)):
            raise ArgumentTypeError(
                f"explain_split: {what} must be a list or tuple of tensors, got "
                f"{type(value).__name__}. Pass [x] for a single tensor."
            )
    inputs = list(inputs)
    weights, names = _named(weights)
    keep = [i for i, o in enumerate(outs) if o.requires_grad]
    outs = [outs[i] for i in keep]
    if grad_outputs is None:
        gouts = [torch.ones_like(o) for o in outs]
    else:
        gouts = [list(grad_outputs)[i] for i in keep]
    splitter_name, backward_input, backward_weight = _splitter(splitter)

    # The graph, outputs first.
    roots = [n for n in (grad_node(o) for o in outs) if n is not None]
    order: list[Node] = []
    index: dict[Node, int] = {}
    queue = collections.deque(roots)
    for r in roots:
        index.setdefault(r, len(index))
    while queue:
        node = queue.popleft()
        order.append(node)
        for nxt in children(node):
            if nxt not in index:
                index[nxt] = len(index)
                queue.append(nxt)
    order.sort(key=index.__getitem__)
    edges = [(index[n], index[nxt]) for n in order for nxt in children(n)]
    depth = _depths(len(order), [index[r] for r in roots], edges)

    # Watch every node: which pass it runs in, and the FLOPs done while it runs.
    measured = SplitRun()
    ran: dict[str, set[int]] = {p: set() for p in (*PASSES, "check")}
    handles: list[RemovableHandle] = []
    for i, node in enumerate(order):

        def pre(grad_outputs: tuple[torch.Tensor | None, ...], i: int = i) -> None:
            ran[measured.phase].add(i)
            measured.counter().key = i

        def post(
            grad_inputs: tuple[torch.Tensor | None, ...],
            grad_outputs: tuple[torch.Tensor | None, ...],
        ) -> None:
            measured.counter().key = None

        handles.append(node.register_prehook(pre))
        handles.append(node.register_hook(post))

    modules = _modules(order, names)
    leaves = [t for t in [*inputs, *weights] if isinstance(t, torch.Tensor)]
    grads_before = [t.grad for t in leaves]
    try:
        wanted = [t for t in leaves if t.requires_grad]

        def full() -> Sequence[torch.Tensor | None]:
            if not (outs and wanted):
                return ()
            grads = [g.clone() for g in gouts]
            return torch.autograd.grad(outs, wanted, grads, retain_graph=True, allow_unused=True)

        full_grads = measured.run("full", full)
        # A second full backward (counted in no pass) must give the first's gradients for the
        # split, which runs after it, to have a reference.
        repeatable = not full_grads or not differences(
            full_grads, measured.run("check", full), wanted, atol=1e-7, rtol=1e-5
        )
        for t in leaves:
            t.grad = None
        dinputs, param_groups = measured.run(
            "input",
            lambda: backward_input(
                [o.clone() for o in outs], [g.clone() for g in gouts], inputs, iter(weights)
            ),
        )
        handed_over = _deferred_nodes(param_groups)
        # The weight halves I deferred run outside any node in W: count them to their node.
        _count_deferred_to_nodes(param_groups, index, measured.counter("weight"))
        _count_direct_calls_to_nodes(param_groups, index, measured.counter("weight"), ran["weight"])
        once_ids = _ran_once(param_groups)
        split_ids = _split_functions(param_groups)
        measured.run("weight", lambda: backward_weight(iter(weights), param_groups))
        split_grads = {id(t): t.grad for t in weights if isinstance(t, torch.Tensor)}
        split_grads.update({id(t): g for t, g in zip(inputs, dinputs)})
        errors = None
        if repeatable:
            got = [split_grads.get(id(t)) for t in wanted]
            errors = {
                names.get(id(wanted[d.at]), f"tensor {d.at} {tuple(wanted[d.at].shape)}"): d.error
                for d in differences(full_grads, got, wanted, atol=1e-6, rtol=1e-4)
            }
    finally:
        for h in handles:
            h.remove()
        for t, g in zip(leaves, grads_before):
            t.grad = g

    input_ids = {id(t) for t in inputs}
    weight_ids = {id(t) for t in weights}
    nodes: list[NodeInfo] = []
    seen: collections.Counter[str] = collections.Counter()
    once_labels: set[str] = set()
    split_labels: set[str] = set()
    for i, node in enumerate(order):
        flops = {p: int(measured.counter(p).by_key.get(i, 0)) for p in PASSES}
        phases = frozenset(p for p in ("input", "weight") if i in ran[p])
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):  # a leaf's gradient accumulator
            kind: NodeKind = "leaf"
            phases = frozenset()
            if id(variable) in input_ids:
                kind, phases = "input", frozenset({"input"})
            elif id(variable) in weight_ids:
                kind, phases = "weight", frozenset({"weight"})
            label = names.get(id(variable), f"{kind} {tuple(variable.shape)}")
            twice = False
        else:
            kind, label = _node_kind_and_label(node)
            both = phases == frozenset({"input", "weight"})
            repeated = flops["input"] + flops["weight"] > flops["full"]
            region = region_of(node) if kind == "compiled" else None
            whole = (kind in ("function", "custom_op") and id(node) not in split_ids) or (
                region is not None and region.status == "fallback"
            )
            twice = both and (whole or repeated)
        seen[label] += 1
        if seen[label] > 1:
            label = f"{label} #{seen[label]}"
        if id(node) in once_ids:
            once_labels.add(label)
        if id(node) in split_ids:
            split_labels.add(label)
        deferred = node in handed_over
        if deferred:
            phases = frozenset({"input", "weight"})
        record = record_of(node)
        auto = None if record is None else describe_node(record)
        region = region_of(node) if kind == "compiled" else None
        compiled = None if region is None else region.describe()  # set for compiled kinds
        kept = () if region is None else region.kept
        nodes.append(
            NodeInfo(
                label,
                kind,
                phases,
                flops,
                depth[i],
                twice,
                deferred,
                auto,
                compiled,
                "(inputs)" if kind == "input" else modules[i],
                kept,
            )
        )
    counters = {p: measured.counter(p) for p in PASSES}
    totals = {p: counters[p].total for p in PASSES}
    outside = {p: int(counters[p].by_key.get(None, 0)) for p in PASSES}
    uncounted = {p: dict(counters[p].uncounted) for p in PASSES if counters[p].uncounted}
    return SplitExplanation(
        nodes,
        edges,
        totals,
        outside,
        splitter_name,
        uncounted,
        tuple(names.values()),
        frozenset(once_labels),
        errors,
        frozenset(split_labels),
    )


def _named(
    weights: Iterable[torch.Tensor]
    | Iterable[tuple[str, torch.Tensor]]
    | Mapping[str, torch.Tensor],
) -> tuple[list[torch.Tensor], dict[int, str]]:
    items: list[Any] = list(weights.items() if isinstance(weights, Mapping) else weights)
    tensors: list[torch.Tensor] = []
    names: dict[int, str] = {}
    for item in items:
        if isinstance(item, tuple):
            name, t = item
            names[id(t)] = name
        else:
            t = item
        tensors.append(t)
    return tensors, names


def _sequence_nr(node: Node) -> int | None:
    """The order the forward made ``node`` in (autograd's sequence number; None for leaves,
    or where this torch has none)."""
    if getattr(node, "variable", None) is not None:
        return None
    get = getattr(node, "_sequence_nr", None)
    try:
        return int(get()) if get is not None else None
    except (RuntimeError, TypeError):
        return None


def _common(paths: Iterable[str]) -> str:
    """The innermost module holding all ``paths`` (``"a.b"``, ``"a.c"`` -> ``"a"``)."""
    parts = [p.split(".") if p else [] for p in paths]
    common: list[str] = []
    for level in zip(*parts):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    return ".".join(common)


def _modules(order: list[Node], names: dict[int, str]) -> list[str]:
    """The module path of each node (see :attr:`NodeInfo.module`).

    A parameter ``"a.b.weight"`` belongs to module ``"a.b"``; a node that reaches it through a
    chain of one-edge nodes (``TBackward0``, views) uses it. A module spans the sequence
    numbers from its first to its last such node, its submodules' included; each node goes
    to the innermost module whose span holds it.
    """
    owner: dict[Node, str] = {}  # node -> module of the parameter its one-edge chain reaches
    for node in reversed(order):  # leaves and deep nodes first
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            name = names.get(id(variable))
            if name is not None:
                owner[node] = name.rpartition(".")[0]
            continue
        edges = [f for f in children(node)]
        if len(edges) == 1 and edges[0] in owner:
            owner[node] = owner[edges[0]]
    spans: dict[str, list[int]] = {}
    module_of: list[str | None] = [None] * len(order)
    for i, node in enumerate(order):
        if getattr(node, "variable", None) is not None:
            module_of[i] = owner.get(node, "")
            continue
        used = [owner[f] for f in children(node) if f in owner]
        if node in owner:
            used.append(owner[node])
        seq = _sequence_nr(node)
        if not used or seq is None:
            continue
        module = module_of[i] = _common(used)
        parts = module.split(".") if module else []
        for k in range(len(parts) + 1):  # the module and every module around it
            span = spans.setdefault(".".join(parts[:k]), [seq, seq])
            span[0], span[1] = min(span[0], seq), max(span[1], seq)
    for i, node in enumerate(order):
        if module_of[i] is None:
            seq = _sequence_nr(node)
            inside = [m for m, (lo, hi) in spans.items() if seq is not None and lo <= seq <= hi]
            module_of[i] = max(inside, key=lambda m: len(m.split(".")) if m else 0, default="")
    return [m or "" for m in module_of]


def _depths(n: int, roots: list[int], edges: list[tuple[int, int]]) -> list[int]:
    """Longest distance from a root, so every edge points to a deeper layer."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    indegree = [0] * n
    for a, b in edges:
        children[a].append(b)
        indegree[b] += 1
    depth = [0] * n
    ready = collections.deque(i for i in range(n) if indegree[i] == 0)
    while ready:
        a = ready.popleft()
        for b in children[a]:
            depth[b] = max(depth[b], depth[a] + 1)
            indegree[b] -= 1
            if indegree[b] == 0:
                ready.append(b)
    return depth


class _CountedWork:
    """A deferred weight half whose FLOPs count to its node's row (``key``) while it runs."""

    __slots__ = ("_counter", "_key", "_work")

    def __init__(self, work: WeightWork, counter: FlopCounter, key: int) -> None:
        self._work = work
        self._counter = counter
        self._key = key

    @property
    def device(self) -> torch.device:
        return self._work.device

    def gradients(self) -> tuple[list[GradientEdge], list[torch.Tensor]]:
        before = self._counter.key
        self._counter.key = self._key
        try:
            return self._work.gradients()
        finally:
            self._counter.key = before

    def __call__(self) -> None:
        roots, values = self.gradients()
        if roots:
            torch.autograd.backward(roots, grad_tensors=values)


def _count_deferred_to_nodes(
    param_groups: object, index: Mapping[Node, int], counter: FlopCounter
) -> None:
    """Make the weight halves customgrad's I deferred count their FLOPs to their nodes when W
    runs them (nothing to do for torch's split, which defers none)."""
    try:
        from customgrad.pipelining._split_state import deferred_work
    except ImportError:  # pragma: no cover - torch without pipelining
        return
    works = deferred_work(param_groups)
    key_of = {id(record_of(node)): i for node, i in index.items() if record_of(node) is not None}
    for record, work in works.items():
        key = key_of.get(id(record))
        if key is not None:
            works[record] = _CountedWork(work, counter, key)


def _count_direct_calls_to_nodes(
    param_groups: object, index: Mapping[Node, int], counter: FlopCounter, ran: set[int]
) -> None:
    """Make the nodes customgrad's W calls itself (for their weight side only, outside the
    engine: their hooks do not fire) count as running in W, with their FLOPs."""
    try:
        from customgrad.pipelining._split_state import watch_direct_calls
    except ImportError:  # pragma: no cover - torch without pipelining
        return

    @contextlib.contextmanager
    def watch(node: Node) -> Iterator[None]:
        key = index.get(node)
        before = counter.key
        if key is not None:
            ran.add(key)
            counter.key = key
        try:
            yield
        finally:
            counter.key = before

    watch_direct_calls(param_groups, watch)


def _deferred_nodes(param_groups: object) -> set[Node]:
    """The nodes whose weight half customgrad's split handed to W (none for torch's split)."""
    try:
        from customgrad.pipelining._split_state import deferred_nodes
    except ImportError:  # pragma: no cover - torch without pipelining
        return set()
    return deferred_nodes(param_groups)


# --- plain autograd.Functions: how each ran, and whether the split's gradients are right -----


@dataclass(frozen=True)
class FunctionRun:
    """A plain ``autograd.Function`` (or ``custom_op``) class of the stage, in one module.

    Attributes:
        label: the class, e.g. ``"LigerRMSNormFunction (autograd.Function)"``.
        module: the module whose forward made its nodes (see :attr:`NodeInfo.module`).
        calls: how many nodes of the graph it made.
        how: ``"once"`` (its backward ran once, in I; W received the weight gradients it
            returned: customgrad's split), ``"split"`` (customgrad's split captured its
            backward and split it: input work in I, weight work in W), ``"twice"`` (it ran whole in I and again in W:
            torch's split, or ``run_functions_once=False``), ``"I"`` or ``"W"`` (it ran in one
            pass only: it has no edge into the weight side, or lies wholly on it).
    """

    label: str
    module: str
    calls: int
    how: str


def _function_runs(report: SplitExplanation) -> list[FunctionRun]:
    rows: dict[tuple[str, str, str], int] = {}
    for n in report.nodes:
        if n.kind not in ("function", "custom_op"):
            continue
        label = n.label.rsplit(" #", 1)[0]
        if n.label in report.ran_once:
            how = "once"
        elif n.label in report.split_functions:
            how = "split"
        elif n.computes_twice:
            how = "twice"
        else:
            how = n.runs_in
        key = (label, n.module, how)
        rows[key] = rows.get(key, 0) + 1
    return [FunctionRun(label, module, calls, how) for (label, module, how), calls in rows.items()]


def _functions_section(report: SplitExplanation) -> str:
    """The report's lines on plain Functions and on the split's gradients."""
    lines: list[str] = []
    runs = report.functions
    if runs:
        lines.append("Plain autograd.Functions:")
        for r in runs:
            where = f" in {r.module}" if r.module else ""
            what = {
                "once": "backward ran once, in I; W received the weight gradients it returned",
                "twice": "backward ran whole in I and again in W",
                "split": "backward captured and split: input work in I, weight work in W",
            }.get(r.how, f"ran in {r.how} only")
            lines.append(f"  - {r.label}{where}, {r.calls} call(s): {what}")
        if any(r.how == "twice" for r in runs):
            lines.append(
                "  customgrad.pipelining's split runs each once (splitter='customgrad'); "
                "customgrad.from_function makes one split."
            )
    if report.gradient_errors is None:
        lines.append(
            "Gradients not compared: a second backward of this graph differs from the first (a "
            "Function's backward changes what it saved), so the split, run after the full "
            "backward, has no reference. Compare a training step's gradients instead."
        )
    elif report.gradient_errors:
        worst = sorted(report.gradient_errors.items(), key=lambda kv: -kv[1])
        shown = ", ".join(f"{name} {err:.3g}" for name, err in worst[:6])
        lines.append(
            f"The split's gradients differ from the full backward's (largest difference "
            f"relative to the gradient): {shown}."
        )
    return "".join(f"\n{line}" for line in lines)


def _split_functions(param_groups: object) -> set[int]:
    """The ids of the plain Function nodes customgrad's split split (none for torch's)."""
    try:
        from customgrad.pipelining._split_state import split_functions_of
    except ImportError:  # pragma: no cover - torch without pipelining
        return set()
    return split_functions_of(param_groups)


def _ran_once(param_groups: object) -> set[int]:
    """The ids of the plain Function nodes customgrad's split ran once (none for torch's)."""
    try:
        from customgrad.pipelining._split_state import ran_once
    except ImportError:  # pragma: no cover - torch without pipelining
        return set()
    return ran_once(param_groups)
