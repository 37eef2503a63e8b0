"""The drop-ins' argument handling, and the full backward of a stage.

:func:`pair_outputs` checks and pairs ``stage_backward_input``'s outputs with their gradients
(as torch's drop-in reads them, with customgrad's errors); :func:`stage_backward` is torch's
``stage_backward``: one full backward of a stage's (nested) outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeAlias

import torch
from torch.autograd.graph import GradientEdge, Node

from customgrad._errors import ArgumentTypeError, ArgumentValueError
from customgrad._split_plan import grad_node
from customgrad.pipelining._split_state import runtime_errors

__all__ = ["Outputs", "pair_outputs", "run_stage_backward", "sequence", "stage_backward"]

Outputs: TypeAlias = list[torch.Tensor | GradientEdge]
"""A stage's outputs that take a gradient."""


def _edge_of(out: torch.Tensor | GradientEdge) -> tuple[Node, int] | None:
    if isinstance(out, GradientEdge):
        return out.node, out.output_nr
    node = grad_node(out)
    if node is None:
        return None
    return node, (out.output_nr if out.grad_fn is not None else 0)


def sequence(value: object, what: str, fix: str) -> Sequence[object]:
    """``value`` if it is a list or tuple, else stage_backward_input's error."""
    if isinstance(value, (torch.Tensor, GradientEdge)) or not isinstance(value, (list, tuple)):
        raise ArgumentTypeError(
            f"stage_backward_input: {what} must be a list or tuple, got "
            f"{type(value).__name__}. {fix}"
        )
    return value


def pair_outputs(
    stage_outputs_or_loss: object, output_grads: object
) -> tuple[Outputs, list[torch.Tensor], list[tuple[Node, int]]]:
    """The outputs that take a gradient, their gradients and the edges those flow into."""
    outs = sequence(stage_outputs_or_loss, "stage_outputs_or_loss", "Pass [loss] for a loss.")
    given = None
    if output_grads is not None:
        given = sequence(
            output_grads, "output_grads", "Pass one gradient per output (or None for a loss)."
        )
        if len(given) != len(outs):
            raise ArgumentValueError(
                f"stage_backward_input: {len(outs)} outputs but {len(given)} output "
                f"gradients. Pass one gradient (or None) per output."
            )
    outputs: list[torch.Tensor | GradientEdge] = []
    grads: list[torch.Tensor] = []
    edges: list[tuple[Node, int]] = []
    for i, out in enumerate(outs):
        if isinstance(out, GradientEdge):
            if given is None:
                raise ArgumentValueError(
                    f"stage_backward_input: output {i} is a GradientEdge, which requires "
                    "output gradients; pass output_grads."
                )
        elif not isinstance(out, torch.Tensor):
            raise ArgumentTypeError(
                f"stage_backward_input: output {i} is a {type(out).__name__}; outputs must be "
                f"Tensors or GradientEdges."
            )
        elif not out.requires_grad and out.grad_fn is None:
            continue
        grad: object = None
        if given is not None:
            grad = given[i]
        elif isinstance(out, torch.Tensor):
            grad = torch.ones_like(out)
        edge = _edge_of(out)
        if grad is None or edge is None:
            continue
        if not isinstance(grad, torch.Tensor):
            raise ArgumentTypeError(
                f"stage_backward_input: the gradient of output {i} is a {type(grad).__name__}; "
                f"pass a Tensor (or None) per output."
            )
        outputs.append(out)
        grads.append(grad)
        edges.append(edge)
    return outputs, grads, edges


def _flatten_outputs(
    stage_output: object, output_grads: object
) -> tuple[Outputs, list[torch.Tensor | None]]:
    """Pair every output tensor (or edge) that takes a gradient with its gradient."""
    tensors: list[torch.Tensor | GradientEdge] = []
    grads: list[torch.Tensor | None] = []
    stack: list[tuple[object, object]] = [(stage_output, output_grads)]
    while stack:
        out, grad = stack.pop()
        if isinstance(out, GradientEdge):
            if not isinstance(grad, torch.Tensor):
                raise ArgumentValueError(
                    "stage_backward: a GradientEdge output requires an output gradient."
                )
            tensors.append(out)
            grads.append(grad)
        elif isinstance(out, torch.Tensor):
            if not out.requires_grad and out.grad_fn is None:
                continue
            if not isinstance(grad, (torch.Tensor, type(None))):
                raise ArgumentTypeError(
                    f"stage_backward: expected a Tensor or None gradient, got {type(grad).__name__}."
                )
            tensors.append(out)
            grads.append(grad)
        elif isinstance(out, (tuple, list)):
            if grad is None:
                continue
            if not isinstance(grad, (tuple, list)) or len(grad) != len(out):
                raise ArgumentValueError(
                    f"stage_backward: gradients for a {type(out).__name__} of {len(out)} outputs "
                    f"must be a tuple or list of the same length, got {grad!r:.80}."
                )
            stack.extend(reversed(list(zip(out, grad))))
        elif isinstance(out, dict):
            if grad is None:
                continue
            if not isinstance(grad, dict) or set(grad) != set(out):
                raise ArgumentValueError(
                    f"stage_backward: gradients for a dict of outputs must be a dict with keys "
                    f"{sorted(map(str, out))}, got {grad!r:.80}."
                )
            stack.extend(reversed([(out[k], grad[k]) for k in out]))
    return tensors, grads


def stage_backward(
    stage_output: object,
    output_grads: object,
    input_values: Sequence[object],
) -> tuple[torch.Tensor | None, ...]:
    """Full backward of a stage: accumulate the weights' gradients, return the inputs'.

    Args:
        stage_output: the stage's output (a tensor, edge, or nested tuple/list/dict of them),
            or its loss.
        output_grads: gradients with the same structure (``None`` for a scalar loss).
        input_values: the stage's inputs.

    Returns:
        One gradient per input value (``None`` for non-tensors); inputs' ``.grad`` are reset
        to ``None`` so that the next microbatch does not add to them.

    Example:
        >>> lin = torch.nn.Linear(3, 3)
        >>> x = torch.randn(2, 3, requires_grad=True)
        >>> (dx,) = stage_backward(lin(x).sum(), None, [x])
        >>> dx.shape, x.grad
        (torch.Size([2, 3]), None)
    """
    with runtime_errors():
        return run_stage_backward(stage_output, output_grads, input_values)


def run_stage_backward(
    stage_output: object,
    output_grads: object,
    input_values: Sequence[object],
    run: Callable[[Outputs, list[torch.Tensor | None]], None] | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """:func:`stage_backward`, with ``run(tensors, grads)`` as the backward (default: torch's)."""
    tensors, grads = _flatten_outputs(stage_output, output_grads)
    if tensors:
        if run is None:
            torch.autograd.backward(tensors, grad_tensors=grads)  # type: ignore[arg-type]
        else:
            run(tensors, grads)
    result: list[torch.Tensor | None] = []
    for v in input_values:
        if isinstance(v, torch.Tensor):
            result.append(v.grad)
            v.grad = None
        else:
            result.append(None)
    return tuple(result)
