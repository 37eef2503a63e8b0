"""Switches for debugging: turn the split off, turn the generated fast path off.

Both are read by the core on every call, so they take effect at once:

- ``CUSTOMGRAD_SPLIT=0`` in the environment, or ``with customgrad.no_split():``, makes every
  customgrad op and every compiled region behave like a plain ``torch.autograd.Function``: its
  whole backward runs in each pass that reaches it (same gradients, work repeated), which is
  what to compare against when a split is suspected of a wrong gradient.
- ``CUSTOMGRAD_FASTPATH=0`` makes every call take the general path (the generated per-signature
  code is not used), for debugging the fast path against it; ``CUSTOMGRAD_FASTPATH=show`` keeps
  it on and prints each piece of generated code to stderr as it is written.

The context manager is process-wide (the autograd engine runs CUDA backwards on its own
threads, which a thread-local switch would not reach) and nests.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["FASTPATH_ENV", "SPLIT_ENV", "fastpath_enabled", "no_split", "split_enabled"]

SPLIT_ENV = "CUSTOMGRAD_SPLIT"
FASTPATH_ENV = "CUSTOMGRAD_FASTPATH"

_OFF = ("0", "false", "off", "no")


def _env_on(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() not in _OFF


class _State:
    """The switches' values: ``split`` and ``fastpath`` are read on hot paths (plain bools)."""

    __slots__ = ("depth", "fastpath", "lock", "show_fastpath", "split", "split_env")

    def __init__(self) -> None:
        self.split_env = _env_on(SPLIT_ENV)
        self.split = self.split_env
        self.fastpath = _env_on(FASTPATH_ENV)
        self.show_fastpath = os.environ.get(FASTPATH_ENV, "").strip().lower() == "show"
        self.depth = 0
        self.lock = threading.Lock()


STATE = _State()


def split_enabled() -> bool:
    """Whether customgrad splits backwards into input and weight passes (the default)."""
    return STATE.split


def fastpath_enabled() -> bool:
    """Whether calls may take the generated fast path (the default)."""
    return STATE.fastpath


@contextmanager
def no_split() -> Iterator[None]:
    """Turn the split off inside the block, for every thread, for A/B debugging.

    Every customgrad op and compiled region then computes its whole backward in each pass that
    reaches it, like a plain ``torch.autograd.Function``: the same gradients, with the work
    repeated under a split schedule. ``CUSTOMGRAD_SPLIT=0`` does the same for a whole run.

    Example:
        >>> import customgrad as cg
        >>> with cg.no_split():
        ...     pass  # loss.backward() / a pipeline step here runs unsplit backwards
    """
    with STATE.lock:
        STATE.depth += 1
        STATE.split = False
    try:
        yield
    finally:
        with STATE.lock:
            STATE.depth -= 1
            STATE.split = STATE.split_env and STATE.depth == 0
