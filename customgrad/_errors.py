"""The customgrad error hierarchy.

Every error customgrad raises for user input is a :class:`CustomGradError` and also the
builtin that fits, so ``except TypeError`` and ``except customgrad.CustomGradError`` both work.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

__all__ = [
    "ArgumentTypeError",
    "ArgumentValueError",
    "CustomGradError",
    "DefinitionError",
    "GradientTypeError",
    "GradientValueError",
    "MissingRegistrationError",
    "MutationError",
    "where",
]


class CustomGradError(Exception):
    """Base class of every error customgrad raises for user input."""


class GradientTypeError(CustomGradError, TypeError):
    """A backward returned the wrong kind of object (not a dict, not a Tensor, ...)."""


class GradientValueError(CustomGradError, ValueError):
    """A backward returned a gradient with the wrong keys, shape, dtype, device or length."""


class DefinitionError(CustomGradError, ValueError):
    """An op definition is invalid: its name, its ``weights`` or its annotations."""


class MissingRegistrationError(CustomGradError, RuntimeError):
    """An op was used in a way that needs a registration it does not have."""


class ArgumentTypeError(CustomGradError, TypeError):
    """A customgrad call got arguments of the wrong kind or number (e.g. an op call)."""


class ArgumentValueError(CustomGradError, ValueError):
    """A customgrad call got an argument with a wrong value (e.g. gradients that don't fit)."""


class MutationError(CustomGradError, RuntimeError):
    """An op would mutate in place an argument that requires grad."""


def where(fn: Callable[..., Any] | None) -> str:
    """Return ``file.py:line`` where ``fn`` was defined, for error messages."""
    if fn is None:
        return "<unknown>"
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return getattr(fn, "__qualname__", repr(fn))
    return f"{code.co_filename}:{code.co_firstlineno}"
