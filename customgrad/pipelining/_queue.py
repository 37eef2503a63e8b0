"""A weight-gradient queue: customgrad ops' weight halves, kept per stage and microbatch.

In the input pass (I) of a microbatch whose forward ran under the queue, customgrad ops compute
their input gradients and put their weight-gradient work in the queue under that microbatch's
``(stage, microbatch)`` key. The weight pass (W) runs one key's work later, sends all of it
through the autograd engine in one call (``.grad`` accumulates as in a full backward, post-
accumulate-grad hooks fire once per weight), and respects the device stream the work was queued
on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.autograd.graph import GradientEdge
from torch.utils.hooks import RemovableHandle

from customgrad import _autograd
from customgrad.pipelining._errors import (
    MissingInputPassError,
    PendingWeightWorkError,
    StreamSyncError,
    WeightPassTwiceError,
)
from customgrad.pipelining._graph import weight_edge_mask

__all__ = ["WeightGradQueue"]

Key = tuple[int, int]

MSG_NO_INPUT_PASS = """\
WeightGradQueue.run(stage={stage}, microbatch={mb}): nothing was queued for this microbatch: \
its input pass (I) never ran, or its forward ran no customgrad op under the queue. Run I \
first, with the forward under the queue:

    with queue.microbatch(stage, mb):     # or queue.attach(stage_module, stage)
        out = stage_module(x)
    out.backward(grad)                    # I: input grads now, weight work queued
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


def _resolve(node: Any) -> _autograd.DeferTarget | None:
    """Queue a tagged node's weight half, if the running backward wants its weight gradients.

    A backward that only asks for input gradients (``autograd.grad`` on inputs, a shape
    inference pass) computes no weight half, so it queues nothing either.
    """
    tag = getattr(node, "_cg_tag", None)
    if not isinstance(tag, _Tag):
        return None
    mask = weight_edge_mask(node) or ()
    for (fn, _), is_weight in zip(node.next_functions, mask):
        if is_weight and fn is not None and _autograd.engine_needs(fn):
            return tag
    return None


def _install() -> None:
    if _resolve not in _autograd.DEFER_RESOLVERS:
        _autograd.DEFER_RESOLVERS.append(_resolve)


class WeightGradQueue:
    """Weight-gradient work of customgrad ops, per (stage, microbatch), run when W comes.

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
        >>> y.sum().backward()   # I: x.grad now, the weight half is queued
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
            torch.autograd.backward(roots, grad_tensors=values)

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
        """
        keys = [k for k in self._recent if stage is None or k[0] == stage]
        self._recent = [k for k in self._recent if k not in keys]

        def run() -> None:
            for s, mb in keys:
                self.run(s, mb)

        return run

    def __repr__(self) -> str:
        return f"WeightGradQueue(pending={self.pending()}, done={sorted(self._done)})"
