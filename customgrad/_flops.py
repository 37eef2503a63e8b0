"""FLOPs with torch's formulas: each op's formula in torch's table, and customgrad's counter.

Every customgrad op registers a FLOP formula with torch's counter
(``torch.utils.flop_counter.flop_registry``, what ``FlopCounterMode`` reads), :class:`OpFlops`:
the author's (``register_flops``, for kernels a counter cannot see into, such as Triton's), or
the FLOPs of the kernel's own torch ops, counted once per signature of the arguments on fake
tensors. A counter sees an op's call at the dispatcher and runs the kernel with itself off the
stack, so the forward counts once, as a native op's does; the backward counts as the ops it
runs.

:class:`torch.utils.flop_counter.FlopCounterMode` tracks modules and, entered before a
forward, can get in the way of ``torch.autograd.grad`` on leaves. customgrad only needs the
numbers, so :class:`FlopCounter` is a small dispatch mode over the same formula table,
completed with the formulas it lacks for ops a transformer runs (:data:`EXTRA_FORMULAS`: CPU
flash attention and its backward, the backend-overridable fused attention, grouped matmuls).
Ops without a formula (opaque kernels: Triton, other custom ops) count zero, which is why
callers also count backward calls; the counter names the ones that may hide FLOPs
(:attr:`FlopCounter.uncounted`).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import optree
import torch
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from customgrad._errors import where
from customgrad._torch.dispatcher import (
    OpOverload,
    OpOverloadPacket,
    TorchDispatchMode,
    active_flop_tables,
    schema_of,
)
from customgrad._torch.fake import (
    detect_fake_mode,
    fake_tensor_mode_type,
    is_fake,
    set_device_guards,
)

if TYPE_CHECKING:
    from customgrad._kernels import Kernels

__all__ = [
    "EXTRA_FORMULAS",
    "FlopCounter",
    "OpFlops",
    "count_flops",
    "formula_of",
    "may_hide_flops",
]

log = logging.getLogger("customgrad")

aten = torch.ops.aten
_PRIM_DEVICE = torch.ops.prim.device.default  # no decomposition to ask for (FlopCounterMode's rule)

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
        formula = formula_of(func)
        if formula is None and func is not _PRIM_DEVICE:
            # As FlopCounterMode does: an op seen before its decomposition (below autograd,
            # where CompositeImplicitAutograd ops such as matmul reach modes) counts as the
            # ops it decomposes into.
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        if formula is not None:
            flops = int(formula(*args, **kwargs, out_val=out))
            self.total += flops
            self.by_key[self.key] += flops
            if self.calls is not None and flops:
                kept = out.detach().clone() if isinstance(out, torch.Tensor) else None
                self.calls.append((func, flops, kept))
            if not flops and isinstance(formula, OpFlops) and formula.blind:
                self.uncounted[str(schema_of(func).name)] += 1  # its kernel hides them
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


MSG_UNCOUNTED = (
    "%s: FLOP counters count 0 FLOPs for this op's kernel: counting the torch ops it runs on "
    "fake tensors raised %s: %s. Give its FLOPs (a Triton or C++ kernel has no torch ops to "
    "count):\n\n    @%s.register_flops\n    def _(%s):\n        return <the FLOPs, from the "
    "arguments' shapes>\n\n(kernel defined at %s)"
)


class OpFlops:
    """The FLOP formula of one op in torch's table, called as torch's counters call a raw
    formula: the op's arguments, then ``out_val``.

    It returns what the author registered (``register_flops``), else the FLOPs of the torch ops
    the op's kernel runs on fake copies of the arguments (under their fake mode when they are
    fake already), once per signature (shapes, strides, dtypes, devices, the other arguments'
    values). A kernel that cannot run on fake tensors (a raw Triton launch, a value read with
    ``.item()``) counts 0, with one log line naming the fix.
    """

    def __init__(self, kernels: Kernels) -> None:
        self._kernels = kernels
        self._counted: dict[Hashable, int] = {}
        self.blind = False
        """Whether the kernel's torch ops could not be counted (it counted 0), once at least."""

    def __call__(self, *args: object, out_val: object = None, **kwargs: object) -> int:
        kernels = self._kernels
        full = kernels.sig.normalize(args, kwargs)
        given = kernels.flops
        if given is not None:
            return int(kernels.sig.call(given, full))
        key = _signature_key(full)
        flops = None if key is None else self._counted.get(key)
        if flops is None:
            flops = self._count(full)
            if key is not None:
                self._counted[key] = flops
        return flops

    def _count(self, args: tuple[object, ...]) -> int:
        """The FLOPs of the kernel's torch ops on fake copies of ``args``, counted in a thread
        of its own: nothing of the caller's thread (its modes, grad mode, what a kernel keeps
        in thread-locals, as a ``from_function`` op's forward does) sees the extra run."""
        found: list[int | Exception] = []
        set_device_guards()  # (here, not first in the worker: see its docstring)
        worker = threading.Thread(target=lambda: found.append(self._count_here(args)))
        worker.start()
        worker.join()
        result = found[0] if found else 0
        if isinstance(result, Exception):
            if not self.blind:  # the kernel cannot run on fake tensors: say it once
                self.blind = True
                kernels = self._kernels
                first = (str(result).strip().splitlines() or [""])[0]
                log.warning(
                    MSG_UNCOUNTED, kernels.qualname, type(result).__name__, first, kernels.var,
                    ", ".join(kernels.sig.names), where(kernels.fn),
                )  # fmt: skip
            return 0
        return result

    def _count_here(self, args: tuple[object, ...]) -> int | Exception:
        from customgrad._kernels import first_tensor

        kernels = self._kernels
        tree: Any = args
        try:
            mode = detect_fake_mode(t for t in optree.tree_leaves(tree) if is_fake(t))
            if mode is None:
                mode = fake_tensor_mode_type()(allow_non_fake_inputs=True)
            with mode, torch.no_grad():
                fakes: Any = optree.tree_map(lambda a: mode.from_tensor(a) if _real(a) else a, tree)
                with FlopCounter() as counter:
                    kernels.run(kernels.kernel_for(first_tensor(fakes)), fakes)
        except Exception as e:  # reported by the caller's thread
            return e
        return int(counter.total)


def _real(a: object) -> bool:
    return isinstance(a, torch.Tensor) and not is_fake(a)


def _signature_key(args: tuple[object, ...]) -> Hashable | None:
    """What an op's derived FLOPs are cached by, or None when the arguments are not hashable
    (symbolic shapes, objects)."""

    def part(a: object) -> object:
        if isinstance(a, torch.Tensor):
            return (tuple(a.shape), a.stride(), a.dtype, a.device.type)
        if isinstance(a, (list, tuple)):
            return tuple(part(t) for t in a)
        return a

    key = tuple(part(a) for a in args)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def register_op_flops(packet: OpOverloadPacket, formula: OpFlops) -> None:
    """Put ``formula`` in torch's table for ``packet`` (a redefinition's replaces the earlier
    one's: the name's packet is new), and in the tables of the FLOP counters running on this
    thread (``FlopCounterMode`` copies the table when it is made: an op defined inside one, such
    as a ``from_function`` op at its first call, is counted by it too)."""
    for table in (flop_registry, *active_flop_tables()):
        table[packet] = formula


def unregister_op_flops(packet: OpOverloadPacket) -> None:
    """Take an op's formula out of torch's table (its definition was replaced)."""
    if isinstance(flop_registry.get(packet), OpFlops):
        del flop_registry[packet]
