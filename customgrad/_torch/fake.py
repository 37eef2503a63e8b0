"""Fake and functional tensors and fake modes (``torch._subclasses``, ``torch._guards``).

Imported lazily: ``torch._subclasses.fake_tensor`` is not loaded by ``import torch``, and
``import customgrad`` should not load it either.

- :func:`fake_tensor_type`, :func:`functional_tensor_type`, :func:`fake_tensor_mode_type`: the
  classes (``FakeTensor``, ``FunctionalTensor``, ``FakeTensorMode``);
- :func:`is_fake`: whether a value is a ``FakeTensor``;
- :func:`detect_fake_mode`: the fake mode of some values or of the running trace
  (``torch._guards.detect_fake_mode``);
- :func:`data_dependent_errors`: what fake tensors raise for an output that depends on data
  (``DataDependentOutputException``) or of a shape that does (``DynamicOutputShapeException``);
- :func:`set_device_guards`: what a fake mode installs first without a usable CUDA device, done
  in the calling thread before a worker thread enters one;
- :data:`FAKE_TENSOR_LOGGER`: the logger name of ``torch._subclasses.fake_tensor``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch

__all__ = [
    "FAKE_TENSOR_LOGGER",
    "data_dependent_errors",
    "detect_fake_mode",
    "fake_tensor_mode_type",
    "fake_tensor_type",
    "functional_tensor_type",
    "is_fake",
    "set_device_guards",
]

FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"
"""The logger ``FakeTensorMode`` logs to."""


def fake_tensor_type() -> type[Any]:
    """``torch._subclasses.fake_tensor.FakeTensor``."""
    from torch._subclasses.fake_tensor import FakeTensor

    return FakeTensor


def fake_tensor_mode_type() -> type[Any]:
    """``torch._subclasses.fake_tensor.FakeTensorMode``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode


@functools.cache
def set_device_guards() -> None:
    """What ``FakeTensorMode.__enter__`` does first where no CUDA device is usable (a CPU-only
    build, or a CUDA build without a GPU): install torch's no-op CUDA device guard
    (``torch._C._ensureCUDADeviceGuardSet``), once per process. Called in a thread before it
    starts a worker that enters a fake mode: on torch 2.11's CUDA builds without a GPU, the
    worker doing it first crashed spawned pipeline ranks (SIGSEGV in ``__enter__``)."""
    if not torch.cuda.is_available():
        ensure = getattr(torch._C, "_ensureCUDADeviceGuardSet", None)
        if ensure is not None:
            ensure()


def functional_tensor_type() -> type[Any]:
    """``torch._subclasses.functional_tensor.FunctionalTensor``."""
    from torch._subclasses.functional_tensor import FunctionalTensor

    return FunctionalTensor


def is_fake(x: object) -> bool:
    """Whether ``x`` is a ``FakeTensor``."""
    return isinstance(x, fake_tensor_type())


def detect_fake_mode(values: Iterable[Any] = ()) -> Any:
    """The fake mode of ``values`` or of the running trace (``torch._guards.detect_fake_mode``),
    or None."""
    import torch._guards

    return torch._guards.detect_fake_mode(list(values))


def data_dependent_errors() -> tuple[type[Exception], type[Exception]]:
    """``(DataDependentOutputException, DynamicOutputShapeException)``: what an op on fake
    tensors raises when its output values, or its output's shape, depend on data."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )

    return DataDependentOutputException, DynamicOutputShapeException
