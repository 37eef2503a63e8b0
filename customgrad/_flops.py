"""Count FLOPs with torch's formulas, without breaking autograd.

:class:`torch.utils.flop_counter.FlopCounterMode` tracks modules and, entered before a
forward, can get in the way of ``torch.autograd.grad`` on leaves. customgrad only needs the
numbers, so this is a small dispatch mode over the same formula table
(``torch.utils.flop_counter.flop_registry``). Ops without a formula (opaque kernels: Triton,
other custom ops) count zero, which is why callers also count backward calls.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

__all__ = ["FlopCounter", "formula_of"]


def formula_of(func: Any) -> Any:
    """torch's FLOP formula for an aten op, or None. In-place variants (``addmm_``,
    ``baddbmm_``, ``addmv_``, ``addbmm_``, ``addr_``), which torch's table lacks, count as their
    out-of-place twins: the same work."""
    packet = getattr(func, "_overloadpacket", None)
    formula = flop_registry.get(packet)
    if formula is None and packet is not None:
        name = packet.__name__
        if name.endswith("_") and not name.startswith("_"):
            formula = flop_registry.get(getattr(torch.ops.aten, name[:-1], None))
    return formula


class FlopCounter(TorchDispatchMode):
    """A dispatch mode that adds up FLOPs, attributed to ``self.key`` at the time of the call.

    Args:
        record: also keep each counted call as ``(op, FLOPs, output)`` in :attr:`calls`.

    Attributes:
        total: FLOPs counted since the mode was created.
        by_key: FLOPs per key; set :attr:`key` to attribute what follows to something else.
        key: what the next FLOPs are attributed to (``None`` by default).
        calls: the counted calls, when ``record``.
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
        self.calls: list[tuple[Any, int, Any]] | None = [] if record else None

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
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
        return out


def count_flops(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, int]:
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
