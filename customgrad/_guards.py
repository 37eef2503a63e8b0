"""What a traced backward depends on besides its arguments: ambient state and what it reads.

A trace of a backward (:mod:`customgrad._autosplit`) runs the function once and keeps the aten
ops it dispatched: every Python value the function read is frozen into it. A trace may only be
reused where reading those values again would give the same. So what selects a trace is, besides
the tensors' metadata and the plain values it is called with:

- ambient state (:func:`ambient`): autocast (enabled and dtype, per device type), deterministic
  algorithms, the default dtype and device;
- the values the function reads from its closure, its defaults and its module's globals, and
  the same for each function of the user's it calls (:func:`reads`). Plain values and containers
  of them (dict, list, tuple, set) are compared by value, so changing an entry of a config dict
  traces again; tensors by identity and metadata; functions, classes and modules by identity,
  with the attributes the code names read from user modules and classes. Anything else (an
  object whose state a trace would freeze: an ``nn.Module``, a user object) makes the backward
  unsplittable: it is called per pass instead.

Modules of torch, customgrad and Python's standard library count as code: their attributes are
not guarded (``torch.backends`` flags, ``os.environ``, ``random``), so a backward must not branch
on them in Python.
"""

from __future__ import annotations

import dataclasses
import dis
import enum
import functools
import inspect
import os
import sys
import sysconfig
import types
from typing import Any

import torch

__all__ = [
    "MAX_ITEMS",
    "ReadGuard",
    "Unguarded",
    "ambient",
    "package_of",
    "reads",
    "reads_nothing",
]

MAX_ITEMS = 64
"""The most items a container read by a backward may hold to be compared by value."""

_TRUSTED_ROOTS = frozenset(sys.stdlib_module_names) | {
    "torch",
    "customgrad",
    "functorch",
    "numpy",
    "optree",
    "triton",
    "einops",
    "typing_extensions",
}
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
_VALUES = (*CONSTANTS, range, slice)
_CODE = (
    types.BuiltinFunctionType,
    types.MethodDescriptorType,
    types.WrapperDescriptorType,
    types.MethodWrapperType,
    types.ClassMethodDescriptorType,
    types.GetSetDescriptorType,
    torch._ops.OpOverload,
    torch._ops.OpOverloadPacket,
    torch._ops._OpNamespace,
    torch._ops.HigherOrderOperator,
)
_any_autocast: Any = torch._C._is_any_autocast_enabled
_function_modes: Any = torch._C._len_torch_function_stack
_deterministic: Any = torch._C._get_deterministic_algorithms
_warn_only: Any = torch._C._get_deterministic_algorithms_warn_only
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


class Unguarded(Exception):
    """The backward reads a value whose state a trace would freeze.

    Attributes:
        what: the value, in words ("a Linear object").
        where: where it is read ("the closure variable 'model' of make.<locals>.backward").
    """

    def __init__(self, what: str, where: tuple[str, ...]) -> None:
        self.what = what
        self.where = _where(where)
        super().__init__(what, self.where)


def _where(parts: tuple[str, ...]) -> str:
    kind, name, owner, *attrs = parts
    named = f" {'.'.join((name, *attrs))}" if name else ""
    return f"{kind}{named}" + (f" of {owner}" if owner else "")


_NAMES: dict[int, tuple[types.CodeType, tuple[str, ...], frozenset[str]]] = {}


def _names(code: types.CodeType) -> tuple[tuple[str, ...], frozenset[str]]:
    """The global names ``code`` loads and the attribute names it uses (nested code included),
    cached by identity (hashing a code object hashes its constants)."""
    found = _NAMES.get(id(code))
    if found is not None and found[0] is code:
        return found[1], found[2]
    names = _read_names(code)
    _NAMES[id(code)] = (code, *names)
    return names


def _read_names(code: types.CodeType) -> tuple[tuple[str, ...], frozenset[str]]:
    globals_: set[str] = set()
    attrs: set[str] = set(code.co_names)
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME") and isinstance(ins.argval, str):
            globals_.add(ins.argval)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            inner_globals, inner_attrs = _names(const)
            globals_.update(inner_globals)
            attrs |= inner_attrs
    return tuple(sorted(globals_)), frozenset(attrs)


_LIBRARY_DIRS = tuple(
    {
        os.path.join(os.path.realpath(p), "")
        for k in ("stdlib", "platstdlib", "purelib", "platlib")
        if (p := sysconfig.get_paths().get(k))
    }
)


@functools.lru_cache(maxsize=1024)
def _trusted(module_name: Any) -> bool:
    """Whether a module is library code (torch, customgrad, the standard library, installed
    packages), whose functions and attributes are not guarded: only the user's are."""
    if not isinstance(module_name, str):
        return False
    if module_name.partition(".")[0] in _TRUSTED_ROOTS:
        return True
    module = sys.modules.get(module_name)
    file = getattr(module, "__file__", None)
    return isinstance(file, str) and os.path.realpath(file).startswith(_LIBRARY_DIRS)


_FUNCTIONS = (types.FunctionType, types.MethodType, functools.partial, staticmethod, classmethod)


class _Walk:
    """One walk over what a function reads: builds the key, or raises :class:`Unguarded`."""

    def __init__(self, own: str) -> None:
        self.key: list[Any] = []
        self.seen: set[int] = set()
        self.own = own  # the backward's own package: walked even where it is installed
        # Where each value was read and what was there (see ReadGuard); ``stable``: every value
        # in the key is fixed by the identity of the objects read (nothing mutable by value).
        self.found: list[tuple[Any, str, Any]] = []
        self.functions: list[tuple[Any, Any, Any, Any, Any]] = []
        self.cells: list[tuple[Any, Any]] = []
        self.stable = True

    def trusted(self, module_name: Any) -> bool:
        if not _trusted(module_name):
            return False
        root = module_name.partition(".")[0]
        return root != self.own or root in _TRUSTED_ROOTS

    def function(self, fn: Any, where: tuple[str, ...]) -> None:
        """Guard what ``fn`` (a function, a method, a partial) reads."""
        if id(fn) in self.seen:
            return
        self.seen.add(id(fn))
        self.key.append(id(fn))
        kind = type(fn)
        if kind is types.MethodType:
            self.function(fn.__func__, where)
            self.value(fn.__self__, where, frozenset())
            return
        if kind is functools.partial:
            self.stable = False  # its arguments can be replaced (__setstate__)
            self.function(fn.func, where)
            for a in (*fn.args, *fn.keywords.values()):
                self.value(a, where, frozenset())
            return
        if kind is staticmethod or kind is classmethod:
            self.function(fn.__func__, where)
            return
        if kind is not types.FunctionType:
            if isinstance(fn, (_CODE, type)) or (
                self.trusted(getattr(kind, "__module__", None))
                and not isinstance(fn, torch.nn.Module)
            ):
                return  # a builtin, a class, an op: code
            raise Unguarded(f"a {kind.__qualname__} object", where)  # a callable object
        self.functions.append((fn, fn.__code__, fn.__defaults__, fn.__kwdefaults__, fn.__module__))
        self.found.append((fn.__dict__, "__wrapped__", fn.__dict__.get("__wrapped__", _UNBOUND)))
        wrapped = getattr(fn, "__wrapped__", None)
        if wrapped is not None:
            self.function(wrapped, where)
        if self.trusted(fn.__module__):
            return  # library code (a wrapper of torch's or customgrad's: its target is walked)
        code = fn.__code__
        globals_, attrs = _names(code)
        scope = fn.__globals__
        builtins: Any = scope.get("__builtins__", {})
        if isinstance(builtins, types.ModuleType):
            builtins = builtins.__dict__
        name = fn.__qualname__
        key = self.key
        found = self.found
        for g in globals_:
            if g in scope:
                found.append((scope, g, scope[g]))
                self.value(scope[g], ("the global", g, name), attrs)
            else:
                found.append((scope, g, _UNBOUND))
                if g not in builtins:
                    key.append(g)  # unbound now: defining it later must trace again
        if fn.__closure__:
            for var, cell in zip(code.co_freevars, fn.__closure__):
                try:
                    content = cell.cell_contents
                except ValueError:
                    self.cells.append((cell, _UNBOUND))
                    key.append(var)
                    continue
                self.cells.append((cell, content))
                self.value(content, ("the closure variable", var, name), attrs)
        for d in fn.__defaults__ or ():
            self.value(d, ("a default argument", "", name), attrs)
        for k, d in (fn.__kwdefaults__ or {}).items():
            self.value(d, ("the default of", k, name), attrs)

    def value(self, v: Any, where: tuple[str, ...], attrs: frozenset[str], depth: int = 0) -> None:
        """Guard the value ``v`` read by code that names the attributes ``attrs``."""
        kind = type(v)
        key = self.key
        if kind in _VALUES:
            key.append((kind, v))
        elif kind is float:
            key.append((float, v.hex()))  # exact, and nan equals nan
        elif kind in _FUNCTIONS:
            self.function(v, where)
        elif kind is types.ModuleType:
            key.append(id(v))
            if not self.trusted(v.__name__):
                self._namespace(v, where, attrs, depth)
        elif isinstance(v, type):
            key.append(id(v))
            if not self.trusted(v.__module__):
                self._namespace(v, where, attrs, depth)
        elif kind in (tuple, list, dict, set, frozenset) or (
            isinstance(v, tuple) and hasattr(kind, "_fields")  # a namedtuple
        ):
            if depth > 8 or len(v) > MAX_ITEMS:
                raise Unguarded(f"a {kind.__name__} of {len(v)} items (or nested deeper)", where)
            if kind in (list, dict, set):
                self.stable = False  # compared by value: read again at every call
            key.append((kind, len(v)))
            if kind is dict:
                for k, item in v.items():
                    self.value(k, where, attrs, depth + 1)
                    self.value(item, where, attrs, depth + 1)
            else:
                for item in sorted(v, key=repr) if kind in (set, frozenset) else v:
                    self.value(item, where, attrs, depth + 1)
        elif isinstance(v, torch.Tensor):
            if kind is not torch.Tensor and kind is not torch.nn.Parameter:
                raise Unguarded(f"a {kind.__qualname__} (a tensor subclass)", where)
            # A trace keeps the tensor itself (and so its identity for as long as it lives) and
            # sees its values as they are when it runs.
            self.stable = False  # its metadata can change in place
            key.append((id(v), v.shape, v.stride(), v.dtype, v.device, v.requires_grad))
        elif isinstance(v, enum.Enum):
            key.append((kind, v.name))
        elif dataclasses.is_dataclass(v):  # a config object: its fields, by value
            self.stable = False
            key.append(kind)
            for field in dataclasses.fields(v):
                self.value(getattr(v, field.name), (*where, field.name), attrs, depth + 1)
        elif isinstance(v, _CODE):
            key.append(id(v))
        elif isinstance(v, property):
            self.function(v.fget, where)
        elif _trusted(kind.__module__) and callable(v) and not isinstance(v, torch.nn.Module):
            key.append(id(v))  # library callables (torch's ops, customgrad's): code, not state
        elif hasattr(kind, "__get__"):
            key.append(id(v))  # a descriptor of a class (a field's getter): code
        else:
            raise Unguarded(f"a {kind.__qualname__} object", where)

    def _namespace(self, v: Any, where: tuple[str, ...], attrs: frozenset[str], depth: int) -> None:
        """Guard what the code may read from a user module or class: the attributes it names."""
        if depth > 8:
            raise Unguarded(f"{v!r} (nested too deep)", where)
        namespace = v.__dict__
        for a in sorted(attrs):
            self.found.append((namespace, a, namespace.get(a, _UNBOUND)))
            if a in namespace:
                self.value(namespace[a], (*where, a), attrs, depth + 1)


def package_of(fn: Any) -> str:
    """The top-level package of the user's function ``fn`` (behind customgrad's wrappers)."""
    own = getattr(inspect.unwrap(fn), "__module__", None)
    return own.partition(".")[0] if isinstance(own, str) else ""


def reads_nothing(fn: Any) -> types.CodeType | None:
    """The code of ``fn`` if, as long as it runs that code without defaults, it reads nothing
    from Python state (no closure, no global but builtins): the common lambda."""
    if type(fn) is not types.FunctionType or fn.__closure__ or hasattr(fn, "__wrapped__"):
        return None
    if fn.__defaults__ is not None or fn.__kwdefaults__ is not None:
        return None
    code = fn.__code__
    scope = fn.__globals__
    builtins: Any = scope.get("__builtins__", {})
    if isinstance(builtins, types.ModuleType):
        builtins = builtins.__dict__
    if any(g in scope or g not in builtins for g in _names(code)[0]):
        return None
    return code


_UNBOUND: Any = object()


class ReadGuard:
    """:func:`reads` of one function, walked again only when something it read was rebound.

    A walk records where it read each value (a global, a closure cell, a function's code,
    defaults and module, a user module's or class's attribute) and the object it found there.
    When the key holds nothing compared by value that can change in place (no list, dict, set,
    dataclass or tensor), it is fixed by those objects' identity: a later call checks that each
    place still holds the same object and walks again only if one does not. Otherwise every call
    walks.
    """

    __slots__ = ("_fn", "_last", "_own")

    def __init__(self, fn: Any, own: str = "") -> None:
        self._fn = fn
        self._own = own
        self._last: Any = None  # (found, functions, cells, key) of the last stable walk

    def key(self) -> Any:
        """``reads(fn, own)``.

        Raises:
            Unguarded: it reads an object whose state a trace would freeze.
        """
        last = self._last
        if last is not None:
            found, functions, cells, key = last
            for namespace, name, obj in found:
                if namespace.get(name, _UNBOUND) is not obj:
                    break
            else:
                for f, code, defaults, kwdefaults, module in functions:
                    if (
                        f.__code__ is not code
                        or f.__defaults__ is not defaults
                        or f.__kwdefaults__ is not kwdefaults
                        or f.__module__ is not module
                    ):
                        break
                else:
                    for cell, obj in cells:
                        try:
                            if cell.cell_contents is not obj:
                                break
                        except ValueError:
                            if obj is not _UNBOUND:
                                break
                    else:
                        return key
        walk = _walk(self._fn, self._own)
        key = tuple(walk.key)
        self._last = (walk.found, walk.functions, walk.cells, key) if walk.stable else None
        return key


def _walk(fn: Any, own: str) -> _Walk:
    walk = _Walk(own)
    try:
        walk.function(fn, ("the backward", "", ""))
    except RuntimeError as e:  # a dict or list changed size while it was read (another thread)
        raise Unguarded(f"state that changed while it was read ({e})", ("", "", "")) from None
    return walk


def reads(fn: Any, own: str = "") -> Any:
    """A hashable key of everything ``fn`` reads from Python state (closures, defaults, globals,
    recursively through the user's functions it calls). ``own``: its package
    (:func:`package_of`), whose functions are walked even where it is installed.

    Raises:
        Unguarded: it reads an object whose state a trace would freeze.
    """
    return tuple(_walk(fn, own).key)
