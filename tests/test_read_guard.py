"""``ReadGuard``: what a traced backward reads from Python state, walked again only when a place
it read was rebound. After every change a hostile user can make, its key equals a fresh walk's
(``reads``), so a trace is never reused where the backward would read something else."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch

from customgrad._guards import ReadGuard, Unguarded, reads


def _module(name: str, source: str) -> types.ModuleType:
    """A user module (not library code: its functions and attributes are guarded)."""
    module = types.ModuleType(name)
    module.__file__ = f"/nonexistent/{name}.py"
    sys.modules[name] = module
    exec(source, module.__dict__)
    return module


SOURCE = """
import torch

SCALE = 2.0
LIMITS = (1, 2)

class Knobs:
    factor = 3

def helper(g):
    return g * SCALE

def make(bias):
    def backward(ctx, saved, g, k=1, *, j=2):
        out = helper(g) * Knobs.factor + bias + abs(k) + j + LIMITS[0]
        return {"x": torch.mul(out, 1)}
    return backward
"""


def _changes(m: types.ModuleType, fn: Any) -> list[tuple[str, Callable[[], None]]]:
    """Every kind of place the backward reads from, changed one at a time."""

    def rebind_cell() -> None:
        fn.__closure__[0].cell_contents = 5.0

    def new_code() -> None:
        def other(ctx: Any, saved: Any, g: Any, k: int = 1, *, j: int = 2) -> Any:
            return {"x": g}

        fn.__code__ = other.__code__.replace(co_freevars=fn.__code__.co_freevars)

    return [
        ("a global rebound to an equal value", lambda: setattr(m, "SCALE", float("2.0"))),
        ("a global rebound", lambda: setattr(m, "SCALE", 4.0)),
        ("a global tuple rebound", lambda: setattr(m, "LIMITS", (3, 4))),
        ("a class attribute changed", lambda: setattr(m.Knobs, "factor", 7)),
        ("a closure cell rebound", rebind_cell),
        ("defaults replaced", lambda: setattr(fn, "__defaults__", (9,))),
        ("keyword defaults replaced", lambda: setattr(fn, "__kwdefaults__", {"j": 8})),
        ("a helper's code replaced", lambda: setattr(m.helper, "__code__", (lambda g: g).__code__)),
        ("a helper rebound", lambda: setattr(m, "helper", lambda g: g * 3)),
        ("a builtin shadowed by a global", lambda: setattr(m, "abs", lambda v: v)),
        ("__wrapped__ set", lambda: setattr(fn, "__wrapped__", m.helper)),
        ("the function's code replaced", new_code),
        ("its module renamed", lambda: setattr(fn, "__module__", "torch.fake")),
    ]


@pytest.mark.parametrize("step", range(13))
def test_key_equals_a_fresh_walk_after_each_change(step: int) -> None:
    m = _module(f"cg_read_guard_{step}", SOURCE)
    fn = m.make(0.5)
    guard = ReadGuard(fn, "")
    first = guard.key()
    assert first == reads(fn)
    assert guard.key() is first  # nothing changed: the recorded key, without a walk
    changes = _changes(m, fn)
    assert len(changes) == 13
    what, change = changes[step]
    change()
    assert guard.key() == reads(fn), what
    if what != "a global rebound to an equal value":
        assert reads(fn) != first, f"{what} should change what the backward reads"


def test_a_list_dict_or_tensor_read_is_compared_at_every_call() -> None:
    m = _module("cg_read_guard_list", "SIZES = [1, 2]\nCONFIG = {'mode': 'a'}\nW = None\n"
                "def bwd(c, s, g):\n    return {'x': g * SIZES[0] * W * len(CONFIG['mode'])}\n")  # fmt: skip
    m.W = torch.ones(2)
    guard = ReadGuard(m.bwd, "")
    first = guard.key()
    m.SIZES.append(3)  # in place: no place was rebound
    assert guard.key() == reads(m.bwd) != first
    second = guard.key()
    m.CONFIG["mode"] = "b"
    assert guard.key() == reads(m.bwd) != second
    third = guard.key()
    m.W.requires_grad_(True)  # tensor metadata changed in place
    assert guard.key() == reads(m.bwd) != third


def test_an_unguarded_read_still_raises_each_time() -> None:
    m = _module("cg_read_guard_object", "def bwd(c, s, g):\n    return {'x': g * MODEL.w}\n")
    m.MODEL = torch.nn.Linear(2, 2)
    guard = ReadGuard(m.bwd, "")
    for _ in range(2):
        with pytest.raises(Unguarded, match="a Linear object"):
            guard.key()
