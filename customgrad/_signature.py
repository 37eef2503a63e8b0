"""What customgrad needs to know about an op's arguments and outputs, read off its schema."""

from __future__ import annotations

import collections
import enum
import inspect
import keyword
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from customgrad._errors import ArgumentTypeError, DefinitionError, where

__all__ = ["ArgKind", "ArgSpec", "Signature", "parse_name", "RESERVED_NAMESPACES"]

RESERVED_NAMESPACES = frozenset({"aten", "at", "prim", "prims", "torch", "pytorch", "c10", "_"})


class ArgKind(enum.Enum):
    """How an argument takes part in autograd."""

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


def _arg_kind(t: Any) -> ArgKind:
    s = str(t)
    if s == "Tensor":
        return ArgKind.TENSOR
    if s == "Optional[Tensor]":
        return ArgKind.OPTIONAL_TENSOR
    if s in ("List[Tensor]", "List[Optional[Tensor]]"):
        return ArgKind.TENSOR_LIST
    return ArgKind.OTHER


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


class Signature:
    """Arguments and outputs of an op, plus the flattening used to pass them to autograd.

    Args:
        qualname: ``"ns::name"``.
        schema: the schema string without the name, from ``torch.library.infer_schema``.
        fn: the user's function, for defaults and error locations.
        weights: names of weight arguments.
        output_differentiability: one bool per output, or None for all differentiable.
    """

    def __init__(
        self,
        qualname: str,
        schema: str,
        fn: Callable[..., Any],
        weights: tuple[str, ...],
        output_differentiability: tuple[bool, ...] | None,
    ) -> None:
        parsed = torch._C.parse_schema("_cg_probe" + schema)
        self.qualname = qualname
        self.schema = schema
        self.args: tuple[ArgSpec, ...] = tuple(
            ArgSpec(a.name, _arg_kind(a.type), bool(a.kwarg_only), str(a.type))
            for a in parsed.arguments
        )
        self.names: tuple[str, ...] = tuple(a.name for a in self.args)
        self.nargs = len(self.names)
        self.index: dict[str, int] = {a.name: i for i, a in enumerate(self.args)}
        self.num_positional = sum(1 for a in self.args if not a.kwarg_only)
        self.kwonly_names: tuple[str, ...] = tuple(a.name for a in self.args if a.kwarg_only)
        self.has_lists = any(a.kind is ArgKind.TENSOR_LIST for a in self.args)
        self.inputs_type = collections.namedtuple("Inputs", self.names)  # type: ignore[misc]
        self.pysig = inspect.signature(fn)

        self.output_kinds: tuple[ArgKind, ...] = tuple(_arg_kind(r.type) for r in parsed.returns)
        self.output_is_tuple = len(parsed.returns) != 1
        for r, kind in zip(parsed.returns, self.output_kinds):
            if kind not in (ArgKind.TENSOR, ArgKind.TENSOR_LIST):
                raise DefinitionError(
                    f"{qualname}: output of type {r.type} is not supported; outputs must be "
                    f"Tensor, list[Tensor] or a tuple of those (function defined at {where(fn)})."
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
        self.flat_slots: dict[str, tuple[int, int | None]] = {
            a.name: (i, None) for i, a in enumerate(self.args)
        }

        n_out = len(self.output_kinds)
        if output_differentiability is not None and len(output_differentiability) != n_out:
            raise DefinitionError(
                f"{qualname}: output_differentiability has {len(output_differentiability)} "
                f"entries but the op has {n_out} output(s). Give one bool per output."
            )
        self.output_differentiability = output_differentiability
        self.plain_output = (
            not self.output_is_tuple
            and self.output_kinds[0] is ArgKind.TENSOR
            and (output_differentiability is None or output_differentiability[0])
        )
        """One differentiable Tensor output: the autograd node returns it as it is."""
        self.flat_node = (
            not self.has_lists
            and not self.output_is_tuple
            and (self.output_kinds[0] is ArgKind.TENSOR)
        )
        """The autograd node's inputs are the arguments and its output is the op's one Tensor."""
        self.backward_plans: dict[int, Any] = {}
        """Per-pass backward plans of ops without list arguments, cached by ``_autograd``."""

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """Return all arguments positionally, in schema order, with defaults filled in."""
        try:
            bound = self.pysig.bind(*args, **kwargs)
        except TypeError as e:
            raise ArgumentTypeError(f"{self.qualname}: {e}. The op takes {self.schema}.") from None
        bound.apply_defaults()
        return tuple(bound.arguments[n] for n in self.names)

    def call(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        """Call ``fn`` (an OpOverload or kernel) with schema-ordered ``args``."""
        if not self.kwonly_names:
            return fn(*args)
        npos = self.num_positional
        return fn(*args[:npos], **dict(zip(self.kwonly_names, args[npos:])))

    def normalize(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """Schema-ordered arguments from what the dispatcher passes to a Python kernel."""
        if not kwargs and len(args) == len(self.names):
            return args
        return self.bind(args, kwargs)
