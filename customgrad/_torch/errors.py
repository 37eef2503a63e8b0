"""How dynamo and AOTAutograd wrap what is raised while they trace, and the error inside.

An error a customgrad op raises while ``torch.compile`` traces it (a missing fake kernel during
dynamo's fake-tensor propagation, a wrong gradient while AOTAutograd traces the backward)
reaches the caller wrapped: dynamo's ``TorchRuntimeError`` (its text quoting the error, raised
``from None`` over an ``Unsupported`` whose cause is the error), ``BackendCompilerFailed``
(the error in ``inner_exception``), or ``torch.library.opcheck``'s ``OpCheckError`` (the error
as its cause). :func:`wrapped_error` finds the error inside; :func:`errors_first` re-raises it,
for code customgrad runs itself (a module compiled by ``customgrad.compile``), with what torch
raised as its cause. torch's wrapping is left alone everywhere else: nothing is patched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["errors_first", "is_dynamo_error", "wrapped_error"]


def is_dynamo_error(e: BaseException) -> bool:
    """Whether ``e`` is one of dynamo's exceptions (``torch._dynamo.exc.TorchDynamoException``:
    ``TorchRuntimeError``, ``BackendCompilerFailed``, ``Unsupported``, ...)."""
    from torch._dynamo.exc import TorchDynamoException

    return isinstance(e, TorchDynamoException)


def wrapped_error(e: BaseException, kind: type[BaseException]) -> BaseException | None:
    """The first exception of type ``kind`` inside ``e`` (``e`` itself, its causes and contexts,
    a ``BackendCompilerFailed``'s ``inner_exception``), or None."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [e]
    while todo:
        found = todo.pop(0)
        if found is None or id(found) in seen:
            continue
        seen.add(id(found))
        if isinstance(found, kind):
            return found
        inner = getattr(found, "inner_exception", None)
        todo += [inner if isinstance(inner, BaseException) else None]
        todo += [found.__cause__, found.__context__]
    return None


@contextlib.contextmanager
def errors_first(kind: type[BaseException]) -> Iterator[None]:
    """Re-raise an exception of type ``kind`` that dynamo wrapped in the block as itself, with
    dynamo's exception as its cause."""
    try:
        yield
    except Exception as e:
        inner = wrapped_error(e, kind) if is_dynamo_error(e) else None
        if inner is None:
            raise
        raise inner.with_traceback(inner.__traceback__) from e
