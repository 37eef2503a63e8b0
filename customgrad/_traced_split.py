"""A single backward captured for one input signature, run as a split program.

A :class:`TracedSplit` is the aten graph of one capture (:mod:`customgrad._capture`) as a
:class:`customgrad._split_program.SplitProgram` whose gradient slots are the backward's
gradients by argument name. It is shared by every node of the op whose call selects that
capture; a node's own state (what its input pass kept for its weight pass) travels through
:meth:`TracedSplit.run`'s ``handoff`` (a :class:`customgrad._handoff.Kept`, kept on the node's
record by the generated runner). Each pass is a generated :class:`torch.fx.GraphModule`
(straight-line Python calling aten ops, through torch's C++-parsed bindings where they run
exactly the node's op), so a call costs about what a hand-written pair costs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias, cast

import optree
import torch
import torch.fx as fx

from customgrad._handoff import Kept
from customgrad._rules import Gradient, OpSpec
from customgrad._saving import SAVED
from customgrad._split_program import Pass, ProgramCut, SplitProgram
from customgrad._torch.dispatcher import OpOverload, TorchDispatchMode, aten_callables
from customgrad._torch.dispatcher import disable_current_modes as _disable_current_modes
from customgrad._torch.fake import detect_fake_mode

__all__ = ["TRACE_LOCK", "Layout", "Slot", "Structure", "TracedSplit", "flatten"]

_Tensor = torch.Tensor

TRACE_LOCK = threading.RLock()
"""One capture or pass build at a time in the process: dynamo, ``make_fx`` and fake modes keep
global state."""

Gradients = dict[str, Gradient]

Slot: TypeAlias = "int | list[int | None] | None"
"""Where a gradient sits among a pass's outputs: a position, None (no gradient), or one of those
per item of a list argument."""
Layout: TypeAlias = "list[tuple[str, Slot]]"
"""Each gradient of the backward by argument name, with its :data:`Slot`."""
Structure: TypeAlias = "int | tuple[int, optree.PyTreeSpec, optree.PyTreeSpec]"
"""How the leaves of (saved values, output gradients) make those: the number of saved values
when both are flat tuples, else the count and the two trees' specs (:func:`flatten`)."""


def flatten(saved: object, grads: tuple[object, ...]) -> tuple[list[object], Structure]:
    """The leaves of the saved values and the output gradients, and their structure."""
    tree: Any = (saved, grads)  # a pytree of the user's values
    saved_leaves, saved_spec = optree.tree_flatten(tree[0], none_is_leaf=True, namespace=SAVED)
    grad_leaves, grads_spec = optree.tree_flatten(tree[1], none_is_leaf=True)
    return [*saved_leaves, *grad_leaves], (len(saved_leaves), saved_spec, grads_spec)


class _Run:
    """One pass as a node runs it: the pass's function and, per gradient it computes, where it
    sits in the outputs (a position, None, or a list of those for a list argument)."""

    __slots__ = ("at", "cut", "fn", "n_out")

    def __init__(self, p: Pass, layout: Layout, needed: frozenset[str]) -> None:
        self.fn = p.fn
        self.n_out = len(p.slots)
        self.cut: ProgramCut | None = None
        pos: dict[int | None, int | None] = {slot: k for k, slot in enumerate(p.slots)}
        pos[None] = None
        self.at: tuple[tuple[str, Any], ...] = tuple(
            (name, [pos[i] for i in slot] if isinstance(slot, list) else pos[slot])
            for name, slot in layout
            if name in needed
        )

    def result(self, outs: Sequence[torch.Tensor | None]) -> Gradients:
        out: Gradients = {}
        for name, k in self.at:
            if type(k) is int:
                out[name] = outs[k]
            else:
                out[name] = None if k is None else [None if i is None else outs[i] for i in k]
        return out


class TracedSplit:
    """A single backward captured for one input signature, with its split program.

    Attributes:
        op: the op.
        program: the split program of the capture (slots: the backward's gradients).
        graph_module: the whole capture, cleaned, ``(*saved tensors, *output grads) ->
            gradients``.
        requires: the arguments that required grad at capture time.
    """

    def __init__(
        self,
        op: OpSpec,
        gm: fx.GraphModule,
        layout: Layout,
        tensor_idx: list[int],
        all_tensors: bool,
        flat: bool,
        requires: frozenset[str],
        recompute: bool,
    ) -> None:
        self.op = op
        self.requires = requires
        self._layout = layout
        self._tensor_idx = tensor_idx
        self._flat = flat
        # The leaves are all tensors (no None gradient, no plain saved value): they are the
        # arguments of a pass as they are.
        self._all_tensors = all_tensors
        self.program = SplitProgram(
            gm, self._slots(requires), "cheap" if recompute else "none", _generated
        )
        self.graph_module = self.program.graph_module
        outputs = self.program.outputs
        self._fakes: dict[str, Any] = {}
        for name, slot in layout:
            if name not in requires and slot is not None:
                slots = [slot] if isinstance(slot, int) else slot
                vals = [None if i is None else outputs[i].meta.get("val") for i in slots]
                if all(v is None or isinstance(v, _Tensor) for v in vals):
                    self._fakes[name] = vals[0] if isinstance(slot, int) else vals
        self._runs: dict[tuple[Any, ...], _Run] = {}

    def run(
        self,
        saved: object,
        grads: tuple[object, ...],
        needed: frozenset[str],
        handoff: Kept | None,
        keep: bool,
    ) -> tuple[Gradients, Kept | None]:
        """Compute the gradients ``needed``: ``(gradients by name, what to keep for later)``.

        ``handoff`` is what this node's input pass kept (or None); ``keep``: a later pass of
        this node will compute the remaining gradients, so keep what it shares with this one.
        """
        if torch.is_grad_enabled():
            # Outside the engine (a create_graph backward calls the function as written): a
            # deferred weight pass, whose gradients go to .grad. Build no graph for them.
            with torch.no_grad():
                return self.run(saved, grads, needed, handoff, keep)
        leaves: Sequence[object] = (
            cast(tuple[object, ...], saved) + grads if self._flat else flatten(saved, grads)[0]
        )
        args = leaves if self._all_tensors else [leaves[i] for i in self._tensor_idx]
        kept: Kept | None = None
        run = None if handoff is None else self._weight_run(handoff.cut, needed)
        if run is not None:
            result = run.result(run.fn(*args, *handoff.values))  # type: ignore[union-attr]
        elif keep:
            run = self._input_run(needed)
            outs = run.fn(*args)
            result = run.result(outs)
            if len(outs) > run.n_out:
                assert run.cut is not None
                kept = Kept(run.cut, tuple(outs[run.n_out :]))
        else:
            run = self._runs.get(("full", needed)) or self._full_run(needed)
            result = run.result(run.fn(*args))
        if self._fakes:
            # The gradients no pass computes (of arguments that don't require grad), as the
            # capture's fake tensors: customgrad's validation sees every gradient the backward
            # returns, on every call, as it does for a backward called as written.
            for name, value in self._fakes.items():
                result.setdefault(name, value)
        return result, kept

    # -- the runs of the program's passes, per pattern -------------------------------------------
    def _weight_run(self, cut: ProgramCut, needed: frozenset[str]) -> _Run | None:
        """The run of ``cut``'s weight pass for ``needed``, or None where it does not serve."""
        if cut.program is not self.program:
            return None  # kept by another capture's cut
        key = (cut.weight, needed)
        run = self._runs.get(key)
        if run is None:
            slots = self._slots(needed)
            if not slots <= cut.weight:
                return None
            run = self._remember(key, self.program.weight_pass(cut, slots), needed)
        return run

    def _input_run(self, needed: frozenset[str]) -> _Run:
        key = ("input", needed)
        run = self._runs.get(key)
        if run is None:
            cut = self.program.cut(self._slots(self.requires - needed))
            run = self._remember(key, cut.input_pass, needed)
            run.cut = cut
        return run

    def _full_run(self, needed: frozenset[str]) -> _Run:
        key = ("full", needed)
        run = self._runs.get(key)
        if run is None:
            run = self._remember(key, self.program.full(self._slots(needed)), needed)
        return run

    def _remember(self, key: tuple[Any, ...], p: Pass, needed: frozenset[str]) -> _Run:
        run = self._runs[key] = _Run(p, self._layout, needed)
        return run

    def _slots(self, names: frozenset[str]) -> frozenset[int]:
        """The program's slots of the gradients of ``names``."""
        slots: set[int] = set()
        for name, slot in self._layout:
            if name in names:
                if isinstance(slot, int):
                    slots.add(slot)
                elif isinstance(slot, list):
                    slots.update(i for i in slot if i is not None)
        return frozenset(slots)

    # -- reporting ---------------------------------------------------------------------------------
    def describe(self) -> str:
        """What each pass runs, in words."""
        weights = self.op.signature.weight_set
        need_w = self.requires & weights
        need_in = self.requires - weights
        total = self.program.n_ops
        if not need_w or not need_in:
            only = "weights" if need_w else "inputs"
            return (
                f"split automatically (traced: {total} ops, all in one pass: only its {only} "
                f"required grad, so there was nothing to split)"
            )
        cut = self.program.cut(self._slots(need_w))
        again = sum(1 for n in cut.recomputed if n.op == "call_function")
        return (
            f"split automatically (traced: {total} ops; the input pass runs "
            f"{cut.input_pass.n_ops}, the weight pass {cut.weight_pass.n_ops}; {len(cut.kept)} "
            f"tensor(s) handed from the input pass to the weight pass, {again} op(s) recomputed "
            f"there)"
        )

    def __repr__(self) -> str:
        return f"<TracedSplit of {self.op.name} for {sorted(self.requires)}>"


def _generated(gm: fx.GraphModule, examples: list[Any]) -> Callable[..., Any]:
    """A traced pass's compiler: the pass's graph as generated Python, each aten op called
    through torch's binding where that runs exactly the op (:func:`_binding`)."""
    with TRACE_LOCK, _disable_current_modes():  # checking bindings runs fake ops
        for node in gm.graph.nodes:
            if node.op == "call_function":
                node.target = _binding(node) or node.target
    gm.recompile()
    forward: Callable[..., Any] = gm.forward
    return forward


class _SeenOps(TorchDispatchMode):
    """Records the aten ops a call dispatches."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops: list[OpOverload] = []

    def __torch_dispatch__(
        self,
        func: OpOverload,
        types: Sequence[type],
        args: Sequence[object] = (),
        kwargs: dict[str, object] | None = None,
    ) -> object:
        if func.namespace != "prim":  # metadata queries (prim.device) are not ops that run
            self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _binding(node: fx.Node) -> Callable[..., Any] | None:
    """torch's Python binding that runs exactly the node's aten op (``torch.mm`` for
    ``aten.mm.default``), or None.

    A binding parses its arguments in C++ and skips the boxed call of an ``OpOverload``: half
    the overhead on small tensors. It is used only when calling it on the node's fake inputs
    dispatches the node's op and nothing else.
    """
    target = node.target
    if not isinstance(target, OpOverload) or target.namespace != "aten":
        return None
    name = target.overloadpacket.__name__
    # torch.split and Tensor.split (& co.) are Python wrappers: only the builtins themselves.
    function, method = aten_callables(name)
    if function is not None and getattr(torch, name, None) is function:
        fn: Any = function
    elif method is not None and getattr(torch.Tensor, name, None) is method:
        fn = method
    else:
        return None
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    fake = detect_fake_mode([*args, *kwargs.values()])
    if fake is None:
        return None
    seen = _SeenOps()
    try:
        with fake, seen:
            fn(*args, **kwargs)
    except Exception:
        return None
    return fn if seen.ops == [target] else None
