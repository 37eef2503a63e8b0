"""The shape of the code, read from its syntax: no import circle wider than 4 modules, no
function over 80 lines in the split engine, one module that keeps values between the passes."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "customgrad"

ENGINE = [
    "_runtime", "_handoff", "_traced_split", "_compiled_backward", "_compiled_region",
    "_split_program", "_partition", "_autograd", "_codegen", "_pass", "_record", "_routing",
    "_split_plan", "_saving", "_user_calls", "pipelining/_backward", "pipelining/_weight_pass",
    "pipelining/_split_state", "pipelining/_function_split", "pipelining/_queue",
    "pipelining/_streams", "pipelining/_tagging", "pipelining/_stage_io", "pipelining/_stage",
]  # fmt: skip
"""The split engine: the runtime, the store, the programs, the planner and the stage's passes."""


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Every customgrad module -> the customgrad modules it imports anywhere (at the top, in a
    function, under ``TYPE_CHECKING``): the type-level graph."""
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                found = [base, *(f"{base}.{a.name}" for a in node.names)]
            else:
                continue
            graph[name].update(m for m in found if m in modules and m != name)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of ``graph``, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                found.append(sorted(component))
    return found


def test_the_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert sorted(strongly_connected(graph)) == [["a", "b", "c"], ["d"]]


def test_no_import_circle_ties_more_than_four_modules() -> None:
    wide = [c for c in strongly_connected(import_graph()) if len(c) > 4]
    assert wide == [], f"modules that import each other in a circle: {wide}"


@pytest.mark.parametrize("module", ENGINE)
def test_no_function_of_the_split_engine_is_over_80_lines(module: str) -> None:
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    long = [
        (n.name, n.end_lineno - n.lineno + 1)
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        and n.end_lineno is not None
        and n.end_lineno - n.lineno + 1 > 80
    ]
    assert long == []


STORE = {"hand_over", "handed_over", "release", "check_pass", "checked"}
"""What keeps, fetches and frees values between the passes (the hand-off store's writers)."""


def test_only_the_runtime_keeps_fetches_and_frees_what_a_pass_keeps() -> None:
    users = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "customgrad._handoff":
                names = {a.name for a in node.names} & STORE
                if names:
                    users[_module(path)] = names
    # the runtime, and the compiled region's node checking versions before AOTAutograd
    # unpacks its saved tensors (its pre-hook runs before the backward reads anything)
    assert users == {
        "customgrad._runtime": {"hand_over", "handed_over", "release"},
        "customgrad._compiled_region": {"check_pass"},
    }
