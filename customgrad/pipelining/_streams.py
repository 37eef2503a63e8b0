"""Device streams of deferred weight work: the stream work was queued on, and running it there.

Weight work queued in the input pass (I) runs in the weight pass (W), perhaps from another
device stream. :class:`QueuedWork` remembers the stream current when the work was queued (and
records an event on it); in W it runs the work on that stream and makes the current stream wait
for it, or, without ``sync_streams``, refuses to run work the current stream has not waited for.
How streams are read and switched is a :class:`StreamPolicy` (``torch.accelerator`` by default),
so that tests can fake streams on CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Protocol

import torch
from torch.autograd.graph import GradientEdge

from customgrad._routing import WeightWork
from customgrad.pipelining._errors import StreamSyncError

__all__ = ["AcceleratorStreams", "QueuedWork", "StreamPolicy", "WeightWork"]

MSG_STREAM = """\
WeightGradQueue.run(stage={stage}, microbatch={mb}): its work was queued on stream {queued} and \
is run from stream {current}, which has not waited for it. Make the current stream wait first \
(current.wait_stream(queued)), or create the queue with WeightGradQueue(sync_streams=True), \
which runs the work on the stream it was queued on and makes the current stream wait for it.
"""


class StreamPolicy(Protocol):
    """How the queue sees device streams (injected, so that tests can fake them on CPU)."""

    def current(self, device: torch.device) -> torch.Stream | None:
        """The current stream of ``device``, or None on a device without streams."""

    def use(self, stream: torch.Stream) -> AbstractContextManager[None]:
        """Make ``stream`` current for its device inside the block."""


class AcceleratorStreams:
    """The streams of ``torch.accelerator`` (CUDA, XPU, ...); none on CPU and meta."""

    def current(self, device: torch.device) -> torch.Stream | None:
        if device.type in ("cpu", "meta"):
            return None
        return torch.accelerator.current_stream(device)

    @contextlib.contextmanager
    def use(self, stream: torch.Stream) -> Iterator[None]:
        prev = torch.accelerator.current_stream(stream.device)
        torch.accelerator.set_stream(stream)
        try:
            yield
        finally:
            torch.accelerator.set_stream(prev)


class QueuedWork:
    """One node's deferred weight work, with the stream it was queued on (None on a device
    without streams) and an event recorded there when it was queued."""

    __slots__ = ("event", "stream", "work")

    def __init__(self, work: WeightWork, stream: torch.Stream | None) -> None:
        self.work = work
        self.stream = stream
        self.event = None if stream is None else stream.record_event()

    def collect(
        self,
        streams: StreamPolicy,
        sync_streams: bool,
        key: tuple[int, int],
        roots: list[GradientEdge],
        values: list[torch.Tensor],
    ) -> None:
        """Compute the work's weight gradients on the stream it was queued on, and append them
        to ``values`` and their edges to ``roots``, keeping no other reference to them (so that
        a leaf's gradient becomes its ``.grad`` without a copy). ``key`` names the microbatch in
        errors.

        Raises:
            StreamSyncError: without ``sync_streams``, the current stream is another one and the
                work has not finished.
        """
        queued = self.stream
        current = None if queued is None else streams.current(queued.device)
        if queued is None or current == queued:
            edges, grads = self.work.gradients()
        elif not sync_streams:
            if self.event is not None and not self.event.query():
                raise StreamSyncError(
                    MSG_STREAM.format(stage=key[0], mb=key[1], queued=queued, current=current)
                )
            edges, grads = self.work.gradients()
        else:
            if current is not None:
                queued.wait_stream(current)
            with streams.use(queued):
                edges, grads = self.work.gradients()
            if current is not None:
                current.wait_stream(queued)
        roots.extend(edges)
        values.extend(grads)
