"""Triton in the test suite: its interpreter on CPU, and shims for the interpreter's gaps.

Loaded by pytest before anything else (``-p tests._triton_support`` in ``pyproject.toml``), so
that ``TRITON_INTERPRET=1`` is set before the first ``import triton``: ``@triton.jit`` picks the
interpreter or the compiler when a kernel is *defined*, and every module that defines a kernel
(``examples/ops/triton_*.py``) must see the same choice. The variable is only set when the
caller has not set it: ``make gpu-check`` runs the Triton tests with ``TRITON_INTERPRET=0``, so
that CUDA runs the kernels compiled.

The interpreter (``triton.runtime.interpreter``, triton 3.9.0) runs a kernel on CPU tensors
with numpy. Two of its gaps make kernels that are correct when compiled misbehave there;
:func:`interpreter_shims` fills them, for the tests that need it, and nothing in ``customgrad/``
or ``examples/`` depends on it:

- a Python ``float`` kernel argument (an ``eps``) stays a Python float, where compiled Triton
  passes it as an fp32 scalar: ``eps.to(tl.float32)`` raises, and numpy may compute in float64.
  The shim converts it to an fp32 scalar, as compiled Triton does;
- ``triton.language.extra.libdevice`` functions are stubs (their body is ``...``) that return
  None under the interpreter; the shim gives ``rsqrt`` and ``tanh`` numpy implementations.

And, for the whole session, triton 3.6's ``__index__`` under numpy 2.4 (:func:`_squeezed_index`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

INTERPRET_SET_HERE = "TRITON_INTERPRET" not in os.environ
"""Whether this plugin set ``TRITON_INTERPRET`` (the caller had not): processes the tests start
as a user would (``tests/test_examples.py``) run without it."""
os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # triton is a dev dependency; without it the Triton tests skip
    HAS_TRITON = False

__all__ = [
    "HAS_TRITON",
    "INDEX_SHIMMED",
    "INTERPRETED",
    "INTERPRET_SET_HERE",
    "count_launches",
    "interpreter_shims",
    "triton_version",
]

INTERPRETED = HAS_TRITON and bool(triton.knobs.runtime.interpret)
"""Whether ``@triton.jit`` kernels run in Triton's interpreter in this process."""


INDEX_SHIMMED = False
"""Whether this session squeezes the interpreter's ``__index__`` (:func:`_squeezed_index`): a
child process this session starts runs the interpreter without it."""


def triton_version() -> str:
    """The installed triton's version, or "none"."""
    return str(triton.__version__) if HAS_TRITON else "none"


def _squeezed_index() -> None:
    """triton 3.6's interpreter takes ``int()`` of a tensor's numpy data for ``__index__`` (a
    loop bound: ``range(start, end)`` of ``tl.minimum`` results), which numpy 2.4 refuses for a
    1-element array that is not 0-d; triton 3.9 squeezes it first. Where the interpreter's
    ``__index__`` fails so (probed on a stand-in), it squeezes, for this test session."""
    from types import SimpleNamespace

    import numpy as np
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    class Scope:
        def set_attr(self, obj: object, name: str, value: object) -> None:
            setattr(obj, name, value)

    class Probe:
        pass

    original(Probe, Scope())
    probe: Any = Probe.__new__(Probe)
    probe.handle = SimpleNamespace(data=np.array([3]))
    try:
        if Probe.__index__(probe) == 3:  # type: ignore[attr-defined]
            return
    except TypeError:
        pass

    def patched(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched
    global INDEX_SHIMMED
    INDEX_SHIMMED = True


if INTERPRETED:
    _squeezed_index()


def _float_as_fp32(original: Any) -> Any:
    import numpy as np
    from triton.runtime.interpreter import TensorHandle

    def cvt(arg: Any) -> Any:
        if isinstance(arg, float):
            return tl.tensor(
                TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32
            )
        return original(arg)

    return cvt


def _elementwise(fn: Any) -> Any:
    """A libdevice function for the interpreter: ``fn`` applied to the numpy data of a tensor."""
    from triton.runtime.interpreter import TensorHandle

    def apply(x: Any) -> Any:
        data = fn(x.handle.data)
        return tl.tensor(TensorHandle(data, x.handle.dtype.scalar), x.type)

    return apply


@contextlib.contextmanager
def interpreter_shims(*modules: Any) -> Iterator[None]:
    """Fill the interpreter's gaps listed in this module's docstring, for the ``with`` block.

    ``modules``: modules that imported a libdevice function by name (Liger-Kernel's
    ``from triton.language.extra.libdevice import rsqrt``): their names are rebound too.

    Does nothing when kernels are compiled (a GPU run): compiled Triton has no such gaps.
    """
    if not INTERPRETED:
        yield
        return
    import numpy as np
    from triton.language.extra import libdevice
    from triton.runtime import interpreter

    patches = {
        (interpreter, "_implicit_cvt"): _float_as_fp32(interpreter._implicit_cvt),
        (libdevice, "rsqrt"): _elementwise(lambda a: (1 / np.sqrt(a)).astype(a.dtype)),
        (libdevice, "tanh"): _elementwise(lambda a: np.tanh(a).astype(a.dtype)),
    }
    for module in modules:
        for name in ("rsqrt", "tanh"):
            if getattr(module, name, None) is getattr(libdevice, name):
                patches[module, name] = patches[libdevice, name]
    saved = {key: getattr(*key) for key in patches}
    try:
        for (module, name), value in patches.items():
            setattr(module, name, value)
        yield
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)


@contextlib.contextmanager
def count_launches(*kernels: Any) -> Iterator[dict[str, int]]:
    """Count the launches of ``kernels`` (``@triton.jit`` functions) in the ``with`` block, by
    kernel name: ``{"_backward_kernel": 1}``. Works interpreted and compiled (each kernel's
    pre-run hook: the interpreter has no global launch hook)."""
    counts: dict[str, int] = {k.__name__: 0 for k in kernels}
    hooks = []
    for k in kernels:

        def hook(*args: Any, _name: str = k.__name__, **kwargs: Any) -> None:
            counts[_name] += 1

        k.add_pre_run_hook(hook)
        hooks.append((k, hook))
    try:
        yield counts
    finally:
        for k, hook in hooks:
            k.pre_run_hooks.remove(hook)
