"""Forward-mode AD of customgrad ops: the registered jvp rule, and when a forward must keep
what a jvp will need."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from customgrad._errors import (
    GradientTypeError,
    GradientValueError,
    MissingRegistrationError,
    UnsupportedError,
    where,
)
from customgrad._layout import _unflatten_args
from customgrad._record import NodeRecord
from customgrad._rules import OpSpec
from customgrad._torch.transforms import forward_ad_level, jvp_transform_active
from customgrad._validate import describe

_Tensor = torch.Tensor


__all__ = ["JvpContext", "Tangent", "forward_ad_active", "jvp"]

Tangent = torch.Tensor | None | tuple[torch.Tensor | None, ...]
"""What a jvp gives back: one output's tangent (None for none), or a tuple, one per output."""


class JvpContext(Protocol):
    """The node a jvp runs on, as it reads it: its record."""

    _cg: NodeRecord


def jvp(spec: OpSpec, ctx: JvpContext, tangents: tuple[torch.Tensor | None, ...]) -> Tangent:
    """The node's jvp: the registered rule, its tangents checked against the outputs."""
    record: NodeRecord = ctx._cg
    sig = spec.signature
    rule = spec.rules.jvp
    kept, record.forward_ad = record.forward_ad, None
    if rule is None:
        raise MissingRegistrationError(
            f"{spec.name}: forward-mode AD (torch.func.jvp, jacfwd, dual tensors) reached "
            f"this op, which has no jvp rule. Register one (customgrad never differentiates "
            f"the kernel behind your registered backward):\n\n"
            f"    @{spec.name.split('::')[1]}.register_jvp\n"
            f"    def _(inputs, output, tangents):     # tangents.x is None without one\n"
            f"        return tangents.x * 2              # the output's tangent\n"
        )
    if kept is None:  # pragma: no cover - jvp without forward AD active at forward
        raise UnsupportedError(f"{spec.name}: jvp called without a forward-AD forward.")
    inputs, outputs = kept
    assert isinstance(inputs, tuple)  # the forward kept the record of its arguments
    flat = tangents[2:]
    by_arg = flat if record.lens is None else _unflatten_args(sig, record.lens, flat)
    result = rule(inputs, outputs, tuple.__new__(sig.inputs_type, by_arg))
    return _check_tangents(spec, rule, outputs, result, record.out_lens)


def _check_tangents(
    spec: OpSpec,
    rule: Callable[..., object],
    outputs: Any,
    result: object,
    out_lens: list[int | None] | None,
) -> Tangent:
    sig = spec.signature
    outs = outputs if sig.output_is_tuple else (outputs,)
    got = result if sig.output_is_tuple else (result,)
    loc = f"(jvp defined at {where(rule)})"
    if not isinstance(got, (tuple, list)) or len(got) != len(outs):
        raise GradientTypeError(
            f"{spec.name}: jvp returned {describe(result)}; return one tangent per output "
            f"({len(outs)}), shaped like the output. {loc}"
        )
    flat: list[torch.Tensor | None] = []
    for i, (o, t) in enumerate(zip(outs, got)):
        pairs = list(zip(o, t)) if isinstance(o, (list, tuple)) else [(o, t)]
        if isinstance(o, (list, tuple)) and (not isinstance(t, (list, tuple)) or len(t) != len(o)):
            raise GradientTypeError(
                f"{spec.name}: jvp returned {describe(t)} as the tangent of output {i}, a list of "
                f"{len(o)} tensors; return a list of the same length. {loc}"
            )
        for oi, ti in pairs:
            if ti is not None and not (
                isinstance(ti, _Tensor)
                and ti.shape == oi.shape
                and ti.dtype == oi.dtype
                and ti.device == oi.device
            ):
                raise GradientValueError(
                    f"{spec.name}: jvp returned {describe(ti)} as the tangent of output {i}, "
                    f"but the output is {describe(oi)}. Return a tangent of the output's shape, "
                    f"dtype and device (or None). {loc}"
                )
            flat.append(ti)
    if sig.plain_output:
        return flat[0]
    # out_lens is set whenever the output is not plain: a single list output gives a tuple too
    listed = out_lens is not None and out_lens[0] is not None
    return tuple(flat) if (sig.output_is_tuple or listed) else flat[0]


def forward_ad_active() -> bool:
    """Whether a jvp may follow this forward: a dual level, or a functorch jvp transform."""
    return forward_ad_level() >= 0 or jvp_transform_active()
