"""Every error message customgrad raises, pinned: op, argument, expected vs got, fix, location."""

from __future__ import annotations

import inspect
import itertools
import math
import re
import textwrap
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

import customgrad as cg
from customgrad._errors import where
from customgrad.pipelining import ActionTimer, ActionTimerError, StageCosts, simulate, stage_costs
from customgrad.pipelining._simulate import _StandInStage
from customgrad.pipelining._stage import MSG_DDP_FIND_UNUSED, MSG_DDP_UNREDUCED
from customgrad.pipelining._timing import MSG_NESTED_STEP
from tests._skips import NO_CUDA

UNIT = StageCosts(forward=1.0, backward_input=1.0, backward_weight=1.0)

_ids = itertools.count()


def unique(name: str) -> str:
    return f"test_err{next(_ids)}::{name}"


def linear_op(
    backward: Callable[..., Any] | None = None,
    *,
    backward_input: Callable[..., Any] | None = None,
    backward_weight: Callable[..., Any] | None = None,
) -> cg.CustomOp[..., torch.Tensor]:
    @cg.op(unique("linear"), weights=("weight", "bias"))
    def linear(
        x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, scale: int = 1
    ) -> torch.Tensor:
        out = x @ weight.mT * scale
        return out if bias is None else out + bias

    linear.register_fake(
        lambda x, weight, bias=None, scale=1: x.new_empty(x.shape[0], weight.shape[0])
    )
    linear.register_save_for_backward(lambda inputs, output: (inputs.x, inputs.weight))
    if backward is not None:
        linear.register_backward(backward)
    if backward_input is not None:
        linear.register_backward_input(backward_input)
    if backward_weight is not None:
        linear.register_backward_weight(backward_weight)
    return linear


def run_backward(op: cg.CustomOp[..., torch.Tensor], with_bias: bool = True) -> None:
    x = torch.randn(2, 3, requires_grad=True)
    w = torch.randn(4, 3, requires_grad=True)
    b = torch.randn(4, requires_grad=True) if with_bias else None
    op(x, w, b).sum().backward()


def good_input(ctx, saved, g):
    return {"x": g @ saved[1]}


def good_weight(ctx, saved, g):
    return {"weight": g.mT @ saved[0], "bias": g.sum(0)}


def good_input_all(ctx, saved, g):
    """A single backward returning every gradient of ``linear_op``'s op (bias as zeros)."""
    x, w = saved
    return {"x": g @ w, "weight": g.mT @ x, "bias": g.sum(0)}


# -- definition ------------------------------------------------------------------------------


def test_invalid_name() -> None:
    with pytest.raises(
        cg.DefinitionError,
        match=re.escape(
            "customgrad.op: invalid op name 'linear'. Name ops \"namespace::name\", "
            'e.g. "mylib::linear", with identifiers on both sides.'
        ),
    ):
        cg.op("linear", lambda x: x)


def test_reserved_namespace() -> None:
    with pytest.raises(
        ValueError,
        match=re.escape(
            "customgrad.op: 'aten::mylinear' uses the reserved namespace 'aten' (_, at, aten, c10, "
            "prim, prims, pytorch, torch and names starting with '_' belong to PyTorch). Use your "
            'library\'s own namespace, e.g. "mylib::mylinear".'
        ),
    ):
        cg.op("aten::mylinear", lambda x: x)


def test_weights_must_name_an_argument() -> None:
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * w

    with pytest.raises(
        cg.DefinitionError,
        match=re.escape(
            "weights=('weight',) names 'weight', which is not an argument of the op. "
            f"Arguments: x, w. Name only Tensor arguments in weights (function defined at {where(f)})."
        ),
    ):
        cg.op(unique("f"), f, weights=("weight",))


def test_weights_must_be_tensor_arguments() -> None:
    def f(x: torch.Tensor, n: int) -> torch.Tensor:
        return x * n

    with pytest.raises(
        ValueError,
        match=re.escape(
            "weights names 'n', which is a int, not a Tensor argument. Only Tensor, "
            "Optional[Tensor] and list[Tensor] arguments can be weights"
        ),
    ):
        cg.op(unique("f"), f, weights="n")


def test_annotations_the_schema_cannot_express() -> None:
    def f(x: torch.Tensor, d: dict) -> torch.Tensor:  # type: ignore[type-arg]
        return x

    with pytest.raises(
        cg.DefinitionError,
        match="(?s)"
        + re.escape(
            f"cannot infer the op's schema from the annotations of the function defined at {where(f)}: "
        )
        + ".*"  # torch's own words for what it cannot express
        + re.escape(". Annotate each argument with a type torch.library understands (Tensor, "),
    ):
        cg.op(unique("f"), f)


def test_unsupported_output_type() -> None:
    def f(x: torch.Tensor) -> int:
        return 1

    with pytest.raises(
        cg.DefinitionError,
        match=re.escape(
            "a return of type int is not supported; outputs and residuals must be Tensor, "
            "list[Tensor] (or Tensor? given with schema=), or a tuple of those"
        ),
    ):
        cg.op(unique("f"), f)


def test_calling_an_op_replaced_by_a_redefinition() -> None:
    name = unique("twice")

    def f(x: torch.Tensor) -> torch.Tensor:
        return x

    def g(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    old = cg.op(name, f)
    cg.op(name, g)
    ns, opname = name.split("::")
    message = (
        f"{name}: this op was replaced by a later definition of the same name (at {where(g)}), "
        f"as torch's custom_op replaces one; the old object no longer runs or takes "
        f"registrations. Use the new one: the object that definition returned, or "
        f"torch.ops.{ns}.{opname}. (replaced op defined at {where(f)})"
    )
    with pytest.raises(cg.MissingRegistrationError, match=re.escape(message)):
        old(torch.ones(2))
    with pytest.raises(cg.MissingRegistrationError, match=re.escape(message)):
        old.register_kernel("cpu", f)


def test_output_differentiability_length() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return x

    with pytest.raises(
        cg.DefinitionError,
        match=re.escape(
            "output_differentiability has 2 entries but the op has 1 output(s). Give one bool per output."
        ),
    ):
        cg.op(unique("f"), f, output_differentiability=[True, False])


# -- registration ----------------------------------------------------------------------------


def test_no_autograd_registered() -> None:
    @cg.op(unique("noautograd"))
    def f(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    x = torch.ones(2, requires_grad=True)
    msg = re.escape(
        f"{f.name}: an input requires grad, but the op's autograd is not registered (missing: "
        "register_save_for_backward, register_backward (or register_backward_input)). Register "
        "a save_for_backward function and a backward:"
    )
    with pytest.raises(cg.MissingRegistrationError, match=msg):
        f(x)
    with pytest.raises(RuntimeError, match=msg):
        f.opoverload(x)
    with torch.no_grad():
        assert f(x).tolist() == [2.0, 2.0]
    assert f(x.detach()).tolist() == [2.0, 2.0]


def test_no_autograd_advice_applied_as_the_message_shows() -> None:
    @cg.op(unique("noautograd_pair"), weights=("weight",))
    def noautograd_pair(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x @ weight.mT

    f = noautograd_pair

    x = torch.randn(2, 3, requires_grad=True)
    w = torch.randn(4, 3, requires_grad=True)
    with pytest.raises(cg.MissingRegistrationError) as info:
        f(x, w)
    shown = str(info.value)
    # The message shows the code to add, with the op's own names; add it as shown.
    assert "    @noautograd_pair.register_save_for_backward\n    def _(inputs, output):\n" in shown
    assert "        return inputs.x, inputs.weight\n" in shown
    assert "    @noautograd_pair.register_backward_input           # gradients of 'x'\n" in shown
    assert '        x, weight = saved\n        return {"x": ...}\n' in shown
    assert '        return {"weight": ...}\n' in shown

    @noautograd_pair.register_save_for_backward
    def _(inputs, output):
        return inputs.x, inputs.weight

    @noautograd_pair.register_backward_input  # gradients of 'x'
    def _(ctx, saved, grad):
        _, weight = saved
        return {"x": grad @ weight}

    @noautograd_pair.register_backward_weight  # gradients of 'weight'
    def _(ctx, saved, grad):
        x, _ = saved
        return {"weight": grad.mT @ x}

    got = torch.autograd.grad(f(x, w).sum(), (x, w))
    torch.testing.assert_close(got, torch.autograd.grad((x @ w.mT).sum(), (x, w)))


def test_only_save_for_backward_registered() -> None:
    op = linear_op()
    with pytest.raises(
        cg.MissingRegistrationError,
        match=re.escape(
            "(missing: register_backward (or the register_backward_input/_weight pair))"
        ),
    ):
        run_backward(op)


def test_only_backward_registered() -> None:
    @cg.op(unique("f"))
    def f(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    f.register_backward(lambda ctx, saved, g: {"x": g * 2})
    with pytest.raises(
        cg.MissingRegistrationError, match=re.escape("(missing: register_save_for_backward)")
    ):
        f(torch.ones(1, requires_grad=True))


@pytest.mark.parametrize("half", ["input", "weight"])
def test_only_one_half_registered(half: str) -> None:
    if half == "input":
        op = linear_op(backward_input=good_input)
        missing = "register_backward_weight"
    else:
        op = linear_op(backward_weight=good_weight)
        missing = "register_backward_input"
    with pytest.raises(cg.MissingRegistrationError, match=re.escape(f"(missing: {missing})")):
        run_backward(op)


def test_no_fake_kernel() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    @cg.op(unique("nofake"))
    def f(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    with (
        pytest.raises(
            cg.MissingRegistrationError,
            match=re.escape(
                f"{f.name}: no fake kernel registered; torch.compile, FakeTensorMode and opcheck need one"
            ),
        ),
        FakeTensorMode(),
    ):
        f(torch.empty(2))


def _no_fake_block() -> tuple[cg.CustomOp[..., torch.Tensor], nn.Module, str]:
    name = unique("nofake_compiled")

    @cg.op(name, weights=("w",))
    def op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x @ w.mT

    op.register_save_for_backward(lambda inputs, output: (inputs.x, inputs.w))
    op.register_backward(lambda ctx, s, g: {"x": g @ s[1], "w": g.mT @ s[0]})

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(5, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return op(x, self.w).sin()

    message = (
        f"{name}: no fake kernel registered; torch.compile, FakeTensorMode and opcheck need one "
        f"to know output shapes without running the op. Add:\n\n"
        f"    @nofake_compiled.register_fake\n"
        f"    def _(x, w):\n"
        f"        return <empty tensor(s) shaped like the output>\n\n"
        f"(op defined at {where(op.__wrapped__)})"
    )
    return op, Block(), message


def test_no_fake_kernel_under_customgrad_compile_is_customgrads_error() -> None:
    # dynamo wraps what fake propagation raises in its TorchRuntimeError, the message quoted
    # by repr; a module compiled by customgrad.compile raises customgrad's error itself, with
    # dynamo's as its cause.
    _, block, message = _no_fake_block()
    cg.compile(block, backend="aot_eager")
    with pytest.raises(cg.MissingRegistrationError, match=f"^{re.escape(message)}$") as info:
        block(torch.randn(3, 4))
    assert type(info.value.__cause__).__name__ == "TorchRuntimeError"


def test_no_fake_kernel_under_torch_compile_reads_as_customgrad_wrote_it() -> None:
    # torch.compile's own call raises dynamo's error (customgrad patches nothing of torch's):
    # customgrad's message inside it reads as written, line breaks and code, not as escapes.
    import torch._dynamo.exc

    _, block, message = _no_fake_block()
    compiled = torch.compile(block, backend="aot_eager")
    quoted = textwrap.indent(message, "    ").lstrip()  # dynamo indents what it quotes
    with pytest.raises(
        torch._dynamo.exc.TorchRuntimeError,
        match=re.escape(f"got MissingRegistrationError: {quoted}\n  Hint: "),
    ):
        compiled(torch.randn(3, 4))


def test_a_wrong_gradient_under_customgrad_compile_is_customgrads_error() -> None:
    name = unique("wrong_grad_compiled")

    @cg.op(name, weights=("w",))
    def op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x @ w.mT

    op.register_fake(lambda x, w: x.new_empty((*x.shape[:-1], w.shape[0])))
    op.register_save_for_backward(lambda inputs, output: (inputs.x, inputs.w))

    @op.register_backward
    def backward(ctx: cg.BackwardContext, s: Any, g: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"x": (g @ s[1])[:1], "w": g.mT @ s[0]}

    block = cg.compile(lambda x, w: op(x, w).sin(), backend="aot_eager")
    with pytest.raises(
        cg.GradientValueError,
        match=re.escape(
            f"{name}: backward returned a gradient for 'x' of shape (1, 4), but the input has "
            f"shape (3, 4). Return a tensor of the input's shape, or None. (backward defined at "
            f"{where(backward)})"
        ),
    ) as info:
        block(torch.randn(3, 4, requires_grad=True), torch.randn(5, 4)).sum().backward()
    assert type(info.value.__cause__).__name__ == "BackendCompilerFailed"


def test_no_kernel_for_device() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    op = cg.op(unique("cudaonly"), f, device_types="cuda")
    with pytest.raises(
        cg.MissingRegistrationError,
        match=re.escape(
            f"{op.name}: no kernel for these inputs' device (kernels registered for: cuda). Add one "
            "with @cudaonly.register_kernel('<device>') or register a kernel for all devices with "
            f"register_kernel(None). (op defined at {where(f)})"
        ),
    ):
        op(torch.ones(2))


def test_mutated_argument_requiring_grad() -> None:
    @cg.op(unique("add_"), mutates_args=("buf",))
    def add_(buf: torch.Tensor, x: torch.Tensor) -> None:
        buf.add_(x)

    add_.register_save_for_backward(lambda inputs, output: None)
    add_.register_backward(lambda ctx, saved: {})
    msg = re.escape(
        "argument 'buf' is in mutates_args and requires grad; customgrad does not differentiate "
        "through in-place mutation. Pass buf.detach() or a buffer that does not require grad."
    )
    buf = torch.zeros(2, requires_grad=True)
    with pytest.raises(cg.MutationError, match=msg):
        add_.opoverload(buf, torch.ones(2))
    with pytest.raises(cg.MutationError, match=msg):
        add_(buf, torch.ones(2))
    with pytest.raises(RuntimeError, match=msg):
        add_(buf, torch.ones(2, requires_grad=True))
    assert buf.detach().tolist() == [0.0, 0.0]


def test_call_with_wrong_arguments() -> None:
    op = linear_op()
    x, w = torch.randn(2, 3), torch.randn(4, 3)
    schema = "(Tensor x, Tensor weight, Tensor? bias=None, SymInt scale=1) -> Tensor"
    with pytest.raises(
        cg.ArgumentTypeError,
        match=re.escape(
            f"{op.name}: missing a required argument: 'weight'. The op takes {schema}."
        ),
    ):
        op(x)
    with pytest.raises(
        TypeError, match=re.escape(f"{op.name}: got an unexpected keyword argument 'bogus'.")
    ):
        op(x, w, bogus=1)


# -- validation of returned gradients --------------------------------------------------------


def test_backward_must_return_a_dict() -> None:
    def bwd(ctx, saved, g):
        return g @ saved[1], None

    with pytest.raises(
        cg.GradientTypeError,
        match=re.escape(
            "backward must return a dict of gradients keyed by argument name, but returned a "
            "tuple of 2 items. Return {'x': grad_x, 'weight': grad_weight, 'bias': grad_bias} "
            f"(None for a gradient that is zero). (backward defined at {where(bwd)})"
        ),
    ):
        run_backward(linear_op(bwd))


def test_the_dict_example_names_the_halfs_own_arguments() -> None:
    def bwd_in(ctx, saved, g):
        return (g @ saved[1],)

    with pytest.raises(
        cg.GradientTypeError,
        match=re.escape(
            "backward_input must return a dict of gradients keyed by argument name, but returned "
            "a tuple of 1 items. Return {'x': grad_x} (None for a gradient that is zero). "
            f"(backward_input defined at {where(bwd_in)})"
        ),
    ):
        run_backward(linear_op(backward_input=bwd_in, backward_weight=good_weight))


def test_the_dict_advice_applied_gives_torchs_gradients() -> None:
    # What the message above says to return, returned: the gradients of plain torch.
    op = linear_op(lambda ctx, saved, g: {"x": g @ saved[1], "weight": g.mT @ saved[0],
                                          "bias": g.sum(0)})  # fmt: skip
    x, w, b = (torch.randn(*s, requires_grad=True) for s in ((2, 3), (4, 3), (4,)))
    got = torch.autograd.grad(op(x, w, b).sum(), (x, w, b))
    torch.testing.assert_close(got, torch.autograd.grad((x @ w.mT + b).sum(), (x, w, b)))


def test_unknown_key_lists_the_valid_ones() -> None:
    def bwd(ctx, saved, g):
        return {"input": g @ saved[1]}

    with pytest.raises(
        cg.GradientValueError,
        match=re.escape(
            "backward returned a gradient for unknown argument 'input'. Valid keys: 'x', 'weight', "
            f"'bias'. (backward defined at {where(bwd)})"
        ),
    ):
        run_backward(linear_op(bwd))


def test_gradient_for_a_non_tensor_argument() -> None:
    def bwd(ctx, saved, g):
        return {"scale": torch.zeros(())}

    with pytest.raises(
        cg.GradientTypeError,
        match=re.escape(
            "backward returned a gradient for 'scale', a int argument; only Tensor arguments take "
            f"gradients. Remove the key. (backward defined at {where(bwd)})"
        ),
    ):
        run_backward(linear_op(bwd))


def test_backward_input_returns_a_weight_key() -> None:
    def bwd_in(ctx, saved, g):
        return {"x": g @ saved[1], "weight": g.mT @ saved[0]}

    with pytest.raises(
        cg.GradientValueError,
        match=re.escape(
            "backward_input returned a gradient for weight 'weight'. Weight gradients belong in "
            f"register_backward_weight; return only 'x'. (backward_input defined at {where(bwd_in)})"
        ),
    ):
        run_backward(linear_op(backward_input=bwd_in, backward_weight=good_weight))


def test_backward_weight_returns_a_non_weight_key() -> None:
    def bwd_w(ctx, saved, g):
        return {"x": g @ saved[1]}

    with pytest.raises(
        cg.GradientValueError,
        match=re.escape(
            "backward_weight returned a gradient for 'x', which is not a weight (weights=('weight', "
            "'bias')). Input gradients belong in register_backward_input; return only 'weight', "
            f"'bias'. (backward_weight defined at {where(bwd_w)})"
        ),
    ):
        run_backward(linear_op(backward_input=good_input, backward_weight=bwd_w))


def test_missing_needed_gradient() -> None:
    def bwd(ctx, saved, g):
        return {"x": g @ saved[1], "weight": g.mT @ saved[0]}

    with pytest.raises(
        cg.GradientValueError,
        match=re.escape(
            "backward returned no gradient for 'bias', which this backward pass needs. Add it to the "
            "dict (use None for a zero gradient), or check ctx.needs_input_grad(name). Returned "
            f"keys: ['weight', 'x']. (backward defined at {where(bwd)})"
        ),
    ):
        run_backward(linear_op(bwd))


def test_missing_gradient_not_needed_in_this_pass_is_fine() -> None:
    op = linear_op(lambda ctx, saved, g: {"x": g @ saved[1]})
    x = torch.randn(2, 3, requires_grad=True)
    w = torch.randn(4, 3, requires_grad=True)
    (gx,) = torch.autograd.grad(op(x, w).sum(), [x])
    torch.testing.assert_close(gx, torch.ones(2, 4) @ w.detach())


def test_gradient_that_is_not_a_tensor() -> None:
    def bwd(ctx, saved, g):
        return {"x": 1.0, "weight": None, "bias": None}

    with pytest.raises(
        cg.GradientTypeError,
        match=re.escape(
            "backward returned float 1.0 as the gradient for 'x'. Return a Tensor or None. "
            f"(backward defined at {where(bwd)})"
        ),
    ):
        run_backward(linear_op(bwd))


def test_wrong_shape() -> None:
    def bwd_w(ctx, saved, g):
        return {"weight": saved[0].mT @ g, "bias": g.sum(0)}

    with pytest.raises(
        cg.GradientValueError,
        match=re.escape(
            "backward_weight returned a gradient for 'weight' of shape (3, 4), but the input has "
            "shape (4, 3). Return a tensor of the input's shape, or None. "
            f"(backward_weight defined at {where(bwd_w)})"
        ),
    ):
        run_backward(linear_op(backward_input=good_input, backward_weight=bwd_w))


def test_wrong_shape_is_not_broadcast() -> None:
    def bwd_w(ctx, saved, g):
        return {"weight": g.mT @ saved[0], "bias": g.sum(0, keepdim=True)}

    with pytest.raises(
        cg.GradientValueError,
        match=re.escape(
            "'bias' of shape (1, 4), but the input has shape (4,). Return a tensor of the input's "
            "shape, or None: the input broadcasts to (1, 4), so sum over the leading dimension "
            f"(0), e.g. grad.sum_to_size((4,)). (backward_weight defined at {where(bwd_w)})"
        ),
    ):
        run_backward(linear_op(backward_input=good_input, backward_weight=bwd_w))


def test_a_broadcast_gradient_is_told_to_sum_over_the_leading_dimensions() -> None:
    # The forward broadcast bias over a batch of (2, 5): returning the output gradient as the
    # bias's gradient is the usual slip.
    @cg.op(unique("add_bias"), weights=("bias",))
    def add_bias(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return x + bias

    add_bias.register_fake(lambda x, bias: torch.empty_like(x))
    add_bias.register_save_for_backward(lambda inputs, output: None)
    add_bias.register_backward_input(lambda ctx, saved, g: {"x": g})

    def bwd_w(ctx, saved, g):
        return {"bias": g}

    add_bias.register_backward_weight(bwd_w)
    x = torch.randn(2, 5, 3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    with pytest.raises(
        cg.GradientValueError,
        match=re.escape(
            "backward_weight returned a gradient for 'bias' of shape (2, 5, 3), but the input "
            "has shape (3,). Return a tensor of the input's shape, or None: the input "
            "broadcasts to (2, 5, 3), so sum over the leading dimensions (0, 1), e.g. "
            f"grad.sum_to_size((3,)). (backward_weight defined at {where(bwd_w)})"
        ),
    ):
        add_bias(x, b).sum().backward()
    # The advice applied: the gradient torch computes for the broadcast add.
    add_bias.register_backward_weight(lambda ctx, saved, g: {"bias": g.sum_to_size((3,))})
    got = torch.autograd.grad((add_bias(x, b) ** 2).sum(), (x, b))
    torch.testing.assert_close(got, torch.autograd.grad(((x + b) ** 2).sum(), (x, b)))


def test_a_size_one_dimension_broadcast_says_the_dimensions() -> None:
    @cg.op(unique("scale_rows"), weights=("s",))
    def scale_rows(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return x * s

    scale_rows.register_fake(lambda x, s: torch.empty_like(x))
    scale_rows.register_save_for_backward(lambda inputs, output: (inputs.x, inputs.s))
    scale_rows.register_backward_input(lambda ctx, saved, g: {"x": g * saved[1]})

    def wrong(ctx, saved, g):
        return {"s": g * saved[0]}

    scale_rows.register_backward_weight(wrong)
    x = torch.randn(3, 4, requires_grad=True)
    s_ = torch.randn(1, 4, requires_grad=True)
    with pytest.raises(
        cg.GradientValueError,
        match=re.escape(
            "the input has shape (1, 4). Return a tensor of the input's shape, or None: the "
            "input broadcasts to (3, 4), so sum over the dimensions the input was broadcast "
            f"along (0), e.g. grad.sum_to_size((1, 4)). (backward_weight defined at {where(wrong)})"
        ),
    ):
        scale_rows(x, s_).sum().backward()
    scale_rows.register_backward_weight(
        lambda ctx, saved, g: {"s": (g * saved[0]).sum_to_size((1, 4))}
    )
    got = torch.autograd.grad((scale_rows(x, s_) ** 2).sum(), (x, s_))
    torch.testing.assert_close(got, torch.autograd.grad(((x * s_) ** 2).sum(), (x, s_)))


def test_public_errors_report_as_customgrad_names() -> None:
    import customgrad.pipelining as pp

    assert cg.GradientValueError.__module__ == "customgrad"
    # as the traceback shows it (torch quotes wrapped errors by repr: readable there too)
    assert repr(cg.GradientValueError("m")) == "GradientValueError: m"
    assert f"{cg.SaveError.__module__}.{cg.SaveError.__qualname__}" == "customgrad.SaveError"
    assert pp.SplitStateError.__module__ == "customgrad.pipelining"
    for name in cg.__all__:
        value = getattr(cg, name)
        if isinstance(value, type) and issubclass(value, BaseException):
            assert value.__module__ == "customgrad", name
    import pickle

    err = pickle.loads(pickle.dumps(cg.GradientValueError("m")))
    assert type(err) is cg.GradientValueError


def test_wrong_dtype_is_not_cast() -> None:
    def bwd_in(ctx, saved, g):
        return {"x": (g @ saved[1]).double()}

    with pytest.raises(
        cg.GradientValueError,
        match=re.escape(
            "backward_input returned a gradient for 'x' of dtype torch.float64, but the input has "
            "dtype torch.float32. Cast it explicitly (e.g. grad.to(torch.float32)); customgrad never "
            f"casts silently. (backward_input defined at {where(bwd_in)})"
        ),
    ):
        run_backward(linear_op(backward_input=bwd_in, backward_weight=good_weight))


def test_wrong_device() -> None:
    def bwd_in(ctx, saved, g):
        return {"x": torch.empty(2, 3, device="meta")}

    with pytest.raises(
        cg.GradientValueError,
        match=re.escape(
            "backward_input returned a gradient for 'x' on device meta, but the input is on cpu. "
            f"Return it on the input's device. (backward_input defined at {where(bwd_in)})"
        ),
    ):
        run_backward(linear_op(backward_input=bwd_in, backward_weight=good_weight))


def test_gradient_for_an_optional_input_that_was_none() -> None:
    def bwd_w(ctx, saved, g):
        return {"weight": g.mT @ saved[0], "bias": g.sum(0)}

    with pytest.raises(
        cg.GradientValueError,
        match=re.escape(
            "backward_weight returned a gradient for 'bias', but that input was None. Return None "
            f"for it. (backward_weight defined at {where(bwd_w)})"
        ),
    ):
        run_backward(linear_op(backward_input=good_input, backward_weight=bwd_w), with_bias=False)


def list_op(backward: Callable[..., Any]) -> cg.CustomOp[..., torch.Tensor]:
    @cg.op(unique("stack_sum"))
    def stack_sum(xs: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(xs).sum(0)

    stack_sum.register_save_for_backward(lambda inputs, output: len(inputs.xs))
    stack_sum.register_backward(backward)
    return stack_sum


def run_list(op: cg.CustomOp[..., torch.Tensor]) -> None:
    xs = [torch.randn(3, requires_grad=True) for _ in range(3)]
    op(xs).sum().backward()


def test_list_gradient_of_wrong_length() -> None:
    def bwd(ctx, n, g):
        return {"xs": [g] * (n - 1)}

    with pytest.raises(
        cg.GradientValueError,
        match=re.escape(
            "backward returned 2 gradients for 'xs', but the input list has 3 items. Return one Tensor "
            f"or None per item. (backward defined at {where(bwd)})"
        ),
    ):
        run_list(list_op(bwd))


def test_list_gradient_that_is_not_a_list() -> None:
    def bwd(ctx, n, g):
        return {"xs": g}

    with pytest.raises(
        cg.GradientTypeError,
        match=re.escape(
            "as the gradient for 'xs', a list[Tensor] argument. Return a list with one Tensor or None per item."
        ),
    ):
        run_list(list_op(bwd))


def test_list_item_of_wrong_shape_names_the_index() -> None:
    def bwd(ctx, n, g):
        return {"xs": [g, g[:2], None]}

    with pytest.raises(
        cg.GradientValueError,
        match=re.escape(
            "backward returned a gradient for 'xs'[1] of shape (2,), but the input has shape (3,)."
        ),
    ):
        run_list(list_op(bwd))


# -- the validation's advice, applied: each fix gives torch's gradients -------------------------


def _same_as_torch(op: cg.CustomOp[..., torch.Tensor], with_bias: bool = True) -> None:
    """The op's gradients of a weighted sum equal plain torch's (None for no gradient)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, generator=g, requires_grad=True)
    w = torch.randn(4, 3, generator=g, requires_grad=True)
    b = torch.randn(4, generator=g, requires_grad=True) if with_bias else None
    r = torch.randn(2, 4, generator=g)
    leaves = [t for t in (x, w, b) if t is not None]
    got = torch.autograd.grad((op(x, w, b) * r).sum(), leaves)
    want = torch.autograd.grad(((x @ w.mT + (0 if b is None else b)) * r).sum(), leaves)
    torch.testing.assert_close(got, want)


def _every(ctx, saved, g):
    x, w = saved
    return {"x": g @ w, "weight": g.mT @ x, "bias": g.sum(0)}


@pytest.mark.parametrize(
    "advice",
    [
        # "unknown argument 'input'. Valid keys: 'x', 'weight', 'bias'": a valid key
        "use a valid key",
        # "a gradient for 'scale', a int argument ... Remove the key"
        "remove the non-tensor key",
        # "Weight gradients belong in register_backward_weight; return only 'x'" (and the reverse)
        "each gradient in its half",
        # "Return a Tensor or None"
        "a tensor",
        # "Cast it explicitly (e.g. grad.to(torch.float32))"
        "cast explicitly",
    ],
)
def test_validation_advice_applied_gives_torchs_gradients(advice: str) -> None:
    if advice == "use a valid key":  # the mistake returned "input" for "x"
        op = linear_op(lambda ctx, saved, g: {**_every(ctx, saved, g), "x": g @ saved[1]})
    elif advice == "remove the non-tensor key":
        op = linear_op(
            lambda ctx, saved, g: {
                k: v
                for k, v in {**_every(ctx, saved, g), "scale": torch.zeros(())}.items()
                if k != "scale"
            }
        )
    elif advice == "each gradient in its half":
        op = linear_op(backward_input=good_input, backward_weight=good_weight)
    elif advice == "a tensor":
        op = linear_op(lambda ctx, saved, g: {**_every(ctx, saved, g), "x": torch.as_tensor(
            g @ saved[1])})  # fmt: skip
    else:
        op = linear_op(
            backward_input=lambda ctx, saved, g: {"x": (g @ saved[1]).double().to(torch.float32)},
            backward_weight=good_weight,
        )
    _same_as_torch(op)


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)  # the second device
def test_device_advice_applied_returns_it_on_the_inputs_device() -> None:
    # "Return it on the input's device": a CPU gradient for a CUDA input, then moved there.
    def bwd_in(ctx, saved, g):
        return {"x": (g @ saved[1]).cpu()}

    op = linear_op(backward_input=bwd_in, backward_weight=good_weight)
    x = torch.randn(2, 3, device="cuda", requires_grad=True)
    w = torch.randn(4, 3, device="cuda", requires_grad=True)
    with pytest.raises(
        cg.GradientValueError,
        match=re.escape(
            f"returned a gradient for 'x' on device cpu, but the input is on {x.device}. Return "
            f"it on the input's device. (backward_input defined at {where(bwd_in)})"
        ),
    ):
        op(x, w).sum().backward()
    op.register_backward_input(lambda ctx, saved, g: {"x": (g @ saved[1]).cpu().to(g.device)})
    got = torch.autograd.grad(op(x, w).sum(), (x, w))
    torch.testing.assert_close(got, torch.autograd.grad((x @ w.mT).sum(), (x, w)))


def test_missing_gradient_advice_applied() -> None:
    # "Add it to the dict (use None for a zero gradient), or check ctx.needs_input_grad(name)"
    _same_as_torch(linear_op(_every))  # added
    none = linear_op(lambda ctx, saved, g: {**_every(ctx, saved, g), "bias": None})
    x, w, b = torch.randn(2, 3), torch.randn(4, 3, requires_grad=True), torch.randn(4)
    b.requires_grad_(True)
    gw, gb = torch.autograd.grad(none(x, w, b).sum(), (w, b), allow_unused=True)
    torch.testing.assert_close(gw, torch.ones(2, 4).mT @ x)
    assert gb is None  # None: a zero gradient, as autograd says it

    def asks(ctx, saved, g):
        x, w = saved
        grads = {"x": g @ w if ctx.needs_input_grad("x") else None}
        if ctx.needs_input_grad("weight"):
            grads["weight"] = g.mT @ x
        if ctx.needs_input_grad("bias"):
            grads["bias"] = g.sum(0)
        return grads

    _same_as_torch(linear_op(asks))


def test_none_input_advice_applied() -> None:
    # "that input was None. Return None for it."
    op = linear_op(
        backward_input=good_input,
        backward_weight=lambda ctx, saved, g: {"weight": g.mT @ saved[0], "bias": None},
    )
    _same_as_torch(op, with_bias=False)


def test_list_advice_applied_one_gradient_per_item() -> None:
    # "Return a list with one Tensor or None per item" / "Return one Tensor or None per item."
    xs = [torch.randn(3, requires_grad=True) for _ in range(3)]
    op = list_op(lambda ctx, n, g: {"xs": [g] * (n - 1) + [None]})
    got = torch.autograd.grad(op(xs).sum(), xs, allow_unused=True)
    assert got[2] is None
    torch.testing.assert_close(got[:2], (torch.ones(3), torch.ones(3)))


def test_needs_input_grad_of_an_unknown_name() -> None:
    def bwd(ctx, saved, g):
        ctx.needs_input_grad("input")
        return {}

    with pytest.raises(
        cg.GradientValueError,
        match=re.escape(
            "ctx.needs_input_grad('input'): no such argument. Arguments: x, weight, bias, scale."
        ),
    ):
        run_backward(linear_op(bwd))


# -- hardening: internal errors and confusing messages become clear errors ---------------------


def test_kernel_returning_none() -> None:
    op = linear_op(good_input_all)
    op.register_kernel(None, lambda x, weight, bias=None, scale=1: None)
    x = torch.randn(2, 3, requires_grad=True)
    msg = re.escape(
        f"{op.name}: the kernel returned None, but the schema ((Tensor x, Tensor weight, "
        "Tensor? bias=None, SymInt scale=1) -> Tensor) asks for Tensor as its output."
    )
    with pytest.raises(cg.KernelOutputError, match=msg):
        op(x, torch.randn(4, 3))
    with torch.no_grad(), pytest.raises(cg.KernelOutputError, match=msg):
        op(x, torch.randn(4, 3))


def test_kernel_returning_an_input() -> None:
    @cg.op(unique("identity"))
    def identity(x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    identity.register_fake(lambda x: torch.empty_like(x))
    identity.register_save_for_backward(lambda inputs, output: None)
    identity.register_backward_input(lambda ctx, saved, g: {"x": g})
    msg = re.escape(
        f"{identity.name}: the kernel returned a Tensor that is (a view of) one of its inputs or "
        "of another output. Custom ops must return new tensors"
    )
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(cg.KernelOutputError, match=msg):
        identity(x)
    with torch.no_grad(), pytest.raises(cg.KernelOutputError, match=msg):
        identity(x)
    with pytest.raises(cg.KernelOutputError, match=msg):
        identity.opoverload(x.detach())


@pytest.mark.parametrize("device", ["cpuu", "CPU", "cpu:0", "tpu"])
def test_unknown_device_type(device: str) -> None:
    name = unique("dev")

    def f(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    with pytest.raises(cg.DefinitionError, match=re.escape(f"{name}: ")) as raised:
        cg.op(name, f, device_types=device)
    assert repr(device) in str(raised.value)
    assert "lowercase and without an index" in str(raised.value)
    op = cg.op(name, f, device_types="cpu")  # nothing half-defined was left behind
    assert op(torch.ones(1)).tolist() == [2.0]
    with pytest.raises(cg.DefinitionError, match=re.escape(f"{name}: ")):
        op.register_kernel(device, f)


def test_unpickling_an_op_this_process_never_defined() -> None:
    import pickle

    from customgrad._op import _lookup

    class Stranger:
        def __reduce__(self) -> tuple[Any, ...]:
            return (_lookup, ("never::defined",))

    with pytest.raises(
        cg.MissingRegistrationError,
        match=re.escape(
            "customgrad op 'never::defined' is not defined in this process, so it cannot be "
            "unpickled. Import the module that defines it"
        ),
    ):
        pickle.loads(pickle.dumps(Stranger()))


def test_builtin_kernel() -> None:
    with pytest.raises(
        cg.DefinitionError,
        match=re.escape("cannot read the signature of <built-in method sin"),
    ):
        cg.op(unique("sin"), torch.sin)


def test_check_op_of_something_else() -> None:
    from customgrad.testing import MSG_NOT_AN_OP, check_op

    with pytest.raises(
        cg.ArgumentTypeError, match=f"^{re.escape(MSG_NOT_AN_OP.format(got=repr(torch.sin)))}$"
    ):
        check_op(torch.sin, torch.ones(2))  # type: ignore[arg-type]
    assert MSG_NOT_AN_OP.startswith(
        "check_op: expected a customgrad op, got {got}. Pass the op that customgrad.op, "
        "customgrad.from_function or customgrad.from_functions made:\n\n"
        "    check_op(linear, x, weight)                  # @customgrad.op(...) def linear(...)\n"
        '    check_op(patch.ops["mymodule.MyFunction"], x, weight)   # patch = from_functions(...)'
    )


def test_check_op_of_what_from_functions_returns_names_its_ops() -> None:
    from customgrad.testing import MSG_NOT_AN_OP, check_op

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return g * 2

    with cg.from_functions(Scale, namespace=unique("fns").split("::")[0]) as patch:
        (label,) = patch.ops
        got = (
            f"a FunctionPatch (what from_functions returns): check one of its ops, "
            f"patch.ops[...] ({label})"
        )
        with pytest.raises(
            cg.ArgumentTypeError, match=f"^{re.escape(MSG_NOT_AN_OP.format(got=got))}$"
        ):
            check_op(patch, torch.ones(2))  # type: ignore[arg-type]
        assert check_op(patch.ops[label], torch.ones(2), checks=["gradcheck"]).ok  # its op


def test_save_for_backward_hiding_tensors_in_an_object() -> None:
    class Saved:  # not a container customgrad flattens (a dataclass would be)
        def __init__(self, x: torch.Tensor, weight: torch.Tensor) -> None:
            self.x, self.weight = x, weight

    op = linear_op(good_input_all)
    save = op.register_save_for_backward(lambda inputs, output: Saved(inputs.x, inputs.weight))
    with pytest.raises(
        cg.SaveError,
        match=re.escape(
            f"{op.name}: save_for_backward returned a "
            "test_save_for_backward_hiding_tensors_in_an_object.<locals>.Saved object with Tensor "
            "attributes, which holds Tensors customgrad cannot see. Tensors must be saved through "
            "autograd (so in-place changes before backward are caught and no reference cycle "
            "keeps outputs alive), which customgrad does for Tensors inside tuples, lists, dicts, "
            "NamedTuples and dataclasses. Return those instead:\n\n"
            "    return inputs.x, inputs.weight, rstd            # or a dict, a NamedTuple, a "
            f"dataclass\n\n(save_for_backward defined at {where(save)})"
        ),
    ):
        run_backward(op)


def test_float_gradient_for_an_integer_argument() -> None:
    @cg.op(unique("gather"))
    def gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return x[index]

    gather.register_fake(lambda x, index: x.new_empty(index.shape))
    gather.register_save_for_backward(lambda inputs, output: (inputs.x, inputs.index))

    @gather.register_backward
    def bwd(ctx: cg.BackwardContext, saved: Any, g: torch.Tensor) -> dict[str, Any]:
        x, index = saved
        return {"x": torch.zeros_like(x).index_add(0, index, g), "index": g}

    with pytest.raises(
        cg.GradientValueError,
        match=re.escape(
            f"{gather.name}: backward returned a gradient for 'index', but that input is a "
            "torch.int64 tensor, which has no gradient (only floating-point and complex tensors "
            f"do). Return None for it. (backward defined at {where(bwd)})"
        ),
    ):
        gather(torch.randn(4, requires_grad=True), torch.tensor([1, 2])).sum().backward()


def test_backward_with_the_wrong_number_of_gradient_parameters() -> None:
    op = linear_op()

    def bwd(ctx: Any, saved: Any, g1: Any, g2: Any) -> dict[str, Any]:
        return {}

    with pytest.raises(
        cg.DefinitionError,
        match=re.escape(
            f"{op.name}: the full backward takes 4 positional parameter(s), but customgrad calls "
            "it with 3: (ctx, saved, grad): one gradient per output."
        ),
    ):
        op.register_backward(bwd)


def test_keyword_only_tensor_passed_positionally() -> None:
    @cg.op(unique("kwonly"))
    def f(x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        return x * scale

    with pytest.raises(
        cg.ArgumentTypeError,
        match=re.escape(
            f"{f.name}: too many positional arguments. The op takes (Tensor x, *, "
            "Tensor scale) -> Tensor; pass 'scale' by keyword."
        ),
    ):
        f(torch.ones(2), torch.ones(2))  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("arg", "got"),
    [
        ("x", "None"),
        ("x", "a list of 2 items"),
        ("x", "a numpy.ndarray"),
        ("scale", "a Tensor of shape (), requires grad"),
        ("xs", "a Tensor of shape (2,)"),
    ],
)
def test_argument_of_the_wrong_kind_is_named_before_the_kernel_runs(arg: str, got: str) -> None:
    import numpy as np

    ran: list[int] = []

    @cg.op(unique("kinds"))
    def f(x: torch.Tensor, xs: list[torch.Tensor], scale: float = 1.0) -> torch.Tensor:
        ran.append(1)
        return x * scale

    values: dict[str, Any] = {
        "x": torch.ones(2),
        "xs": [torch.ones(2)],
        "scale": 1.0,
    }
    values[arg] = {
        "None": None,
        "a list of 2 items": [1.0, 2.0],
        "a numpy.ndarray": np.ones(2),
        "a Tensor of shape (), requires grad": torch.tensor(2.0, requires_grad=True),
        "a Tensor of shape (2,)": torch.ones(2),
    }[got]
    want = {
        "x": "a Tensor",
        "xs": "a list of Tensors",
        "scale": "a float, not a Tensor (customgrad differentiates Tensor arguments only)",
    }[arg]
    with pytest.raises(
        cg.ArgumentTypeError,
        match=re.escape(f"{f.name}: argument {arg!r} must be {want}, but got {got}."),
    ):
        f(**values)
    assert ran == []


def test_missing_autograd_of_an_op_without_weights_says_nothing_of_weights() -> None:
    @cg.op(unique("mul"))
    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x * y

    with pytest.raises(cg.MissingRegistrationError) as raised:
        f(torch.ones(2, requires_grad=True), torch.ones(2))
    assert "weight" not in str(raised.value)
    assert "register_backward (or register_backward_input)" in str(raised.value)


def test_in_place_change_of_a_saved_output_names_the_op() -> None:
    @cg.op(unique("exp"))
    def exp(x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x)

    exp.register_fake(lambda x: torch.empty_like(x))
    exp.register_save_for_backward(lambda inputs, output: output)
    exp.register_backward_input(lambda ctx, out, g: {"x": g * out})
    y = exp(torch.randn(3, requires_grad=True))
    y.mul_(2)
    with pytest.raises(
        RuntimeError,
        match=re.escape(f"CustomGrad[{exp.name}]"),  # the rest is autograd's text
    ):
        y.sum().backward()


def test_backward_writing_into_its_gradient() -> None:
    def bwd_in(ctx: Any, saved: Any, g: torch.Tensor) -> dict[str, Any]:
        g.mul_(2)  # planted: Liger-style in_place=True
        return {"x": g @ saved[1]}

    op = linear_op(backward_input=bwd_in, backward_weight=good_weight)
    x = torch.randn(2, 3, requires_grad=True)
    out = op(x, torch.randn(4, 3, requires_grad=True))
    with pytest.raises(
        cg.MutationError,
        match=re.escape(
            f"{op.name}: backward_input modified the gradient of output 0 in place (its version "
            "went from 0 to 1). The other half of a split backward may still need it"
        ),
    ):
        out.backward(torch.ones(2, 4))


def test_bare_tensors_where_lists_are_expected() -> None:
    from customgrad.graph import explain_split
    from customgrad.pipelining import stage_backward_input

    x = torch.randn(2, 3, requires_grad=True)
    w = torch.randn(4, 3, requires_grad=True)
    out = x @ w.mT
    with pytest.raises(
        cg.ArgumentTypeError,
        match=re.escape(
            "stage_backward_input: output_grads must be a list or tuple, got Tensor. Pass one "
            "gradient per output (or None for a loss)."
        ),
    ):
        stage_backward_input([out], torch.ones_like(out), [x], [w])  # type: ignore[arg-type]
    with pytest.raises(
        cg.ArgumentTypeError,
        match=re.escape("stage_backward_input: input_values must be a list or tuple, got Tensor."),
    ):
        stage_backward_input([out], [torch.ones_like(out)], x, [w])
    with pytest.raises(
        cg.ArgumentTypeError,
        match=re.escape(
            "stage_backward_input: stage_outputs_or_loss must be a list or tuple, got Tensor. "
            "Pass [loss] for a loss."
        ),
    ):
        stage_backward_input(out.sum(), None, [x], [w])  # type: ignore[arg-type]
    with pytest.raises(
        cg.ArgumentValueError,
        match=re.escape(
            "stage_backward_input: 2 outputs but 1 output gradients. Pass one gradient (or None) "
            "per output."
        ),
    ):
        stage_backward_input([out, out], [torch.ones_like(out)], [x], [w])
    with pytest.raises(
        cg.ArgumentTypeError,
        match=re.escape(
            "stage_backward_input: the gradient of output 0 is a list; pass a Tensor (or None) "
            "per output."
        ),
    ):
        stage_backward_input([out], [[torch.ones_like(out)]], [x], [w])  # type: ignore[list-item]
    with pytest.raises(
        cg.ArgumentTypeError,
        match=re.escape(
            "explain_split: inputs must be a list or tuple of tensors, got Tensor. Pass [x] for "
            "a single tensor."
        ),
    ):
        explain_split(out, x, [w])  # type: ignore[arg-type]


def test_check_op_report_says_why_opcheck_failed() -> None:
    from customgrad.testing import check_op

    op = linear_op(good_input_all)
    op.register_fake(lambda x, weight, bias=None, scale=1: x.new_empty(x.shape[0], 1))
    report = check_op(
        op, torch.randn(2, 3), torch.randn(4, 3), checks=["opcheck"], raise_on_failure=False
    )
    line = next(line for line in str(report).splitlines() if "opcheck" in line)
    assert line.startswith("  [FAIL] opcheck: torch.library.opcheck's ")
    assert "failed: " in line


# -- pipelining --------------------------------------------------------------------------------


def _queued(queue: Any, stage: int, mb: int) -> None:
    op = linear_op(backward_input=good_input, backward_weight=good_weight)
    x = torch.randn(2, 3, requires_grad=True)
    with queue.microbatch(stage, mb):
        out = op(x, torch.randn(4, 3, requires_grad=True), torch.randn(4, requires_grad=True))
    queue.backward(out.sum(), inputs=[x])


def test_queue_errors() -> None:
    from customgrad.pipelining import (
        MissingInputPassError,
        PendingWeightWorkError,
        StrayWeightWorkError,
        WeightGradQueue,
        WeightPassTwiceError,
    )
    from customgrad.pipelining._queue import (
        MSG_NO_INPUT_PASS,
        MSG_PENDING,
        MSG_STRAY,
        MSG_TWICE,
    )

    queue = WeightGradQueue()
    with pytest.raises(
        MissingInputPassError, match=re.escape(MSG_NO_INPUT_PASS.format(stage=0, mb=1))
    ):
        queue.run(0, 1)
    assert MSG_NO_INPUT_PASS.format(stage=0, mb=1).startswith(
        "WeightGradQueue.run(stage=0, microbatch=1): nothing was queued for this microbatch: its "
        "input pass (I) never ran, or its forward ran no customgrad op under the queue."
    )
    _queued(queue, 0, 1)
    _queued(queue, 0, 2)
    with pytest.raises(
        StrayWeightWorkError,
        match=re.escape(
            MSG_STRAY.format(which="stage=0", n=2, keys="(0, 1), (0, 2)").splitlines()[0]
        ),
    ):
        queue.dw_builder(0)
    with pytest.raises(
        PendingWeightWorkError,
        match=re.escape(MSG_PENDING.format(which="", keys="(0, 1), (0, 2)")),
    ):
        queue.finish()
    assert MSG_PENDING.format(which="", keys="(0, 1)").startswith(
        "WeightGradQueue.finish(): weight-gradient work is still queued for (stage, microbatch) "
        "(0, 1): their W never ran, so those weights' .grad are incomplete."
    )
    queue.run(0, 1)
    with pytest.raises(WeightPassTwiceError, match=re.escape(MSG_TWICE.format(stage=0, mb=1))):
        queue.run(0, 1)
    assert MSG_TWICE.format(stage=0, mb=1).startswith(
        "WeightGradQueue.run(stage=0, microbatch=1): W already ran for this microbatch in this "
        "step."
    )
    queue.run(0, 2)
    queue.finish()


def test_split_state_errors() -> None:
    from torch.distributed.pipelining import _backward as torch_backward

    from customgrad.pipelining import SplitStateError, stage_backward_input, stage_backward_weight

    op = linear_op(backward_input=good_input, backward_weight=good_weight)
    x = torch.randn(2, 3, requires_grad=True)
    w = torch.randn(4, 3, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    _, groups = stage_backward_input([op(x, w, b).sum()], None, [x], [w, b])
    stage_backward_weight([w, b], groups)
    with pytest.raises(
        SplitStateError,
        match=re.escape(
            "stage_backward_weight: these param_groups were already used by an earlier "
            "stage_backward_weight call; each stage_backward_input result runs W once."
        ),
    ):
        stage_backward_weight([w, b], groups)
    native = (x @ w.mT + b).sum()  # torch's own split (which refuses customgrad ops on 2.11)
    _, torch_groups = torch_backward.stage_backward_input([native], None, [x], [w, b])
    with pytest.raises(
        SplitStateError,
        match=re.escape(
            "stage_backward_weight: param_groups did not come from "
            "customgrad.pipelining.stage_backward_input (got list)."
        ),
    ):
        stage_backward_weight([w], torch_groups)


def test_stage_with_queue_and_dw_builder() -> None:
    from customgrad.pipelining import PipelineStage, WeightGradQueue

    queue = WeightGradQueue()
    with pytest.raises(
        cg.ArgumentValueError,
        match=re.escape(
            "customgrad.pipelining.PipelineStage: pass either queue= or dw_builder=, not both "
            "(a queue brings its own dw_builder)."
        ),
    ):
        PipelineStage(
            torch.nn.Linear(2, 2),
            0,
            2,
            torch.device("cpu"),
            queue=queue,
            dw_builder=queue.dw_builder,
        )


def test_two_planned_backwards_through_one_graph() -> None:
    from customgrad._record import record_of
    from customgrad._routing import Route, routing
    from customgrad._split_plan import postorder

    op = linear_op(backward_input=good_input, backward_weight=good_weight)
    out = op(torch.randn(2, 3, requires_grad=True), torch.randn(4, 3, requires_grad=True))
    routes = {r: Route() for n in postorder([out.grad_fn]) if (r := record_of(n)) is not None}
    with (
        routing(routes),
        pytest.raises(
            cg.UnsupportedError,
            match=re.escape(
                f"{op.name}: two planned backwards run through the same autograd node at once "
                "(another thread's split of the same graph?). Run one backward per graph at a time."
            ),
        ),
        routing(routes),
    ):
        pass


def test_errors_are_the_matching_builtins() -> None:
    assert issubclass(cg.GradientTypeError, TypeError)
    assert issubclass(cg.GradientValueError, ValueError)
    assert issubclass(cg.DefinitionError, ValueError)
    assert issubclass(cg.MissingRegistrationError, RuntimeError)
    assert issubclass(cg.ArgumentTypeError, TypeError)
    assert issubclass(cg.ArgumentValueError, ValueError)
    assert issubclass(cg.MutationError, RuntimeError)
    assert issubclass(cg.KernelOutputError, RuntimeError)
    assert issubclass(cg.UnsupportedError, RuntimeError)
    assert issubclass(cg.SaveError, TypeError)
    for cls in (
        cg.KernelOutputError,
        cg.UnsupportedError,
        cg.SaveError,
        cg.ArgumentTypeError,
        cg.ArgumentValueError,
        cg.MutationError,
        cg.GradientTypeError,
        cg.GradientValueError,
        cg.DefinitionError,
        cg.MissingRegistrationError,
    ):
        assert issubclass(cls, cg.CustomGradError)


# --- automatic split of a single backward, and wrapped autograd.Functions --------------------


def _plain_linear(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    ctx.save_for_backward(x, w)
    return x @ w.mT


def _function(
    forward: Callable[..., Any] = _plain_linear,
    backward: Callable[..., Any] | None = None,
    **methods: Any,
) -> type[torch.autograd.Function]:
    def default_backward(ctx: Any, g: torch.Tensor) -> Any:
        x, w = ctx.saved_tensors
        return g @ w, g.mT @ x

    namespace = {
        "forward": staticmethod(forward),
        "backward": staticmethod(backward or default_backward),
        **{k: staticmethod(v) for k, v in methods.items()},
    }
    return type("Fn", (torch.autograd.Function,), namespace)


def test_untraceable_single_backward_log_line(caplog: pytest.LogCaptureFixture) -> None:
    def backward(ctx: Any, saved: Any, g: torch.Tensor) -> dict[str, Any]:
        x, w = saved
        scale = 2.0 if bool(g.sum() > 0) else 1.0
        return {"x": scale * g @ w, "weight": g.mT @ x, "bias": g.sum(0)}

    op = linear_op(backward)
    caplog.set_level("WARNING", logger="customgrad")
    run_backward(op)  # a full backward calls it as written: nothing tried, nothing logged
    assert not [r for r in caplog.records if r.name == "customgrad"]
    for _ in range(2):  # input passes (x's gradient only): the capture is tried, logged once
        x = torch.randn(2, 3, requires_grad=True)
        w, b = torch.randn(4, 3, requires_grad=True), torch.randn(4, requires_grad=True)
        torch.autograd.grad(op(x, w, b).sum(), [x])
    lines, first = inspect.getsourcelines(backward)
    at = f"{inspect.getsourcefile(backward)}:{first + 2} (`{lines[2].strip()}`)"
    assert [r.getMessage() for r in caplog.records if r.name == "customgrad"] == [
        f"{op.name}: the single backward cannot be split automatically: it branches on tensor "
        f"values in Python at {at}. It runs once, whole, "
        "in the first pass that needs any of its gradients, and hands the gradients a later "
        "pass needs to that pass: nothing is computed twice, but under a split backward the "
        "weight work is done in the input pass. To split it automatically, compute with tensor "
        "ops instead (torch.where, masks), so the same ops run for every value. To silence "
        "this, register the register_backward_input/_weight pair, or register_backward(fn, "
        "split='phase') (called once per pass with ctx.needs_input_grad set for it: repeated "
        "work, unsafe for kernels that write into their inputs). (backward defined at "
        f"{where(backward)})"
    ]


def test_from_function_needs_a_function_class() -> None:
    with pytest.raises(
        cg.DefinitionError,
        match=re.escape(
            "mylib::f: from_function needs a torch.autograd.Function subclass, got Fn.apply. "
            "Pass the class: Fn."
        ),
    ):
        cg.from_function(_function().apply, "mylib::f")  # type: ignore[arg-type]


def test_from_function_without_annotations_reads_the_schema_from_the_first_call() -> None:
    def forward(ctx: Any, x, w, eps=1e-5):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(x, w)
        return x @ w.mT + eps

    def backward(ctx: Any, g: torch.Tensor) -> Any:
        x, w = ctx.saved_tensors
        return g @ w, g.mT @ x, None

    name = unique("f")
    op = cg.from_function(_function(forward, backward), name, weights=("w",))
    x, w = torch.randn(2, 3, requires_grad=True), torch.randn(4, 3, requires_grad=True)
    got = torch.autograd.grad(op(x, w).sum(), (x, w))
    torch.testing.assert_close(got, torch.autograd.grad((x @ w.mT + 1e-5).sum(), (x, w)))
    assert op.schema == "(Tensor x, Tensor w, float eps=1e-05) -> Tensor"
    with pytest.raises(
        cg.UnsupportedError,
        match=re.escape(
            f"{name}: argument 'eps' got Tensor, but the op's schema, inferred from the first "
            "call, says float ((Tensor x, Tensor w, float eps=1e-05) -> Tensor). Give the "
            'schema that covers both calls: cg.from_function(..., schema="(Tensor x, Tensor w, '
            f'float eps) -> Tensor"). (forward defined at {where(forward)})'
        ),
    ):
        op(x, w, torch.ones(()))


def test_from_function_outputs_that_change_between_calls() -> None:
    def forward(ctx: Any, x, with_stats):  # type: ignore[no-untyped-def]
        return x * 2, (x.sum() if with_stats else None)

    def backward(ctx: Any, g: torch.Tensor, g_stats: Any) -> Any:
        return g * 2, None

    name = unique("f")
    op = cg.from_function(_function(forward, backward), name)
    op(torch.ones(2), False)
    with pytest.raises(
        cg.KernelOutputError,
        match=re.escape(
            f"{name}: the Function's forward returned (Tensor, Tensor), but on the call that "
            "defined the op it returned (Tensor, None). The op's outputs are fixed when it is "
            "defined. Wrap the Function once per way of calling it (cg.from_function(..., "
            'schema="(...) -> (Tensor, Tensor)") with the outputs it returns), or call it the '
            f"same way. (forward defined at {where(forward)})"
        ),
    ):
        op(torch.ones(2), True)


def test_from_function_with_varargs_forward() -> None:
    def forward(ctx: Any, *tensors: torch.Tensor) -> torch.Tensor:
        return tensors[0] * 2

    name = unique("f")
    with pytest.raises(
        cg.DefinitionError,
        match=re.escape(
            f"{name}: Fn.forward takes *tensors; autograd.Function.apply passes "
            "its inputs by position, and a customgrad op needs one named parameter per input. "
            "Name them: def forward(ctx, x: Tensor, weight: Tensor) -> Tensor, or name them in the "
            'schema: cg.from_function(..., schema="(Tensor x, Tensor weight) -> Tensor"). '
            f"(forward defined at {where(forward)})"
        ),
    ):
        cg.from_function(_function(forward), name)


def test_from_function_undeclared_non_differentiable_output() -> None:
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(x, w)
        out = x @ w.mT
        stats = out.amax(-1)
        ctx.mark_non_differentiable(stats)
        return out, stats

    name = unique("f")
    op = cg.from_function(_function(forward), name, weights=("w",))
    with pytest.raises(
        cg.DefinitionError,
        match=re.escape(
            f"{name}: the Function's forward marks output 1 non-differentiable "
            "(ctx.mark_non_differentiable), but the op declares it differentiable. Declare it "
            "when wrapping: cg.from_function(..., output_differentiability=[True, False]). "
            f"(forward defined at {where(forward)})"
        ),
    ):
        op(torch.randn(2, 3, requires_grad=True), torch.randn(4, 3))


def test_from_function_forward_that_marks_dirty() -> None:
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.mark_dirty(x)
        return x.mul_(2)

    name = unique("f")
    op = cg.from_function(_function(forward), name)
    with pytest.raises(
        cg.UnsupportedError,
        match=re.escape(
            f"{name}: the Function's forward calls ctx.mark_dirty: it modifies an input in place, "
            "which customgrad ops do not differentiate through. Return a new tensor instead, or "
            f"keep this Function as it is. (forward defined at {where(forward)})"
        ),
    ):
        op(torch.randn(2))


def test_from_function_backward_with_too_few_gradients() -> None:
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return g @ ctx.saved_tensors[1]  # only the first

    fn = _function(backward=backward)
    name = unique("f")
    op = cg.from_function(fn, name, weights=("w",))
    with pytest.raises(
        cg.GradientValueError,
        match=re.escape(
            f"{name}: Fn.backward returned 1 gradient(s), but forward takes 2 input(s) (x, w). "
            "Return one per input, in order (None for inputs without a gradient). (Fn.backward "
            f"defined at {where(backward)})"
        ),
    ):
        op(torch.randn(2, 3, requires_grad=True), torch.randn(4, 3)).sum().backward()


def test_from_function_gradient_for_a_non_tensor_input() -> None:
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x * scale

    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return g * ctx.scale, g.sum()

    name = unique("f")
    op = cg.from_function(_function(forward, backward), name)
    with pytest.raises(
        cg.GradientTypeError,
        match=re.escape(
            f"{name}: Fn.backward returned a gradient at position 1, for 'scale', which is not a "
            f"Tensor input. Return None there. (Fn.backward defined at {where(backward)})"
        ),
    ):
        op(torch.randn(3, requires_grad=True), 2.0).sum().backward()


def test_from_function_double_backward_through_a_computed_tensor() -> None:
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y = torch.exp(x)
        ctx.save_for_backward(x, y.clone())  # the clone: neither an input nor an output
        return y * x

    def backward(ctx: Any, g: torch.Tensor) -> Any:
        x, y = ctx.saved_tensors
        return g * y * (1 + x)

    name = unique("f")
    op = cg.from_function(_function(forward, backward), name)
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    (gx,) = torch.autograd.grad(op(x).sum(), [x], create_graph=True)
    with pytest.raises(
        cg.UnsupportedError,
        match=re.escape(
            f"{name}: double backward (create_graph=True, gradient penalties) reached a tensor "
            "that the Function's forward computed and saved on ctx: autograd sees it as a "
            "constant (as it did for the Function), so the gradient through it would be silently "
            "wrong. If the Function needs no double backward, say so with one line: decorate its "
            "backward with @once_differentiable (from torch.autograd.function import "
            "once_differentiable); double backward then raises at once and check_op skips "
            "gradgradcheck. If it does need it, save the inputs and recompute the tensor in "
            f"backward with differentiable torch ops. (forward defined at {where(forward)})"
        ),
    ):
        torch.autograd.grad(gx.sum(), [x])


def test_from_function_op_whose_kernel_was_replaced() -> None:
    name = unique("f")
    op = cg.from_function(_function(), name, weights=("w",))
    op.register_kernel("cpu", lambda x, w: (x @ w.mT, []))
    with pytest.raises(
        cg.MissingRegistrationError,
        match=re.escape(
            f"{name}: the op's kernel is not the Function's forward on this call (a kernel "
            "registered with register_kernel replaced it?), so what forward saved on ctx is "
            "unknown. An op made with from_function runs its Function's forward as its kernel. "
            f"(forward defined at {where(_plain_linear)})"
        ),
    ):
        op(torch.randn(2, 3, requires_grad=True), torch.randn(4, 3))


# --- definitions of real ops: residuals, hand-off, schema=, weightless ops ---------------------


def residual_rms(differentiable: bool = True) -> cg.CustomOp[..., torch.Tensor]:
    @cg.op(unique("rms"), weights=("weight",), residuals=("rstd",))
    def rms(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return x * rstd * weight, rstd

    rms.register_fake(lambda x, weight: (torch.empty_like(x), x.new_empty(x.shape[0], 1)))
    rms.register_save_for_backward(lambda inputs, output, res: (inputs.x, inputs.weight, res.rstd))

    @rms.register_backward_input(differentiable=differentiable)
    def _(ctx: Any, saved: Any, g: torch.Tensor) -> dict[str, Any]:
        x, weight, rstd = saved
        x_hat, m = x * rstd, g * weight
        return {"x": rstd * (m - x_hat * (m * x_hat).mean(-1, keepdim=True))}

    rms.register_backward_weight(lambda ctx, s, g: {"weight": (g * s[0] * s[2]).sum(0)})
    return rms


def test_double_backward_through_a_residual() -> None:
    rms = residual_rms()
    x, w = torch.randn(2, 4, requires_grad=True), torch.randn(4, requires_grad=True)
    (gx,) = torch.autograd.grad(rms(x, w).sum(), x, create_graph=True)
    with pytest.raises(
        cg.UnsupportedError,
        match=re.escape(
            f"{rms.name}: double backward (create_graph=True, gradient penalties) reached "
            "residual 'rstd', which the kernel computed in the forward: autograd sees it as a "
            "constant, so the gradient through it would be silently wrong. Save the inputs and "
            "recompute it in the backward with differentiable torch ops if you need double "
            "backward; otherwise register the backward with differentiable=False to declare the "
            f"op once differentiable. (kernel defined at {where(rms.__wrapped__)})"
        ),
    ):
        gx.sum().backward()


def test_double_backward_of_a_backward_registered_not_differentiable() -> None:
    rms = residual_rms(differentiable=False)
    bwd_in = rms.rules.backward_input
    x, w = torch.randn(2, 4, requires_grad=True), torch.randn(4, requires_grad=True)
    (gx,) = torch.autograd.grad(rms(x, w).sum(), x, create_graph=True)
    with pytest.raises(
        cg.UnsupportedError,
        match=re.escape(
            f"{rms.name}: backward_input was registered with differentiable=False, so its "
            "gradients cannot be differentiated again (double backward, gradient penalties). "
            "Register a differentiable backward_input, written with differentiable torch ops. "
            f"(backward_input defined at {where(bwd_in)})"
        ),
    ):
        torch.autograd.grad(gx.sum(), w)


def test_backward_writing_into_a_saved_tensor() -> None:
    def bwd_in(ctx: Any, saved: Any, g: torch.Tensor) -> dict[str, Any]:
        _, weight = saved
        return {"x": g @ weight.mul_(1)}  # planted: in place on a saved tensor

    op = linear_op(backward_input=bwd_in, backward_weight=good_weight)
    out = op(torch.randn(2, 3, requires_grad=True), torch.randn(4, 3, requires_grad=True))
    with pytest.raises(
        cg.MutationError,
        match=re.escape(
            f"{op.name}: backward_input modified saved tensor 1 in place (its version went from "
            "0 to 1). The other half of a split backward may still need it, and autograd may "
            "share it with other nodes. Compute out of place (grad = grad * s, not "
            f"grad.mul_(s)). (backward_input defined at {where(bwd_in)})"
        ),
    ):
        out.backward(torch.ones(2, 4))


def test_shared_work_writing_into_the_gradient() -> None:
    def shared(ctx: Any, saved: Any, g: torch.Tensor) -> torch.Tensor:
        return g.mul_(2)  # planted

    op = linear_op(backward_input=good_input, backward_weight=good_weight)
    op.register_backward_shared(shared)
    op.register_backward_input(lambda ctx, s, g: {"x": ctx.shared @ s[1]})
    out = op(torch.randn(2, 3, requires_grad=True), torch.randn(4, 3, requires_grad=True))
    with pytest.raises(
        cg.MutationError,
        match=re.escape(
            f"{op.name}: backward_shared modified the gradient of output 0 in place (its version "
            "went from 0 to 1)."
        )
        + ".*"
        + re.escape(f"(backward_shared defined at {where(shared)})"),
    ):
        out.backward(torch.ones(2, 4))


def test_reading_ctx_shared_without_registering_shared_work() -> None:
    op = linear_op(backward_input=lambda ctx, s, g: {"x": ctx.shared}, backward_weight=good_weight)
    with pytest.raises(
        cg.MissingRegistrationError,
        match=re.escape(
            f"{op.name}: ctx.shared was read, but the op registers no shared work. ctx.shared is "
            "what register_backward_shared computes for the halves of the input/weight pair; "
            "register the work both halves need:\n\n"
            "    @linear.register_backward_shared\n"
            "    def _(ctx, saved, grad):\n"
            "        return grad @ saved.w_down      # read as ctx.shared in both halves\n\n"
            "(A single register_backward computes such work itself: its automatic split runs it "
            "once and hands it from I to W.)"
        ),
    ):
        run_backward(op)


def test_weight_half_of_an_op_without_weights() -> None:
    @cg.op(unique("square"))
    def square(x: torch.Tensor) -> torch.Tensor:
        return x * x

    def bwd_w(ctx: Any, saved: Any, g: torch.Tensor) -> dict[str, Any]:
        return {}

    with pytest.raises(
        cg.DefinitionError,
        match=re.escape(
            f"{square.name}: register_backward_weight on an op without weights. Its backward is "
            "its input half alone: register it with @square.register_backward_input (or name "
            f"the weight arguments in cg.op(..., weights=...)). (backward_weight defined at "
            f"{where(bwd_w)})"
        ),
    ):
        square.register_backward_weight(bwd_w)


def test_input_half_of_an_op_whose_tensors_are_all_weights() -> None:
    @cg.op(unique("bias_only"), weights=("bias",))
    def bias_only(bias: torch.Tensor, n: int) -> torch.Tensor:
        return bias.repeat(n)

    def bwd_in(ctx: Any, saved: Any, g: torch.Tensor) -> dict[str, Any]:
        return {}

    with pytest.raises(
        cg.DefinitionError,
        match=re.escape(
            f"{bias_only.name}: register_backward_input on an op whose Tensor arguments are all "
            "weights (bias). Its backward is its weight half alone: register it with "
            f"@bias_only.register_backward_weight. (backward_input defined at {where(bwd_in)})"
        ),
    ):
        bias_only.register_backward_input(bwd_in)


def kernel_with_residual(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x * 2, x.sum(-1, keepdim=True)


@pytest.mark.parametrize(
    ("residuals", "message"),
    [
        (
            ("r", "r"),
            "residuals=('r', 'r') names 'r' twice. Give each residual its own name (function "
            f"defined at {where(kernel_with_residual)}).",
        ),
        (
            ("1r",),
            "residuals=('1r',): give the residuals names (identifiers), e.g. "
            'residuals=("rstd",), one per value the kernel returns after its outputs (function '
            f"defined at {where(kernel_with_residual)}).",
        ),
        (
            ("a", "b"),
            "residuals=('a', 'b') names 2 residual(s), but the kernel returns 2 value(s) "
            "((Tensor, Tensor)). The kernel returns its outputs, then the residuals: annotate it "
            "-> tuple[Tensor, Tensor] for one output and one residual (function defined at "
            f"{where(kernel_with_residual)}).",
        ),
    ],
    ids=["twice", "not_identifiers", "no_output_left"],
)
def test_invalid_residuals(residuals: tuple[str, ...], message: str) -> None:
    name = unique("f")
    with pytest.raises(cg.DefinitionError, match=re.escape(f"{name}: {message}")):
        cg.op(name, kernel_with_residual, residuals=residuals)


def test_save_for_backward_without_the_residuals_parameter() -> None:
    op = cg.op(unique("f"), kernel_with_residual, residuals=("r",))

    def save(inputs: Any, output: Any) -> Any:
        return inputs.x

    with pytest.raises(
        cg.DefinitionError,
        match=re.escape(
            f"{op.name}: save_for_backward takes 2 positional parameter(s), but customgrad calls "
            f"it with 3: (inputs, output, residuals). (defined at {where(save)})"
        ),
    ):
        op.register_save_for_backward(save)


def test_kernel_that_forgets_its_residual() -> None:
    def forgot(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2  # type: ignore[return-value]

    op = cg.op(unique("f"), forgot, residuals=("r",))
    with pytest.raises(
        cg.KernelOutputError,
        match=re.escape(
            f"{op.name}: the kernel returned a Tensor of shape (2,), but the schema ((Tensor x) -> "
            "(Tensor, Tensor)) asks for a tuple of 2 values. Return what the annotations say "
            f"(kernel defined at {where(forgot)})."
        ),
    ):
        op(torch.ones(2))


def test_no_fake_kernel_mentions_the_residuals() -> None:
    op = cg.op(unique("f"), kernel_with_residual, residuals=("r",))
    with pytest.raises(
        cg.MissingRegistrationError,
        match=re.escape("return <empty tensor(s) shaped like the output and the residuals>"),
    ):
        op(torch.ones(2, 3, device="meta"))


def kernel_x(x: torch.Tensor, *, n: int = 1) -> torch.Tensor:
    return x * n


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        (
            "Tensor x -> Tensor",
            "schema='Tensor x -> Tensor' is not a schema string. Give it like \"(Tensor x, "
            'int[2] window=[-1, -1]) -> Tensor", without the op name.',
        ),
        (
            "(Tensor x, *, int[2 n=1) -> Tensor",
            (
                "torch cannot parse schema='(Tensor x, *, int[2 n=1) -> Tensor': ",
                # torch's parser error in between
                '. Write it as torch schemas are written, e.g. "(Tensor x, int[2] '
                'window=[-1, -1], float? scale=None) -> (Tensor, Tensor?)", without the op name.',
            ),
        ),
        (
            "(Tensor y, *, int n=1) -> Tensor",
            "schema='(Tensor y, *, int n=1) -> Tensor' names the arguments ['y', 'n'], but the "
            f"kernel defined at {where(kernel_x)} takes ['x', 'n']. Give the schema the kernel's "
            "parameters, in order.",
        ),
        (
            "(Tensor x, int n=1) -> Tensor",
            "argument 'n' is keyword-only in the kernel but not in the schema. Put '*' before it "
            f"in both, or in neither (kernel defined at {where(kernel_x)}).",
        ),
    ],
    ids=["not_a_schema", "unparsable", "other_names", "keyword_only"],
)
def test_invalid_schema(schema: str, message: str | tuple[str, str]) -> None:
    name = unique("f")
    if isinstance(message, tuple):  # customgrad's words around torch's
        pattern = re.escape(f"{name}: {message[0]}") + ".+" + re.escape(message[1])
    else:
        pattern = re.escape(f"{name}: {message}")
    with pytest.raises(cg.DefinitionError, match=pattern):
        cg.op(name, kernel_x, schema=schema)


class QuantState:
    """A Python object never registered as an opaque type."""

    blocksize = 64


def test_python_object_argument_without_an_opaque_type() -> None:
    def f(x: torch.Tensor, state: QuantState) -> torch.Tensor:
        return x.clone()

    name = unique("f")
    with pytest.raises(
        cg.DefinitionError,
        match="(?s)"
        + re.escape(
            f"{name}: cannot infer the op's schema from the annotations of the function defined at "
            f"{where(f)}: "
        )
        + ".*"  # torch's own words for the annotation it cannot express
        + re.escape(". Annotate each argument with a type torch.library understands")
        + ".*"
        + re.escape(
            "A Python object the kernel and the backward read (a quantization state, a config) "
            "is passed as an opaque object: register its class with torch first, then annotate "
            "with it:"
        )
        + ".*"
        + re.escape('torch._library.opaque_object.register_opaque_type(QuantState, typ="value")'),
    ):
        cg.op(name, f)


# --- pipelining: the schedule simulator, the action timer, data parallelism -------------------


def test_simulate_errors_unknown_schedule() -> None:
    with pytest.raises(cg.ArgumentValueError, match=re.escape(
        "simulate: unknown schedule name 'ZeroBubble'. torch's schedule names: 1F1B, GPipe, "
        "Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV; or pass "
        "a schedule class."
    )):  # fmt: skip
        simulate("ZeroBubble", 4, 8, UNIT)
    with pytest.raises(cg.ArgumentTypeError, match=re.escape(
        "simulate: expected one of torch.distributed.pipelining's schedule classes (or its "
        "name), got <class 'int'>. Pass the class itself, for example:"
    )):  # fmt: skip
        simulate(int, 4, 8, UNIT)
    stage = _StandInStage(0, 2, 2, 0)
    instance = Schedule1F1B(stage, 2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=re.escape("got <torch.distributed.pipelining")):
        simulate(instance, 2, 2, UNIT)  # type: ignore[arg-type]
    with pytest.raises(cg.ArgumentValueError, match=re.escape(
        "simulate: PipelineScheduleSingle is an abstract base class, with no action list to "
        "replay. Use a schedule that trains: Schedule1F1B, ScheduleGPipe, "
        "ScheduleInterleaved1F1B, ScheduleLoopedBFS, ScheduleInterleavedZeroBubble, "
        "ScheduleZBVZeroBubble, ScheduleDualPipeV, or a subclass of one."
    )):  # fmt: skip
        simulate(PipelineScheduleSingle, 2, 2, UNIT)

    class NoOrder(PipelineScheduleSingle):
        def _step_microbatches(self, *args: object, **kwargs: object) -> None:
            pass

    with pytest.raises(cg.ArgumentValueError, match=re.escape(
        "simulate: NoOrder has no action list (pipeline_order) to replay. Use a schedule that "
        "trains: Schedule1F1B,"
    )):  # fmt: skip
        simulate(NoOrder, 2, 2, UNIT)


def test_simulate_errors_stages_the_schedule_cannot_run() -> None:
    with pytest.raises(cg.ArgumentValueError, match=re.escape(
        "simulate: ScheduleZBVZeroBubble places several stages on each rank, and 5 stages do "
        "not make 2 per rank. Pass n_ranks= (n_stages must be a multiple of it), or an even "
        "n_stages."
    )):  # fmt: skip
        simulate(ScheduleZBVZeroBubble, 5, 8, UNIT)
    with pytest.raises(cg.ArgumentValueError, match=re.escape(
        "simulate: torch's ScheduleZBVZeroBubble cannot run 6 stages on 2 ranks (3 per rank) "
        "with 8 microbatches: ZBV requires exactly 2 stages per rank, but got 3. Change "
        "n_stages, n_ranks or n_microbatches to what the schedule supports."
    )):  # fmt: skip
        simulate(ScheduleZBVZeroBubble, 6, 8, UNIT, n_ranks=2)
    with pytest.raises(cg.ArgumentValueError, match=re.escape(
        "simulate: torch's ScheduleDualPipeV cannot run 8 stages on 4 ranks (2 per rank) with "
        "4 microbatches: DualPipeV requires at least as many microbatches as stages, but got 4 "
        "microbatches and 8 stages."
    )):  # fmt: skip
        simulate(ScheduleDualPipeV, 8, 4, UNIT)
    with pytest.raises(cg.ArgumentValueError, match=re.escape(
        "simulate: torch's Schedule1F1B cannot run 4 stages on 4 ranks (1 per rank) with 2 "
        "microbatches: Number of microbatches (2) must be greater than"
    )):  # fmt: skip
        simulate(Schedule1F1B, 4, 2, UNIT)
    with pytest.raises(cg.ArgumentValueError, match=re.escape(
        "simulate: Schedule1F1B runs one stage per rank, so 4 stages need 4 ranks, got "
        "n_ranks=2. Leave n_ranks out, or use a multi-stage schedule (ScheduleInterleaved1F1B, "
        "ScheduleZBVZeroBubble, ...)."
    )):  # fmt: skip
        simulate(Schedule1F1B, 4, 8, UNIT, n_ranks=2)
    with pytest.raises(cg.ArgumentValueError, match=re.escape(
        "simulate: ScheduleInterleaved1F1B places the same number of stages on each rank, so "
        "n_stages (7) must be a multiple of n_ranks (2). Pass n_stages=8, or another n_ranks."
    )):  # fmt: skip
        simulate(ScheduleInterleaved1F1B, 7, 8, UNIT, n_ranks=2)
    with pytest.raises(cg.ArgumentValueError, match=re.escape(
        "simulate: n_microbatches is 0, expected at least 1."
    )):  # fmt: skip
        simulate(Schedule1F1B, 2, 0, UNIT)
    with pytest.raises(cg.ArgumentTypeError, match=re.escape(
        "simulate: n_stages is a float (2.0), expected an int."
    )):  # fmt: skip
        simulate(Schedule1F1B, 2.0, 4, UNIT)  # type: ignore[arg-type]


def test_simulate_errors_costs() -> None:
    with pytest.raises(cg.ArgumentValueError, match=re.escape(
        "StageCosts: backward_weight is -0.5 seconds, expected a finite number >= 0. Pass the "
        "measured seconds per microbatch (0.0 for an action that costs nothing)."
    )):  # fmt: skip
        StageCosts(1.0, 1.0, -0.5)
    with pytest.raises(cg.ArgumentValueError, match=re.escape(
        "StageCosts: send is nan seconds"
    )):  # fmt: skip
        StageCosts(1.0, 1.0, 1.0, send=math.nan)
    with pytest.raises(cg.ArgumentValueError, match=re.escape(
        "StageCosts: backward is -1.0 seconds"
    )):  # fmt: skip
        StageCosts(1.0, 1.0, 1.0, backward=-1.0)
    with pytest.raises(cg.ArgumentTypeError, match=re.escape(
        "StageCosts: forward is a str ('1ms'), expected seconds as a float. Pass a number, "
        "e.g. forward=0.004."
    )):  # fmt: skip
        StageCosts("1ms", 1.0, 1.0)  # type: ignore[arg-type]
    with pytest.raises(cg.ArgumentValueError, match=re.escape(
        "simulate: 3 StageCosts for 4 stages. Pass one per stage, in stage order, or a single "
        "StageCosts for all of them."
    )):  # fmt: skip
        simulate(ScheduleZBVZeroBubble, 4, 8, [UNIT] * 3)
    with pytest.raises(cg.ArgumentTypeError, match=re.escape(
        "simulate: costs[1] is a dict, expected StageCosts. Pass StageCosts(forward=..., "
        "backward_input=..., backward_weight=...) for each stage."
    )):  # fmt: skip
        simulate(Schedule1F1B, 2, 4, [UNIT, {"forward": 1.0}])  # type: ignore[list-item]
    with pytest.raises(cg.ArgumentTypeError, match=re.escape(
        "simulate: costs is a float, expected StageCosts or a sequence of them (one per stage)."
    )):  # fmt: skip
        simulate(Schedule1F1B, 2, 4, 1.0)  # type: ignore[arg-type]


def test_simulate_errors_are_value_and_type_errors() -> None:
    with pytest.raises(ValueError):
        simulate("nope", 2, 2, UNIT)
    with pytest.raises(TypeError):
        simulate(Schedule1F1B, 2, 2, "fast")  # type: ignore[arg-type]


def test_nested_steps_are_refused() -> None:
    timer = ActionTimer()
    with (
        timer.step(),
        pytest.raises(ActionTimerError, match=re.escape(MSG_NESTED_STEP)),
        timer.step(),
    ):
        pass
    assert len(timer.steps) == 1  # the outer step is still recorded


def test_stage_class_wants_a_stage_class() -> None:
    stage = nn.Linear(2, 2)
    with pytest.raises(
        cg.ArgumentTypeError,
        match=re.escape(
            "ActionTimer.stage_class: expected a pipeline stage class (a subclass of "
            "torch.distributed.pipelining.PipelineStage), got Linear(in_features=2, "
            "out_features=2, bias=True). Pass the class, not a stage: "
            "timer.stage_class(PipelineStage)(module, stage_index, ...)."
        ),
    ):
        ActionTimer().stage_class(stage)  # type: ignore[type-var]


def test_action_kinds_are_checked() -> None:
    with (
        pytest.raises(
            cg.ArgumentValueError,
            match=re.escape(
                "ActionTimer.action: kind must be one of ('F', 'I', 'W', 'B'), got 'X'."
            ),
        ),
        ActionTimer().action("X", 0, 0),
    ):
        pass


def test_stage_costs_of_no_steps_explains() -> None:
    with pytest.raises(
        cg.ArgumentValueError,
        match=re.escape(
            "stage_costs: the steps recorded no action. Time steps with ActionTimer.step() "
            "around schedule.step(...), on stages built from ActionTimer.stage_class(...)."
        ),
    ):
        stage_costs([])


def test_the_ddp_error_message_is_pinned() -> None:
    assert MSG_DDP_UNREDUCED.format(stage=3) == (
        "customgrad.pipelining.PipelineStage(stage_index=3): DDP did not reduce this step's "
        "gradients: some weights of the stage got their last gradient before the last backward "
        "of the step, where DDP's reduction runs, so DDP never saw them ready and left the "
        "reduction unfinished. With queue=, the weights of native modules and plain "
        "autograd.Functions get their gradients in the input pass (I); only customgrad ops' "
        "weights wait for W. Use the plain split, which accumulates every weight in W, or "
        "FSDP2, which reduces once the step's backwards are done:\n"
        "\n"
        "    stage = PipelineStage(DDP(module, process_group=dp_group), stage_index, n_stages, "
        "device)\n"
        "    stage = PipelineStage(fully_shard(module, mesh=dp_mesh), stage_index, n_stages, "
        "device)\n"
    )


def test_the_find_unused_error_message_is_pinned() -> None:
    assert MSG_DDP_FIND_UNUSED.format(stage=1) == (
        "customgrad.pipelining.PipelineStage(stage_index=1): DDP(find_unused_parameters=True) "
        "cannot reduce a split backward: DDP finds unused weights by walking the graph from the "
        "stage's outputs, but the weight pass (W) starts inside the graph, after the input pass "
        "(I) used the outputs, so DDP would take every weight for unused and reduce it before W "
        "adds its gradient. Build DDP with find_unused_parameters=False (the default), or use "
        "FSDP2:\n"
        "\n"
        "    DDP(module, process_group=dp_group)\n"
        "    fully_shard(module, mesh=dp_mesh)\n"
    )


# --------------------------------------------------------------------------------------------
# Round 3, issue 18: a traced backward is as trustworthy as a called one


def test_a_schema_default_differing_from_the_kernel_default_explains() -> None:
    def scaled(x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
        return x * scale

    name = unique("scaled")
    with pytest.raises(
        cg.DefinitionError,
        match=re.escape(
            f"{name}: argument 'scale' defaults to 2.0 in the kernel defined at {where(scaled)}, "
            "but to 1.0 in schema=: a call through the op would use one and torch.ops or a "
            "compiled call the other. Give both the same default."
        ),
    ):
        cg.op(name, scaled, schema="(Tensor x, float scale=1.0) -> Tensor")


def test_the_fallback_reasons_of_a_backward_reading_python_state_are_pinned() -> None:
    from customgrad._autosplit import AutoSplitter

    @cg.op(unique("lin"), weights=("w",))
    def lin(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x @ w.mT

    lin.register_save_for_backward(lambda i, o: (i.x, i.w))
    module = nn.Linear(1, 1)
    seen: list[int] = []

    def reads_a_module(ctx: Any, saved: Any, g: torch.Tensor) -> dict[str, Any]:
        x, w = saved
        return {"x": g @ w * module.in_features, "w": g.mT @ x}

    def appends(ctx: Any, saved: Any, g: torch.Tensor) -> dict[str, Any]:
        seen.append(1)
        x, w = saved
        return {"x": g @ w, "w": g.mT @ x}

    whys = []
    for fn in (reads_a_module, appends):
        lin.register_backward(fn)
        x, w = torch.randn(3, 2, requires_grad=True), torch.randn(4, 2, requires_grad=True)
        torch.autograd.grad(lin(x, w).sum(), [x])  # an input pass: the capture is tried
        auto = lin.rules.auto
        assert isinstance(auto, AutoSplitter)
        fallback = auto.fallback()
        whys.append(None if fallback is None else (fallback.why, fallback.fix))
    # A module's attribute is guarded by dynamo: captured. A list appended to is a side effect
    # dynamo would replay outside the graph: run once, naming what it changes.
    assert whys == [
        None,
        (
            f"it changes state outside itself (the closure variable 'seen' of "
            f"{appends.__qualname__}), which dynamo replays after the graph and a split pass "
            f"would not",
            "return what it computes instead of storing it (or keep it run once)",
        ),
    ]


def test_check_op_flops_messages_are_pinned() -> None:
    from customgrad.testing import FIX_TWICE, MSG_NO_FLOPS

    assert MSG_NO_FLOPS.format(ran="input pass: backward_input x1") == (
        "could not measure FLOPs: torch's FLOP formulas count none of the ops the backward runs "
        "(they count matmuls, convolutions and attention), so repeated work would not show. "
        "Checked instead: which backward functions ran in each pass (input pass: backward_input "
        "x1), and that no pass returned a gradient it was not asked for."
    )
    assert FIX_TWICE == (
        "Compute it once: hand it from the input pass to the weight pass with "
        "register_backward_shared\n"
        "\n"
        "    @op.register_backward_shared     # runs once, in the earlier pass that needs it\n"
        "    def _(ctx, saved, grad):\n"
        "        return grad @ down           # what both halves need\n"
        "    @op.register_backward_input\n"
        "    def _(ctx, saved, grad):\n"
        "        dh = ctx.shared              # computed once\n"
        '        return {"x": dh @ saved.w_up}\n'
        "\n"
        "or register one backward that computes every gradient (register_backward, "
        'split="auto", the\n'
        "default): customgrad traces it and runs shared work once, handing it to the weight "
        "pass."
    )


# customgrad.compile


def test_compile_something_not_callable() -> None:
    from customgrad._compile import MSG_NOT_CALLABLE

    with pytest.raises(cg.ArgumentTypeError, match=re.escape(MSG_NOT_CALLABLE.format(got="int"))):
        cg.compile(3)
    assert MSG_NOT_CALLABLE.format(got="int").startswith(
        "customgrad.compile: expected an nn.Module or a callable to compile, got int."
    )


@pytest.mark.parametrize(
    ("backend", "got"),
    [
        ("eager", "'eager'"),
        ("cudagraphs", "'cudagraphs'"),
        (print, "builtin_function_or_method print"),
    ],
)
def test_compile_with_a_backend_without_aot_autograd(backend: Any, got: str) -> None:
    from customgrad._compile import MSG_BACKEND

    message = MSG_BACKEND.format(got=got)
    assert message.startswith(
        f"customgrad.compile: backend {got} does not go through AOTAutograd, so its backward "
        'cannot be split into an input and a weight pass. Supported: "inductor" (the default)'
    )
    with pytest.raises(cg.ArgumentValueError, match=re.escape(message)):
        cg.compile(nn.Linear(2, 2), backend=backend)
    with pytest.raises(ValueError):  # the builtin too
        cg.compile(nn.Linear(2, 2), backend=backend)


def test_compile_with_mode_on_a_backend_that_takes_none() -> None:
    from customgrad._compile import MSG_MODE

    message = MSG_MODE.format(got="'aot_eager'", mode="max-autotune", options=None)
    assert message.startswith(
        "customgrad.compile: mode='max-autotune' and options=None are inductor's settings; "
        "backend 'aot_eager' takes neither."
    )
    with pytest.raises(cg.ArgumentValueError, match=re.escape(message)):
        cg.compile(nn.Linear(2, 2), backend="aot_eager", mode="max-autotune")


def test_compile_twice_or_an_optimized_module() -> None:
    from customgrad._compile import MSG_TWICE

    block = cg.compile(nn.Linear(2, 2), backend="aot_eager")
    message = MSG_TWICE.format(got="Linear", how="its _compiled_call_impl is set")
    assert message.startswith("customgrad.compile: Linear is already compiled")
    with pytest.raises(cg.ArgumentTypeError, match=re.escape(message)):
        cg.compile(block, backend="aot_eager")
    optimized = torch.compile(nn.Linear(2, 2), backend="aot_eager")
    message = MSG_TWICE.format(got="this OptimizedModule", how="by torch.compile(module)")
    with pytest.raises(cg.ArgumentTypeError, match=re.escape(message)):
        cg.compile(optimized)


# -- the troubleshooting page's fixes, applied: each gives the outcome it promises ------------


def test_definition_advice_applied() -> None:
    # 'Name ops "namespace::name"', "Use your library's own namespace", "Name only Tensor
    # arguments in weights": the forms the messages show define working ops.
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * w

    op = cg.op(unique("mylinear"), f, weights=("w",))
    assert op.weights == ("w",)
    assert torch.equal(op(torch.ones(2), torch.full((2,), 3.0)), torch.full((2,), 3.0))


def test_missing_kernel_advice_applied() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    def f(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    op = cg.op(unique("cpu_later"), f, device_types="cuda")
    op.register_kernel("cpu", lambda x: x * 2)  # "Add one with @...register_kernel('<device>')"
    assert op(torch.ones(2)).tolist() == [2.0, 2.0]
    op.register_fake(lambda x: torch.empty_like(x))  # "no fake kernel registered"
    with FakeTensorMode():
        assert op(torch.empty(2)).shape == (2,)


def test_mutation_advice_applied_pass_a_detached_buffer() -> None:
    # "Pass buf.detach() or a buffer that does not require grad."
    @cg.op(unique("add_"), mutates_args=("buf",))
    def add_(buf: torch.Tensor, x: torch.Tensor) -> None:
        buf.add_(x)

    add_.register_save_for_backward(lambda inputs, output: None)
    add_.register_backward(lambda ctx, saved: {})
    buf = torch.zeros(2, requires_grad=True)
    add_(buf.detach(), torch.ones(2))
    assert buf.detach().tolist() == [1.0, 1.0]


def test_backward_mutation_advice_applied_out_of_place() -> None:
    # "Compute out of place (grad = grad * s, not grad.mul_(s))."
    def bwd_in(ctx: Any, saved: Any, g: torch.Tensor) -> dict[str, Any]:
        _, weight = saved
        return {"x": g @ (weight * 1)}

    _same_as_torch(linear_op(backward_input=bwd_in, backward_weight=good_weight))


def test_kernel_output_advice_applied_return_a_copy() -> None:
    # "Return a copy (x.clone())": an identity op that works, with its gradient.
    @cg.op(unique("identity"))
    def identity(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    identity.register_fake(lambda x: torch.empty_like(x))
    identity.register_save_for_backward(lambda inputs, output: None)
    identity.register_backward_input(lambda ctx, saved, g: {"x": g})
    x = torch.randn(3, requires_grad=True)
    (gx,) = torch.autograd.grad((identity(x) * torch.arange(3.0)).sum(), [x])
    assert gx.tolist() == [0.0, 1.0, 2.0]


def test_save_advice_applied_return_a_tuple() -> None:
    # "Return those instead: return inputs.x, inputs.weight, ... (or a dict / a NamedTuple)"
    import typing

    class Saved(typing.NamedTuple):
        x: torch.Tensor
        weight: torch.Tensor

    for save in (
        lambda inputs, output: (inputs.x, inputs.weight),
        lambda inputs, output: Saved(inputs.x, inputs.weight),
    ):
        op = linear_op(_every)
        op.register_save_for_backward(save)
        _same_as_torch(op)


def test_split_state_advice_applied_one_weight_pass_per_input_pass() -> None:
    # "each stage_backward_input result runs W once" / groups from customgrad's own I
    from customgrad.pipelining import stage_backward_input, stage_backward_weight

    op = linear_op(backward_input=good_input, backward_weight=good_weight)
    x = torch.randn(2, 3, requires_grad=True)
    w = torch.randn(4, 3, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    for _ in range(2):  # a new I for each W
        _, groups = stage_backward_input([op(x, w, b).sum()], None, [x], [w, b])
        stage_backward_weight([w, b], groups)
    gw, gb = torch.autograd.grad((x @ w.mT + b).sum(), (w, b))
    torch.testing.assert_close((w.grad, b.grad), (2 * gw, 2 * gb))


def test_vmap_advice_applied_loop_over_the_batch() -> None:
    # "Call the op on the whole batch, or loop over the batch yourself."
    op = linear_op(_every)
    xs = torch.randn(3, 2, 3, requires_grad=True)
    w = torch.randn(4, 3, requires_grad=True)
    looped = torch.stack([op(x, w) for x in xs])
    whole = op(xs.reshape(6, 3), w).reshape(3, 2, 4)
    torch.testing.assert_close(looped, whole)
    torch.testing.assert_close(whole, xs @ w.mT)


def test_queue_advice_applied() -> None:
    # MSG_NO_INPUT_PASS's code (forward under queue.microbatch, queue.backward, queue.run),
    # MSG_TWICE and MSG_PENDING ("run W once per microbatch", "queue.run(...) for each before
    # the step ends", then queue.finish()), MSG_STRAY ("work already queued can still be run with
    # queue.run"): the weights' gradients are those of full backwards, and finish() passes.
    from customgrad.pipelining import WeightGradQueue

    op = linear_op(backward_input=good_input, backward_weight=good_weight)
    w = torch.randn(4, 3, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    xs = [torch.randn(2, 3, requires_grad=True) for _ in range(2)]
    queue = WeightGradQueue()
    for mb, x in enumerate(xs):
        with queue.microbatch(0, mb):
            out = op(x, w, b)
        queue.backward(out.sum(), inputs=[x])  # I: input grads now, weight work queued
    assert w.grad is None  # W has not run
    for mb in range(len(xs)):
        queue.run(0, mb)  # W, once per microbatch
    queue.finish()
    gw, gb = torch.autograd.grad(sum(((x @ w.mT + b).sum() for x in xs), torch.zeros(())), (w, b))
    torch.testing.assert_close((w.grad, b.grad), (gw, gb))
    for x in xs:
        torch.testing.assert_close(x.grad, torch.ones(2, 4) @ w.detach())


# --------------------------------------------------------------------------------------------
# Round 6, issue 41: weight work hides the expert all-to-all


def test_overlap_forward_backward_wants_a_schedule_that_runs_an_action_list(group: None) -> None:
    from customgrad.pipelining import PipelineStage, WeightGradQueue, overlap_forward_backward

    stage = PipelineStage(nn.Linear(2, 2), 0, 1, torch.device("cpu"), queue=WeightGradQueue())
    with pytest.raises(
        cg.ArgumentTypeError,
        match=re.escape(
            "overlap_forward_backward: expected one of torch's schedules that run an action list "
            "(ScheduleDualPipeV, ScheduleZBVZeroBubble, ScheduleInterleavedZeroBubble, "
            "ScheduleInterleaved1F1B, ScheduleLoopedBFS), got Schedule1F1B. Schedule1F1B and "
            "ScheduleGPipe run each stage's weight gradients inside its full backward: no W is "
            "left to hide a forward's all-to-all. For example:\n"
            "\n"
            "    schedule = ScheduleDualPipeV([stage0, stage1], n_microbatches, loss_fn=loss_fn)\n"
            "    overlap_forward_backward(schedule)\n"
        ),
    ):
        overlap_forward_backward(Schedule1F1B(stage, 2))


def test_overlap_forward_backward_wants_stages_with_one_queue(group: None) -> None:
    from customgrad.pipelining import PipelineStage, WeightGradQueue, overlap_forward_backward

    cpu = torch.device("cpu")
    queue = WeightGradQueue()
    plain = [PipelineStage(nn.Linear(2, 2), s, 2, cpu, queue=queue if s else None)
             for s in range(2)]  # fmt: skip
    with pytest.raises(
        cg.ArgumentValueError,
        match=re.escape(
            "overlap_forward_backward: stage 0 is a PipelineStage without a WeightGradQueue, "
            "but the overlap runs the queue's weight work inside the forwards' all-to-all waits. "
            "Build every stage with one queue, the one the model's all-to-all waits through:\n"
            "\n"
            "    queue = WeightGradQueue()\n"
            "    stage = customgrad.pipelining.PipelineStage(module, stage_index, n_stages, "
            "device, queue=queue)\n"
            "    ...                                     # in the model, where it waits for an "
            "all-to-all:\n"
            "    work = dist.all_to_all_single(out, x, out_splits, in_splits, group=ep_group, "
            "async_op=True)\n"
            '    queue.run_while(work, "dispatch")\n'
        ),
    ):
        overlap_forward_backward(ScheduleZBVZeroBubble(plain, 2))
    two = [PipelineStage(nn.Linear(2, 2), s, 2, cpu, queue=WeightGradQueue()) for s in range(2)]
    with pytest.raises(
        cg.ArgumentValueError,
        match=re.escape(
            "overlap_forward_backward: stages 0 and 1 have different WeightGradQueues; the "
            "overlap runs one queue's weight work in the waits of the model's all-to-alls, so "
            "every stage of the rank must use the same queue (the one the model's all-to-all "
            "waits through). Build them with one: queue = WeightGradQueue(); "
            "PipelineStage(..., queue=queue) for each."
        ),
    ):
        overlap_forward_backward(ScheduleZBVZeroBubble(two, 2))


# -- customgrad.ops: the grouped GEMM's arguments ------------------------------------------------

_OFFS_FIX = (
    "Pass the end row of each expert's tokens, a running sum of the tokens per expert: "
    "torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)."
)


def _grouped_call(case: str) -> Callable[[], object]:
    import customgrad.ops as ops

    x, w = torch.randn(12, 16), torch.randn(4, 16, 8)
    offs = torch.tensor([3, 3, 7, 12], dtype=torch.int32)

    def ends(*values: int) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32)

    calls: dict[str, Callable[[], object]] = {
        "x-3d": lambda: ops.grouped_mm(x.view(2, 6, 16), w, offs),
        "w-features": lambda: ops.grouped_mm(x, torch.randn(4, 15, 8), offs),
        "offs-int64": lambda: ops.grouped_mm(x, w, offs.long()),
        "offs-length": lambda: ops.grouped_mm(x, w, offs[:3]),
        "no-experts": lambda: ops.grouped_mm(x, torch.randn(0, 16, 8), offs[:0]),
        "dtypes": lambda: ops.grouped_mm(x, w.double(), offs),
        "integers": lambda: ops.grouped_mm(x.int(), w.int(), offs),
        "devices": lambda: ops.grouped_mm(x, w, offs.to("meta")),
        "offs-falling": lambda: ops.grouped_mm(x, w, ends(3, 2, 7, 12)),
        "offs-past-x": lambda: ops.triton_grouped_mm(x, w, ends(3, 3, 7, 13)),
        "grad-rows": lambda: ops.grouped_weight_grad(x, torch.randn(11, 8), offs),
    }
    return calls[case]


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("x-3d", "customgrad::grouped_mm: 'x' must be 2-D (tokens sorted by expert, features), "
         "got torch.float32 (2, 6, 16) on cpu. Flatten the batch dimensions first: "
         "x.flatten(0, -2)."),
        ("w-features", "customgrad::grouped_mm: 'w' must be 3-D (experts, 16 = x's features, out "
         "features), got torch.float32 (4, 15, 8) on cpu. Pass the experts' weights as "
         "torchtitan's _grouped_mm takes them: w_EFD.transpose(-2, -1)."),
        ("offs-int64", "customgrad::grouped_mm: 'offs' must be a 1-D int32 tensor of length 4 "
         f"(one per expert), got torch.int64 (4,) on cpu. {_OFFS_FIX}"),
        ("offs-length", "customgrad::grouped_mm: 'offs' must be a 1-D int32 tensor of length 4 "
         f"(one per expert), got torch.int32 (3,) on cpu. {_OFFS_FIX}"),
        ("no-experts", "customgrad::grouped_mm: 'offs' must be a 1-D int32 tensor of at least "
         f"one expert, got torch.int32 (0,) on cpu. {_OFFS_FIX}"),
        ("dtypes", "customgrad::grouped_mm: 'w' must have x's dtype torch.float32, got "
         "torch.float64. Cast one to the other's dtype (torchtitan casts both to bfloat16)."),
        ("integers", "customgrad::grouped_mm: 'x' must be a floating-point tensor (float32, "
         "bfloat16, float16 or float64), got torch.int32. Cast x and w with .float()."),
        ("devices", "customgrad::grouped_mm: x, w and offs must be on one device, got cpu, cpu "
         "and meta. Move offs with .to(x.device)."),
        ("offs-falling", "customgrad::grouped_mm: 'offs' must rise from 0 to at most x's 12 "
         "rows, got [3, 2, 7, 12] (expert 1 would end at row 2 after starting at 3). "
         f"{_OFFS_FIX}"),
        ("offs-past-x", "customgrad::triton_grouped_mm: 'offs' must rise from 0 to at most x's "
         "12 rows, got [3, 3, 7, 13] (expert 3 would end at row 13 after starting at 7). "
         f"{_OFFS_FIX}"),
        ("grad-rows", "customgrad::grouped_mm_weight_grad: 'grad' must be 2-D with x's 12 rows, "
         "got torch.float32 (11, 8) on cpu. Pass the gradient of grouped_mm's output."),
    ],
    ids=lambda v: v if len(v) < 20 else "",
)  # fmt: skip
def test_grouped_mm_arguments(case: str, message: str) -> None:
    with pytest.raises(cg.ArgumentValueError, match=f"^{re.escape(message)}$") as info:
        _grouped_call(case)()
    assert isinstance(info.value, ValueError)


def test_grouped_mm_fake_kernel_checks_the_arguments_under_compile() -> None:
    import customgrad.ops as ops

    fn = torch.compile(ops.grouped_mm, backend="eager", fullgraph=True)
    offs = torch.tensor([3, 12], dtype=torch.int64)
    message = (
        "customgrad::grouped_mm: 'offs' must be a 1-D int32 tensor of length 2 (one per expert), "
        f"got torch.int64 (2,) on cpu. {_OFFS_FIX}"
    )
    with pytest.raises(Exception, match=re.escape(message)):
        fn(torch.randn(12, 16), torch.randn(2, 16, 8), offs)


def test_a_saved_tensor_written_between_the_passes_is_pinned() -> None:
    from customgrad.pipelining import stage_backward_input, stage_backward_weight

    op = linear_op(backward_input=good_input, backward_weight=good_weight)
    x = torch.randn(2, 3, requires_grad=True)
    w = torch.randn(4, 3, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    h = torch.tanh(x)
    _, groups = stage_backward_input([op(h, w, b).sum()], None, [x], [w, b])
    with torch.no_grad():
        h.mul_(2)
    msg = (
        f"{op.name}: saved tensor 0 (argument 'x'), which the weight pass (W) reads, was "
        "modified by an inplace operation after the input pass (I) used it: it is at version 1; "
        "expected version 0 instead. W would compute gradients from the changed value (torch's "
        'autograd refuses a plain backward the same way: "one of the variables needed for '
        'gradient computation has been modified by an inplace operation"). Between the input '
        "and the weight pass (stage_backward_input and stage_backward_weight, a "
        "WeightGradQueue's backward and run), do not write in place into the tensors a backward "
        "saved or its output gradients: write out of place (h = h * 2, not h.mul_(2)), or clone "
        "the tensor and change the clone. (saved by save_for_backward at "
        f"{where(op.rules.save)})"
    )
    with pytest.raises(cg.ModifiedBetweenPassesError, match=re.escape(msg)) as e:
        stage_backward_weight([w, b], groups)
    assert isinstance(e.value, RuntimeError) and isinstance(e.value, cg.MutationError)


def test_modified_between_passes_advice_applied_write_out_of_place() -> None:
    # "write out of place (h = h * 2, not h.mul_(2))": W then gives the gradient of the h I saw
    from customgrad.pipelining import stage_backward_input, stage_backward_weight

    op = linear_op(backward_input=good_input, backward_weight=good_weight)
    x = torch.randn(2, 3, requires_grad=True)
    w = torch.randn(4, 3, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    h = torch.tanh(x)
    _, groups = stage_backward_input([op(h, w, b).sum()], None, [x], [w, b])
    want = torch.autograd.grad((h @ w.mT + b).sum(), w)[0]
    h = h * 2
    stage_backward_weight([w, b], groups)
    torch.testing.assert_close(w.grad, want)
