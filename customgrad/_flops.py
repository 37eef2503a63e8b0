"""Count FLOPs with torch's formulas, without breaking autograd.

:class:`torch.utils.flop_counter.FlopCounterMode` tracks modules and, entered before a
forward, can get in the way of ``torch.autograd.grad`` on leaves. customgrad only needs the
numbers, so this is a small dispatch mode over the same formula table
(``torch.utils.flop_counter.flop_registry``), completed with the formulas it lacks for ops a
transformer runs (:data:`EXTRA_FORMULAS`: CPU flash attention and its backward, the
backend-overridable fused attention, grouped matmuls). Ops without a formula (opaque kernels:
Triton, other custom ops) count zero, which is why callers also count backward calls; the counter
names the ones that may hide FLOPs (:attr:`FlopCounter.uncounted`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import ParamSpec, TypeVar

import torch
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from customgrad._torch.dispatcher import OpOverload, OpOverloadPacket, TorchDispatchMode, schema_of

__all__ = ["EXTRA_FORMULAS", "FlopCounter", "count_flops", "formula_of", "may_hide_flops"]

aten = torch.ops.aten

FlopFormula = Callable[..., int]
"""A FLOP formula: takes an op's arguments and ``out_val`` (its output), returns its FLOPs."""

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _heads_of(query: torch.Tensor, kv: torch.Tensor) -> tuple[int, ...]:
    """``kv``'s shape with the query's heads: with grouped-query attention the kernel broadcasts
    the key/value heads to the query's, and torch 2.11's counts take equal heads only (2.12 and
    later broadcast themselves, to the same count)."""
    shape = tuple(kv.shape)
    return (*shape[:-3], int(query.shape[-3]), *shape[-2:])


def _sdpa_forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: object, **kwargs: object
) -> int:
    """Attention forward (``q @ k^T``, then ``p @ v``), as torch counts its fused kernels."""
    return int(sdpa_flop_count(query.shape, _heads_of(query, key), _heads_of(query, value)))


def _sdpa_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *args: object,
    **kwargs: object,
) -> int:
    """Attention backward as torch counts its fused kernels: ``q @ k^T`` recomputed, then four
    matmuls for the gradients of ``q``, ``k``, ``v`` (2.5x the forward)."""
    k, v = _heads_of(query, key), _heads_of(query, value)
    return int(sdpa_backward_flop_count(grad_out.shape, query.shape, k, v))


def _grouped_mm(
    a: torch.Tensor, b: torch.Tensor, *args: object, out_val: torch.Tensor, **kwargs: object
) -> int:
    """``torch._grouped_mm``: one matmul per group. With 2-D ``a`` and ``b`` the groups split
    the reduced dimension (``a`` is ``(m, k)``, ``b`` ``(k, n)``: ``2mkn`` in all); otherwise each
    output element is a dot product over ``a``'s last dimension."""
    if a.dim() == 2 and b.dim() == 2:
        return 2 * int(a.shape[0]) * int(a.shape[1]) * int(b.shape[1])
    return 2 * int(out_val.numel()) * int(a.shape[-1])


EXTRA_FORMULAS: dict[OpOverloadPacket, FlopFormula] = {
    aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_forward,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_backward,
    aten._scaled_dot_product_fused_attention_overrideable: _sdpa_forward,
    aten._scaled_dot_product_fused_attention_overrideable_backward: _sdpa_backward,
    aten._grouped_mm: _grouped_mm,
}
"""FLOP formulas for ops torch 2.13's table lacks, keyed by overload packet; each takes the op's
arguments (tensors, not shapes) and ``out_val``. The attention ones use torch's own counts for
its other fused attention kernels, so every attention backend counts alike."""

_HIDING = ("attention", "mm", "conv", "matmul", "linear", "einsum", "gemm")


def formula_of(func: object) -> FlopFormula | None:
    """The FLOP formula for an aten op (torch's, else :data:`EXTRA_FORMULAS`), or None (also for
    anything else, such as a graph node's Python function).
    In-place variants (``addmm_``, ``baddbmm_``, ``addmv_``, ``addbmm_``, ``addr_``), which
    torch's table lacks, count as their out-of-place twins: the same work."""
    packet = getattr(func, "_overloadpacket", None)
    formula = flop_registry.get(packet)
    if formula is None and packet is not None:
        formula = EXTRA_FORMULAS.get(packet)
        name = packet.__name__
        if formula is None and name.endswith("_") and not name.startswith("_"):
            formula = flop_registry.get(getattr(aten, name[:-1], None))
    return formula


def may_hide_flops(func: OpOverload) -> bool:
    """An op without a formula that may do FLOPs the counter cannot see: an opaque kernel (an
    op outside ``aten``, such as a Triton kernel or another custom op) or an aten op named like
    a matmul, a convolution or attention. Communication ops are not."""
    namespace = getattr(func, "namespace", None)
    if namespace is None or formula_of(func) is not None:
        return False
    if namespace != "aten":
        return namespace not in ("_c10d_functional", "c10d", "_dtensor", "profiler", "prims")
    name = func._overloadpacket.__name__
    return any(word in name for word in _HIDING)


class FlopCounter(TorchDispatchMode):
    """A dispatch mode that adds up FLOPs, attributed to ``self.key`` at the time of the call.

    Args:
        record: also keep each counted call as ``(op, FLOPs, output)`` in :attr:`calls`.

    Attributes:
        total: FLOPs counted since the mode was created.
        by_key: FLOPs per key; set :attr:`key` to attribute what follows to something else.
        key: what the next FLOPs are attributed to (``None`` by default).
        calls: the counted calls, when ``record``.
        uncounted: calls per op (``"ns::name"``) of ops that may do FLOPs the counter cannot
            see (:func:`may_hide_flops`).
    """

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Let code compiled by ``torch.compile`` run under the counter (dynamo would otherwise skip the
        frame, and then the code object for good): its FLOPs are counted as it runs. FLOPs
        of tracing are counted too, so count a compiled module after its first call."""
        return True

    def __init__(self, record: bool = False) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.total = 0
        self.by_key: Counter[Hashable] = Counter()
        self.key: Hashable = None
        self.calls: list[tuple[OpOverload, int, torch.Tensor | None]] | None = (
            [] if record else None
        )
        self.uncounted: Counter[str] = Counter()

    def __torch_dispatch__(
        self,
        func: OpOverload,
        types: Sequence[type],
        args: Sequence[object] = (),
        kwargs: Mapping[str, object] | None = None,
    ) -> object:
        kwargs = dict(kwargs or {})
        out = func(*args, **kwargs)
        formula = formula_of(func)
        if formula is not None:
            flops = int(formula(*args, **kwargs, out_val=out))
            self.total += flops
            self.by_key[self.key] += flops
            if self.calls is not None and flops:
                kept = out.detach().clone() if isinstance(out, torch.Tensor) else None
                self.calls.append((func, flops, kept))
        elif may_hide_flops(func):
            self.uncounted[str(schema_of(func).name)] += 1
        return out


def count_flops(fn: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs) -> tuple[_R, int]:
    """Call ``fn(*args, **kwargs)`` and return its result and the FLOPs it did.

    Examples:
        >>> import torch
        >>> a = torch.ones(2, 3)
        >>> _, flops = count_flops(torch.mm, a, a.mT)
        >>> flops
        24
    """
    with FlopCounter() as counter:
        out = fn(*args, **kwargs)
    return out, counter.total
