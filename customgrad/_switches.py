"""Switches for debugging: turn the split off, print the code customgrad writes.

The split switch is read by the core on every call, so it takes effect at once:

- ``CUSTOMGRAD_SPLIT=0`` in the environment, or ``with customgrad.no_split():``, makes every
  customgrad op and every compiled region behave like a plain ``torch.autograd.Function``: its
  whole backward runs in each pass that reaches it (same gradients, work repeated), which is
  what to compare against when a split is suspected of a wrong gradient.
- ``CUSTOMGRAD_SHOW_CODE=1`` prints each piece of code :mod:`customgrad._codegen` writes (a pass
  plan's runner, an op's kernel call) to stderr as it is written.

``CUSTOMGRAD_FASTPATH`` is retired: every call takes the one call path (there is no written
fast path to turn off); setting it warns once, naming ``CUSTOMGRAD_SHOW_CODE``.

The context manager is process-wide (the autograd engine runs CUDA backwards on its own
threads, which a thread-local switch would not reach) and nests.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["SHOW_CODE_ENV", "SPLIT_ENV", "no_split", "split_enabled"]

SPLIT_ENV = "CUSTOMGRAD_SPLIT"
SHOW_CODE_ENV = "CUSTOMGRAD_SHOW_CODE"
RETIRED_ENV = "CUSTOMGRAD_FASTPATH"

MSG_RETIRED = f"""\
{RETIRED_ENV} is retired and has no effect: every customgrad call takes the one call path (there \
is no written fast path to turn off). To print the code customgrad writes, set \
{SHOW_CODE_ENV}=1; to compare against an unsplit backward, set {SPLIT_ENV}=0."""

_OFF = ("0", "false", "off", "no")


def _env_on(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() not in _OFF


class _State:
    """The switches' values: ``split`` is read on hot paths (a plain bool)."""

    __slots__ = ("depth", "lock", "show_code", "split", "split_env")

    def __init__(self) -> None:
        self.split_env = _env_on(SPLIT_ENV)
        self.split = self.split_env
        self.show_code = os.environ.get(SHOW_CODE_ENV, "0").strip().lower() not in ("", *_OFF)
        self.depth = 0
        self.lock = threading.Lock()


STATE = _State()
if RETIRED_ENV in os.environ:
    warnings.warn(MSG_RETIRED, FutureWarning, stacklevel=2)


def split_enabled() -> bool:
    """Whether customgrad splits backwards into input and weight passes (the default)."""
    return STATE.split


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
