"""``customgrad.from_function``: an existing ``torch.autograd.Function`` as a customgrad op.

Code that already has ``autograd.Function`` subclasses gets zero-bubble-ready ops without a
rewrite: the Function's ``forward`` becomes the op's kernel, run with a ctx that records what it
saves, and its ``backward`` becomes the op's single backward, split automatically into an input
and a weight part (:mod:`customgrad._autosplit`).

What ``forward`` leaves on its ctx reaches the backward on every call path (eager, ``torch.ops``,
``torch.compile``, fake tensors): saved inputs and outputs are saved as they are, views of them
are rebuilt with ``as_strided``, and the other tensors it saves (intermediates) are returned by
the kernel as one ``Tensor[]`` residual, which only ``save_for_backward`` sees. Everything else it
records (non-tensor attributes, where each tensor comes from) is handed from the kernel to
``save_for_backward`` on the same thread, right after the kernel ran.

The fake kernel is the Function's forward run on fake tensors, unless the forward cannot run on
them (a raw Triton launch): then the user gives one with ``op.register_fake``, for the outputs
the user sees. What forward saves (the hidden residuals, the attributes) is then learned by
running the Function's forward once per input signature on zero-filled tensors like the fake
ones (:class:`_SavedProbe`), and the user's outputs are checked against that run.
"""

from __future__ import annotations

import inspect
import re
import sys
import threading
import types
import typing
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeGuard, TypeVar, cast

import optree
import torch

from customgrad._autograd import _raises_if_differentiated, _requiring_grad
from customgrad._errors import (
    DefinitionError,
    GradientTypeError,
    GradientValueError,
    KernelOutputError,
    MissingRegistrationError,
    UnsupportedError,
    where,
)
from customgrad._function_ctx import ForwardContext, FunctionContext
from customgrad._op import CustomOp
from customgrad._saving import SAVED, register_dataclasses
from customgrad._signature import _split_returns
from customgrad._torch import dynamo
from customgrad._torch.dispatcher import disable_current_modes as _disable_current_modes
from customgrad._torch.dispatcher import is_alias_of, parse_schema
from customgrad._torch.fake import detect_fake_mode, functional_tensor_type, is_fake
from customgrad._torch.functions import setup_context_defined
from customgrad._triton import raw_launch

__all__ = ["DeferredFunctionOp", "FunctionPatch", "from_function", "from_functions"]

_Tensor = torch.Tensor
_RESIDUAL = "saved"
_LEAVES = (_Tensor, torch.nn.Parameter, type(None), bool, int, float, str, torch.dtype, torch.Size)
_is_alias_of = is_alias_of

FunctionOutput = torch.Tensor | tuple[torch.Tensor | None, ...]
"""What an op made from a Function returns: its forward's Tensor, or its tuple (None outputs
kept as None)."""

_Attrs = dict[str, tuple[optree.PyTreeSpec | None, list[object]]]
"""The attributes forward set on ctx: each one's structure (None for a single leaf) and leaves
(a saved tensor's :class:`_Place`, or the value)."""

_Recipe = tuple[tuple[object, ...], _Attrs, int, tuple[bool, ...]]
"""What the kernel recorded for ``save_for_backward``: the places (or values) of what forward
saved, its attributes, its number of residuals and which inputs required grad."""

_Meta = tuple[tuple[int, ...], tuple[int, ...], torch.dtype, torch.device]
"""A tensor as ``(shape, stride, dtype, device)``."""

_Probed = tuple[_Recipe | None, list[_Meta | object], list[_Meta | object]]
"""What :meth:`_SavedProbe.run` learns: the recipe, the outputs and the residuals."""

_F = TypeVar("_F", bound=Callable[..., Any])


class _Descriptor(Protocol):
    """A Function's own ``apply`` (a classmethod), as :class:`_PatchedApply` hands it on."""

    def __get__(self, instance: object, owner: type, /) -> object:
        """The bound ``apply``."""


_Layout = tuple[int, tuple[str, ...], tuple[tuple[int, int | None], ...]]
"""The layout of the saved values: how many tensors forward saved, the attributes' names, and
where the tensors it computed are (a position, and the leaf inside an attribute's container)."""


class _Stash(threading.local):
    """What the kernel recorded on this thread, for the ``save_for_backward`` that follows."""

    recipe: _Recipe | None = None


_stash = _Stash()


# --------------------------------------------------------------------------------------------
# What forward keeps on ctx, as it reaches the backward


class _ByReference:
    """An attribute ``forward`` set on ctx, handed to ``backward`` as the object itself (as
    plain autograd does), not rebuilt from a snapshot: a container changed between forward and
    backward, or appended to by backward, is the user's own."""

    __slots__ = ("value",)
    __customgrad_by_reference__ = True  # a tensor argument kept on ctx is held on purpose

    def __init__(self, value: object) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"<ctx attribute {type(self.value).__name__}>"


class _LeafByReference:
    """A leaf tensor that requires grad (a weight) ``forward`` kept on ctx without saving it
    (``ctx.w = w``), for ``backward`` to read as it is then, as plain autograd does: without a
    saved tensor's version check, so an in-place change before backward (an optimizer step,
    ``w.mul_``) raises nothing and gives plain autograd's gradients. A weak reference: the leaf
    lives on its own (the graph's accumulator holds it). A non-leaf argument kept on ctx goes
    the same way, held (:class:`_ByReference`)."""

    __slots__ = ("ref",)

    def __init__(self, value: _Tensor) -> None:
        self.ref = weakref.ref(value)


def _arg_by_reference(
    value: object, args: Sequence[object], weights: Sequence[object]
) -> TypeGuard[_Tensor]:
    """Whether ``value`` is a parameter among ``args`` of an eager call, or one of its
    ``weights`` (weight arguments: a tensor made from a parameter) that requires grad: kept on
    ctx, it reaches backward by reference (see :class:`_LeafByReference`)."""
    if not isinstance(value, _Tensor) or _traced(value):
        return False
    if isinstance(value, torch.nn.Parameter):
        return any(value is a for a in args)
    return value.requires_grad and any(value is a for a in weights)


def _by_reference(value: object, args: Sequence[object]) -> bool:
    """Whether an attribute ``value`` of ctx reaches backward by reference: a mutable object
    holding no tensor, in an eager call (under tracing, torch.compile's or fake tensors', every
    attribute goes the traced way). Tensors go through autograd's saving, version-checked
    (except a leaf kept on ctx: :class:`_LeafByReference`)."""
    if type(value) in _LEAVES or isinstance(value, (tuple, frozenset, torch.dtype)):
        return False
    leaves, _ = _flatten(value)
    return not any(isinstance(v, _Tensor) for v in leaves) and not any(
        isinstance(a, _Tensor) and _traced(a) for a in args
    )


def _flatten(value: object) -> tuple[list[object], optree.PyTreeSpec]:
    """``value``'s leaves (None a leaf) and structure, as customgrad's saving sees it."""
    tree: Any = value  # optree types a tree as PyTree[T]; any object is one (a leaf at least)
    leaves, spec = optree.tree_flatten(tree, none_is_leaf=True, namespace=SAVED)
    if register_dataclasses(leaves):
        leaves, spec = optree.tree_flatten(tree, none_is_leaf=True, namespace=SAVED)
    return leaves, spec


def _traced(t: _Tensor) -> bool:
    """Whether ``t`` is a fake or functional tensor (a trace, not an eager call)."""
    return is_fake(t) or isinstance(t, functional_tensor_type())


# --------------------------------------------------------------------------------------------
# Where each saved tensor comes from


class _Place(tuple):  # type: ignore[type-arg]
    """Where a saved tensor comes from: ``("arg", i, item)``, ``("out", j)``, ``("view",
    place, size, stride, offset)`` or ``("res", k)`` (the kernel's ``k``-th residual)."""

    __slots__ = ()


def _sources(args: Sequence[object], outs: Sequence[object]) -> list[tuple[Any, _Place]]:
    """The tensors a saved tensor may be (or view): arguments (list items too), outputs."""
    found: list[tuple[Any, _Place]] = []
    for i, a in enumerate(args):
        if isinstance(a, _Tensor):
            found.append((a, _Place(("arg", i, None))))
        elif isinstance(a, (list, tuple)):
            found += [(t, _Place(("arg", i, k))) for k, t in enumerate(a) if isinstance(t, _Tensor)]
    found += [(t, _Place(("out", j))) for j, t in enumerate(outs)]
    return found


def _place(t: _Tensor, sources: list[tuple[Any, _Place]], residuals: list[_Tensor]) -> _Place:
    """How ``save_for_backward`` finds ``t`` again: an argument or output, a view of one
    (``as_strided``), or a residual the kernel returns."""
    for s, where_ in sources:
        if t is s:
            return where_
    for s, where_ in sources:
        if _is_alias_of(t, s):
            return _Place(("view", where_, tuple(t.shape), tuple(t.stride()), t.storage_offset()))
    for k, r in enumerate(residuals):
        if t is r:
            return _Place(("res", k))
    base = t._base
    if base is not None:
        # A view of an intermediate (h.chunk(2)): the kernel returns the intermediate once, and
        # each view is rebuilt from it (residuals that alias each other are refused by torch).
        return _Place(
            ("view", _place(base, sources, residuals), tuple(t.shape), tuple(t.stride()),
             t.storage_offset())
        )  # fmt: skip
    residuals.append(t)
    return _Place(("res", len(residuals) - 1))


def _needs(args: Sequence[object]) -> tuple[bool, ...]:
    """Per argument: it requires grad (a list: one of its tensors does)."""
    return tuple(
        (isinstance(a, _Tensor) and a.requires_grad)
        or (isinstance(a, (list, tuple)) and any(getattr(t, "requires_grad", False) for t in a))
        for a in args
    )


def _computed(place: _Place) -> bool:
    """Whether the tensor at ``place`` is (a view of) one the forward computed."""
    while place[0] == "view":
        place = place[1]
    return bool(place[0] == "res")


def _find(place: _Place, inputs: Sequence[object], outs: Sequence[object], res: Any) -> Any:
    kind = place[0]
    if kind == "arg":
        a = inputs[place[1]]
        return a if place[2] is None else a[place[2]]
    if kind == "out":
        return outs[place[1]]
    if kind == "view":
        base = _find(place[1], inputs, outs, res)
        return base.as_strided(place[2], place[3], place[4])
    return res[place[1]]


MSG_COMPUTED_DOUBLE_BACKWARD = """\
{op}: double backward (create_graph=True, gradient penalties) reached a tensor that the \
Function's forward computed and saved on ctx: autograd sees it as a constant (as it did for the \
Function), so the gradient through it would be silently wrong. If the Function needs no double \
backward, say so with one line: decorate its backward with @once_differentiable (from \
torch.autograd.function import once_differentiable); double backward then raises at once and \
check_op skips gradgradcheck. If it does need it, save the inputs and recompute the tensor in \
backward with differentiable torch ops. (forward defined at {loc})"""


def _guard_computed(
    qualname: str,
    forward: Callable[..., object],
    saved: tuple[Any, ...],
    grads: tuple[torch.Tensor | None, ...],
    computed: Sequence[tuple[int, int | None]],
) -> tuple[Any, ...]:
    """``saved`` with each tensor that forward computed (at positions ``computed``) replaced by
    an alias whose backward raises, in double backward (as customgrad does for residuals)."""
    anchors = _requiring_grad(grads, saved)
    if not anchors:
        return saved
    msg = MSG_COMPUTED_DOUBLE_BACKWARD.format(op=qualname, loc=where(forward))
    guarded = list(saved)
    for i, k in computed:
        if k is None:
            guarded[i] = _raises_if_differentiated(msg, guarded[i], anchors)
        else:  # inside an attribute's container
            leaves, spec = _flatten(guarded[i])
            leaves[k] = _raises_if_differentiated(msg, cast(_Tensor, leaves[k]), anchors)
            guarded[i] = optree.tree_unflatten(spec, leaves)
    return tuple(guarded)


class _Layouts:
    """Numbers for the layouts of what an op's forward saved (how many saved tensors, which
    attributes with which structure, which tensors it computed), so that the saved values are
    one flat tuple of tensors and plain values."""

    def __init__(self) -> None:
        self._numbers: dict[_Layout, int] = {}
        self._layouts: list[_Layout] = []
        self._lock = threading.Lock()

    def number(self, layout: _Layout) -> int:
        found = self._numbers.get(layout)
        if found is None:
            with self._lock:
                found = self._numbers.setdefault(layout, len(self._layouts))
                if found == len(self._layouts):
                    self._layouts.append(layout)
        return found

    def layout(self, number: int) -> _Layout:
        return self._layouts[number]


# --------------------------------------------------------------------------------------------
# A fake kernel for the outputs the user sees

MSG_NO_FAKE = """\
{op}: the Function's forward cannot run on fake tensors (torch.compile, opcheck and \
FakeTensorMode run an op's fake kernel, which for an op made with from_function is the \
Function's forward): {why}. Give the op a fake kernel for the outputs the user sees; customgrad \
handles what the forward saves on ctx:

    op = cg.from_function({function}, "{op}", ...)
    @op.register_fake
    def _({args}):
        return torch.empty_like(x)              # each output's shape, dtype and device

(forward defined at {loc})"""

MSG_FAKE_MISMATCH = """\
{op}: the fake kernel registered with register_fake returned {got}, but the Function's forward \
returns {expected} for these arguments. Return tensors exactly like the forward's outputs (same \
count, shape, dtype and device); return only the outputs the user sees, not what forward saves. \
(fake kernel defined at {loc})"""

MSG_SYMBOLIC = """\
{op}: the fake kernel was called with symbolic shapes (torch.compile with dynamic shapes), but \
what the Function's forward saves on ctx is learned by running it once on concrete tensors. \
Compile with dynamic=False (torch.compile(..., dynamic=False)), or define the op with cg.op and \
a fake kernel that returns the residuals too. (forward defined at {loc})"""


def _describe(metas: Sequence[object]) -> str:
    """``metas``: tensors, or ``(shape, stride, dtype, device)`` tuples."""
    items = []
    for m in metas:
        if isinstance(m, _Tensor):
            m = (tuple(m.shape), None, m.dtype, m.device)
        if isinstance(m, tuple) and len(m) == 4:
            shape, _, dtype, device = m
            items.append(
                f"({', '.join(map(str, shape))}) {str(dtype).removeprefix('torch.')} on {device}"
            )
        else:
            items.append(type(m).__name__)
    return f"{len(items)} output(s): {'; '.join(items)}"


class _SavedProbe:
    """What the Function's forward saves, per input signature, learned by running it on
    zero-filled real tensors shaped like the fake arguments (for a user's fake kernel)."""

    def __init__(
        self,
        qualname: str,
        kernel: Callable[..., tuple[object, ...]],
        forward: Callable[..., object],
    ) -> None:
        self.qualname = qualname
        self.kernel = kernel
        self.forward = forward
        self._seen: dict[tuple[object, ...], _Probed] = {}
        self._lock = threading.Lock()

    def _concrete(self, t: _Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
        if not all(isinstance(n, int) for n in (*t.shape, *t.stride())):
            raise UnsupportedError(MSG_SYMBOLIC.format(op=self.qualname, loc=where(self.forward)))
        return tuple(t.shape), tuple(t.stride())

    def run(self, args: Sequence[object], needs: tuple[bool, ...]) -> _Probed:
        """``(recipe, outputs, residuals)`` of the forward on tensors like ``args`` (outputs
        and residuals as ``(shape, stride, dtype, device)``), its inputs requiring grad as
        ``needs`` says."""
        key_parts: list[Any] = [needs]
        for a in args:
            for t in a if isinstance(a, (list, tuple)) else (a,):
                if isinstance(t, _Tensor):
                    key_parts.append((*self._concrete(t), t.dtype, t.device))
                else:
                    key_parts.append(repr(t))
        key = tuple(key_parts)
        found = self._seen.get(key)
        if found is not None:
            return found

        def real(t: Any, need: bool) -> Any:
            if not isinstance(t, _Tensor):
                return t
            shape, stride = self._concrete(t)
            r = torch.empty_strided(shape, stride, dtype=t.dtype, device=t.device).zero_()
            return r.requires_grad_() if need and r.is_floating_point() else r

        def meta(t: Any) -> Any:
            if not isinstance(t, _Tensor):
                return t
            return (tuple(t.shape), tuple(t.stride()), t.dtype, t.device)

        with _disable_current_modes(), torch.no_grad():
            rargs = [
                [real(t, n) for t in a] if isinstance(a, (list, tuple)) else real(a, n)
                for a, n in zip(args, needs)
            ]
            before, _stash.recipe = _stash.recipe, None
            try:
                *outs, residuals = self.kernel(*rargs)
                recipe = _stash.recipe
            finally:
                _stash.recipe = before
        assert isinstance(residuals, list)  # the kernel returns its residuals as a list
        found = (recipe, [meta(o) for o in outs], [meta(r) for r in residuals])
        with self._lock:
            self._seen[key] = found
        return found


class _Writes:
    """Calls a Function's backward, handing it copies of the saved tensors and output gradients
    it writes in place (unsloth's ``torch.matmul(..., out=X)`` into its saved input). Autograd
    lets a Function's backward write into what it is handed; customgrad refuses it (another
    node, or the other half of a split, may read it). Which ones it writes is learned per
    layout and plain attribute values (``ctx.inplace``) at the first eager call, which is handed
    copies of all of them, leaves too (the input of a first stage), each copy sharing its
    original's attributes (a backward reads and sets them on weights: Megatron's ``main_grad``,
    ``grad_added_to_main_grad``): the gradients the raw Function computes, at the memory of its
    out-of-place way. A write torch's version counter does not see (a Triton store) is neither
    seen here nor refused."""

    def __init__(self, backward: Callable[..., object]) -> None:
        self.backward = backward
        self._seen: dict[Any, frozenset[tuple[int, int]]] = {}

    def call(
        self,
        layout: int,
        tensors: tuple[object, ...],
        attrs: Mapping[str, object],
        grads: tuple[torch.Tensor | None, ...],
        needs: tuple[bool, ...],
    ) -> object:
        parts = (tensors, grads)
        if dynamo.tracing() or any(
            isinstance(t, _Tensor) and _traced(t) for t in (*tensors, *grads)
        ):  # a trace: a write there is the trace's business
            return self.backward(FunctionContext(tensors, attrs, needs), *grads)
        key = (layout, needs, *(
            (k, v if type(v) in _PLAIN else type(v)) for k, v in attrs.items()
        ))  # fmt: skip
        written = self._seen.get(key)

        def copy(at: tuple[int, int], t: Any) -> Any:
            if not isinstance(t, _Tensor) or (written is not None and at not in written):
                return t
            c = t.clone()
            if t.requires_grad and not c.requires_grad:  # cloned without grad: read as t is
                c.requires_grad_()
            c.__dict__ = t.__dict__  # its attributes are the original's (Megatron's main_grad)
            return c

        given = tuple(
            tuple(copy((p, i), t) for i, t in enumerate(ts)) for p, ts in enumerate(parts)
        )
        if written is not None:
            return self.backward(FunctionContext(given[0], attrs, needs), *given[1])
        watched = [
            ((p, i), t) for p, ts in enumerate(given) for i, t in enumerate(ts)
            if isinstance(t, _Tensor)
        ]  # fmt: skip
        before = [t._version for _, t in watched]
        result = self.backward(FunctionContext(given[0], attrs, needs), *given[1])
        self._seen[key] = frozenset(at for (at, t), v in zip(watched, before) if t._version != v)
        return result


_PLAIN = (type(None), bool, int, float, str, torch.dtype)


def _fake_like(meta: Any, device: torch.device) -> torch.Tensor:
    shape, stride, dtype, _ = meta
    return torch.empty_strided(shape, stride, dtype=dtype, device=device)


class _FunctionOp(CustomOp[..., FunctionOutput]):
    """The op :func:`from_function` makes: ``register_fake`` takes a fake kernel for the
    outputs the user sees (what the Function's forward saves is customgrad's business)."""

    _user_fake: Callable[..., object] | None = None

    def register_fake(self, fn: _F) -> _F:
        """Register a fake kernel for the op's outputs (not what the Function's forward saves).

        A Function whose forward launches a raw Triton kernel cannot run on fake tensors, so
        ``torch.compile`` needs this. customgrad learns what the forward saves by running it
        once per input signature on zero-filled tensors, and checks these outputs against it.
        """
        if not callable(fn):
            raise DefinitionError(f"{self.name}: register_fake needs a function, got {fn!r}.")
        self._user_fake = fn
        return fn


# --------------------------------------------------------------------------------------------
# Reading the Function


def _once_differentiable(fn: object) -> bool:
    """Whether ``fn`` is wrapped by ``torch.autograd.function.once_differentiable``."""
    code = getattr(fn, "__code__", None)
    return (
        code is not None
        and code.co_name == "wrapper"
        and code.co_filename == getattr(torch.autograd.function, "__file__", None)
        and hasattr(fn, "__wrapped__")
    )


def _parameters(
    function: type[torch.autograd.Function], name: str, classic: bool, schema: str | None
) -> tuple[list[inspect.Parameter], Any]:
    """The forward's parameters (without ``ctx``), with annotations resolved; named by
    ``schema`` when the forward takes ``*args`` (a decorator that wraps it without
    ``functools.wraps``)."""
    forward = function.forward
    label = f"{function.__qualname__}.forward"
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        raise DefinitionError(
            f"{name}: cannot read the signature of {label}. Give the Function a Python forward."
        ) from None
    if classic:
        params = params[1:]  # ctx
    kinds: dict[object, str] = {
        inspect.Parameter.VAR_POSITIONAL: "*",
        inspect.Parameter.VAR_KEYWORD: "**",
        inspect.Parameter.KEYWORD_ONLY: "keyword-only ",
    }
    bad = [p for p in params if p.kind in kinds]
    if bad:
        named = _schema_parameters(schema)
        if named is not None:
            return named, inspect.Parameter.empty
        stars = kinds[bad[0].kind]
        raise DefinitionError(
            f"{name}: {label} takes {stars}{bad[0].name}; autograd.Function.apply passes its "
            f"inputs by position, and a customgrad op needs one named parameter per input. Name "
            f"them: def forward(ctx, x: Tensor, weight: Tensor) -> Tensor, or name them in "
            f'the schema: cg.from_function(..., schema="(Tensor x, Tensor weight) -> Tensor"). '
            f"(forward defined at {where(forward)})"
        )
    try:
        hints = typing.get_type_hints(forward)
    except Exception:  # unresolvable string annotations: infer_schema reports them
        hints = {}
    params = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in params]
    return params, hints.get("return", inspect.signature(forward).return_annotation)


def _schema_parameters(schema: str | None) -> list[inspect.Parameter] | None:
    """One positional parameter per argument of ``schema`` (with its default), or None."""
    try:
        parsed = parse_schema("_cg_probe" + schema) if schema is not None else None
    except RuntimeError:
        return None  # the op's definition reports it
    if parsed is None:
        return None
    empty = inspect.Parameter.empty
    return [
        inspect.Parameter(
            a.name,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            default=a.default_value if a.has_default_value() else empty,
        )
        for a in parsed.arguments
    ]


def _annotated_schema(params: list[inspect.Parameter], returns: Any) -> str | None:
    """The schema ``forward``'s annotations give, or None (not annotated, or not in types a
    schema has: a ``Literal``): then it is read from the first call."""
    empty = inspect.Parameter.empty
    if returns is empty or any(p.annotation is empty for p in params):
        return None

    def prototype(*args: Any, **kwargs: Any) -> Any:  # only its signature is read
        return None

    prototype.__signature__ = inspect.Signature(params, return_annotation=returns)  # type: ignore[attr-defined]
    try:
        return str(torch.library.infer_schema(prototype, mutates_args=()))
    except (ValueError, TypeError):
        return None


# --------------------------------------------------------------------------------------------
# The op


def from_function(
    function: type[torch.autograd.Function],
    name: str,
    /,
    *,
    weights: Iterable[str] = (),
    schema: str | None = None,
    output_differentiability: Sequence[bool] | None = None,
) -> CustomOp[..., FunctionOutput] | DeferredFunctionOp:
    """Wrap an existing ``torch.autograd.Function`` subclass into a customgrad op.

    The Function's ``forward`` becomes the op's kernel (for every device) and its fake kernel;
    what it keeps on ``ctx`` (``save_for_backward``, attributes) reaches its ``backward``, which
    becomes the op's single backward, split automatically into an input and a weight part.
    ``ctx.needs_input_grad`` in that backward reflects the running pass. Functions written with
    ``setup_context`` work too; ``once_differentiable`` backwards become
    ``differentiable=False``.

    Args:
        function: the ``torch.autograd.Function`` subclass.
        name: ``"namespace::name"`` of the op.
        weights: names of ``forward``'s weight parameters (their gradients go to the W pass).
        schema: the schema without the name, e.g. ``"(Tensor x, Tensor weight) -> Tensor"``.
            Without it, the schema comes from ``forward``'s annotations or, when they don't
            give one (no annotations, as in most libraries), from the first call.
        output_differentiability: one bool per output (the Function's ``None`` outputs
            included). Read from the first call when the schema is: False for integer outputs
            and those ``forward`` passes to ``ctx.mark_non_differentiable``; with a schema from
            annotations or ``schema=``, those must be declared False here.

    Returns:
        A :class:`~customgrad.CustomOp` called with ``forward``'s parameters (without ``ctx``);
        for a ``forward`` without annotations or ``schema=``, a
        :class:`~customgrad.DeferredFunctionOp`, called as ``Function.apply`` is, that defines
        the op at its first call.

    Raises:
        DefinitionError: ``function`` is not an ``autograd.Function`` subclass, its forward
            takes ``*args``, or ``weights`` names a parameter it does not take.

    Example:
        >>> import torch, customgrad as cg
        >>> class Scale(torch.autograd.Function):
        ...     @staticmethod
        ...     def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ...         ctx.save_for_backward(x, w)
        ...         return x * w
        ...     @staticmethod
        ...     def backward(ctx, grad):
        ...         x, w = ctx.saved_tensors
        ...         return grad * w, (grad * x).sum(0)
        >>> scale = cg.from_function(Scale, "doc_from_function::scale", weights=("w",))
        >>> x = torch.ones(2, 3, requires_grad=True)
        >>> w = torch.full((3,), 2.0, requires_grad=True)
        >>> scale(x, w).sum().backward()
        >>> w.grad
        tensor([2., 2., 2.])
    """
    if not (isinstance(function, type) and issubclass(function, torch.autograd.Function)):
        owner = getattr(function, "__self__", None)
        if isinstance(owner, type) and issubclass(owner, torch.autograd.Function):
            got, fix = f"{owner.__qualname__}.apply", f" Pass the class: {owner.__qualname__}."
        else:
            got, fix = repr(function), ""
        raise DefinitionError(
            f"{name}: from_function needs a torch.autograd.Function subclass, got {got}.{fix}"
        )
    classic = not setup_context_defined(function)
    params, returns = _parameters(function, name, classic, schema)
    public = schema if schema is not None else _annotated_schema(params, returns)
    if public is None:  # read from the first call
        return DeferredFunctionOp(function, name, params, weights, output_differentiability)
    diff = None if output_differentiability is None else tuple(output_differentiability)
    return _define(function, name, params, public, weights, diff, _Calls())


class _Calls:
    """How the op's kernel calls the Function when its results are not a customgrad op's as
    they are (learned from the first call, :class:`DeferredFunctionOp`): ``outputs`` is what the
    forward returns (``"T"`` a tensor, ``None``, one tensor when ``single``), ``cloned`` the
    positions of the arguments forward writes and returns (given a copy, so the op's outputs
    are new tensors)."""

    def __init__(
        self,
        outputs: tuple[str | None, ...] = (),
        single: bool = True,
        cloned: frozenset[int] = frozenset(),
    ) -> None:
        self.outputs = outputs
        self.single = single
        self.cloned = cloned
        self.plain = None not in outputs and (single or len(outputs) > 1)
        """The op's result is the Function's as it is (no ``None`` output to put back)."""


def _define(
    function: type[torch.autograd.Function],
    name: str,
    params: list[inspect.Parameter],
    public: str,
    weights: Iterable[str],
    diff: tuple[bool, ...] | None,
    calls: _Calls,
) -> CustomOp[..., FunctionOutput]:
    """The op for ``function`` with the schema ``public``."""
    classic = not setup_context_defined(function)
    args_part, rets = _split_returns(public)
    if rets == ["()"] or not rets or rets == [""]:
        raise DefinitionError(
            f"{name}: {function.__qualname__}.forward returns nothing; a customgrad op needs "
            f"tensor outputs."
        )
    kernel_schema = f"{args_part} -> ({', '.join([*rets, 'Tensor[]'])})"
    n_out = len(rets)
    names = [p.name for p in params]
    forward = function.forward
    qualname = name
    weights = tuple(weights)
    weight_at = [i for i, n in enumerate(names) if n in weights]

    def kernel(*args: Any) -> Any:
        needs = _needs(args)
        ctx = ForwardContext(needs, qualname, forward)
        given = tuple(a.clone() if i in calls.cloned else a for i, a in enumerate(args))
        if classic:
            out = forward(ctx, *given)
        else:
            out = forward(*given)
            function.setup_context(ctx, given, out)
        outs = out if isinstance(out, tuple) else (out,)
        if calls.outputs:
            outs = _tensor_outputs(qualname, forward, outs, calls.outputs)
        # A forward that returns an input it wrote (Liger's rope rotates q and k in place when
        # they are laid out for its kernel) returns it as the raw Function does; the op, whose
        # outputs are new tensors, returns a copy.
        inputs = [t for a in args for t in (a if isinstance(a, (list, tuple)) else (a,))]
        outs = tuple(
            o.clone()
            if isinstance(o, _Tensor)
            and any(isinstance(t, _Tensor) and _is_alias_of(o, t) for t in inputs)
            else o
            for o in outs
        )
        residuals: list[_Tensor] = []
        sources = _sources(args, outs)

        def place(value: Any) -> Any:
            return _place(value, sources, residuals) if isinstance(value, _Tensor) else value

        saved = tuple(place(t) for t in ctx._cg_saved)
        attrs: dict[str, tuple[Any, list[Any]]] = {}
        for attr, value in ctx._cg_attrs.items():
            if _by_reference(value, args):
                attrs[attr] = (None, [_ByReference(value)])
                continue
            if _arg_by_reference(value, args, [args[i] for i in weight_at if i < len(args)]):
                held = _LeafByReference(value) if value.is_leaf else _ByReference(value)
                attrs[attr] = (None, [held])
                continue
            if type(value) in _LEAVES:  # a plain value or a tensor: no flattening
                attrs[attr] = (None, [place(value)])
                continue
            leaves, spec = _flatten(value)
            attrs[attr] = (None if spec.is_leaf() else spec, [place(v) for v in leaves])
        for t in ctx._cg_nondiff:
            j = next((j for j, o in enumerate(outs) if o is t), None)
            if j is not None and (diff is None or diff[j]):
                declared = list(diff or (True,) * n_out)
                declared[j] = False
                raise DefinitionError(
                    f"{qualname}: the Function's forward marks output {j} non-differentiable "
                    f"(ctx.mark_non_differentiable), but the op declares it differentiable. "
                    f"Declare it when wrapping: cg.from_function(..., "
                    f"output_differentiability={declared}). (forward defined at {where(forward)})"
                )
        _stash.recipe = (saved, attrs, len(residuals), needs)
        return (*outs, residuals)

    def attrs_as_if(args: Sequence[object], needs: tuple[bool, ...], attrs: Any) -> Any:
        """``attrs`` with the plain values that forward records when its inputs require grad
        as ``needs`` says. Under AOTAutograd (torch.compile, opcheck) the kernel runs on fake
        tensors that never require grad, while autograd's inputs do: forward runs again on
        fakes that do, to read what it records from ``x.requires_grad`` (or
        ``ctx.needs_input_grad``). Its tensors stay those of the kernel's run."""
        tensors = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a])]
        fake = detect_fake_mode([t for t in tensors if isinstance(t, _Tensor)])
        if fake is None:
            return attrs
        if op._user_fake is not None:  # the forward can't run on fakes: ask the probe
            recipe = probe.run(args, needs)[0]
            assert recipe is not None  # the probe runs the kernel, which records it
            return recipe[1]

        def like(t: Any, need: bool) -> Any:
            if not isinstance(t, _Tensor):
                return t
            f = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
            return f.requires_grad_() if need and f.is_floating_point() else f

        with _disable_current_modes(), fake, torch.no_grad():
            fargs = [
                [like(t, n) for t in a] if isinstance(a, (list, tuple)) else like(a, n)
                for a, n in zip(args, needs)
            ]
            ctx = ForwardContext(needs, qualname, forward)
            if classic:
                forward(ctx, *fargs)
            else:
                function.setup_context(ctx, tuple(fargs), forward(*fargs))
        fixed: dict[str, tuple[Any, list[Any]]] = {}
        for attr, (spec, leaves) in attrs.items():
            again = ctx._cg_attrs.get(attr, leaves[0] if spec is None else None)
            new, new_spec = _flatten(again)
            if (None if new_spec.is_leaf() else new_spec) != spec or len(new) != len(leaves):
                fixed[attr] = (spec, leaves)  # another structure: keep what the kernel saw
                continue
            fixed[attr] = (
                spec,
                [v if isinstance(v, _Place) or isinstance(w, _Tensor) else w
                 for v, w in zip(leaves, new)],
            )  # fmt: skip
        return fixed

    kernel.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    kernel.__wrapped__ = forward  # type: ignore[attr-defined]
    kernel.__doc__ = function.__doc__
    kernel.__name__ = kernel.__qualname__ = function.__name__

    op = _FunctionOp(
        name,
        kernel,
        weights=weights,
        schema=kernel_schema,
        residuals=(_RESIDUAL,),
        output_differentiability=diff,
    )
    probe = _SavedProbe(qualname, kernel, forward)

    def fake(*args: Any) -> Any:
        user = op._user_fake
        if user is None:  # the Function's forward itself, on fake tensors
            try:
                return kernel(*args)
            except Exception as e:  # RuntimeError, or FakeTensor's warning made an error
                launch = raw_launch(e)
                if launch is None:
                    raise
                why = f"it launches the Triton kernel {launch.kernel} directly ({launch.at})"
                raise UnsupportedError(
                    MSG_NO_FAKE.format(
                        op=qualname, why=why, function=function.__name__,
                        args=", ".join(names), loc=where(forward),
                    )
                ) from e  # fmt: skip
        recipe, out_metas, res_metas = probe.run(args, _needs(args))
        got = user(*args)
        outs = got if isinstance(got, tuple) else (got,)
        if len(outs) != len(out_metas) or any(
            not isinstance(o, _Tensor)
            or not isinstance(m, tuple)
            or (tuple(o.shape), o.dtype, o.device.type) != (m[0], m[2], m[3].type)
            for o, m in zip(outs, out_metas)
        ):
            raise KernelOutputError(
                MSG_FAKE_MISMATCH.format(
                    op=qualname, got=_describe(outs), expected=_describe(out_metas),
                    loc=where(user),
                )
            )  # fmt: skip
        device = outs[0].device
        _stash.recipe = recipe
        return (*outs, [_fake_like(m, device) for m in res_metas])

    fake.__signature__ = kernel.__signature__  # type: ignore[attr-defined]
    fake.__wrapped__ = forward  # type: ignore[attr-defined]
    CustomOp.register_fake(op, fake)
    tensor_args = {a.name for a in op.signature.args if a.is_tensor}

    layouts = _Layouts()

    @op.register_save_for_backward
    def save_for_backward(inputs: Any, output: Any, residuals: Any) -> Any:
        recipe, _stash.recipe = _stash.recipe, None
        res = residuals.saved
        if recipe is None or recipe[2] != len(res):
            raise MissingRegistrationError(
                f"{qualname}: the op's kernel is not the Function's forward on this call (a "
                f"kernel registered with register_kernel replaced it?), so what forward saved "
                f"on ctx is unknown. An op made with from_function runs its Function's forward "
                f"as its kernel. (forward defined at {where(forward)})"
            )
        saved_places, attrs, _, seen = recipe
        real = _needs(inputs)
        if real != seen and attrs:
            attrs = attrs_as_if(inputs, real, attrs)
        outs = output if n_out > 1 else (output,)
        computed: list[tuple[int, int | None]] = []

        def found(p: Any, at: int, k: int | None) -> Any:
            if not isinstance(p, _Place):
                return p
            if _computed(p):
                computed.append((at, k))
            return _find(p, inputs, outs, res)

        # One tuple: the layout's number, the saved tensors, then each attribute as forward
        # set it (a container rebuilt here, so that the backward, which dynamo captures, reads
        # it as it is: customgrad's saving flattens it and rebuilds it before the backward).
        flat: list[Any] = [None]
        for p in saved_places:
            flat.append(found(p, len(flat), None))
        for spec, leaves in attrs.values():
            at = len(flat)
            if spec is None:
                flat.append(found(leaves[0], at, None))
            else:
                flat.append(
                    optree.tree_unflatten(spec, [found(v, at, k) for k, v in enumerate(leaves)])
                )
        flat[0] = layouts.number((len(saved_places), tuple(attrs), tuple(computed)))
        return tuple(flat)

    n_args = len(names)
    label = f"{function.__qualname__}.backward"
    # The function itself, called as a plain function: dynamo (which captures this backward
    # for the automatic split) takes ``Function.backward(...)`` for compiled autograd's call.
    user_backward = function.backward
    writes = _Writes(user_backward)

    def backward(ctx: Any, saved: Any, *grads: Any) -> dict[str, Any]:
        n_saved, names_of_attrs, computed = layouts.layout(saved[0])
        if computed and torch.is_grad_enabled():  # create_graph: see _guard_computed
            saved = _guard_computed(qualname, forward, saved, grads, computed)
        tensors = saved[1 : 1 + n_saved]
        attrs: dict[str, Any] = {}
        for attr, value in zip(names_of_attrs, saved[1 + n_saved :]):
            if isinstance(value, _ByReference):
                value = value.value
            elif isinstance(value, _LeafByReference):
                value = value.ref()
            attrs[attr] = value
        needs = tuple(n in tensor_args and ctx.needs_input_grad(n) for n in names)
        if calls.outputs:  # the Function's None outputs get None, as autograd gives them
            it = iter(grads)
            grads = tuple(None if k is None else next(it) for k in calls.outputs)
        result = writes.call(saved[0], tensors, attrs, grads, needs)
        got = result if isinstance(result, tuple) else (result,)
        extra = got[n_args:]
        if len(got) < n_args or any(g is not None for g in extra):
            raise GradientValueError(
                f"{qualname}: {label} returned {len(got)} gradient(s), but forward takes "
                f"{n_args} input(s) ({', '.join(names)}). Return one per input, in order (None "
                f"for inputs without a gradient). ({label} defined at {where(function.backward)})"
            )
        out: dict[str, Any] = {}
        for i, (arg, g) in enumerate(zip(names, got)):
            if arg in tensor_args:
                out[arg] = g
            elif g is not None:
                raise GradientTypeError(
                    f"{qualname}: {label} returned a gradient at position {i}, for {arg!r}, "
                    f"which is not a Tensor input. Return None there. ({label} defined at "
                    f"{where(function.backward)})"
                )
        return out

    backward.__signature__ = inspect.signature(backward)  # type: ignore[attr-defined]
    backward.__wrapped__ = function.backward  # type: ignore[attr-defined]  # for file:line
    op.register_backward(backward, differentiable=not _once_differentiable(function.backward))
    return op


# --------------------------------------------------------------------------------------------
# A Function without annotations: the schema from its first call


MSG_OUTPUTS_CHANGED = """\
{op}: the Function's forward returned {got}, but on the call that defined the op it returned \
{expected}. The op's outputs are fixed when it is defined. Wrap the Function once per way of \
calling it (cg.from_function(..., schema="(...) -> (Tensor, Tensor)") with the outputs it \
returns), or call it the same way. (forward defined at {loc})"""


def _output_kinds(outs: Sequence[object]) -> tuple[str | None, ...]:
    return tuple(
        None if o is None else "T" if isinstance(o, _Tensor) else type(o).__name__ for o in outs
    )


def _show(kinds: Sequence[str | None]) -> str:
    return (
        "(" + ", ".join("None" if k is None else "Tensor" if k == "T" else k for k in kinds) + ")"
    )


def _tensor_outputs(
    qualname: str,
    forward: Callable[..., object],
    outs: Sequence[object],
    expected: tuple[str | None, ...],
) -> tuple[object, ...]:
    """The tensor outputs among ``outs`` (the Function's ``None`` outputs dropped), checked
    against what the defining call returned."""
    got = _output_kinds(outs)
    if got != expected:
        raise KernelOutputError(
            MSG_OUTPUTS_CHANGED.format(
                op=qualname, got=_show(got), expected=_show(expected), loc=where(forward)
            )
        )
    return tuple(o for o in outs if o is not None)


_KINDS: dict[type, str] = {
    _Tensor: "Tensor", torch.nn.Parameter: "Tensor", type(None): "None", bool: "bool",
    int: "int", float: "float", str: "str",
}  # fmt: skip
"""The kind of the common argument types, by type (:func:`_kind` for the others)."""


def _kind(value: object) -> str:
    """The schema type a call's argument is read as."""
    if isinstance(value, _Tensor):
        return "Tensor"
    if value is None:
        return "None"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float, str)):
        return type(value).__name__
    if isinstance(value, torch.dtype):
        return "ScalarType"
    if isinstance(value, torch.device):
        return "Device"
    if isinstance(value, (list, tuple)) and value:
        kinds = {_kind(v) for v in value}
        if kinds == {"Tensor"} or kinds == {"int"} or kinds == {"float"} or kinds == {"bool"}:
            return f"{kinds.pop()}[]"
        if kinds == {"int", "float"}:
            return "float[]"
    return type(value).__qualname__


_ANNOTATIONS: dict[str, object] = {
    "Tensor": _Tensor, "bool": bool, "int": int, "float": float, "str": str,
    "ScalarType": torch.dtype, "Device": torch.device, "Tensor[]": list[_Tensor],
    "int[]": list[int], "float[]": list[float], "bool[]": list[bool],
}  # fmt: skip

_ACCEPTS: dict[str, set[str]] = {
    "Tensor": {"Tensor"},
    "Tensor?": {"Tensor", "None"},
    "float": {"float", "int"},
    "float[]": {"float[]", "int[]"},
}
"""For a schema type, the kinds of argument it takes (by default, its own)."""


def _accepts(schema_type: str, kind: str) -> bool:
    return kind in _ACCEPTS.get(schema_type, {schema_type})


def _infer_types(
    qualname: str, function: Any, params: list[inspect.Parameter], values: Sequence[object]
) -> list[str]:
    """One schema type per parameter, from the values of the first call: a tensor is
    ``Tensor``, ``None`` (or a tensor given for a parameter that defaults to None) ``Tensor?``,
    numbers, bools, strings and dtypes their type, a list of tensors ``Tensor[]``."""
    types: list[str] = []
    for p, v in zip(params, values):
        kind = _kind(v)
        if kind == "None" or (kind == "Tensor" and p.default is None):
            types.append("Tensor?")
        elif kind in _ANNOTATIONS:
            types.append(kind)
        else:
            raise DefinitionError(
                MSG_UNINFERABLE.format(
                    op=qualname, arg=p.name, got=f"{type(v).__module__}.{type(v).__qualname__}",
                    loc=where(function.forward),
                )
            )  # fmt: skip
    return types


MSG_UNINFERABLE = """\
{op}: cannot infer a schema type for argument {arg!r} from the value of the first call, a \
{got}: a customgrad op takes tensors (and lists and optional ones), numbers, bools, strings, \
dtypes and devices, and Python objects only as opaque objects registered with torch. Give the \
schema with the argument as one of these (cg.from_function(..., schema="(Tensor x, ...) -> \
Tensor")), registering the object's type as an opaque type as docs/examples/real-ops.md shows \
("Python objects as arguments"), or keep the Function out of from_function. (forward defined \
at {loc})"""

MSG_KIND_CHANGED = """\
{op}: argument {arg!r} got {got}, but the op's schema, inferred from the first call, says \
{expected} ({schema}). Give the schema that covers both calls: cg.from_function(..., \
schema="{suggested}"). (forward defined at {loc})"""


def _schema_text(
    params: list[inspect.Parameter], types: list[str], returns: int
) -> tuple[str, list[inspect.Parameter]]:
    """The schema (without the name) for ``types``, and the parameters annotated with them,
    defaults kept where torch's schema can write them (``float eps=1e-05``)."""
    annotated: list[inspect.Parameter] = []
    for p, t in zip(params, types):
        ann: Any = _ANNOTATIONS.get(t, typing.Optional[_Tensor])  # noqa: UP045
        default = p.default
        if default is not inspect.Parameter.empty and not _accepts(t, _kind(default)):
            default = inspect.Parameter.empty
        annotated.append(p.replace(annotation=ann, default=default))
    ret: Any = _Tensor if returns == 1 else tuple[(_Tensor,) * returns]  # type: ignore[misc]

    def prototype(*args: Any, **kwargs: Any) -> Any:  # only its signature is read
        return None

    for keep_defaults in (True, False):
        if not keep_defaults:  # a default torch cannot write (a tuple): left out
            annotated = [p.replace(default=inspect.Parameter.empty) for p in annotated]
        prototype.__signature__ = inspect.Signature(annotated, return_annotation=ret)  # type: ignore[attr-defined]
        try:
            return str(torch.library.infer_schema(prototype, mutates_args=())), annotated
        except (ValueError, TypeError):
            if not keep_defaults:
                raise
    raise AssertionError("unreachable")


class DeferredFunctionOp:
    """The op :func:`from_function` makes for a Function whose ``forward`` is not annotated:
    defined (registered with ``torch.library``) at its first call, with the schema read from
    that call's arguments, the outputs and ``output_differentiability`` from what the forward
    returned and marked. Called as ``Function.apply`` is: by position, with the forward's
    defaults. Later calls are checked against the schema.

    Attributes:
        op: the :class:`~customgrad.CustomOp`, ``None`` before the first call.
    """

    def __init__(
        self,
        function: type[torch.autograd.Function],
        name: str,
        params: list[inspect.Parameter],
        weights: Iterable[str],
        output_differentiability: Sequence[bool] | None,
    ) -> None:
        self.function = function
        self.name = name
        self._params = params
        self._signature = inspect.Signature(params)
        self._defaults = tuple(p.default for p in params)
        empty = inspect.Parameter.empty
        self._required = max((i + 1 for i, d in enumerate(self._defaults) if d is empty), default=0)
        self._weights = tuple(weights)
        self._diff = None if output_differentiability is None else tuple(output_differentiability)
        self._types: list[str] = []
        self._calls = _Calls()
        self._lock = threading.Lock()
        self.op: CustomOp[..., FunctionOutput] | None = None
        unknown = [w for w in self._weights if w not in {p.name for p in params}]
        if unknown:
            raise DefinitionError(
                f"{name}: weights names {unknown}, which {function.__qualname__}.forward does "
                f"not take (it takes {', '.join(p.name for p in params)}). (forward defined at "
                f"{where(function.forward)})"
            )

    def __repr__(self) -> str:
        state = "not called yet" if self.op is None else self.schema
        return f"<customgrad op {self.name} from {self.function.__qualname__}: {state}>"

    @property
    def schema(self) -> str | None:
        """The inferred schema (``None`` before the first call)."""
        return None if self.op is None else str(self.op.schema)

    def __call__(self, *args: object, **kwargs: object) -> FunctionOutput:
        n = len(args)
        if not kwargs and n >= self._required and n < len(self._params):
            args = (*args, *self._defaults[n:])  # positional, as Function.apply is called
        elif kwargs or n != len(self._params):
            try:
                bound = self._signature.bind(*args, **kwargs)
            except TypeError as e:
                raise TypeError(f"{self.name}: {e}") from None
            bound.apply_defaults()
            args = tuple(bound.arguments.values())
        values = args
        op = self.op
        if op is None:
            with self._lock:
                op = self.op if self.op is not None else self._define(values)
        else:
            self._check(values)
        result = op(*values)
        if self._calls.plain:
            return result
        outs = result if isinstance(result, tuple) else (result,)
        it = iter(outs)
        full = tuple(None if k is None else next(it) for k in self._calls.outputs)
        if not self._calls.single:
            return full
        assert full[0] is not None  # a single output is a Tensor (_define refuses None alone)
        return full[0]

    def _check(self, values: Sequence[object]) -> None:
        for p, t, v in zip(self._params, self._types, values):
            kind = _KINDS.get(type(v)) or _kind(v)
            if kind != t and not _accepts(t, kind):
                types = ["Tensor?" if x == t == "Tensor" else x for x in self._types]
                suggested = ", ".join(f"{x} {q.name}" for x, q in zip(types, self._params))
                schema = str(self.schema).split("(", 1)[1]
                raise UnsupportedError(
                    MSG_KIND_CHANGED.format(
                        op=self.name, arg=p.name, got=kind,
                        expected=t, schema="(" + schema,
                        suggested=f"({suggested}) -> " + schema.rsplit(" -> ", 1)[1],
                        loc=where(self.function.forward),
                    )
                )  # fmt: skip

    def _define(self, values: Sequence[object]) -> CustomOp[..., FunctionOutput]:
        """Infer the schema and the outputs from this call, define the op."""
        types = _infer_types(self.name, self.function, self._params, values)
        out, nondiff, cloned = self._probe(values)
        outs = out if isinstance(out, tuple) else (out,)
        kinds = _output_kinds(outs)
        bad = [k for k in kinds if k not in ("T", None)]
        if bad or not any(k == "T" for k in kinds):
            raise DefinitionError(
                f"{self.name}: {self.function.__qualname__}.forward returned "
                f"{', '.join(str(k) for k in kinds)}: a customgrad op returns tensors (None "
                f"outputs are kept as None). (forward defined at {where(self.function.forward)})"
            )
        tensors = [o for o in outs if o is not None]
        diff = self._diff
        if diff is not None:
            diff = tuple(d for d, k in zip(diff, kinds) if k is not None)
        else:
            marked = tuple(
                not any(o is m for m in nondiff) and (o.is_floating_point() or o.is_complex())
                for o in tensors
            )
            diff = None if all(marked) else marked
        public, annotated = _schema_text(self._params, types, len(tensors))
        calls = _Calls(kinds, not isinstance(out, tuple), cloned)
        op = _define(self.function, self.name, annotated, public, self._weights, diff, calls)
        self._types, self._calls = types, calls
        self.op = op
        return op

    def _probe(self, values: Sequence[object]) -> tuple[Any, list[Any], frozenset[int]]:
        """Run the forward once on copies of this call's tensors (no gradient recorded, no mode
        of the caller's seeing it: a FLOP counter counts the call itself, once): what it
        returns, what it marks non-differentiable, which arguments it writes and returns."""

        def copy(v: Any) -> Any:
            if isinstance(v, _Tensor):
                c = v.detach().clone()
                return c.requires_grad_(v.requires_grad) if v.is_floating_point() else c
            if isinstance(v, (list, tuple)) and any(isinstance(t, _Tensor) for t in v):
                return type(v)(copy(t) for t in v)
            return v

        function, forward = self.function, self.function.forward
        ctx = ForwardContext(_needs(values), self.name, forward)
        with torch.no_grad(), _disable_current_modes():
            copies = [copy(v) for v in values]
            if setup_context_defined(function):
                out = forward(*copies)
                function.setup_context(ctx, tuple(copies), out)
            else:
                out = forward(ctx, *copies)
        outs = out if isinstance(out, tuple) else (out,)
        cloned = frozenset(
            i
            for i, c in enumerate(copies)
            if isinstance(c, _Tensor)
            and any(isinstance(o, _Tensor) and _is_alias_of(o, c) for o in outs)
        )
        return out, list(ctx._cg_nondiff), cloned


# --------------------------------------------------------------------------------------------
# A whole library: every call of Function.apply reaches the op

FunctionOp = CustomOp[..., FunctionOutput] | DeferredFunctionOp
"""What :func:`from_function` makes: the op, or one defined at its first call."""

_OPS: dict[tuple[type[torch.autograd.Function], tuple[str, ...], str], FunctionOp] = {}
"""The op made for each (Function, weights, namespace): wrapping again reuses it (an op name
is registered with torch.library once per process)."""


def _functions_in(target: object) -> list[type[torch.autograd.Function]]:
    """The Functions ``target`` names: a Function class itself, or those a module (and its
    imported submodules) defines."""
    if isinstance(target, type) and issubclass(target, torch.autograd.Function):
        return [target]
    if isinstance(target, types.ModuleType):
        prefix = target.__name__
        found: dict[type[torch.autograd.Function], None] = {}
        modules = [
            m for n, m in sorted(sys.modules.items()) if n == prefix or n.startswith(prefix + ".")
        ]
        for module in modules:
            for value in vars(module).values():
                if (
                    isinstance(value, type)
                    and issubclass(value, torch.autograd.Function)
                    and value.__module__ == module.__name__
                    and "forward" in vars(value)
                ):
                    found[value] = None
        return list(found)
    raise DefinitionError(
        f"from_functions: needs torch.autograd.Function subclasses or modules, got {target!r}."
    )


class FunctionPatch:
    """Functions whose ``apply`` goes through their customgrad op (:func:`from_functions`):
    a context manager, or :meth:`restore` to undo.

    Attributes:
        ops: the op of each wrapped Function, by the Function's ``module.qualname``.
    """

    def __init__(
        self,
        patched: dict[type[torch.autograd.Function], object],
        ops: dict[str, FunctionOp],
    ) -> None:
        self._patched = patched
        self.ops = ops

    def __repr__(self) -> str:
        return f"<FunctionPatch of {', '.join(self.ops) or 'nothing'}>"

    def __enter__(self) -> FunctionPatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def restore(self) -> None:
        """Give each Function its own ``apply`` back (again: nothing)."""
        for function, original in self._patched.items():
            if original is None:
                if "apply" in vars(function):
                    delattr(function, "apply")
            else:
                function.apply = original  # type: ignore[method-assign,assignment]
        self._patched = {}


def _label(function: type) -> str:
    return f"{function.__module__}.{function.__qualname__}"


def _op_name(namespace: str, function: type) -> str:
    return f"{namespace}::" + re.sub(r"\W", "_", _label(function))


def from_functions(
    *functions: type[torch.autograd.Function] | types.ModuleType,
    weights: Mapping[type[torch.autograd.Function] | str, Iterable[str]] | None = None,
    namespace: str = "customgrad_fn",
) -> FunctionPatch:
    """Make every call of these Functions' ``apply`` go through a customgrad op, without editing
    the code that calls them (a library's modules, its own registry of Functions).

    Each Function is wrapped with :func:`from_function` (the schema read from its annotations,
    or from its first call) and its ``apply`` replaced by the op until :meth:`FunctionPatch.restore`
    or the end of the ``with`` block. Subclasses keep their own ``apply``.

    Args:
        *functions: ``torch.autograd.Function`` subclasses, or modules: the Functions each
            module and its imported submodules define.
        weights: for each Function (the class or its ``__name__``), the names of its forward's
            weight parameters; a Function left out has none (all its gradients go to I).
        namespace: the ``torch.library`` namespace of the ops, named ``namespace::module_Class``.

    Returns:
        A :class:`FunctionPatch`; its ``ops`` name every Function wrapped.

    Raises:
        DefinitionError: a key of ``weights`` names no Function wrapped, or a Function is
            already patched.

    Example:
        >>> import torch, customgrad as cg
        >>> class Scale(torch.autograd.Function):
        ...     @staticmethod
        ...     def forward(ctx, x, w):
        ...         ctx.save_for_backward(x, w)
        ...         return x * w
        ...     @staticmethod
        ...     def backward(ctx, grad):
        ...         x, w = ctx.saved_tensors
        ...         return grad * w, (grad * x).sum(0)
        >>> x, w = torch.ones(2, 3, requires_grad=True), torch.full((3,), 2.0, requires_grad=True)
        >>> with cg.from_functions(Scale, weights={Scale: ("w",)}, namespace="doc_fns") as patch:
        ...     Scale.apply(x, w).sum().backward()
        >>> list(patch.ops)
        ['customgrad._from_function.Scale']
        >>> w.grad
        tensor([2., 2., 2.])
    """
    found: dict[type[torch.autograd.Function], None] = {}
    for target in functions:
        found.update(dict.fromkeys(_functions_in(target)))
    by_key = dict(weights or {})
    unknown = [
        k for k in by_key if not any(k is f or k == f.__name__ or k == _label(f) for f in found)
    ]
    if unknown:
        raise DefinitionError(
            f"from_functions: weights names {[getattr(k, '__name__', k) for k in unknown]}, "
            f"which are not among the Functions wrapped "
            f"({', '.join(f.__name__ for f in found) or 'none'}). Pass their classes or "
            f"modules too, or check the names."
        )
    patched: dict[type[torch.autograd.Function], object] = {}
    ops: dict[str, FunctionOp] = {}
    for function in found:
        current = vars(function).get("apply")
        if isinstance(current, _PatchedApply):
            FunctionPatch(patched, {}).restore()  # undo this call's patches first
            raise DefinitionError(
                f"from_functions: {_label(function)} is already wrapped by another "
                f"from_functions; restore that one first (or leave its with block)."
            )
        w = tuple(
            next(
                (
                    v
                    for k, v in by_key.items()
                    if k is function or k in (function.__name__, _label(function))
                ),
                (),
            )
        )
        key = (function, w, namespace)
        op = _OPS.get(key)
        if op is None:
            op = _OPS[key] = from_function(function, _op_name(namespace, function), weights=w)
        patched[function] = current
        ops[_label(function)] = op
        function.apply = _PatchedApply(function, op, current)  # type: ignore[method-assign,assignment]
    return FunctionPatch(patched, ops)


class _PatchedApply:
    """``Function.apply`` while patched: the op for the Function itself, the Function's own
    ``apply`` for its subclasses."""

    def __init__(
        self, function: type[torch.autograd.Function], op: FunctionOp, original: _Descriptor | None
    ) -> None:
        self.function = function
        self.op = op
        self.original = original if original is not None else vars(torch.autograd.Function)["apply"]

    def __get__(self, instance: object, owner: type) -> object:
        if owner is self.function:
            return self.op
        return self.original.__get__(instance, owner)
