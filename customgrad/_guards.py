"""When a traced backward may be reused: only for backwards proven to read nothing else.

A trace of a backward (:mod:`customgrad._autosplit`) runs the function once and keeps the aten
ops it dispatched: every Python value the function read is frozen into it. Earlier rounds
guarded what a backward reads with a walker that compared the values it found, and each hostile
round found Python features it missed (a tensor read as a number, an ``lru_cache``, an inherited
class attribute, ``getattr`` by name, a classmethod...). torch.compile's dynamo gets all of them
right, but its frame evaluation and guards cost several times a small backward per call
(``python -m benchmarks.trace_guard`` measures both). So the rule here is the conservative one:
a trace is reused only for a backward
**proven** to read nothing but

- its arguments (``ctx``, the saved values, the output gradients),
- immutable values (``None``, bools, numbers, strings, dtypes, devices, tuples of these) bound
  to globals, closure cells or defaults,
- library code: the modules ``torch``, ``math``, ``operator``, ``functools``, ``itertools``,
  ``typing``, ``einops``, ``customgrad`` (and their functions, ops and classes), a few builtins
  without state (``len``, ``range``, ``zip``, ``isinstance``, ``min``...),
- plain functions of the user's (no decorator, no closure over anything else) proven the same
  way, recursively,

and that writes no global or closure variable and calls none of torch's functions that read or
change process state (seeding, generators, ``torch.save``...). :class:`TraceGuard` proves it
once and then checks, per call, that every place it read (a global, a closure cell, a function's
code and defaults) still holds the same object; when one was rebound it proves again. Every
other backward is called as written (once per backward: the run-once rule of
:mod:`customgrad._codegen`), so what it reads is read when it runs, exactly as without customgrad.

Ambient state a trace depends on (autocast, deterministic algorithms, the default dtype and
device) is part of what selects a trace (:func:`ambient`).
"""

from __future__ import annotations

import builtins as _builtins
import dis
import enum
import types
from typing import Any

import torch

from customgrad._torch.dispatcher import (
    any_autocast_enabled,
    deterministic,
    deterministic_warn_only,
    function_stack_len,
)

__all__ = ["CONSTANTS", "Impure", "TraceGuard", "ambient"]

_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu", "privateuseone", "mtia", "maia")
# Plain values compared by value (floats apart: by their exact bits). A saved value of one of
# these kinds may be kept as a constant in a trace (customgrad._autosplit's signature).
CONSTANTS = (
    type(None),
    bool,
    int,
    complex,
    str,
    bytes,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    torch.Size,
)
_IMMUTABLE = (*CONSTANTS, float, range, slice, type(Ellipsis), type(NotImplemented))

LIBRARIES = frozenset(
    {"torch", "math", "operator", "functools", "itertools", "typing", "einops", "customgrad"}
)
"""Top-level modules whose code a traced backward may call: their functions are code, not state."""

SAFE_BUILTINS = frozenset(
    {
        "abs", "all", "any", "bool", "complex", "dict", "divmod", "enumerate", "filter",
        "float", "frozenset", "getattr", "hasattr", "int", "isinstance", "issubclass", "iter",
        "len", "list", "map", "max", "min", "next", "pow", "range", "reversed", "round", "set",
        "slice", "sorted", "str", "sum", "tuple", "type", "zip", "None", "True", "False",
        "ArithmeticError", "AssertionError", "Exception", "IndexError", "KeyError",
        "NotImplementedError", "RuntimeError", "TypeError", "ValueError", "NotImplemented",
        "Ellipsis",
    }
)  # fmt: skip
"""Builtins without state (``print``, ``id``, ``open``, ``setattr``... are not among them)."""

STATEFUL_NAMES = frozenset(
    {
        "Generator", "manual_seed", "seed", "initial_seed", "get_rng_state", "set_rng_state",
        "fork_rng", "save", "load", "set_default_dtype", "set_default_device",
        "set_printoptions", "use_deterministic_algorithms", "set_grad_enabled", "compile",
        "random", "environ",
    }
)  # fmt: skip
"""Names whose use (as any attribute or global) means a backward reads or changes process state
(seeds, generators, files, defaults): a trace would freeze it."""

_WRITES = frozenset({"STORE_GLOBAL", "DELETE_GLOBAL", "STORE_NAME", "DELETE_NAME"})
_UNBOUND: Any = object()

_any_autocast = any_autocast_enabled
_function_modes = function_stack_len
_deterministic = deterministic
_warn_only = deterministic_warn_only
_default_dtype: Any = torch.get_default_dtype


def ambient() -> Any:
    """The ambient state a trace depends on, as a hashable key (cheap: read per backward).

    The grad mode is not in it: a traced backward runs only without grad (a ``create_graph``
    backward calls the function as written).
    """
    det = _deterministic()
    plain = (det and (_warn_only() or 2), _default_dtype())  # warn-only matters only when on
    if not _any_autocast() and not _function_modes():
        return plain
    autocast: Any = None
    if _any_autocast():
        enabled = tuple(
            (d, torch.get_autocast_dtype(d))
            for d in _AUTOCAST_DEVICES
            if torch.is_autocast_enabled(d)
        )
        autocast = (enabled, torch.is_autocast_cache_enabled())
    # set_default_device works through a torch function mode
    device = torch.get_default_device() if _function_modes() else None
    return (plain, autocast, device)


class Impure(Exception):
    """A backward reads (or writes) something a trace would freeze: it is called as written.

    Attributes:
        what: what it reads, in words ("the global 'LOSS_SCALE' (a Tensor)").
    """

    def __init__(self, what: str) -> None:
        self.what = what
        super().__init__(what)


def _library(module_name: object) -> bool:
    return isinstance(module_name, str) and module_name.partition(".")[0] in LIBRARIES


def _describe(v: object) -> str:
    kind = type(v)
    if kind is types.ModuleType and v.__name__.partition(".")[0] == "triton":  # type: ignore[attr-defined]
        return (
            f"the module {v.__name__}: a Triton kernel launched raw, which a trace cannot see; "  # type: ignore[attr-defined]
            f"wrap the launch in an op with a fake kernel (torch.library.triton_op, or a "
            f"customgrad op) to split it"
        )
    if kind.__module__.partition(".")[0] == "triton":
        return (
            f"a Triton kernel ({kind.__qualname__}) launched raw, which a trace cannot see; wrap "
            f"the launch in an op with a fake kernel (torch.library.triton_op, or a customgrad "
            f"op) to split it"
        )
    if kind is types.ModuleType:
        return f"the module {v.__name__}"  # type: ignore[attr-defined]
    if isinstance(v, type):
        return f"the class {v.__qualname__}"
    return f"a {kind.__qualname__}"


class _Proof:
    """One proof that a function reads nothing but its arguments and immutable values, and the
    places it read (checked again per call by :class:`TraceGuard`)."""

    def __init__(self) -> None:
        self.places: list[tuple[dict[str, Any], str, Any]] = []
        self.functions: list[tuple[Any, Any, Any, Any]] = []
        self.cells: list[tuple[Any, Any]] = []
        self.seen: set[int] = set()
        # The values read, as a key: immutable values by value (floats by their exact bits),
        # functions by identity. A trace is selected by it (a global rebound to another number
        # traces again; rebound back, the first trace serves again).
        self.key: list[Any] = []

    def function(self, fn: Any, where: str) -> None:
        if id(fn) in self.seen:
            return
        self.seen.add(id(fn))
        self.key.append((id(fn), id(getattr(fn, "__code__", None))))
        if type(fn) is not types.FunctionType:
            raise Impure(f"{where} ({_describe(fn)}, not a plain function)")
        self.functions.append((fn, fn.__code__, fn.__defaults__, fn.__kwdefaults__))
        if _library(fn.__module__):
            wrapped = fn.__dict__.get("__wrapped__")
            self.places.append((fn.__dict__, "__wrapped__", wrapped))
            if wrapped is not None:  # customgrad's (or torch's) wrapper of a user function
                self.function(wrapped, where)
            return
        if "__wrapped__" in fn.__dict__:
            raise Impure(f"{where} (a decorated function: what its wrapper reads is unknown)")
        name = f"{fn.__qualname__}"
        self.code(fn, fn.__code__, name)
        for d in fn.__defaults__ or ():
            self.value(d, f"a default argument of {name}", fn.__code__.co_names)
        for k, d in (fn.__kwdefaults__ or {}).items():
            self.value(d, f"the default of {k!r} of {name}", fn.__code__.co_names)
        if fn.__closure__:
            for var, cell in zip(fn.__code__.co_freevars, fn.__closure__):
                try:
                    content = cell.cell_contents
                except ValueError:
                    raise Impure(f"the closure variable {var!r} of {name}, unbound") from None
                self.cells.append((cell, content))
                self.value(content, f"the closure variable {var!r} of {name}", _all_names(fn))

    def code(self, fn: Any, code: types.CodeType, name: str) -> None:
        """The globals ``code`` (and the code nested in it) reads, and the writes it makes."""
        scope = fn.__globals__
        table: Any = scope.get("__builtins__", _builtins.__dict__)
        if isinstance(table, types.ModuleType):
            table = table.__dict__
        stateful = STATEFUL_NAMES.intersection(code.co_names)
        if stateful:
            raise Impure(f"{', '.join(sorted(stateful))} in {name} (process state)")
        for ins in dis.get_instructions(code):
            op = ins.opname
            if op in _WRITES:
                raise Impure(f"a write to the global {ins.argval!r} in {name}")
            if op in ("STORE_ATTR", "DELETE_ATTR"):  # of a module's flag, a shared object...
                raise Impure(f"a write to an attribute ({ins.argval!r}) in {name}")
            if op == "STORE_DEREF" and ins.argval in code.co_freevars:
                raise Impure(f"a write to the closure variable {ins.argval!r} in {name}")
            if op == "IMPORT_NAME" and not _library(ins.argval):
                raise Impure(f"an import of {ins.argval} in {name}")
            if op not in ("LOAD_GLOBAL", "LOAD_NAME"):
                continue
            g = ins.argval
            if g in scope:
                value = scope[g]
                self.places.append((scope, g, value))
                self.value(value, f"the global {g!r} of {name}", _all_names(fn))
            else:
                self.places.append((scope, g, _UNBOUND))
                if g not in SAFE_BUILTINS or g not in table:
                    raise Impure(f"the builtin {g!r} in {name}")
                self.places.append((table, g, table[g]))
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                self.code(fn, const, name)

    def value(self, v: Any, where: str, names: tuple[str, ...] = (), depth: int = 0) -> None:
        """Prove ``v`` (read by code that names the attributes ``names``) immutable, or code."""
        kind = type(v)
        if kind in _IMMUTABLE:
            self.key.append((kind, v.hex() if kind is float else v))
            return
        if kind is tuple or kind is frozenset:
            if depth > 8 or len(v) > 64:
                raise Impure(f"{where} (a {kind.__name__} too large to prove immutable)")
            self.key.append((kind, len(v)))
            for item in sorted(v, key=repr) if kind is frozenset else v:
                self.value(item, where, names, depth + 1)
            return
        self.key.append(id(v))  # code: by identity
        if kind is types.ModuleType:
            if not _library(v.__name__):
                raise Impure(f"{where} ({_describe(v)})")
            return
        if kind is types.FunctionType:
            self.function(v, where)
            return
        module = getattr(v, "__module__", None)
        if isinstance(v, type):
            if v is torch.Generator:
                raise Impure(f"{where} ({_describe(v)})")
            if _library(module) or v.__module__ == "builtins" or _plain_record(v, names):
                return
            raise Impure(f"{where} ({_describe(v)})")
        if isinstance(v, types.BuiltinFunctionType):
            owner = getattr(v, "__self__", None)
            if isinstance(owner, types.ModuleType):
                if owner.__name__ != "builtins" and _library(owner.__name__):
                    return
            elif _library(module) or _library(getattr(owner, "__module__", None)):
                return
        elif type(v).__module__.partition(".")[0] in ("torch", "customgrad") and not isinstance(
            v, (torch.Tensor, torch.nn.Module, torch.Generator)
        ):
            return  # torch's ops and op namespaces, a customgrad op: code, not state
        raise Impure(f"{where} ({_describe(v)})")


_NAMEDTUPLE_API = frozenset({"_replace", "_asdict", "_make", "_fields", "count", "index"})


def _all_names(fn: Any) -> tuple[str, ...]:
    """The attribute and global names ``fn``'s code (nested code included) uses."""
    names: list[str] = []
    stack = [fn.__code__]
    while stack:
        code = stack.pop()
        names.extend(code.co_names)
        stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return tuple(names)


def _plain_record(cls: type, names: tuple[str, ...]) -> bool:
    """Whether a user class is a record whose use a trace may freeze: a namedtuple or an enum
    class, of which the code names no attribute but its fields or members (``isinstance``,
    construction, field reads). Any other class (class attributes, inherited ones, class
    methods, properties, descriptors...) can change in place."""
    if issubclass(cls, tuple) and isinstance(getattr(cls, "_fields", None), tuple):
        allowed = frozenset(cls._fields) | _NAMEDTUPLE_API  # type: ignore[attr-defined]
    elif issubclass(cls, enum.Enum):
        allowed = frozenset(cls.__members__)
    else:
        return False
    for n in set(names) - allowed:
        if any(n in vars(c) for c in cls.__mro__ if c is not object and c is not tuple):
            return False
    return True


class TraceGuard:
    """Whether a backward may be traced and its trace reused, checked per call.

    :meth:`check` proves the function reads nothing but its arguments and immutable values (see
    the module's docstring), then, at later calls, only that every place it read still holds
    the same object (about 0.1 us per place).

    Args:
        fn: the backward (customgrad's wrappers of a user's function are seen through).
    """

    __slots__ = ("_fn", "_last", "_proofs")

    def __init__(self, fn: Any) -> None:
        self._fn = fn
        # Every proof whose key may select a trace, kept alive: the ids in a key are never
        # reused by other objects while a trace selected by them exists.
        self._proofs: list[_Proof] = []
        # The last proof, why it failed (the refusal's arguments; None: it held) and its key.
        # Not the exception itself: raised again, its traceback would grow by each call's
        # frames, keeping every step's tensors alive.
        self._last: tuple[_Proof, tuple[Any, ...] | None, tuple[Any, ...]] | None = None

    def check(self) -> tuple[Any, ...]:
        """The values the function reads (a key that selects its trace), once it is proven to
        read nothing but its arguments, immutable values and code.

        Raises:
            Impure: it reads something else (or writes a global).
        """
        last = self._last
        if last is not None and _unchanged(last[0]):
            if last[1] is not None:
                raise Impure(*last[1])
            return last[2]
        proof = _Proof()
        try:
            proof.function(self._fn, "the backward")
        except Impure as e:
            # its places up to the impure read: proved again on a change
            self._last = (proof, e.args, ())
            raise
        key = tuple(proof.key)
        self._last = (proof, None, key)
        if len(self._proofs) >= 256:
            raise Impure("what it reads, rebound more than 256 times")
        self._proofs.append(proof)
        return key


def _unchanged(proof: _Proof) -> bool:
    for namespace, name, obj in proof.places:
        if namespace.get(name, _UNBOUND) is not obj:
            return False
    for f, code, defaults, kwdefaults in proof.functions:
        if f.__code__ is not code or f.__defaults__ is not defaults:
            return False
        if f.__kwdefaults__ is not kwdefaults:
            return False
    for cell, obj in proof.cells:
        try:
            if cell.cell_contents is not obj:
                return False
        except ValueError:
            return False
    return True
