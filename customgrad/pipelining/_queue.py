"""A weight-gradient queue: customgrad ops' weight halves, kept per stage and microbatch.

In the input pass (I) of a microbatch whose forward ran under the queue, customgrad ops compute
their input gradients and put their weight-gradient work in the queue under that microbatch's
``(stage, microbatch)`` key. The weight pass (W) runs one key's work later, sends all of it
through the autograd engine in one call (``.grad`` accumulates as in a full backward, post-
accumulate-grad hooks fire once per weight), and respects the device stream the work was queued
on.

I runs through :meth:`WeightGradQueue.backward` (which
:class:`customgrad.pipelining.PipelineStage` uses): a backward that leaves the deferred weights'
part of the graph alone, so their ``AccumulateGrad`` nodes (and the hooks on them) run once, in
W. A plain ``Tensor.backward()`` of a queued forward still queues the weight halves (that is
what torch's own ``PipelineStage`` runs), but the engine then also runs the deferred weights'
accumulators with no gradient: their post-accumulate-grad hooks fire in I with ``.grad`` unset,
and again in W.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node
from torch.utils.hooks import RemovableHandle

from customgrad import _autograd
from customgrad.pipelining._errors import (
    MissingInputPassError,
    PendingWeightWorkError,
    StrayWeightWorkError,
    StreamSyncError,
    WeightPassTwiceError,
)
from customgrad.pipelining._graph import grad_node, weight_edge_mask

__all__ = ["WeightGradQueue"]

Key = tuple[int, int]

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

MSG_STREAM = """\
WeightGradQueue.run(stage={stage}, microbatch={mb}): its work was queued on stream {queued} and \
is run from stream {current}, which has not waited for it. Make the current stream wait first \
(current.wait_stream(queued)), or create the queue with WeightGradQueue(sync_streams=True), \
which runs the work on the stream it was queued on and makes the current stream wait for it.
"""


def _current_stream(device: torch.device) -> Any:
    """The current stream of ``device`` (``None`` on CPU and devices without streams)."""
    if device.type in ("cpu", "meta"):
        return None
    return torch.accelerator.current_stream(device)


@contextlib.contextmanager
def _use_stream(stream: Any) -> Iterator[None]:
    """Make ``stream`` current for its device inside the block."""
    prev = torch.accelerator.current_stream(stream.device)
    torch.accelerator.set_stream(stream)
    try:
        yield
    finally:
        torch.accelerator.set_stream(prev)


class _Work:
    __slots__ = ("event", "run", "stream")

    def __init__(self, run: Callable[[], None], stream: Any) -> None:
        self.run = run
        self.stream = stream
        self.event = None if stream is None else stream.record_event()


class _Attachment:
    """What :meth:`WeightGradQueue.attach` returns: ``remove()`` detaches the queue."""

    def __init__(self, *handles: RemovableHandle) -> None:
        self._handles = handles

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


class _Tag:
    """What a forward under the queue leaves on each customgrad node (``node._cg_tag``)."""

    __slots__ = ("key", "queue")

    def __init__(self, queue: WeightGradQueue, key: Key) -> None:
        self.queue = queue
        self.key = key

    def defer(self, node: Any, run: Callable[[], None]) -> None:
        self.queue._enqueue(self.key, node, run)


def _compute(item: _Work, roots: list[GradientEdge], values: list[torch.Tensor]) -> None:
    gradients = getattr(item.run, "gradients", None)
    if gradients is None:
        item.run()  # an older core: it sends its gradients itself
        return
    edges, grads = gradients()
    roots.extend(edges)
    values.extend(grads)


_INPUT_PASSES: list[dict[Node, _Tag | None]] = []
"""One entry per running :meth:`WeightGradQueue.backward`: its tagged nodes, and where each goes.

Read by the resolver from whatever thread the engine runs a node on (CUDA backward runs on
device threads), so it is a plain shared list, not a thread-local or a context variable.
"""


def _resolve(node: Any) -> _autograd.DeferTarget | None:
    """Where a tagged customgrad node's weight half goes, if anywhere.

    - In an input pass run by :meth:`WeightGradQueue.backward`: as that pass planned it.
    - In a queue's weight pass (W): nowhere; W computes everything it reaches.
    - In any other backward (a plain ``Tensor.backward()``, torch's stage): queued if the
      backward wants the node's weight gradients. A backward that only asks for input gradients
      (``autograd.grad`` on inputs, a shape inference pass) computes no weight half, so it queues
      nothing either.
    """
    tag = getattr(node, "_cg_tag", None)
    if not isinstance(tag, _Tag):
        return None
    for plan in _INPUT_PASSES:
        if node in plan:
            return plan[node]
    if tag.queue._weight_passes:
        return None
    mask = weight_edge_mask(node) or ()
    for (fn, _), is_weight in zip(node.next_functions, mask):
        if is_weight and fn is not None and _autograd.engine_needs(fn):
            return tag
    return None


def _split_children(node: Node) -> tuple[list[Node], list[Node]]:
    """A customgrad node's children along its non-weight edges, and along its weight edges."""
    mask = weight_edge_mask(node) or ()
    others: list[Node] = []
    weights: list[Node] = []
    for i, (fn, _) in enumerate(node.next_functions):
        if fn is not None:
            (weights if i < len(mask) and mask[i] else others).append(fn)
    return others, weights


def _reach(
    starts: Sequence[Node], stop: set[Node], cut: dict[Node, list[Node]] | None = None
) -> set[Node]:
    """Nodes reachable from ``starts``, not past ``stop``; a node in ``cut`` leads only to
    ``cut[node]``."""
    seen: set[Node] = set()
    stack = list(starts)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in stop:
            continue
        if cut is not None and node in cut:
            stack.extend(cut[node])
        else:
            stack.extend(fn for fn, _ in node.next_functions if fn is not None)
    return seen


def _plan_input_pass(
    roots: Sequence[Node], stop: set[Node]
) -> tuple[dict[Node, _Tag | None], list[Node]]:
    """Plan an input pass: which tagged nodes defer their weight half, which nodes must run.

    A tagged node defers when nothing on its weights' side of the graph is needed by the rest of
    the pass (no stage input, nothing another path reaches). Returns the plan (tagged node ->
    tag to defer to, or ``None`` to compute in place) and the nodes the engine must run: every
    leaf accumulator reached without crossing a deferring node's weight edges, and the
    deferring nodes themselves (they run for their input half, or to hand over their work).
    """
    everything = _reach(roots, stop)
    tags: dict[Node, _Tag] = {}
    for node in everything:
        tag = getattr(node, "_cg_tag", None)
        if isinstance(tag, _Tag):
            tags[node] = tag
    cut: dict[Node, list[Node]] = {}
    weight_side: dict[Node, set[Node]] = {}
    for node in tags:
        others, weights = _split_children(node)
        cut[node] = others
        weight_side[node] = _reach(weights, stop)
    while True:
        live = _reach(roots, stop, cut)
        clash = [n for n in cut if not weight_side[n].isdisjoint(live) or weight_side[n] & stop]
        if not clash:
            break
        for n in clash:
            del cut[n]
    deferring = cut
    plan: dict[Node, _Tag | None] = {n: (t if n in deferring else None) for n, t in tags.items()}
    targets = [
        n
        for n in live
        if n in deferring or (n not in stop and not n.next_functions and hasattr(n, "variable"))
    ]
    return plan, targets


def _install() -> None:
    if _resolve not in _autograd.DEFER_RESOLVERS:
        _autograd.DEFER_RESOLVERS.append(_resolve)


class WeightGradQueue:
    """Weight-gradient work of customgrad ops, per (stage, microbatch), run when W comes.

    Tag a microbatch's forward with :meth:`microbatch` (or :meth:`attach`), run its input pass
    with :meth:`backward`, and its weight pass with :meth:`run` (or the runner of
    :meth:`dw_builder`); :meth:`finish` ends a step. ``customgrad.pipelining.PipelineStage(...,
    queue=queue)`` does all of this for torch's schedules.

    Deferred weights accumulate as in one full backward: once, in W, post-accumulate-grad hooks
    included. That needs the input pass to be :meth:`backward` (customgrad's ``PipelineStage``
    runs it). A plain ``Tensor.backward()`` of a tagged forward (and torch's own
    ``PipelineStage(dw_builder=queue.dw_builder)``, which runs ``torch.autograd.backward``
    itself) still queues the weight halves and gives the same ``.grad``, but the engine runs the
    deferred weights' accumulators in I too, with no gradient: their post-accumulate-grad hooks
    fire once in I with ``.grad`` unset, then again in W. DDP's reducer, which wants each
    parameter ready once, cannot be used that way.

    Args:
        sync_streams: when W runs from another device stream than the one its work was queued
            on, run the work on the queued stream and make the current stream wait for it
            (default). With ``False``, such a run raises :class:`StreamSyncError` unless the
            queued work has already finished.

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

    def __init__(self, *, sync_streams: bool = True) -> None:
        self.sync_streams = sync_streams
        self._pending: dict[Key, list[_Work]] = {}
        self._done: set[Key] = set()
        self._recent: list[Key] = []
        self._counters: dict[int, int] = {}
        self._weight_passes = 0

    # ------------------------------------------------------------------ forward side

    @contextlib.contextmanager
    def microbatch(self, stage: int, microbatch: int) -> Iterator[None]:
        """Run a forward inside this block to queue its customgrad weight work under the key."""
        _install()
        token = _autograd.FORWARD_TAG.set(_Tag(self, (stage, microbatch)))
        try:
            yield
        finally:
            _autograd.FORWARD_TAG.reset(token)

    def attach(self, module: torch.nn.Module, stage: int) -> _Attachment:
        """Queue the weight work of every forward of ``module``, numbering microbatches 0, 1, ...

        For ``torch.distributed.pipelining.PipelineStage(module, ..., dw_builder=...)``, whose
        forwards run microbatches in order; numbering restarts after :meth:`finish`.
        Returns a handle whose ``remove()`` detaches the queue.

        Every forward counts, so remove the handle around a forward and backward of the module
        outside the schedule: otherwise the schedule's next :meth:`dw_builder` call finds that
        work too and raises :class:`StrayWeightWorkError`. torch's stage runs its input pass as
        a plain full backward, so queued weights' post-accumulate-grad hooks fire in I (with no
        gradient) as well as in W; ``customgrad.pipelining.PipelineStage(..., queue=queue)``
        needs no ``attach`` and fires them once, in W.
        """
        _install()
        tokens: list[Any] = []

        def pre(mod: torch.nn.Module, args: Any) -> None:
            mb = self._counters.get(stage, 0)
            self._counters[stage] = mb + 1
            tokens.append(_autograd.FORWARD_TAG.set(_Tag(self, (stage, mb))))

        def post(mod: torch.nn.Module, args: Any, out: Any) -> None:
            if tokens:
                _autograd.FORWARD_TAG.reset(tokens.pop())

        return _Attachment(
            module.register_forward_pre_hook(pre),
            module.register_forward_hook(post, always_call=True),
        )

    # ------------------------------------------------------------------ backward side

    def backward(
        self,
        outputs: torch.Tensor | GradientEdge | Sequence[torch.Tensor | GradientEdge],
        grad_outputs: torch.Tensor | Sequence[torch.Tensor | None] | None = None,
        *,
        inputs: Sequence[Any] = (),
    ) -> None:
        """The input pass (I): ``torch.autograd.backward``, with queued weights left for W.

        Runs the backward of ``outputs`` as ``torch.autograd.backward(outputs, grad_outputs)``
        would, except for the weights whose gradients only come through customgrad ops queued
        by this pass: those ops compute their input half now and queue their weight half, and
        the engine does not touch the weights' side of the graph at all, so their ``.grad`` and
        post-accumulate-grad hooks (DDP/FSDP-style) see one accumulation, in :meth:`run`.
        Everything else (stage inputs, native modules' and plain ``autograd.Function``\\ s'
        weights, weights also used outside customgrad ops) gets its gradient now, as in a plain
        backward.

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
        _install()
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
        stop = {n for v in stage_inputs if (n := grad_node(v)) is not None}
        plan, nodes = _plan_input_pass(roots, stop)
        targets: list[torch.Tensor | GradientEdge] = [*stage_inputs]
        targets.extend(GradientEdge(n, 0) for n in nodes)
        if not targets:
            return  # nothing in this graph takes a gradient now, and nothing is queued
        _INPUT_PASSES.append(plan)
        try:
            torch.autograd.backward(
                outs,  # type: ignore[arg-type]
                grad_tensors=grads,
                inputs=targets,  # type: ignore[arg-type]
            )
        finally:
            _INPUT_PASSES.remove(plan)

    def _enqueue(self, key: Key, node: Any, run: Callable[[], None]) -> None:
        device = next((m[2] for m in node._cg_meta if m is not None), torch.device("cpu"))
        if key not in self._pending:
            self._pending[key] = []
            self._recent.append(key)
        self._pending[key].append(_Work(run, _current_stream(device)))

    def pending(self) -> list[Key]:
        """The ``(stage, microbatch)`` keys whose W has not run yet."""
        return list(self._pending)

    def run(self, stage: int, microbatch: int) -> None:
        """Run W for one microbatch: compute its queued weight gradients and accumulate them.

        Raises:
            MissingInputPassError: nothing was queued for this microbatch.
            WeightPassTwiceError: W already ran for it in this step.
            StreamSyncError: with ``sync_streams=False``, run from a stream that has not waited
                for the one the work was queued on.
        """
        key = (stage, microbatch)
        if key in self._done:
            raise WeightPassTwiceError(MSG_TWICE.format(stage=stage, mb=microbatch))
        work = self._pending.get(key)
        if work is None:
            raise MissingInputPassError(MSG_NO_INPUT_PASS.format(stage=stage, mb=microbatch))
        roots: list[GradientEdge] = []
        values: list[torch.Tensor] = []
        for item in work:
            self._collect(key, item, roots, values)
        del self._pending[key]
        self._done.add(key)
        if roots:
            self._weight_passes += 1
            try:
                torch.autograd.backward(roots, grad_tensors=values)
            finally:
                self._weight_passes -= 1

    def _collect(
        self, key: Key, item: _Work, roots: list[GradientEdge], values: list[torch.Tensor]
    ) -> None:
        queued = item.stream
        current = None if queued is None else _current_stream(queued.device)
        if queued is None or current == queued:
            _compute(item, roots, values)
        elif not self.sync_streams:
            if item.event is not None and not item.event.query():
                raise StreamSyncError(
                    MSG_STREAM.format(stage=key[0], mb=key[1], queued=queued, current=current)
                )
            _compute(item, roots, values)
        else:
            if current is not None:
                queued.wait_stream(current)
            with _use_stream(queued):
                _compute(item, roots, values)
            if current is not None:
                current.wait_stream(queued)

    def finish(self, stage: int | None = None) -> None:
        """End a step (for one stage, or all): check no work is left, start counting anew.

        Raises:
            PendingWeightWorkError: some microbatch's W never ran.
        """
        keys = [k for k in self._pending if stage is None or k[0] == stage]
        if keys:
            raise PendingWeightWorkError(
                MSG_PENDING.format(
                    which="" if stage is None else f"stage={stage}",
                    keys=", ".join(map(str, sorted(keys))),
                )
            )
        self._done = {k for k in self._done if stage is not None and k[0] != stage}
        self._recent = [k for k in self._recent if stage is not None and k[0] != stage]
        if stage is None:
            self._counters.clear()
        else:
            self._counters.pop(stage, None)

    # ------------------------------------------------------------------ PipelineStage

    def dw_builder(self, stage: int | None = None) -> Callable[[], None]:
        """A ``dw_builder`` for ``torch.distributed.pipelining.PipelineStage``.

        The stage calls it right after a microbatch's backward; the runner it returns runs the
        work that backward queued (for ``stage``, or any stage when ``None``).

        Raises:
            StrayWeightWorkError: more than one microbatch's work was queued since the last
                call: a forward and backward of an attached module ran outside the schedule.
        """
        keys = [k for k in self._recent if stage is None or k[0] == stage]
        if len(keys) > 1:
            raise StrayWeightWorkError(
                MSG_STRAY.format(
                    which="" if stage is None else f"stage={stage}",
                    n=len(keys),
                    keys=", ".join(map(str, keys)),
                )
            )
        return self._runner(keys, strict=True)

    def _runner(self, keys: list[Key], *, strict: bool) -> Callable[[], None]:
        """A runner for ``keys``' W; with ``strict=False``, keys with no work are skipped."""
        self._recent = [k for k in self._recent if k not in keys]

        def run() -> None:
            for s, mb in keys:
                if strict or (s, mb) in self._pending:
                    self.run(s, mb)

        return run

    def __repr__(self) -> str:
        return f"WeightGradQueue(pending={self.pending()}, done={sorted(self._done)})"
