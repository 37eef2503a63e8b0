"""The forward side of the weight-gradient queue: what tagged customgrad nodes carry, and a module
attached to a queue.

A forward under ``queue.microbatch(stage, mb)`` tags the customgrad nodes it creates with a
:class:`Tag`: the queue and the ``(stage, microbatch)`` key their weight halves go under when
the queue's input pass defers them. ``queue.attach(module, stage)`` tags every forward of the
module instead (:class:`Attachment`, microbatches numbered in order) and plans, when a backward
reaches the module's outputs, which nodes' weight halves that backward defers: torch's
``PipelineStage(dw_builder=...)`` runs its input pass as a plain backward, not through the queue.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
from torch.autograd.graph import Node

from customgrad._record import NodeRecord, record_of
from customgrad._routing import Route, Routed, WeightWork, install_for_task, tagging
from customgrad._split_plan import is_leaf_accumulator, plan_input_pass, reach
from customgrad._torch import engine
from customgrad._torch.functions import keep_graphs

if TYPE_CHECKING:
    from customgrad.pipelining._queue import WeightGradQueue

__all__ = ["Attachment", "Key", "Tag"]

Key = tuple[int, int]

_will_execute = engine.will_execute


class Tag:
    """What a forward under the queue tags its customgrad nodes with: where their weight halves
    go when the queue's input pass defers them."""

    __slots__ = ("attached", "key", "queue")

    def __init__(self, queue: WeightGradQueue, key: Key, attached: bool) -> None:
        self.queue = queue
        self.key = key
        self.attached = attached

    def defer(self, record: Routed, work: WeightWork) -> None:
        self.queue._enqueue(self.key, work)


class Attachment:
    """What :meth:`WeightGradQueue.attach` returns: the module's forwards are tagged for the
    queue until ``remove()`` detaches it.

    Args:
        queue: the queue.
        module: the module whose forwards are tagged.
        stage: the stage the module is; each forward is the stage's next microbatch.
    """

    def __init__(self, queue: WeightGradQueue, module: torch.nn.Module, stage: int) -> None:
        self._queue = queue
        self._stage = stage
        self._tags: list[tuple[contextlib.ExitStack, Key]] = []
        self._handles = (
            module.register_forward_pre_hook(self._pre),
            module.register_forward_hook(self._post, always_call=True),
        )

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def _pre(self, mod: torch.nn.Module, args: tuple[object, ...]) -> None:
        mb = self._queue._next_microbatch(self._stage)
        stack = contextlib.ExitStack()
        stack.enter_context(tagging(Tag(self._queue, (self._stage, mb), attached=True)))
        self._tags.append((stack, (self._stage, mb)))

    def _post(self, mod: torch.nn.Module, args: tuple[object, ...], out: object) -> None:
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if self._tags:
            stack, key = self._tags.pop()
            stack.close()
            self._queue._keep(key, keep_graphs(outs))  # torch 2.11 and 2.12: until its W
        for o in outs:
            if isinstance(o, torch.Tensor) and o.grad_fn is not None:
                self._plan_at(o.grad_fn)

    def _plan_at(self, root: Node) -> None:
        """Plan the backward that reaches ``root`` (an attached module's output) when it runs."""
        queue = self._queue
        planned = [-1]

        def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            task = engine.graph_task_id()
            if planned[0] == task:
                return
            planned[0] = task

            def target_of(record: NodeRecord) -> Tag | None:
                tag = record.tag
                if isinstance(tag, Tag) and tag.queue is queue and tag.attached:
                    return tag
                return None

            plan = plan_input_pass([root], set(), target_of, defer_native=False)
            routes: dict[NodeRecord, Route] = {}
            for node, target in plan.deferred.items():
                record = record_of(node)
                if record is not None and _accumulates(node, record):
                    weights = record.edge_is_weight()
                    routes[record] = Route(
                        needed=tuple(False if w else None for w in weights), defer=target
                    )
            install_for_task(routes)

        root.register_prehook(hook)


def _accumulates(node: Node, record: NodeRecord) -> bool:
    """Whether the running backward accumulates into ``.grad`` (rather than captures, as
    ``autograd.grad`` does, or skips) the gradient of every leaf on ``node``'s weight side."""
    if _will_execute is None:
        return False
    weights = [fn for (fn, _), w in zip(node.next_functions, record.edge_is_weight()) if w and fn]
    for leaf in reach(weights, set()):
        if is_leaf_accumulator(leaf):
            try:
                if not _will_execute(leaf):
                    return False  # not needed now: nothing to defer
            except Exception:  # a leaf captured by autograd.grad: compute it now
                return False
    return True
