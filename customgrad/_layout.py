"""Lists: a node's flat inputs and outputs (list items inline) and the op's arguments and
outputs they come from."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch

from customgrad._signature import ArgKind, Signature

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_VERSION = itertools.repeat("_version")
_NO_VERSION = itertools.repeat(None)


def _flatten_args(sig: Signature, args: tuple[Any, ...]) -> tuple[tuple[int, ...], list[Any]]:
    """List arguments' items inline, with each list's length."""
    lens: list[int] = []
    flat: list[Any] = []
    for spec, a in zip(sig.args, args):
        if spec.kind is ArgKind.TENSOR_LIST:
            items = list(a)
            lens.append(len(items))
            flat.extend(items)
        else:
            flat.append(a)
    return tuple(lens), flat


def _unflatten_args(sig: Signature, lens: tuple[int, ...], flat: Sequence[Any]) -> tuple[Any, ...]:
    out: list[Any] = []
    pos = 0
    it = iter(lens)
    for spec in sig.args:
        if spec.kind is ArgKind.TENSOR_LIST:
            n = next(it)
            out.append(list(flat[pos : pos + n]))
            pos += n
        else:
            out.append(flat[pos])
            pos += 1
    return tuple(out)


def _slots(sig: Signature, lens: tuple[int, ...]) -> dict[str, tuple[int, int | None]]:
    """Map each argument name to (first flat position, list length or None)."""
    slots: dict[str, tuple[int, int | None]] = {}
    pos = 0
    it = iter(lens)
    for spec in sig.args:
        if spec.kind is ArgKind.TENSOR_LIST:
            n = next(it)
            slots[spec.name] = (pos, n)
            pos += n
        else:
            slots[spec.name] = (pos, None)
            pos += 1
    return slots


def _regroup(out_lens: list[int | None] | None, flat: tuple[Any, ...]) -> tuple[Any, ...]:
    """Group a node's flat outputs (or their gradients) back into the op's outputs."""
    if out_lens is None or all(n is None for n in out_lens):
        return tuple(flat)
    out: list[Any] = []
    pos = 0
    for n in out_lens:
        if n is None:
            out.append(flat[pos])
            pos += 1
        else:
            out.append(list(flat[pos : pos + n]))
            pos += n
    return tuple(out)


def _public_outputs(sig: Signature, out_lens: Any, output: Any) -> Any:
    """The op's outputs from the node's flat outputs."""
    if sig.output_is_tuple:
        return _regroup(out_lens, output if isinstance(output, tuple) else (output,))
    if sig.output_kinds and sig.output_kinds[0] is ArgKind.TENSOR_LIST:
        return list(output)
    return output
