"""Every error message customgrad raises, pinned: op, argument, expected vs got, fix, location."""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

import customgrad as cg
from customgrad._errors import where

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
        match=re.escape(
            f"cannot infer the op's schema from the annotations of the function defined at {where(f)}: "
        )
        + ".*Parameter d has unsupported type",
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


def test_duplicate_name() -> None:
    name = unique("twice")

    def f(x: torch.Tensor) -> torch.Tensor:
        return x

    cg.op(name, f)
    with pytest.raises(
        cg.DefinitionError,
        match=re.escape(
            f"{name}: an op of that name is already defined (at {where(f)}). Op names are global"
        ),
    ):
        cg.op(name, f)


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
            "backward must return a dict of gradients keyed by argument name, e.g. {'x': grad_x}, "
            f"but returned a tuple of 2 items. (backward defined at {where(bwd)})"
        ),
    ):
        run_backward(linear_op(bwd))


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
        match=re.escape("'bias' of shape (1, 4), but the input has shape (4,)"),
    ):
        run_backward(linear_op(backward_input=good_input, backward_weight=bwd_w))


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


def test_errors_are_the_matching_builtins() -> None:
    assert issubclass(cg.GradientTypeError, TypeError)
    assert issubclass(cg.GradientValueError, ValueError)
    assert issubclass(cg.DefinitionError, ValueError)
    assert issubclass(cg.MissingRegistrationError, RuntimeError)
    assert issubclass(cg.ArgumentTypeError, TypeError)
    assert issubclass(cg.ArgumentValueError, ValueError)
    assert issubclass(cg.MutationError, RuntimeError)
    for cls in (
        cg.ArgumentTypeError,
        cg.ArgumentValueError,
        cg.MutationError,
        cg.GradientTypeError,
        cg.GradientValueError,
        cg.DefinitionError,
        cg.MissingRegistrationError,
    ):
        assert issubclass(cls, cg.CustomGradError)
