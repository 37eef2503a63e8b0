"""What customgrad hands a backward is traceable, and the Python real libraries write splits or
says why (issue 40, items 1, 2, 4 and 5).

One table: every object customgrad passes to a user backward (a customgrad op's ``inputs``
record, its residuals, what ``save_for_backward`` returned in every container, ``ctx``; a
Function's ctx through ``from_function`` and in customgrad's stage), each with a read of it in
the backward. Each must split: ``summary()`` names it captured, the gradients of the input
pass (I) and the weight pass (W) equal the backward's as written (a full backward calls it
so), and FLOPs(I) + FLOPs(W) equal that backward's, the input gradient's matmul in I and the
weight gradient's in W (``FlopCounterMode``).

Then the constructs libraries write their backwards with (xformers' ``Orig.backward.__func__``,
classmethods, ``super()``, bound methods, ``functools.partial``, decorators wrapping with
``*args, **kwargs``): they split, or run once with a reason naming the construct and a rewrite,
and the rewrite splits. Then reasons that name their cause (a Triton launch in a function dynamo
does not trace, CUDA called where there is none), and Functions ``from_function`` takes as the
raw Function runs (Liger's rope, unsloth's LoRA_W and LoRA MLP).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import itertools
import re
import typing
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.utils.flop_counter import FlopCounterMode

import customgrad as cg
from customgrad._autosplit import AutoSplitter, Fallback
from customgrad._capture import FIX_FUNCTION_CLASS, FIX_NO_CUDA
from customgrad._flops import count_flops
from customgrad._triton import FIX_RAW_LAUNCH
from customgrad.pipelining import stage_backward_input, stage_backward_weight
from tests import _unsloth_port as U
from tests._skips import optional_package
from tests._triton_support import HAS_TRITON, INTERPRETED

DT = torch.float64
N, OUT, IN = 4, 5, 3
MM = 2 * N * OUT * IN  # the FLOPs of one gradient: g @ w (I) or g.mT @ x (W)
_ids = itertools.count()

Forward = Callable[[Tensor, Tensor], Tensor]


def _ns() -> str:
    return f"test_capture_objects{next(_ids)}"


def _dx(g: Tensor, w: Tensor) -> Tensor:
    return g @ w


def _dw(g: Tensor, x: Tensor) -> Tensor:
    return g.mT @ x


# --------------------------------------------------------------------------------------------
# The hosts: a customgrad op, a Function through from_function, a Function in customgrad's stage


@dataclasses.dataclass
class Host:
    """A ``y = x @ w.mT`` whose backward reads one object: how to call it, and how to ask
    whether its backward was captured."""

    forward: Forward
    captured: Callable[[], str]
    """``"traced"`` when the latest split captured the backward, else what summary() says."""


def op_host(
    save: Callable[..., object],
    backward: Callable[..., dict[str, Tensor]],
    residuals: bool = False,
) -> Host:
    ns = _ns()
    if residuals:

        @cg.op(f"{ns}::linear", weights=("w",), residuals=("x_copy",))
        def linear_r(x: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
            return x @ w.mT, x.clone()

        linear_r.register_fake(lambda x, w: (x.new_empty((x.shape[0], w.shape[0])), x.clone()))
        op: cg.CustomOp[..., Tensor] = linear_r  # type: ignore[assignment]
    else:

        @cg.op(f"{ns}::linear", weights=("w",))
        def linear(x: Tensor, w: Tensor) -> Tensor:
            return x @ w.mT

        linear.register_fake(lambda x, w: x.new_empty((x.shape[0], w.shape[0])))
        op = linear
    op.register_save_for_backward(save)
    op.register_backward(backward)

    def captured() -> str:
        (row,) = cg.summary(ns).ops
        return row.split

    return Host(op, captured)


def function_class(
    keep: Callable[[Any, Tensor, Tensor], None], backward: Callable[[Any, Tensor], Any]
) -> type[torch.autograd.Function]:
    """A Function computing ``x @ w.mT`` whose forward saves ``x, w`` and calls ``keep(ctx, x,
    w)``, and whose backward is ``backward(ctx, grad)``."""

    class Linear(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
            ctx.save_for_backward(x, w)
            keep(ctx, x, w)
            return x @ w.mT

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> Any:
            return backward(ctx, g)

    Linear.__qualname__ = Linear.__name__ = f"Linear{next(_ids)}"
    return Linear


def from_function_host(
    keep: Callable[[Any, Tensor, Tensor], None], backward: Callable[[Any, Tensor], Any]
) -> Host:
    return wrapped(function_class(keep, backward))


def wrapped(function: type[torch.autograd.Function]) -> Host:
    ns = _ns()
    op = cg.from_function(
        function, f"{ns}::fn", weights=("w",), schema="(Tensor x, Tensor w) -> Tensor"
    )

    def captured() -> str:
        (row,) = cg.summary(ns).ops
        return row.split

    return Host(op, captured)  # type: ignore[arg-type]


def stage_host(
    keep: Callable[[Any, Tensor, Tensor], None], backward: Callable[[Any, Tensor], Any]
) -> Host:
    return in_stage(function_class(keep, backward))


def in_stage(function: type[torch.autograd.Function]) -> Host:
    label = f"{function.__module__}.{function.__qualname__}"

    def captured() -> str:
        return "traced" if label in cg.summary().split_functions else "not split"

    return Host(function.apply, captured)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# The objects


class Saved(typing.NamedTuple):
    x: Tensor
    w: Tensor


SavedPair = collections.namedtuple("SavedPair", "x w")


@dataclasses.dataclass
class SavedData:
    x: Tensor
    w: Tensor


@dataclasses.dataclass(frozen=True)
class FrozenData:
    x: Tensor
    w: Tensor


class Mode(enum.Enum):
    PLAIN = 1
    SCALED = 2


class Config:
    """A user's object without tensors (a quantization state, a kernel config)."""

    def __init__(self, scale: float) -> None:
        self.scale = scale


@dataclasses.dataclass
class Options:
    scale: float
    transpose: bool = False


@dataclasses.dataclass
class Buffers:
    w: Tensor
    scale: float


def _grads(g: Tensor, x: Tensor, w: Tensor) -> dict[str, Tensor]:
    return {"x": _dx(g, w), "w": _dw(g, x)}


def _needed(ctx: cg.BackwardContext, g: Tensor, x: Tensor, w: Tensor) -> dict[str, Any]:
    return {
        "x": _dx(g, w) if ctx.needs_input_grad("x") else None,
        "w": _dw(g, x) if ctx.needs_input_grad("w") else None,
    }


def _tensors(ctx: Any) -> tuple[Tensor, Tensor]:
    x, w = ctx.saved_tensors
    return x, w


def _both(dx: Tensor, dw: Tensor) -> tuple[Tensor, Tensor]:
    return dx, dw


def _set(**attrs: Any) -> Callable[[Any, Tensor, Tensor], None]:
    def keep(ctx: Any, x: Tensor, w: Tensor) -> None:
        for name, value in attrs.items():
            setattr(ctx, name, value(x, w) if callable(value) else value)

    return keep


def _nothing(ctx: Any, x: Tensor, w: Tensor) -> None:
    pass


def _ctx_reads() -> dict[str, tuple[Callable[..., None], Callable[[Any, Tensor], Any]]]:
    """A Function's ctx, each read: (what forward keeps on ctx, the backward)."""

    def scaled(ctx: Any, g: Tensor, scale: float) -> tuple[Tensor, Tensor]:
        x, w = _tensors(ctx)
        return _dx(g, w) * scale, _dw(g, x)

    return {
        "ctx.saved_tensors": (_nothing, lambda c, g: _both(_dx(g, _tensors(c)[1]), _dw(g, c.saved_tensors[0]))),
        "ctx.needs_input_grad[i]": (
            _nothing,
            lambda c, g: (
                _dx(g, _tensors(c)[1]) if c.needs_input_grad[0] else None,
                _dw(g, _tensors(c)[0]) if c.needs_input_grad[1] else None,
            ),
        ),
        "ctx.<float>": (_set(scale=1.0), lambda c, g: scaled(c, g, c.scale)),
        "ctx.<tuple of ints>": (_set(dims=(1, 2)), lambda c, g: scaled(c, g, c.dims[1] - c.dims[0])),
        # unsloth's LoRA_W: ctx.custom_saved_tensors = (W, W_quant, S), a tensor, None, a float
        "ctx.<tuple of a tensor, None, a float>": (
            _set(custom=lambda x, w: (w, None, 1.0)),
            lambda c, g: _both(_dx(g, c.custom[0]) * c.custom[2], _dw(g, _tensors(c)[0])),
        ),
        "ctx.<NamedTuple>": (_set(pair=lambda x, w: Saved(x, w)), lambda c, g: _both(_dx(g, c.pair.w), _dw(g, c.pair.x))),
        "ctx.<list>": (_set(bias=[False, False]), lambda c, g: scaled(c, g, 1.0 if not any(c.bias) else 2.0)),
        "ctx.<dict>": (_set(cfg={"scale": 1.0}), lambda c, g: scaled(c, g, c.cfg["scale"])),
        "ctx.<enum member>": (_set(mode=Mode.PLAIN), lambda c, g: scaled(c, g, float(c.mode.value))),
        "ctx.<dataclass>": (_set(opts=Options(1.0)), lambda c, g: scaled(c, g, c.opts.scale)),
        "ctx.<dataclass holding a tensor>": (
            _set(bufs=lambda x, w: Buffers(w, 1.0)),
            lambda c, g: _both(_dx(g, c.bufs.w) * c.bufs.scale, _dw(g, _tensors(c)[0])),
        ),
        "ctx.<torch.Size, dtype>": (
            _set(shape=lambda x, w: x.shape, dtype=lambda x, w: x.dtype),
            lambda c, g: _both(_dx(g, _tensors(c)[1]).reshape(c.shape).to(c.dtype), _dw(g, _tensors(c)[0])),
        ),
        "ctx.<a saved input kept as an attribute>": (
            _set(x_again=lambda x, w: x),
            lambda c, g: _both(_dx(g, _tensors(c)[1]), _dw(g, c.x_again)),
        ),
        "hasattr(ctx, name) and getattr(ctx, name, default)": (
            _nothing,
            lambda c, g: scaled(c, g, getattr(c, "scale", 1.0) * (2.0 if hasattr(c, "other") else 1.0)),
        ),
    }  # fmt: skip


def _op_reads() -> dict[str, Host | Callable[[], Host]]:
    """A customgrad op's backward, each object it is handed and a read of it."""

    def inputs(read: Callable[[Any, Tensor], dict[str, Tensor]]) -> Callable[[], Host]:
        return lambda: op_host(lambda i, o: i, lambda ctx, i, g: read(i, g))

    def saving(
        make: Callable[[Any], object], read: Callable[[Any], tuple[Tensor, Tensor]]
    ) -> Callable[[], Host]:
        return lambda: op_host(lambda i, o: make(i), lambda ctx, s, g: _grads(g, *read(s)))

    return {
        # the issue's repro: register_save_for_backward(lambda inputs, output: inputs)
        "inputs.<name>": inputs(lambda i, g: {"x": g @ i.w, "w": g.mT @ i.x}),
        "inputs[<index>]": inputs(lambda i, g: _grads(g, i[0], i[1])),
        "inputs unpacked": inputs(lambda i, g: _grads(g, *i)),
        "inputs._asdict()": inputs(lambda i, g: _grads(g, i._asdict()["x"], i._asdict()["w"])),
        "inputs._fields, getattr": inputs(lambda i, g: _grads(g, *(getattr(i, n) for n in i._fields))),
        "inputs._replace()": inputs(lambda i, g: _grads(g, i._replace(w=i.w).x, i.w)),
        "inputs in a tuple with a float": lambda: op_host(
            lambda i, o: (i, 1.0), lambda ctx, s, g: _grads(g, s[0].x * s[1], s[0].w)
        ),
        "residuals.<name>": lambda: op_host(
            lambda i, o, r: (i.w, r), lambda ctx, s, g: _grads(g, s[1].x_copy, s[0]), residuals=True
        ),
        "residuals and inputs": lambda: op_host(
            lambda i, o, r: {"inputs": i, "residuals": r},
            lambda ctx, s, g: _grads(g, s["residuals"].x_copy, s["inputs"].w),
            residuals=True,
        ),
        "tuple": saving(lambda i: (i.x, i.w), lambda s: (s[0], s[1])),
        "list": saving(lambda i: [i.x, i.w], lambda s: (s[0], s[1])),
        "dict": saving(lambda i: {"x": i.x, "w": i.w}, lambda s: (s["x"], s["w"])),
        "dict.items()": saving(lambda i: {"x": i.x, "w": i.w}, lambda s: tuple(v for _, v in s.items())),
        "typing.NamedTuple": saving(lambda i: Saved(i.x, i.w), lambda s: (s.x, s.w)),
        "collections.namedtuple": saving(lambda i: SavedPair(i.x, i.w), lambda s: (s.x, s.w)),
        "dataclass": saving(lambda i: SavedData(i.x, i.w), lambda s: (s.x, s.w)),
        "frozen dataclass": saving(lambda i: FrozenData(i.x, i.w), lambda s: (s.x, s.w)),
        "nested: a dict of a NamedTuple and a list": saving(
            lambda i: {"pair": Saved(i.x, i.w), "more": [i.w]}, lambda s: (s["pair"].x, s["more"][0])
        ),
        "an enum member": saving(lambda i: (i.x, i.w, Mode.PLAIN), lambda s: (s[0] * s[2].value, s[1])),
        "an object without tensors": saving(lambda i: (i.x, i.w, Config(1.0)), lambda s: (s[0] * s[2].scale, s[1])),
        "ctx.needs_input_grad(name)": lambda: op_host(lambda i, o: i, lambda ctx, i, g: _needed(ctx, g, i.x, i.w)),
        "ctx.phase, ctx.op.name": lambda: op_host(
            lambda i, o: i,
            lambda ctx, i, g: _grads(g, i.x * (1.0 if ctx.phase and "::" in ctx.op.name else 2.0), i.w),
        ),
    }  # fmt: skip


TABLE: dict[str, Callable[[], Host]] = {
    **{f"op: {k}": v for k, v in _op_reads().items()},  # type: ignore[misc]
    **{f"from_function: {k}": functools.partial(from_function_host, *v) for k, v in _ctx_reads().items()},
    **{
        f"stage: {k}": functools.partial(stage_host, *v)
        for k, v in _ctx_reads().items()
        if k in ("ctx.saved_tensors", "ctx.needs_input_grad[i]", "ctx.<tuple of a tensor, None, a float>",
                 "ctx.<list>", "ctx.<enum member>", "ctx.<dataclass>", "ctx.<float>")
    },
}  # fmt: skip


def leaves(seed: int) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, IN, dtype=DT, generator=gen).requires_grad_()
    w = torch.randn(OUT, IN, dtype=DT, generator=gen).requires_grad_()
    return x, w, torch.randn(N, OUT, dtype=DT, generator=gen)


def flops(fn: Callable[[], object]) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def flops_in_place_too(fn: Callable[[], object]) -> int:
    """FLOPs with customgrad's counter, which counts in-place matmuls (``addmm_``) too."""
    return count_flops(fn)[1]


def split(forward: Forward, seed: int) -> tuple[Tensor, Tensor, int, int]:
    """I then W through customgrad's stage_backward_*: dx, dw and each pass's FLOPs."""
    x, w, g = leaves(seed)
    y = forward(x, w)
    got: list[Any] = []
    i_flops = flops(lambda: got.append(stage_backward_input([y], [g], [x], [w])))
    w_flops = flops(lambda: stage_backward_weight([w], got[0][1]))
    assert w.grad is not None
    return got[0][0][0], w.grad, i_flops, w_flops


def written(forward: Forward, seed: int) -> tuple[Tensor, Tensor, int]:
    """A full backward (the function as written): dx, dw and its FLOPs."""
    x, w, g = leaves(seed)
    y = forward(x, w)
    total = flops(lambda: y.backward(g))
    assert x.grad is not None and w.grad is not None
    return x.grad, w.grad, total


def assert_splits(host: Host) -> None:
    split(host.forward, seed=1)  # the first split pass captures it
    dx, dw, i_flops, w_flops = split(host.forward, seed=2)
    assert host.captured() == "traced"
    want_dx, want_dw, full = written(host.forward, seed=2)
    torch.testing.assert_close(dx, want_dx, rtol=0, atol=0)
    torch.testing.assert_close(dw, want_dw, rtol=0, atol=0)
    assert (i_flops, w_flops, full) == (MM, MM, 2 * MM)


@pytest.mark.parametrize("case", list(TABLE))
def test_every_object_a_backward_is_handed_splits_with_its_gradients_and_flops(case: str) -> None:
    assert_splits(TABLE[case]())


def test_the_issue_repro_saving_inputs_splits_with_one_stage_backward_pair() -> None:
    """The issue's minimal repro, told as the user would see it (summary and explain_split)."""
    host = op_host(lambda inputs, output: inputs, lambda ctx, i, g: {"x": g @ i.w, "w": g.mT @ i.x})
    x, w, g = leaves(3)
    y = host.forward(x, w)
    _, groups = stage_backward_input([y], [g], [x], [w])
    stage_backward_weight([w], groups)
    assert host.captured() == "traced"
    torch.testing.assert_close(w.grad, g.mT @ x.detach())


def test_a_ctx_shared_read_by_a_single_backward_raises_customgrads_error_when_split() -> None:
    """``ctx.shared`` is the pair's; a single backward reading it gets customgrad's error in a
    split pass as in a full one (the capture does not swallow it)."""
    host = op_host(lambda i, o: i, lambda ctx, i, g: _grads(g, i.x + ctx.shared, i.w))
    x, w, g = leaves(4)
    with pytest.raises(cg.MissingRegistrationError, match=re.escape("ctx.shared was read")):
        stage_backward_input([host.forward(x, w)], [g], [x], [w])


# --------------------------------------------------------------------------------------------
# The Python libraries write


class SwiGLU(torch.autograd.Function):
    """xformers' shape: classmethods reading class attributes (``FORCE_BW_F32``)."""

    FORCE_BW_F32 = False

    @classmethod
    def forward(cls, ctx: Any, x: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(x, w)
        return x @ w.mT

    @classmethod
    def backward(cls, ctx: Any, dy: Tensor) -> Any:
        x, w = ctx.saved_tensors
        if cls.FORCE_BW_F32:
            dy = dy.float()
        return _dx(dy, w), _dw(dy, x)


class SwiGLUFused(torch.autograd.Function):
    """xformers' ``_SwiGLUFusedFunc`` calling the original's backward through ``__func__``."""

    FORCE_BW_F32 = False

    @classmethod
    def forward(cls, ctx: Any, x: Tensor, w: Tensor) -> Tensor:
        return SwiGLU.forward.__func__(cls, ctx, x, w)

    @classmethod
    def backward(cls, ctx: Any, dy: Tensor) -> Any:
        return SwiGLU.backward.__func__(cls, ctx, dy)


class SwiGLUSub(SwiGLU):
    @classmethod
    def backward(cls, ctx: Any, dy: Tensor) -> Any:
        return super().backward(ctx, dy)


class BorrowsBound(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(x, w)
        return x @ w.mT

    backward = SwiGLU.backward  # a bound classmethod of the original Function


class CallsOriginal(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(x, w)
        return x @ w.mT

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> Any:
        return Plain.backward(ctx, dy)


class Plain(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(x, w)
        return x @ w.mT

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> Any:
        x, w = ctx.saved_tensors
        return _dx(dy, w), _dw(dy, x)


# The rewrite FIX_FUNCTION_CLASS advises: what backward reads of the class kept on ctx in
# forward, the body a plain function both Functions' backward are.
def _swiglu_backward(ctx: Any, dy: Tensor) -> Any:
    x, w = ctx.saved_tensors
    if ctx.force_bw_f32:
        dy = dy.float()
    return _dx(dy, w), _dw(dy, x)


class SwiGLUAdvised(torch.autograd.Function):
    FORCE_BW_F32 = False

    @classmethod
    def forward(cls, ctx: Any, x: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(x, w)
        ctx.force_bw_f32 = cls.FORCE_BW_F32
        return x @ w.mT

    backward = staticmethod(_swiglu_backward)


class SwiGLUFusedAdvised(SwiGLUAdvised):
    FORCE_BW_F32 = False
    backward = staticmethod(_swiglu_backward)


def _scaled_backward(ctx: Any, dy: Tensor, scale: float) -> Any:
    x, w = ctx.saved_tensors
    return _dx(dy, w) * scale, _dw(dy, x)


class WithPartial(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(x, w)
        return x @ w.mT

    backward = staticmethod(functools.partial(_scaled_backward, scale=1.0))


def passes_through(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A decorator wrapping with ``*args, **kwargs`` and no ``functools.wraps``."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return wrapper


class Decorated(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")  # unsloth's torch_amp_custom_fwd
    @passes_through  # the schema names the arguments
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(x, w)
        return x @ w.mT

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")  # unsloth's torch_amp_custom_bwd
    @passes_through
    def backward(ctx: Any, dy: Tensor) -> Any:
        x, w = ctx.saved_tensors
        return _dx(dy, w), _dw(dy, x)


def _partial_op() -> Host:
    def backward(ctx: Any, saved: Any, g: Tensor, scale: float) -> dict[str, Tensor]:
        return {"x": _dx(g, saved.w) * scale, "w": _dw(g, saved.x)}

    return op_host(lambda i, o: i, functools.partial(backward, scale=1.0))


SPLITS: dict[str, Callable[[], Host]] = {
    "functools.partial as a Function's backward (from_function)": lambda: wrapped(WithPartial),
    "functools.partial as a Function's backward (stage)": lambda: in_stage(WithPartial),
    "functools.partial as an op's backward": _partial_op,
    "decorators with *args, **kwargs, torch.amp.custom_fwd/bwd (from_function)": lambda: wrapped(Decorated),
    "decorators with *args, **kwargs, torch.amp.custom_fwd/bwd (stage)": lambda: in_stage(Decorated),
    "the advised rewrite (from_function)": lambda: wrapped(SwiGLUFusedAdvised),
    "the advised rewrite (stage)": lambda: in_stage(SwiGLUFusedAdvised),
}  # fmt: skip


@pytest.mark.parametrize("case", list(SPLITS))
def test_python_constructs_of_real_libraries_split(case: str) -> None:
    assert_splits(SPLITS[case]())


# Each construct dynamo refuses: the Function, and the line the reason must quote.
REFUSED = {
    "Orig.backward.__func__(cls, ctx, dy) (xformers)": (SwiGLUFused, "return SwiGLU.backward.__func__(cls, ctx, dy)"),
    "a classmethod reading cls.ATTR": (SwiGLU, "if cls.FORCE_BW_F32:"),
    "super().backward(ctx, dy)": (SwiGLUSub, "return super().backward(ctx, dy)"),
    "a bound classmethod of the original Function": (BorrowsBound, "if cls.FORCE_BW_F32:"),
    "Orig.backward(ctx, dy) from another Function": (CallsOriginal, "return Plain.backward(ctx, dy)"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_function_class_used_as_a_class_runs_once_naming_the_line_and_the_rewrite(
    case: str,
) -> None:
    function, line = REFUSED[case]
    host = wrapped(function)
    dx, dw, i_flops, w_flops = split(host.forward, seed=5)
    want_dx, want_dw, _ = written(host.forward, seed=5)
    torch.testing.assert_close((dx, dw), (want_dx, want_dw), rtol=0, atol=0)
    assert (i_flops, w_flops) == (2 * MM, 0)  # run once, in I; W takes its gradient
    fallback = _fallback(host)
    assert re.fullmatch(
        re.escape("it uses a torch.autograd.Function class as a class at ")
        + re.escape(__file__)
        + r":\d+ "
        + re.escape(f"(`{line}`)")
        + re.escape(
            f": torch {torch.__version__}'s dynamo traces such a class only in Cls.apply(...) "
            "and calls of its staticmethods, not its attributes, a classmethod's cls, super(), "
            "Cls.backward(ctx, ...) or .__func__"
        ),
        fallback.why,
    ), fallback.why
    assert fallback.fix == FIX_FUNCTION_CLASS  # applied: SwiGLUFusedAdvised splits (above)


def _fallback(host: Host) -> Fallback:
    op: Any = host.forward
    auto = op.rules.auto
    assert isinstance(auto, AutoSplitter)
    fallback = auto.fallback()
    assert fallback is not None
    return fallback


def test_unsloth_lora_w_through_from_function_splits() -> None:
    """unsloth's LoRA_W keeps ``(W, W_quant, S)`` on ctx: dynamo raised a TypeError in its
    pytree polyfill rebuilding it; now it splits, A and B's gradients in W. Counted with
    customgrad's counter: the backward's matmuls are in-place (``addmm_``), which torch's
    FlopCounterMode does not count."""
    torch.manual_seed(0)
    X = torch.randn(2, 3, 8, dtype=DT)
    W, A, B = torch.randn(6, 8, dtype=DT), torch.randn(2, 8, dtype=DT), torch.randn(6, 2, dtype=DT)
    ns = _ns()
    op = cg.from_function(U.LoRA_W, f"{ns}::lora_w", weights=("A", "B"))

    def run(fn: Callable[..., Tensor], split_it: bool) -> tuple[list[Tensor], int, int]:
        x, a, b = X.clone().requires_grad_(), A.clone().requires_grad_(), B.clone().requires_grad_()
        y = fn(x, W, None, a, b, 2.0)
        g = torch.ones_like(y)
        if not split_it:
            total = flops_in_place_too(lambda: y.backward(g))
            return [t.grad for t in (x, a, b)], total, 0  # type: ignore[misc]
        got: list[Any] = []
        count = flops_in_place_too
        i_flops = count(lambda: got.append(stage_backward_input([y], [g], [x], [a, b])))
        w_flops = count(lambda: stage_backward_weight([a, b], got[0][1]))
        return [got[0][0][0], a.grad, b.grad], i_flops, w_flops  # type: ignore[list-item]

    run(op, True)
    got, i_flops, w_flops = run(op, True)
    (row,) = cg.summary(ns).ops
    assert row.split == "traced", row.detail
    want, _, _ = run(U.LoRA_W.apply, False)  # the raw Function
    _, full, _ = run(op, False)
    torch.testing.assert_close(got, want)
    # The backward as written computes dY @ B.t() twice (for dA and for dX); the split once,
    # in I, and hands it to W with W's own work: X.t() @ it, (A.t() @ X.t()) @ dY.
    shared = 2 * 6 * 6 * 2
    assert i_flops + w_flops == full - shared
    assert w_flops == 2 * 8 * 6 * 2 + 2 * 2 * 8 * 6 + 2 * 2 * 6 * 6


# --------------------------------------------------------------------------------------------
# Reasons that name the cause


class ProbesCuda(torch.autograd.Function):
    """A backward that picks its path by trying CUDA (as unsloth's RMSNorm does on CPU)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(x, w)
        return x @ w.mT

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> Any:
        x, w = ctx.saved_tensors
        try:
            torch.cuda.current_device()
            on_gpu = True
        except (AssertionError, RuntimeError):
            on_gpu = False
        return _gpu_or_cpu(on_gpu, dy, x, w)


class ChecksCuda(torch.autograd.Function):
    """The same, as FIX_NO_CUDA advises."""

    forward = ProbesCuda.forward

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> Any:
        x, w = ctx.saved_tensors
        return _gpu_or_cpu(dy.is_cuda and torch.cuda.is_available(), dy, x, w)


def _gpu_or_cpu(on_gpu: bool, dy: Tensor, x: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    if on_gpu:  # where a CUDA kernel would run
        return _dx(dy.float(), w.float()).to(dy.dtype), _dw(dy, x)
    return _dx(dy, w), _dw(dy, x)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_backward_calling_cuda_without_cuda_names_the_call_and_the_rewrite_splits() -> None:
    host = wrapped(ProbesCuda)
    split(host.forward, seed=6)
    fallback = _fallback(host)
    at = f"{__file__}:{_line_of(ProbesCuda.backward, 'torch.cuda.current_device()')}"
    call, _, said = fallback.why.partition(", which this torch cannot reach: ")
    assert call == f"it calls CUDA at {at} (`torch.cuda.current_device()`)"
    # torch's own words: a CPU build's, or a CUDA build's on a machine without a driver
    assert said == "Torch not compiled with CUDA enabled" or "no NVIDIA driver" in said, said
    assert fallback.fix == FIX_NO_CUDA
    assert_splits(wrapped(ChecksCuda))


def _line_of(fn: Callable[..., Any], text: str) -> int:
    import inspect

    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if text in line)


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _scale_rows_kernel(dy_ptr, w_ptr, dx_ptr, d, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < d
        dy = tl.load(dy_ptr + row * d + cols, mask=mask)
        w = tl.load(w_ptr + cols, mask=mask)
        tl.store(dx_ptr + row * d + cols, dy * w, mask=mask)

    @torch.compiler.disable
    def scale_rows_backward(dy: Tensor, w: Tensor) -> Tensor:
        """flash-linear-attention's shape: a function that launches a Triton kernel, which
        dynamo does not trace (``torch.compiler.disable``)."""
        dx = torch.empty_like(dy)
        n, d = dy.shape
        _scale_rows_kernel[(n,)](dy, w, dx, d, BLOCK=triton.next_power_of_2(d))
        return dx

    class ScaleRows(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
            ctx.save_for_backward(x, w)
            return x * w

        @staticmethod
        def backward(ctx: Any, dy: Tensor) -> Any:
            x, w = ctx.saved_tensors
            return scale_rows_backward(dy.contiguous(), w), (dy * x).sum(0)


@pytest.mark.skipif(not (HAS_TRITON and INTERPRETED), reason="runs the kernel on CPU")
def test_a_skipped_function_launching_triton_names_the_kernel_its_line_and_the_fix() -> None:
    op = cg.from_function(ScaleRows, f"{_ns()}::scale_rows", weights=("w",))
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, requires_grad=True)
    y = op(x, w)
    _, groups = stage_backward_input([y], [torch.ones_like(y)], [x], [w])
    stage_backward_weight([w], groups)
    torch.testing.assert_close((x.grad, w.grad), (w.detach().expand(4, 8), x.detach().sum(0)))
    fallback = _fallback(Host(op, str))  # type: ignore[arg-type]
    launch = _line_of(scale_rows_backward, "_scale_rows_kernel[")
    call = _line_of(ScaleRows.backward, "scale_rows_backward(")
    assert fallback.why == (
        f"it calls scale_rows_backward at {__file__}:{call}, which launches the Triton kernel "
        f"_scale_rows_kernel at {__file__}:{launch}, and dynamo does not trace "
        "scale_rows_backward (torch.compiler.disable)"
    )
    assert fallback.fix == FIX_RAW_LAUNCH


# --------------------------------------------------------------------------------------------
# from_function takes what the raw Function takes


def _rope_inputs(seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """q, k laid out as Llama's attention makes them (a view of (batch, seq, heads, dim)), so
    that Liger's kernel rotates them in place; cos, sin."""
    gen = torch.Generator().manual_seed(seed)
    b, s, h, d = 2, 4, 2, 8
    x = torch.randn(b, s, 2 * h * d, generator=gen, requires_grad=True)
    q, k = x.view(b, s, 2 * h, d).transpose(1, 2).split(h, dim=1)
    return x, q * 1.0, k * 1.0, torch.randn(1, s, d, generator=gen)


@pytest.mark.skipif(not (HAS_TRITON and INTERPRETED), reason="runs Liger's kernels on CPU")
@pytest.mark.parametrize("schema", [False, True], ids=["deferred", "schema"])
def test_liger_rope_through_from_function_gives_the_raw_functions_gradients_once(
    schema: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    rope = pytest.importorskip("liger_kernel.ops.rope", reason=optional_package("liger-kernel"))
    Rope = rope.LigerRopeFunction
    calls: list[int] = []
    original = Rope.backward

    def counted(ctx: Any, dq: Tensor, dk: Tensor) -> Any:
        calls.append(1)
        return original(ctx, dq, dk)

    monkeypatch.setattr(Rope, "backward", staticmethod(counted))
    text = (
        "(Tensor q, Tensor k, Tensor cos, Tensor sin, Tensor? position_ids=None, "
        "int unsqueeze_dim=1, int? rotary_dim=None) -> (Tensor, Tensor)"
    )
    op = cg.from_function(Rope, f"{_ns()}::rope", schema=text if schema else None)

    def grad(fn: Callable[..., Any], seed: int) -> Tensor:
        x, q, k, cos = _rope_inputs(seed)
        oq, ok = fn(q, k, cos, cos.flip(-1))
        loss = (oq * torch.arange(8)).sum() + ok.pow(2).sum()
        (dx,), _ = stage_backward_input([loss], None, [x], [])
        return dx  # type: ignore[no-any-return]

    want = grad(Rope.apply, 7)
    calls.clear()
    torch.testing.assert_close(grad(op, 7), want)
    assert calls == [1]


@pytest.mark.parametrize("how", ["from_function", "stage"])
def test_unsloth_lora_mlp_inplace_with_a_leaf_input_gives_the_raw_gradients_once(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``inplace=True`` writes dX into the saved input X; a first stage's X is a leaf."""
    calls: list[int] = []
    original = U.LoRA_MLP.backward

    def counted(ctx: Any, dy: Tensor) -> Any:
        calls.append(1)
        return original(ctx, dy)

    monkeypatch.setattr(U.LoRA_MLP, "backward", staticmethod(counted))
    torch.manual_seed(0)
    m = U.LoraMLP(inplace=True)
    weights = [m.gate, m.gate_A, m.gate_B, m.up, m.up_A, m.up_B, m.down, m.down_A, m.down_B]
    trained = [p for p in weights if p.requires_grad]
    x0 = torch.randn(2, 3, 8)
    names = ("gateW", "gateA", "gateB", "upW", "upA", "upB", "downW", "downA", "downB")
    op = cg.from_function(U.LoRA_MLP, f"{_ns()}::lora_mlp", weights=names)

    def run(fn: Callable[..., Tensor], split_it: bool) -> list[Tensor]:
        for p in trained:
            p.grad = None
        x = x0.clone().requires_grad_()  # a leaf, handed to the Function as it is
        args = [x, m.gate, m.gate_A, m.gate_B, 2.0, m.up, m.up_A, m.up_B, 2.0]
        y = fn(*args, m.down, m.down_A, m.down_B, 2.0, True)
        g = torch.ones_like(y)
        if split_it:
            (dx,), groups = stage_backward_input([y], [g], [x], trained)
            stage_backward_weight(trained, groups)
        else:
            y.backward(g)
            dx = x.grad
        return [dx, *(p.grad for p in trained)]  # type: ignore[list-item]

    want = run(U.LoRA_MLP.apply, False)  # the raw Function (it writes dX over x)
    calls.clear()
    got = run(op if how == "from_function" else U.LoRA_MLP.apply, True)
    torch.testing.assert_close(got, want)
    assert calls == [1]
