"""No bare `Any` at a module boundary of customgrad's core (issue 33): the signatures of
module-level public functions, the public methods (and dunders) of module-level classes, and
class attribute annotations name a concrete type, a union, a Protocol or a TypeVar, never `Any`.
`customgrad/_torch/` is outside the core: its adapters face torch's untyped internals and may
keep `Any`. An alias of `Any` (`Value = Any`, `Table = dict[str, Any]`) counts as `Any`, and so
do `typing.Any` and `Any` inside a quoted annotation."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import customgrad

PACKAGE = Path(customgrad.__file__).parent


def _public(name: str) -> bool:
    return not name.startswith("_") or (name.startswith("__") and name.endswith("__"))


def _any_aliases(tree: ast.Module) -> set[str]:
    """The module-level names that stand for a type mentioning Any (`X = Any`,
    `X: TypeAlias = dict[str, Any]`, `type X = ...`), found to a fixed point so an alias of an
    alias counts too."""
    assigned: dict[str, ast.expr] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name) and not isinstance(node.value, ast.Constant):
                assigned[target.id] = node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
            assigned[node.target.id] = node.value
        elif isinstance(node, getattr(ast, "TypeAlias", ())):  # `type X = ...`, Python 3.12
            assigned[node.name.id] = node.value
    aliases: set[str] = set()
    while True:
        found = {n for n, v in assigned.items() if n not in aliases and _mentions(v, aliases)}
        if not found:
            return aliases
        aliases |= found


def _mentions(annotation: ast.expr | None, aliases: set[str]) -> int:
    """How many times `annotation` names Any (or an alias of it); a `Literal`'s values are
    values, not types."""
    if annotation is None:
        return 0
    node = annotation
    if isinstance(node, ast.Name):
        return int(node.id == "Any" or node.id in aliases)
    if isinstance(node, ast.Attribute):
        return int(node.attr == "Any")
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            return _mentions(ast.parse(node.value, mode="eval").body, aliases)
        except SyntaxError:
            return 0  # a string that is no type
    if isinstance(node, ast.Subscript) and ast.unparse(node.value).split(".")[-1] == "Literal":
        return 0
    return sum(
        _mentions(child, aliases)
        for child in ast.iter_child_nodes(node)
        if isinstance(child, ast.expr)
    )


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef, aliases: set[str]) -> int:
    a = node.args
    params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *(v for v in (a.vararg, a.kwarg) if v)]
    return sum(_mentions(p.annotation, aliases) for p in params) + _mentions(node.returns, aliases)


def bare_any(source: str) -> list[str]:
    """Where `source` names Any at its boundary, one `name:line` a use."""
    tree = ast.parse(source)
    aliases = _any_aliases(tree)
    found: list[str] = []

    def record(name: str, line: int, count: int) -> None:
        found.extend([f"{name}:{line}"] * count)

    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and _public(node.name):
            record(node.name, node.lineno, _signature(node, aliases))
        elif isinstance(node, ast.ClassDef):
            for member in node.body:
                if isinstance(member, ast.FunctionDef | ast.AsyncFunctionDef):
                    if _public(member.name):
                        name = f"{node.name}.{member.name}"
                        record(name, member.lineno, _signature(member, aliases))
                elif isinstance(member, ast.AnnAssign):
                    target = ast.unparse(member.target)
                    name = f"{node.name}.{target}"
                    record(name, member.lineno, _mentions(member.annotation, aliases))
    return found


# The user's own values, typed by the user: ``ctx.shared`` is what the op's
# ``register_backward_shared`` returned (as torch's ``ctx.saved_tensors`` holds what the user saved);
# typed ``object``, every backward would need a cast to read its own value.
USER_VALUES: dict[str, set[str]] = {"_rules.py": {"BackwardContext.shared"}}


def core_modules() -> list[str]:
    """Every module of customgrad outside `_torch/`, as a path relative to the package."""
    paths = sorted(PACKAGE.rglob("*.py"))
    return [p.relative_to(PACKAGE).as_posix() for p in paths if "_torch" not in p.parts]


def test_the_core_has_no_bare_any_at_its_module_boundaries() -> None:
    found = {}
    for module in core_modules():
        allowed = USER_VALUES.get(module, set())
        uses = [
            u for u in bare_any((PACKAGE / module).read_text()) if u.split(":")[0] not in allowed
        ]
        if uses:
            found[module] = uses
    assert found == {}


def test_each_user_value_kept_as_any_is_still_there() -> None:
    for module, names in USER_VALUES.items():
        uses = {u.split(":")[0] for u in bare_any((PACKAGE / module).read_text())}
        assert names <= uses, f"{module}: no longer Any, remove from USER_VALUES: {names - uses}"


def test_the_core_excludes_only_the_torch_adapters() -> None:
    modules = core_modules()
    assert "_op.py" in modules
    assert "pipelining/_stage.py" in modules
    assert not any(m.startswith("_torch/") for m in modules)


SOURCE = """
import typing
from typing import Any, TypeAlias

Value = Any
Table: TypeAlias = dict[str, Value]

def f(x: Any, *args: int, **kwargs: Any) -> list[Any]: ...
def g(x: "Any") -> typing.Any: ...
def h(x: Table) -> Value: ...
def _private(x: Any) -> Any: ...
def typed(x: int, y: object) -> Literal["Any"]: ...

class C:
    field: dict[str, Any]
    count: int
    def method(self, x: Any) -> None: ...
    def __call__(self) -> Any: ...
    def _helper(self, x: Any) -> Any: ...
"""


@pytest.mark.parametrize(
    ("where", "count"),
    [
        ("f:8", 3),
        ("g:9", 2),
        ("h:10", 2),
        ("C.field:15", 1),
        ("C.method:17", 1),
        ("C.__call__:18", 1),
    ],
)
def test_bare_any_finds_each_use(where: str, count: int) -> None:
    assert bare_any(SOURCE).count(where) == count


def test_bare_any_skips_private_names_and_typed_signatures() -> None:
    assert len(bare_any(SOURCE)) == 10
    assert not any(w.split(":")[0] in ("_private", "typed", "C._helper") for w in bare_any(SOURCE))
