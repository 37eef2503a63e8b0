"""The customgrad error hierarchy.

Every error customgrad raises for user input is a :class:`CustomGradError` and also the
builtin that fits, so ``except TypeError`` and ``except customgrad.CustomGradError`` both work.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable

__all__ = [
    "ArgumentTypeError",
    "ArgumentValueError",
    "CustomGradError",
    "DefinitionError",
    "DoubleBackwardError",
    "GradientTypeError",
    "GradientValueError",
    "KernelOutputError",
    "MissingRegistrationError",
    "MutationError",
    "UnsupportedError",
    "UnsupportedTorchError",
    "where",
]


class CustomGradError(Exception):
    """Base class of every error customgrad raises for user input."""

    def __repr__(self) -> str:
        # Read as the traceback shows it: torch quotes a wrapped error by its repr (dynamo's
        # "got ...(...)" under torch.compile), where the default would print the message's
        # line breaks and code as escapes.
        return f"{type(self).__name__}: {self}"


class GradientTypeError(CustomGradError, TypeError):
    """A backward returned the wrong kind of object (not a dict, not a Tensor, ...)."""


class GradientValueError(CustomGradError, ValueError):
    """A backward returned a gradient with the wrong keys, shape, dtype, device or length."""


class DefinitionError(CustomGradError, ValueError):
    """An op definition is invalid: its name, its ``weights``, its annotations or a registration."""


class MissingRegistrationError(CustomGradError, RuntimeError):
    """An op was used in a way that needs a registration it does not have."""


class ArgumentTypeError(CustomGradError, TypeError):
    """A customgrad call got arguments of the wrong kind or number (e.g. an op call)."""


class ArgumentValueError(CustomGradError, ValueError):
    """A customgrad call got an argument with a wrong value (e.g. gradients that don't fit)."""


class MutationError(CustomGradError, RuntimeError):
    """Something was modified in place that must not be: a mutated argument that requires grad,
    or a gradient or saved tensor written to by a backward."""


class KernelOutputError(CustomGradError, RuntimeError):
    """A kernel returned something its schema does not allow (None, an input, an alias)."""


class UnsupportedError(CustomGradError, RuntimeError):
    """A transform or feature customgrad ops do not support (e.g. ``torch.vmap``)."""


class DoubleBackwardError(UnsupportedError):
    """Double backward reached what customgrad cannot differentiate: the gradients of a
    backward registered with ``differentiable=False``, a residual, a tensor a Function's forward
    computed and saved. ``check_op`` reports ``gradgradcheck`` as not applicable."""


class UnsupportedTorchError(UnsupportedError):
    """What the installed torch release cannot do with customgrad ops; the message names the
    release that can and what to use instead."""


def where(fn: Callable[..., object] | None) -> str:
    """Return ``file.py:line`` where ``fn`` was defined, for error messages.

    Builtins and other callables without Python source give their qualified name.
    """
    if fn is None:
        return "<unknown>"
    with contextlib.suppress(ValueError):  # a wrapper cycle
        fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
        return str(name) if name else repr(fn)
    return f"{code.co_filename}:{code.co_firstlineno}"
