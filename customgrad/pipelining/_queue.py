"""A weight-gradient queue: customgrad ops' weight halves, kept per stage and microbatch.

A forward run under the queue (:meth:`WeightGradQueue.microbatch`, or every forward of a module
given to :meth:`WeightGradQueue.attach`) tags its customgrad nodes with a
``(stage, microbatch)`` key. The queue's input pass (I), :meth:`WeightGradQueue.backward`,
computes input gradients and native weight gradients now and puts the tagged nodes' weight
halves in the queue under their key; the weight pass (W), :meth:`WeightGradQueue.run`, runs one
key's work later and sends all of it through the autograd engine in one call (``.grad``
accumulates as in a full backward, tensor and post-accumulate-grad hooks fire once per weight),
on the device stream the work was queued on.

Only the queue's own input pass defers work. Any other backward of a tagged forward
(``loss.backward()``, ``torch.autograd.grad(loss, [w])`` for a gradient penalty) computes what
it asks for, with one exception: a module given to :meth:`~WeightGradQueue.attach` is meant for
torch's own ``PipelineStage(dw_builder=queue.dw_builder(stage))``, whose input pass is a plain
``torch.autograd.backward``; a backward that starts at such a module's outputs and accumulates
into ``.grad`` (not ``autograd.grad``) defers its weight halves. The engine then still runs the
deferred weights' accumulators in I with no gradient: their tensor hooks are called with
``None`` and their post-accumulate-grad hooks fire with ``.grad`` unset, in I, and again in W.
``customgrad.pipelining.PipelineStage(..., queue=queue)`` avoids that.

W can also hide communication: inside :meth:`WeightGradQueue.overlap`, a forward's collective
waited for through :meth:`WeightGradQueue.run_while` (an expert-parallel all-to-all) runs queued
weight work while it is in flight; :func:`customgrad.pipelining.overlap_forward_backward` makes
torch's schedules do so.

The forward side (tags, and a module attached to the queue) is :mod:`._tagging`; running queued
work on its stream is :mod:`._streams`; what the queue holds during a step is its ``_Ledger``.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch.autograd.graph import GradientEdge, Node

from customgrad._record import NodeRecord
from customgrad._routing import routing, tagging
from customgrad._split_plan import grad_node, plan_input_pass
from customgrad._torch.engine import current_node
from customgrad._torch.functions import keep_graphs
from customgrad.pipelining._backward import tell_weights_in_regions
from customgrad.pipelining._errors import (
    MissingInputPassError,
    PendingWeightWorkError,
    StrayWeightWorkError,
    WeightPassTwiceError,
)
from customgrad.pipelining._streams import AcceleratorStreams, QueuedWork, StreamPolicy
from customgrad.pipelining._tagging import Attachment, Key, Tag
from customgrad.pipelining._weight_pass import send_gradients

__all__ = [
    "RECORDER",
    "AcceleratorStreams",
    "InFlight",
    "StreamPolicy",
    "WaitRecorder",
    "WeightGradQueue",
]


class InFlight(Protocol):
    """A collective in flight: what ``torch.distributed`` returns with ``async_op=True``
    (``torch.distributed.Work``), or anything that says whether it is done and waits for it."""

    def is_completed(self) -> bool: ...

    def wait(self) -> object: ...


class WaitRecorder(Protocol):
    """What records the waits of :meth:`WeightGradQueue.run_while` and the W run inside them:
    :class:`~customgrad.pipelining.ActionTimer` while it times a step (it sets
    :data:`RECORDER`)."""

    def action(self, kind: str, stage: int, microbatch: int) -> AbstractContextManager[None]: ...

    def record_wait(
        self, label: str, start: float, end: float, overlapped: float, hidden: float
    ) -> None: ...


RECORDER: contextvars.ContextVar[WaitRecorder | None] = contextvars.ContextVar(
    "customgrad_wait_recorder", default=None
)
"""The recorder of the step running here, if any."""

_OVERLAPS: contextvars.ContextVar[tuple[tuple[WeightGradQueue, tuple[Key, ...] | None], ...]] = (
    contextvars.ContextVar("customgrad_overlaps", default=())
)
"""The :meth:`WeightGradQueue.overlap` blocks running here, innermost last: the queue and the
keys whose W may run in a wait (None: any queued)."""

MSG_NO_INPUT_PASS = """\
WeightGradQueue.run(stage={stage}, microbatch={mb}): nothing was queued for this microbatch: \
its input pass (I) never ran, or its forward ran no customgrad op under the queue. Run I \
first, with the forward under the queue:

    with queue.microbatch(stage, mb):     # or queue.attach(stage_module, stage)
        out = stage_module(x)
    queue.backward(out, grad, inputs=[x]) # I: input grads now, weight work queued
    queue.run(stage, mb)                  # W
"""

MSG_TWICE = """\
WeightGradQueue.run(stage={stage}, microbatch={mb}): W already ran for this microbatch in this \
step. Run W once per microbatch, and call queue.finish() when the step ends.
"""

MSG_PENDING = """\
WeightGradQueue.finish({which}): weight-gradient work is still queued for (stage, microbatch) \
{keys}: their W never ran, so those weights' .grad are incomplete. Run \
queue.run(stage, microbatch) for each before the step ends (before optimizer.step()).
"""

MSG_STRAY = """\
WeightGradQueue.dw_builder({which}): expected the weight work of the one microbatch whose \
backward just ran, but work of {n} microbatches was queued since the last dw_builder call: \
(stage, microbatch) {keys}. A forward and backward of a module attached with queue.attach() ran \
outside the pipeline schedule, and running its work here would mix its gradients into this \
step's. Run an attached module's backward only through the schedule (call the handle's \
remove() before other forward+backward passes, and attach again after), or use \
customgrad.pipelining.PipelineStage(..., queue=queue), which queues only the schedule's own \
forwards. Work already queued can still be run with queue.run(stage, microbatch).
"""


class _Ledger:
    """What a queue holds during one step, per ``(stage, microbatch)``: the work queued and not
    yet run, the keys whose W ran, the keys queued since the last ``dw_builder`` call, and the
    numbering of an attached module's microbatches. Backwards on several threads may feed it."""

    def __init__(self) -> None:
        self.pending: dict[Key, list[QueuedWork]] = {}
        # On torch 2.11 and 2.12, what keeps each key's graph alive until its W (keep_graphs).
        self.kept: dict[Key, list[Any]] = {}
        self.done: set[Key] = set()
        self.recent: list[Key] = []
        self._counters: dict[int, int] = {}
        self._lock = threading.Lock()

    def add(self, key: Key, item: QueuedWork) -> None:
        with self._lock:
            if key not in self.pending:
                self.pending[key] = []
                self.recent.append(key)
            self.pending[key].append(item)

    def work_for(self, key: Key) -> list[QueuedWork]:
        """The work queued under ``key``; it stays queued until :meth:`ran`.

        Raises:
            MissingInputPassError: nothing was queued under ``key``.
            WeightPassTwiceError: W already ran for ``key`` in this step.
        """
        stage, microbatch = key
        with self._lock:
            if key in self.done:
                raise WeightPassTwiceError(MSG_TWICE.format(stage=stage, mb=microbatch))
            work = self.pending.get(key)
            if work is None:
                raise MissingInputPassError(MSG_NO_INPUT_PASS.format(stage=stage, mb=microbatch))
        return work

    def ran(self, key: Key) -> None:
        """W ran for ``key``: its work leaves the queue."""
        with self._lock:
            del self.pending[key]
            self.kept.pop(key, None)
            self.done.add(key)

    def next_microbatch(self, stage: int) -> int:
        mb = self._counters.get(stage, 0)
        self._counters[stage] = mb + 1
        return mb

    def finish(self, stage: int | None) -> None:
        """End a step for ``stage`` (or every stage).

        Raises:
            PendingWeightWorkError: some microbatch's W never ran.
        """
        with self._lock:
            keys = [k for k in self.pending if stage is None or k[0] == stage]
            if keys:
                raise PendingWeightWorkError(
                    MSG_PENDING.format(
                        which="" if stage is None else f"stage={stage}",
                        keys=", ".join(map(str, sorted(keys))),
                    )
                )
            self.kept = {k: v for k, v in self.kept.items() if stage is not None and k[0] != stage}
            self.done = {k for k in self.done if stage is not None and k[0] != stage}
            self.recent = [k for k in self.recent if stage is not None and k[0] != stage]
            if stage is None:
                self._counters.clear()
            else:
                self._counters.pop(stage, None)


class WeightGradQueue:
    """Weight-gradient work of customgrad ops, per (stage, microbatch), run when W comes.

    Tag a microbatch's forward with :meth:`microbatch` (or :meth:`attach`), run its input pass
    with :meth:`backward`, and its weight pass with :meth:`run` (or the runner of
    :meth:`dw_builder`); :meth:`finish` ends a step. ``customgrad.pipelining.PipelineStage(...,
    queue=queue)`` does all of this for torch's schedules.

    Deferred weights accumulate as in one full backward: once, in W, tensor hooks and
    post-accumulate-grad hooks included.

    Args:
        sync_streams: when W runs from another device stream than the one its work was queued
            on, run the work on the queued stream and make the current stream wait for it
            (default). With ``False``, such a run raises :class:`StreamSyncError` unless the
            queued work has already finished.
        streams: how device streams are read and switched (default: ``torch.accelerator``).

    Example:
        >>> import customgrad as cg
        >>> queue = WeightGradQueue()
        >>> @cg.op("queue_doc::scale", weights=("w",))
        ... def scale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ...     return x * w
        >>> _ = scale.register_save_for_backward(lambda inputs, out: (inputs.x, inputs.w))
        >>> _ = scale.register_backward_input(lambda ctx, s, g: {"x": g * s[1]})
        >>> _ = scale.register_backward_weight(lambda ctx, s, g: {"w": g * s[0]})
        >>> w = torch.ones(2, requires_grad=True)
        >>> x = torch.full((2,), 3.0, requires_grad=True)
        >>> with queue.microbatch(stage=0, microbatch=0):
        ...     y = scale(x, w)
        >>> queue.backward(y.sum(), inputs=[x])   # I: x.grad now, the weight half is queued
        >>> x.grad, w.grad
        (tensor([1., 1.]), None)
        >>> queue.run(stage=0, microbatch=0)   # W
        >>> w.grad
        tensor([3., 3.])
        >>> queue.finish()
    """

    def __init__(self, *, sync_streams: bool = True, streams: StreamPolicy | None = None) -> None:
        self.sync_streams = sync_streams
        self.streams: StreamPolicy = AcceleratorStreams() if streams is None else streams
        self._ledger = _Ledger()

    # ------------------------------------------------------------------ forward side

    def microbatch(self, stage: int, microbatch: int) -> AbstractContextManager[None]:
        """Run a forward inside this block to queue its customgrad weight work under the key
        when its input pass runs through :meth:`backward`."""
        return tagging(Tag(self, (stage, microbatch), attached=False))

    def attach(self, module: torch.nn.Module, stage: int) -> Attachment:
        """Queue the weight work of every forward of ``module``, numbering microbatches 0, 1, ...

        For ``torch.distributed.pipelining.PipelineStage(module, ..., dw_builder=...)``, whose
        forwards run microbatches in order and whose input pass is a plain backward from the
        module's outputs: such a backward defers the weight halves (see the module docs for
        the hooks it fires early). Numbering restarts after :meth:`finish`. Returns a handle
        whose ``remove()`` detaches the queue.

        Every forward counts, so remove the handle around a forward and backward of the module
        outside the schedule: otherwise the schedule's next :meth:`dw_builder` call finds that
        work too and raises :class:`StrayWeightWorkError`.
        """
        return Attachment(self, module, stage)

    def _next_microbatch(self, stage: int) -> int:
        """The number of an attached module's next forward in this step."""
        return self._ledger.next_microbatch(stage)

    # ------------------------------------------------------------------ backward side

    def backward(
        self,
        outputs: torch.Tensor | GradientEdge | Sequence[torch.Tensor | GradientEdge],
        grad_outputs: torch.Tensor | Sequence[torch.Tensor | None] | None = None,
        *,
        inputs: Sequence[object] = (),
    ) -> None:
        """The input pass (I): input gradients now, customgrad weight halves into the queue.

        Tagged customgrad nodes whose weights nothing else in this pass reaches put their
        weight half in the queue, and their weights' part of the graph is left alone until
        :meth:`run`: ``.grad``, tensor hooks and post-accumulate-grad hooks (DDP/FSDP-style)
        see one accumulation, in :meth:`run`. Everything else (stage inputs, native modules'
        and plain ``autograd.Function``\\ s' weights, weights also used outside customgrad ops)
        gets its gradient now, as in a plain backward.

        Args:
            outputs: what to differentiate (tensors or
                :class:`~torch.autograd.graph.GradientEdge`\\ s).
            grad_outputs: their gradients, as for ``torch.autograd.backward`` (``None`` for a
                scalar loss).
            inputs: the stage's inputs: their gradients accumulate into ``.grad``, and the
                graph is not followed past them (what lies before them is an earlier stage's).
                Entries that are not tensors requiring grad are skipped, so a stage's input
                values can be passed as they are. By default the whole graph is followed.

        Example:
            >>> import customgrad as cg
            >>> @cg.op("queue_doc::mul", weights=("w",))
            ... def mul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            ...     return x * w
            >>> _ = mul.register_save_for_backward(lambda inputs, out: (inputs.x, inputs.w))
            >>> _ = mul.register_backward_input(lambda ctx, s, g: {"x": g * s[1]})
            >>> _ = mul.register_backward_weight(lambda ctx, s, g: {"w": g * s[0]})
            >>> w = torch.ones(2, requires_grad=True)
            >>> _ = w.register_post_accumulate_grad_hook(lambda p: print("hook:", p.grad))
            >>> x = torch.full((2,), 3.0, requires_grad=True)
            >>> queue = WeightGradQueue()
            >>> with queue.microbatch(stage=0, microbatch=0):
            ...     y = mul(x, w)
            >>> queue.backward(y.sum(), inputs=[x])   # I: no hook yet
            >>> x.grad
            tensor([1., 1.])
            >>> queue.run(stage=0, microbatch=0)      # W
            hook: tensor([3., 3.])
            >>> queue.finish()
        """
        if isinstance(outputs, (torch.Tensor, GradientEdge)):
            outputs = [outputs]
        outs = list(outputs)
        grads: list[torch.Tensor | None] | None
        if grad_outputs is None or isinstance(grad_outputs, torch.Tensor):
            grads = None if grad_outputs is None else [grad_outputs]
        else:
            grads = list(grad_outputs)
        roots: list[Node] = []
        for out in outs:
            node = out.node if isinstance(out, GradientEdge) else grad_node(out)
            if node is None:
                # Not differentiable: torch raises its usual error, before running anything.
                torch.autograd.backward(outs, grad_tensors=grads)  # type: ignore[arg-type]
                return
            roots.append(node)
        stage_inputs = [v for v in inputs if isinstance(v, torch.Tensor) and v.requires_grad]
        self._input_pass(outs, grads, roots, stage_inputs)

    def _input_pass(
        self,
        outs: list[torch.Tensor | GradientEdge],
        grads: list[torch.Tensor | None] | None,
        roots: list[Node],
        stage_inputs: list[torch.Tensor],
    ) -> None:
        """Plan I (the tagged customgrad nodes whose weights nothing else in it reaches defer
        their weight half here) and run it."""
        stop = {n for v in stage_inputs if (n := grad_node(v)) is not None}

        def target_of(record: NodeRecord) -> Tag | None:
            tag = record.tag
            return tag if isinstance(tag, Tag) and tag.queue is self else None

        plan = plan_input_pass(roots, stop, target_of, defer_native=False)
        tell_weights_in_regions(plan, functions=False)
        targets: list[torch.Tensor | GradientEdge] = [*stage_inputs]
        targets.extend(GradientEdge(n, 0) for n in plan.targets)
        if not targets:
            return  # nothing in this graph takes a gradient now, and nothing is queued
        with routing(plan.input_routes):
            torch.autograd.backward(
                outs,  # type: ignore[arg-type]
                grad_tensors=grads,
                inputs=targets,  # type: ignore[arg-type]
            )
        keep = keep_graphs(outs)  # torch 2.11 and 2.12: the queued nodes' graph, until W
        if keep:
            for key in {t.key for t in plan.deferred.values() if isinstance(t, Tag)}:
                self._keep(key, keep)

    def _keep(self, key: Key, handles: list[Any]) -> None:
        """Keep ``handles`` (:func:`~customgrad._torch.functions.keep_graphs`) until ``key``'s W
        runs or its stage's step ends."""
        if handles:
            with self._ledger._lock:
                self._ledger.kept.setdefault(key, []).extend(handles)

    def _enqueue(self, key: Key, work: Any) -> None:
        self._ledger.add(key, QueuedWork(work, self.streams.current(work.device)))

    def pending(self) -> list[Key]:
        """The ``(stage, microbatch)`` keys whose W has not run yet, oldest input pass first."""
        return list(self._ledger.pending)

    def ran(self, stage: int, microbatch: int) -> bool:
        """Whether W already ran for this microbatch in this step (by :meth:`run`, a runner, or
        inside a wait)."""
        return (stage, microbatch) in self._ledger.done

    # ------------------------------------------------------------------ hiding communication

    @contextlib.contextmanager
    def overlap(self, keys: Iterable[Key] | None = None) -> Iterator[None]:
        """Inside the block, :meth:`run_while` runs this queue's weight work while it waits.

        Wrap a forward whose collectives (an expert-parallel all-to-all) wait through
        :meth:`run_while`: the W of microbatches whose input pass already ran fills those waits
        instead of leaving the rank idle. What the waits leave stays queued for :meth:`run`.
        Outside the block, :meth:`run_while` only waits, so the same model code runs with and
        without the overlap.

        Args:
            keys: the ``(stage, microbatch)`` keys whose W may run in the block's waits, in that
                order (those not queued, or already run, are passed over); None (the default):
                every key queued when a wait begins, oldest first.

        Example:
            >>> import customgrad as cg
            >>> @cg.op("queue_doc::gain", weights=("w",))
            ... def gain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            ...     return x * w
            >>> _ = gain.register_save_for_backward(lambda inputs, out: (inputs.x, inputs.w))
            >>> _ = gain.register_backward_input(lambda ctx, s, g: {"x": g * s[1]})
            >>> _ = gain.register_backward_weight(lambda ctx, s, g: {"w": g * s[0]})
            >>> class Sending:  # stands for the Work of dist.all_to_all_single(..., async_op=True)
            ...     def is_completed(self) -> bool:
            ...         return False
            ...     def wait(self) -> bool:
            ...         return True
            >>> queue = WeightGradQueue()
            >>> w = torch.ones(2, requires_grad=True)
            >>> x0 = torch.full((2,), 3.0, requires_grad=True)
            >>> with queue.microbatch(stage=0, microbatch=0):
            ...     y0 = gain(x0, w)
            >>> queue.backward(y0.sum(), inputs=[x0])     # I of microbatch 0: its W is queued
            >>> with queue.overlap(), queue.microbatch(stage=0, microbatch=1):
            ...     y1 = gain(torch.ones(2), w)           # microbatch 1's forward...
            ...     queue.run_while(Sending())            # ...waits: microbatch 0's W runs
            [(0, 0)]
            >>> w.grad
            tensor([3., 3.])
            >>> queue.finish()
        """
        token = _OVERLAPS.set((*_OVERLAPS.get(), (self, None if keys is None else tuple(keys))))
        try:
            yield
        finally:
            _OVERLAPS.reset(token)

    def run_while(self, work: InFlight, label: str = "all-to-all") -> list[Key]:
        """Wait for the collective ``work``, running queued weight work while it is in flight.

        The call to put where a model waits for its collective (an expert-parallel all-to-all
        issued with ``async_op=True``), in place of ``work.wait()``. Inside :meth:`overlap`, it
        runs the W of the keys the block allows, one microbatch at a time: the first always
        (it is due), each next one only while ``work`` has not completed; then it waits. W never
        starts inside a backward (the wait of a gradient's all-to-all) nor outside
        :meth:`overlap`: there it only waits. An :class:`ActionTimer` recording the step
        records the wait (:class:`~customgrad.pipelining.CommWait`: hidden and exposed time) and the W as an action
        nested in the one that waited.

        Args:
            work: the collective in flight (``torch.distributed.Work``, or any
                :class:`InFlight`).
            label: what the collective is, as the timer reports it (``"dispatch"`` and
                ``"combine"`` are what :func:`~customgrad.pipelining.stage_costs` turns into an MoE stage's all-to-all
                costs).

        Returns:
            The ``(stage, microbatch)`` keys whose W ran.
        """
        timer = RECORDER.get()
        start = time.perf_counter()
        seen_done: float | None = None
        ran: list[Key] = []
        for key in self._due():
            if seen_done is None and work.is_completed():
                seen_done = time.perf_counter()
            if ran and seen_done is not None:
                break
            with timer.action("W", *key) if timer is not None else contextlib.nullcontext():
                self.run(*key)
            ran.append(key)
        overlapped = time.perf_counter() if ran else start
        work.wait()
        if timer is not None:
            end = time.perf_counter()
            hidden = (overlapped if seen_done is None else min(seen_done, overlapped)) - start
            timer.record_wait(label, start, end, overlapped - start, hidden)
        return ran

    def _due(self) -> list[Key]:
        """The keys a wait may run W for now (see :meth:`run_while`)."""
        scopes = [keys for queue, keys in _OVERLAPS.get() if queue is self]
        if not scopes or current_node() is not None:
            return []
        keys, pending = scopes[-1], self.pending()
        return pending if keys is None else [k for k in keys if k in pending]

    def run(self, stage: int, microbatch: int) -> None:
        """Run W for one microbatch: compute its queued weight gradients and accumulate them.

        Raises:
            MissingInputPassError: nothing was queued for this microbatch.
            WeightPassTwiceError: W already ran for it in this step.
            StreamSyncError: with ``sync_streams=False``, run from a stream that has not waited
                for the one the work was queued on.
        """
        key = (stage, microbatch)
        work = self._ledger.work_for(key)
        roots: list[GradientEdge] = []
        values: list[torch.Tensor] = []
        for item in work:
            item.collect(self.streams, self.sync_streams, key, roots, values)
        self._ledger.ran(key)
        if roots:
            send_gradients(roots, values)

    def finish(self, stage: int | None = None) -> None:
        """End a step (for one stage, or all): check no work is left, start counting anew.

        Raises:
            PendingWeightWorkError: some microbatch's W never ran.
        """
        self._ledger.finish(stage)

    # ------------------------------------------------------------------ PipelineStage

    def dw_builder(self, stage: int | None = None) -> Callable[[], None]:
        """A ``dw_builder`` for ``torch.distributed.pipelining.PipelineStage``.

        The stage calls it right after a microbatch's backward; the runner it returns runs the
        work that backward queued (for ``stage``, or any stage when ``None``).

        Raises:
            StrayWeightWorkError: more than one microbatch's work was queued since the last
                call: a forward and backward of an attached module ran outside the schedule.
        """
        keys = [k for k in self._ledger.recent if stage is None or k[0] == stage]
        if len(keys) > 1:
            raise StrayWeightWorkError(
                MSG_STRAY.format(
                    which="" if stage is None else f"stage={stage}",
                    n=len(keys),
                    keys=", ".join(map(str, keys)),
                )
            )
        return self.runner(keys, strict=True)

    def runner(self, keys: list[Key], *, strict: bool) -> Callable[[], None]:
        """A function that runs W for ``keys``; with ``strict=False``, keys with no work are
        skipped (a stage without customgrad ops queues none)."""
        ledger = self._ledger
        ledger.recent = [k for k in ledger.recent if k not in keys]

        def run() -> None:
            for s, mb in keys:
                if strict or (s, mb) in ledger.pending:
                    self.run(s, mb)

        return run

    def __repr__(self) -> str:
        return f"WeightGradQueue(pending={self.pending()}, done={sorted(self._ledger.done)})"
