"""What customgrad needs to know about an op's arguments and outputs, read off its schema."""

from __future__ import annotations

import collections
import enum
import inspect
import keyword
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NoReturn, TypeVar

import torch

from customgrad._errors import ArgumentTypeError, DefinitionError, KernelOutputError, where
from customgrad._torch.dispatcher import parse_schema

_R = TypeVar("_R")

__all__ = [
    "RESERVED_NAMESPACES",
    "ArgKind",
    "ArgSpec",
    "Signature",
    "make_schema",
    "parse_name",
    "record_type",
]

RESERVED_NAMESPACES = frozenset({"aten", "at", "prim", "prims", "torch", "pytorch", "c10", "_"})


class ArgKind(enum.Enum):
    """How an argument (or output) takes part in autograd."""

    TENSOR = "Tensor"
    OPTIONAL_TENSOR = "Tensor?"
    TENSOR_LIST = "Tensor[]"
    OTHER = "other"


@dataclass(frozen=True)
class ArgSpec:
    """One argument of the op, as its schema declares it."""

    name: str
    kind: ArgKind
    kwarg_only: bool
    type_str: str

    @property
    def is_tensor(self) -> bool:
        return self.kind is not ArgKind.OTHER


def _arg_kind(t: object) -> ArgKind:
    s = str(t)
    if s == "Tensor":
        return ArgKind.TENSOR
    if s == "Optional[Tensor]":
        return ArgKind.OPTIONAL_TENSOR
    if s in ("List[Tensor]", "List[Optional[Tensor]]"):
        return ArgKind.TENSOR_LIST
    return ArgKind.OTHER


# Non-tensor schema types a Tensor may stand for (torch converts 0-dim tensors to Scalars).
_TENSOR_OK = frozenset({"Scalar", "number", "Any"})


MSG_UNSUPPORTED_ANNOTATION = """\
{qualname}: cannot infer the op's schema from the annotations of the function defined at \
{loc}: {detail}. Annotate each argument with a type torch.library understands (Tensor, \
Tensor | None, list[Tensor], int, float, bool, str, list[int], torch.dtype, ...), or give the \
schema yourself: cg.op(..., schema="(Tensor x, int[2] window=[-1, -1]) -> Tensor"). A Python \
object the kernel and the backward read (a quantization state, a config) is passed as an opaque \
object: register its class with torch first, then annotate with it:

    from torch._opaque_base import OpaqueBase    # its base (torch 2.11 requires it)

    @dataclasses.dataclass(frozen=True)          # a value: compared, hashed, baked into graphs
    class QuantState(OpaqueBase):
        blocksize: int
        def __fx_repr__(self):
            return f"QuantState({{self.blocksize}})", {{"QuantState": QuantState}}

    torch._library.opaque_object.register_opaque_type(QuantState, typ="value")

    @cg.op("mylib::dequant_linear", weights=("weight",))
    def dequant_linear(x: Tensor, weight: Tensor, state: QuantState) -> Tensor: ..."""


def parse_name(name: object) -> tuple[str, str]:
    """Split ``"ns::name"`` into its parts, raising :class:`DefinitionError` when invalid."""
    fix = 'Name ops "namespace::name", e.g. "mylib::linear", with identifiers on both sides.'
    if not isinstance(name, str) or name.count("::") != 1:
        raise DefinitionError(f"customgrad.op: invalid op name {name!r}. {fix}")
    ns, opname = name.split("::")
    for part in (ns, opname):
        if not part.isidentifier() or keyword.iskeyword(part):
            raise DefinitionError(f"customgrad.op: invalid op name {name!r}. {fix}")
    if ns in RESERVED_NAMESPACES or ns.startswith("_"):
        reserved = ", ".join(sorted(RESERVED_NAMESPACES))
        raise DefinitionError(
            f"customgrad.op: {name!r} uses the reserved namespace {ns!r} ({reserved} and names "
            f"starting with '_' belong to PyTorch). Use your library's own namespace, "
            f'e.g. "mylib::{opname}".'
        )
    return ns, opname


_Field: type = type(vars(collections.namedtuple("_Probe", "field"))["field"])
"""The descriptor of a namedtuple's field (CPython's ``_tuplegetter``)."""


def record_type(typename: str, names: Sequence[str]) -> type[tuple[object, ...]]:
    """A tuple type with one read-only attribute per name, a namedtuple in all but its checks.

    Unlike ``collections.namedtuple`` it takes any argument name torch.library takes
    (``_input``, ``count``, ...). Its fields are a namedtuple's own descriptors, so dynamo
    (which captures a backward reading ``inputs.weight``) reads them as a namedtuple's.

    Example:
        >>> Inputs = record_type("Inputs", ["x", "_input"])
        >>> inputs = Inputs._make([1, 2])
        >>> inputs.x, inputs._input, inputs
        (1, 2, Inputs(x=1, _input=2))
    """
    fields = tuple(names)

    def __repr__(self: tuple[object, ...]) -> str:
        inner = ", ".join(f"{n}={v!r}" for n, v in zip(fields, self))
        return f"{typename}({inner})"

    def _asdict(self: tuple[object, ...]) -> dict[str, object]:
        return dict(zip(fields, self))

    def _make(cls: type[tuple[object, ...]], iterable: Iterable[object]) -> tuple[object, ...]:
        return tuple.__new__(cls, iterable)

    def __new__(cls: type[tuple[object, ...]], *values: object) -> tuple[object, ...]:
        if len(values) != len(fields):
            raise TypeError(f"{typename} takes {len(fields)} values, got {len(values)}")
        return tuple.__new__(cls, values)

    def _replace(self: tuple[object, ...], **changes: object) -> tuple[object, ...]:
        values = [changes.pop(n, v) for n, v in zip(fields, self)]
        if changes:
            raise ValueError(f"{typename} has no fields {sorted(changes)}")
        return tuple.__new__(type(self), values)

    def __getnewargs__(self: tuple[object, ...]) -> tuple[object, ...]:
        return tuple(self)

    namespace: dict[str, object] = {
        "__slots__": (),
        "__new__": __new__,
        "__doc__": f"{typename}({', '.join(fields)})",
        "__repr__": __repr__,
        "_asdict": _asdict,
        "_make": classmethod(_make),
        "_replace": _replace,
        "_fields": fields,
        "__match_args__": fields,
        "_field_defaults": {},
        "__getnewargs__": __getnewargs__,
    }
    for i, n in enumerate(fields):
        namespace[n] = _Field(i, f"{n!r}")
    return type(typename, (tuple,), namespace)


def _split_returns(schema: str) -> tuple[str, list[str]]:
    """``"(Tensor x) -> (Tensor, Tensor[])"`` → ``("(Tensor x)", ["Tensor", "Tensor[]"])``."""
    args, _, ret = schema.rpartition(" -> ")
    ret = ret.strip()
    if ret.startswith("(") and ret.endswith(")"):
        inner = ret[1:-1].strip()
        parts = [p.strip() for p in inner.split(",")] if inner else []
    else:
        parts = [ret]
    return args, parts


def _join_returns(parts: Sequence[str]) -> str:
    return parts[0] if len(parts) == 1 else f"({', '.join(parts)})"


def make_schema(
    qualname: str,
    fn: Callable[..., object],
    schema: str | None,
    mutates: tuple[str, ...],
) -> str:
    """The kernel's schema (arguments and every return, residuals included), without the name.

    Inferred from ``fn``'s annotations with ``torch.library.infer_schema``, or ``schema`` as
    given, checked against ``fn``'s parameters.
    """
    try:
        pysig = inspect.signature(fn)
    except (TypeError, ValueError):
        raise DefinitionError(
            f"{qualname}: cannot read the signature of {fn!r} (a builtin or C function). "
            f"customgrad.op needs a Python function with type annotations as the kernel; wrap "
            f"it: def kernel(x: torch.Tensor) -> torch.Tensor: return {where(fn)}(x)"
        ) from None
    if schema is None:
        try:
            return str(torch.library.infer_schema(fn, mutates_args=mutates))
        except (ValueError, TypeError) as e:
            detail = str(e).split(" The valid types are")[0].removeprefix("infer_schema(func): ")
            raise DefinitionError(
                MSG_UNSUPPORTED_ANNOTATION.format(
                    qualname=qualname, loc=where(fn), detail=detail.rstrip(".")
                )
            ) from None
    if not isinstance(schema, str) or " -> " not in schema or not schema.startswith("("):
        raise DefinitionError(
            f'{qualname}: schema={schema!r} is not a schema string. Give it like "(Tensor x, '
            f'int[2] window=[-1, -1]) -> Tensor", without the op name.'
        )
    try:
        parsed = parse_schema("_cg_probe" + schema)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0].removesuffix(" here:")
        raise DefinitionError(
            f"{qualname}: torch cannot parse schema={schema!r}: {first}. Write it as torch "
            f'schemas are written, e.g. "(Tensor x, int[2] window=[-1, -1], float? scale=None) '
            f'-> (Tensor, Tensor?)", without the op name.'
        ) from None
    params = [
        p
        for p in pysig.parameters.values()
        if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    names = [a.name for a in parsed.arguments]
    if [p.name for p in params] != names or len(params) != len(pysig.parameters):
        raise DefinitionError(
            f"{qualname}: schema={schema!r} names the arguments {names}, but the kernel defined "
            f"at {where(fn)} takes {list(pysig.parameters)}. Give the schema the kernel's "
            f"parameters, in order."
        )
    for p, a in zip(params, parsed.arguments):
        in_kernel = p.kind is inspect.Parameter.KEYWORD_ONLY
        if in_kernel != bool(a.kwarg_only):
            first, second = ("kernel", "schema") if in_kernel else ("schema", "kernel")
            raise DefinitionError(
                f"{qualname}: argument {p.name!r} is keyword-only in the {first} but not in the "
                f"{second}. Put '*' before it in both, or in neither (kernel defined at "
                f"{where(fn)})."
            )
        if (
            p.default is not inspect.Parameter.empty
            and a.has_default_value()
            and not _same_default(p.default, a.default_value, str(a.type))
        ):
            raise DefinitionError(
                MSG_DEFAULT_DIFFERS.format(
                    qualname=qualname,
                    arg=p.name,
                    kernel=p.default,
                    schema_default=a.default_value,
                    loc=where(fn),
                )
            )
    return schema


MSG_DEFAULT_DIFFERS = (
    "{qualname}: argument {arg!r} defaults to {kernel!r} in the kernel defined at {loc}, but to "
    "{schema_default!r} in schema=: a call through the op would use one and torch.ops or a "
    "compiled call the other. Give both the same default."
)

_ENUM_TYPES = ("ScalarType", "Layout", "MemoryFormat", "Device")


def _same_default(kernel: object, schema: object, type_str: str) -> bool:
    """Whether a kernel's Python default and a schema's default are the same value."""
    if any(t in type_str for t in _ENUM_TYPES) and schema is not None:
        return True  # the schema gives enums as numbers: compared by torch's own binding
    if isinstance(kernel, (list, tuple)):
        items = list(schema) if isinstance(schema, (list, tuple)) else [schema] * len(kernel)
        return len(items) == len(kernel) and all(
            _same_default(k, v, "") for k, v in zip(kernel, items)
        )
    if kernel is None or schema is None:
        return kernel is schema
    if isinstance(kernel, bool) or isinstance(schema, bool):
        return type(kernel) is type(schema) and kernel == schema
    return bool(kernel == schema)


class Signature:
    """Arguments and outputs of an op, plus the flattening used to pass them to autograd.

    Args:
        qualname: ``"ns::name"``.
        kernel_schema: the kernel's schema string without the name (returns include residuals).
        fn: the user's function, for defaults and error locations.
        weights: names of weight arguments.
        residuals: names of the kernel's last returns that only ``save_for_backward`` sees.
        output_differentiability: one bool per (public) output, or None for all
            differentiable.
    """

    def __init__(
        self,
        qualname: str,
        kernel_schema: str,
        fn: Callable[..., object],
        weights: tuple[str, ...],
        residuals: tuple[str, ...] = (),
        output_differentiability: tuple[bool, ...] | None = None,
    ) -> None:
        parsed = parse_schema("_cg_probe" + kernel_schema)
        self.qualname = qualname
        self.fn = fn
        self.args: tuple[ArgSpec, ...] = tuple(
            ArgSpec(a.name, _arg_kind(a.type), bool(a.kwarg_only), str(a.type))
            for a in parsed.arguments
        )
        self.names: tuple[str, ...] = tuple(a.name for a in self.args)
        self.nargs = len(self.names)
        self.kinds: tuple[ArgKind, ...] = tuple(a.kind for a in self.args)
        self.index: dict[str, int] = {a.name: i for i, a in enumerate(self.args)}
        self.num_positional = sum(1 for a in self.args if not a.kwarg_only)
        self.kwonly_names: tuple[str, ...] = tuple(a.name for a in self.args if a.kwarg_only)
        self.has_lists = ArgKind.TENSOR_LIST in self.kinds
        self.inputs_type = record_type("Inputs", self.names)
        self.pysig = inspect.signature(fn)

        # Returns: the public outputs, then the residuals.
        arg_part, return_parts = _split_returns(kernel_schema)
        kinds = tuple(_arg_kind(r.type) for r in parsed.returns)
        n_res = len(residuals)
        if n_res and not all(isinstance(r, str) and r.isidentifier() for r in residuals):
            raise DefinitionError(
                f"{qualname}: residuals={residuals!r}: give the residuals names (identifiers), "
                f'e.g. residuals=("rstd",), one per value the kernel returns after its outputs '
                f"(function defined at {where(fn)})."
            )
        if n_res and len(set(residuals)) != n_res:
            twice = next(r for r in residuals if residuals.count(r) > 1)
            raise DefinitionError(
                f"{qualname}: residuals={residuals!r} names {twice!r} twice. Give each residual "
                f"its own name (function defined at {where(fn)})."
            )
        if n_res and len(kinds) - n_res < 1:
            raise DefinitionError(
                f"{qualname}: residuals={residuals!r} names {n_res} residual(s), but the kernel "
                f"returns {len(kinds)} value(s) ({kernel_schema.rpartition(' -> ')[2]}). The "
                f"kernel returns its outputs, then the residuals: annotate it "
                f"-> tuple[Tensor, Tensor] for one output and one residual (function defined "
                f"at {where(fn)})."
            )
        self.kernel_schema = kernel_schema
        self.schema = f"{arg_part} -> {_join_returns(return_parts[: len(kinds) - n_res])}"
        self.residual_names: tuple[str, ...] = residuals
        self.residual_kinds = kinds[len(kinds) - n_res :]
        self.residuals_type = record_type("Residuals", residuals) if n_res else None
        self.n_kernel_outputs = len(kinds)
        self.kernel_output_is_tuple = len(kinds) != 1
        self.output_kinds: tuple[ArgKind, ...] = kinds[: len(kinds) - n_res]
        self.output_is_tuple = len(self.output_kinds) != 1
        for r, kind in zip(parsed.returns, kinds):
            if kind is ArgKind.OTHER:
                raise DefinitionError(
                    f"{qualname}: a return of type {r.type} is not supported; outputs and "
                    f"residuals must be Tensor, list[Tensor] (or Tensor? given with schema=), "
                    f"or a tuple of those (function defined at {where(fn)})."
                )

        bad = [w for w in weights if w not in self.index]
        if bad:
            raise DefinitionError(
                f"{qualname}: weights={weights!r} names {bad[0]!r}, which is not an argument of "
                f"the op. Arguments: {', '.join(self.names)}. Name only Tensor arguments in "
                f"weights (function defined at {where(fn)})."
            )
        non_tensor = [w for w in weights if not self.args[self.index[w]].is_tensor]
        if non_tensor:
            arg = self.args[self.index[non_tensor[0]]]
            raise DefinitionError(
                f"{qualname}: weights names {arg.name!r}, which is a {arg.type_str}, not a Tensor "
                f"argument. Only Tensor, Optional[Tensor] and list[Tensor] arguments can be "
                f"weights (function defined at {where(fn)})."
            )
        if len(set(weights)) != len(weights):
            raise DefinitionError(f"{qualname}: weights={weights!r} names an argument twice.")
        self.weights = weights
        self.weight_set = frozenset(weights)
        self.tensor_names = tuple(a.name for a in self.args if a.is_tensor)
        self.input_names = tuple(n for n in self.tensor_names if n not in self.weight_set)
        self.tensor_set = frozenset(self.tensor_names)
        self.input_set = frozenset(self.input_names)

        n_out = len(self.output_kinds)
        if output_differentiability is not None and len(output_differentiability) != n_out:
            raise DefinitionError(
                f"{qualname}: output_differentiability has {len(output_differentiability)} "
                f"entries but the op has {n_out} output(s). Give one bool per output."
            )
        self.output_differentiability = output_differentiability
        self.plain_output = (
            n_out == 1
            and self.output_kinds[0] is ArgKind.TENSOR
            and (output_differentiability is None or output_differentiability[0])
        )
        """One differentiable Tensor output: the autograd node returns it as it is."""
        self.simple = not self.has_lists and self.plain_output and not n_res and len(kinds) == 1
        """No list argument, no residual, one differentiable Tensor output: the node's inputs
        are the arguments and its output the kernel's (the node's forward reads this)."""
        self.tensors_only = all(
            k is ArgKind.TENSOR or k is ArgKind.OPTIONAL_TENSOR for k in self.kinds
        )
        """Every argument a Tensor or an Optional Tensor (the call's checks read this)."""
        self.required_tensors = tuple(i for i, k in enumerate(self.kinds) if k is ArgKind.TENSOR)
        """The positions of the Tensor arguments that are not Optional."""

    # -- arguments -----------------------------------------------------------------------------
    def bind(self, args: tuple[object, ...], kwargs: Mapping[str, object]) -> tuple[object, ...]:
        """Return all arguments positionally, in schema order, with defaults filled in."""
        try:
            bound = self.pysig.bind(*args, **kwargs)
        except TypeError as e:
            raise ArgumentTypeError(
                f"{self.qualname}: {e}. The op takes {self.schema}"
                + (
                    f"; pass {', '.join(repr(n) for n in self.kwonly_names)} by keyword."
                    if self.kwonly_names
                    else "."
                )
            ) from None
        bound.apply_defaults()
        return tuple(bound.arguments[n] for n in self.names)

    def call(self, fn: Callable[..., _R], args: tuple[object, ...]) -> _R:
        """Call ``fn`` (an OpOverload or kernel) with schema-ordered ``args``."""
        if not self.kwonly_names:
            return fn(*args)
        npos = self.num_positional
        return fn(*args[:npos], **dict(zip(self.kwonly_names, args[npos:])))

    def normalize(
        self, args: tuple[object, ...], kwargs: Mapping[str, object]
    ) -> tuple[object, ...]:
        """Schema-ordered arguments from what the dispatcher passes to a Python kernel."""
        if not kwargs and len(args) == self.nargs:
            return args
        return self.bind(args, kwargs)

    def check_args(self, args: tuple[object, ...]) -> None:
        """Raise :class:`ArgumentTypeError` naming the first argument of the wrong kind.

        Tensor arguments take a Tensor (``Optional`` ones also None), list arguments a list or
        tuple of Tensors, and other arguments anything but a Tensor (torch would fail later,
        in the kernel or the dispatcher, without naming the argument).
        """
        for spec, a in zip(self.args, args):
            kind = spec.kind
            if kind is ArgKind.TENSOR:
                ok = isinstance(a, torch.Tensor)
                want = "a Tensor"
            elif kind is ArgKind.OPTIONAL_TENSOR:
                ok = a is None or isinstance(a, torch.Tensor)
                want = "a Tensor or None"
            elif kind is ArgKind.TENSOR_LIST:
                optional = "Optional" in spec.type_str
                ok = isinstance(a, (list, tuple)) and all(
                    isinstance(t, torch.Tensor) or (optional and t is None) for t in a
                )
                want = "a list of Tensors" + (" (or None)" if optional else "")
            else:
                ok = not isinstance(a, torch.Tensor) or spec.type_str in _TENSOR_OK
                want = f"a {spec.type_str}, not a Tensor"
                if not ok and isinstance(a, torch.Tensor) and a.requires_grad:
                    want += " (customgrad differentiates Tensor arguments only)"
            if not ok:
                raise ArgumentTypeError(
                    f"{self.qualname}: argument {spec.name!r} must be {want}, but got "
                    f"{_describe(a)}. The op takes {self.schema}. (op defined at {where(self.fn)})"
                )

    # -- outputs -------------------------------------------------------------------------------
    def split_outputs(
        self, out: object, args: tuple[object, ...]
    ) -> tuple[object, tuple[object, ...]]:
        """Check what the kernel returned; return ``(outputs as the op returns them, residuals)``.

        Raises:
            KernelOutputError: the kernel returned the wrong number or kind of values.
        """
        n = self.n_kernel_outputs
        if n == 0:
            if out is not None:
                self._bad_output(out, "None (the op has no outputs)")
            return None, ()
        if self.kernel_output_is_tuple:
            if not isinstance(out, (tuple, list)) or len(out) != n:
                self._bad_output(out, f"a tuple of {n} values")
            outs = tuple(out)
        else:
            outs = (out,)
        for i, (kind, o) in enumerate(zip((*self.output_kinds, *self.residual_kinds), outs)):
            if kind is ArgKind.TENSOR:
                ok = isinstance(o, torch.Tensor)
            elif kind is ArgKind.OPTIONAL_TENSOR:
                ok = o is None or isinstance(o, torch.Tensor)
            else:
                ok = isinstance(o, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in o)
            if not ok:
                what = self._return_label(i)
                self._bad_output(o, f"{kind.value} as {what}")
        n_out = len(self.output_kinds)
        public = outs[0] if n_out == 1 else tuple(outs[:n_out])
        return public, outs[n_out:]

    def _return_label(self, i: int) -> str:
        n_out = len(self.output_kinds)
        if i < n_out:
            return f"output {i}" if self.output_is_tuple else "its output"
        return f"residual {self.residual_names[i - n_out]!r}"

    def _bad_output(self, got: object, want: str) -> NoReturn:
        raise KernelOutputError(
            f"{self.qualname}: the kernel returned {_describe(got)}, but the schema "
            f"({self.kernel_schema}) asks for {want}. Return what the annotations say (kernel "
            f"defined at {where(self.fn)})."
        )


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        grad = ", requires grad" if value.requires_grad else ""
        return f"a Tensor of shape {tuple(value.shape)}{grad}"
    if value is None:
        return "None"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)} items"
    return f"a {type(value).__module__}.{type(value).__qualname__}".replace("builtins.", "")
