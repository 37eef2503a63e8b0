"""Messages that show the code a user is missing: a registration, an annotated signature."""

from __future__ import annotations

from collections.abc import Callable

from customgrad._errors import where
from customgrad._rules import AutogradRules
from customgrad._signature import ArgKind, Signature

__all__ = ["missing_autograd_message"]

MSG_NO_AUTOGRAD = """\
{name}: an input requires grad, but the op's autograd is not registered{missing}. Register a \
save_for_backward function and {how}:

    @{var}.register_save_for_backward
    def _(inputs, output):
        return {saved}
{example}
Call the op under torch.no_grad() or on inputs that don't require grad if you need no gradients.
(op defined at {loc})"""

EXAMPLE_PAIR = """
    @{var}.register_backward_input           # gradients of {inputs}
    def _(ctx, saved, grad):
        {unpack} = saved
        return {{{input_grads}}}

    @{var}.register_backward_weight          # gradients of {weights}
    def _(ctx, saved, grad):
        {unpack} = saved
        return {{{weight_grads}}}

(or @{var}.register_backward: one function returning every gradient, split automatically).
"""

EXAMPLE_SINGLE = """
    @{var}.register_backward                 # gradients of {inputs}
    def _(ctx, saved, grad):
        {unpack} = saved
        return {{{input_grads}}}
"""


def missing_autograd_message(
    sig: Signature, rules: AutogradRules, var: str, fn: Callable[..., object]
) -> str:
    """The error for an op whose inputs require grad but whose autograd is incomplete
    (``var``: the op's name as a Python variable; ``fn``: its kernel, for the location)."""
    missing = rules.missing(has_inputs=bool(sig.input_names), has_weights=bool(sig.weights))
    inputs = [n for n in sig.input_names if sig.args[sig.index[n]].kind is ArgKind.TENSOR]
    weights = list(sig.weights)
    tensors = inputs + weights
    unpack = ", ".join(tensors) if tensors else "saved_value"
    if weights and inputs:
        how = "either one backward or the input/weight pair"
        example = EXAMPLE_PAIR.format(
            var=var,
            inputs=", ".join(repr(n) for n in inputs),
            weights=", ".join(repr(n) for n in weights),
            unpack=unpack,
            input_grads=", ".join(f'"{n}": ...' for n in inputs),
            weight_grads=", ".join(f'"{n}": ...' for n in weights),
        )
    else:
        names = inputs or weights
        how = "a backward"
        example = EXAMPLE_SINGLE.format(
            var=var,
            inputs=", ".join(repr(n) for n in names) or "the Tensor arguments",
            unpack=unpack,
            input_grads=", ".join(f'"{n}": ...' for n in names),
        )
    return MSG_NO_AUTOGRAD.format(
        name=sig.qualname,
        missing=f" (missing: {', '.join(missing)})" if missing else "",
        how=how,
        var=var,
        saved=", ".join(f"inputs.{n}" for n in tensors) or "None",
        example=example,
        loc=where(fn),
    )
