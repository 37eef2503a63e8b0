"""What deciding "may this capture be reused?" costs per backward, against the backward itself.

Run: ``.venv/bin/python -m benchmarks.trace_guard``.

customgrad's automatic split captures a single backward with dynamo and reuses the capture for a
node only while dynamo's guards hold (``customgrad._autosplit``): per node, it calls the guard
manager dynamo keeps for the captured code (C++, ``customgrad._torch.dynamo.guard_check``) with
the backward's arguments, plus customgrad's own checks (exact bits of floats read, modules'
attributes). This script times, per call, on the same small backward (a linear's two matmuls on
8x16 by 16x16 tensors, reading a global float and a torch function):

- the backward called directly (the anchor),
- customgrad's check of one capture (``Capture.holds``: dynamo's guard manager and customgrad's
  checks), and dynamo's guard manager alone,
- the same backward through ``torch.compile(fullgraph=True)`` with a backend that runs dynamo's
  graph as it is (what running through the compiled frame would cost instead),
- ``AutoSplitter.select`` as a node's first backward calls it (signature, ambient state, check),
- the check in place: forward + a pass that splits (``autograd.grad`` of ``x`` alone: the input
  pass) with the check, less the same with the check skipped (the first check after a forward
  runs cold, slower than a repeated one). A full backward (``.backward()``) calls the function
  as written and checks nothing: only passes that split select a capture,

as CPU time of this process, the minimum over rounds, with one thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

import customgrad as cg
from customgrad._autosplit import AutoSplitter
from customgrad._capture import Capture
from customgrad._rules import BackwardContext

ROUNDS = 7
CALLS = 3000
SCALE = 1.0


def backward(ctx: Any, saved: Any, g: torch.Tensor) -> dict[str, torch.Tensor]:
    x, w = saved
    return {"x": torch.matmul(g, w) * SCALE, "weight": g.mT @ x}


def per_call(fn: Callable[[], Any]) -> float:
    for _ in range(200):
        fn()
    best = float("inf")
    for _ in range(ROUNDS):
        start = time.process_time()
        for _ in range(CALLS):
            fn()
        best = min(best, (time.process_time() - start) / CALLS)
    return best * 1e6


def main() -> None:
    torch.set_num_threads(1)

    @cg.op("bench_trace_guard::linear", weights=("weight",))
    def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x @ weight.mT

    linear.register_save_for_backward(lambda i, o: (i.x, i.weight))
    linear.register_backward(backward)
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)
    g = torch.randn(8, 16)
    # the first pass that splits captures it (a full backward calls the function as written)
    torch.autograd.grad(linear(x, w), (x,), g)
    auto = linear.rules.auto
    assert isinstance(auto, AutoSplitter)
    ((capture,),) = [entry.captures for entry in auto._cache.values()]
    saved = (x, w)  # as the engine hands them: the inputs themselves
    requires = frozenset({"x", "weight"})
    ctx = BackwardContext(linear, "full", requires)
    frame = {"ctx": ctx, "saved": saved, "grads": (g,)}
    check = capture._check
    compiled = torch.compile(backward, backend=lambda gm, _: gm.forward, fullgraph=True)

    def make_ctx(needed: frozenset[str]) -> Any:
        return BackwardContext(linear, "full", needed)

    with torch.no_grad():  # as in the engine's backward
        assert capture.holds(frame) and check(frame)
        times = {
            "backward called directly": per_call(lambda: backward(ctx, saved, g)),
            "dynamo's guard manager (C++)": per_call(lambda: check(frame)),
            "customgrad's check of a capture": per_call(lambda: capture.holds(frame)),
            "AutoSplitter.select (per node)": per_call(
                lambda: auto.select(make_ctx, saved, (g,), requires)
            ),
            "through the compiled frame": per_call(lambda: compiled(ctx, saved, g)),
        }
    # In place: forward + the input pass of the op, with the check and with it skipped. The first
    # check after a forward costs more than a repeated one (dynamo's guard manager runs cold).
    step = lambda: torch.autograd.grad(linear(x, w), (x,), g)  # noqa: E731
    with_check = per_call(step)
    holds = Capture.holds
    Capture.holds = lambda self, frame: True  # type: ignore[method-assign]
    try:
        without = per_call(step)
    finally:
        Capture.holds = holds  # type: ignore[method-assign]
    times["the check in forward + input pass"] = with_check - without
    floor = times["backward called directly"]
    print(f"CPU time per call, µs (process_time, min of {ROUNDS} x {CALLS}, 1 thread)")
    print(f"| {'what':<34} | {'µs':>7} | {'/ backward':>10} |")
    print(f"|{'-' * 36}|{'-' * 9}|{'-' * 12}|")
    for name, us in times.items():
        print(f"| {name:<34} | {us:7.2f} | {us / floor:10.2f} |")


if __name__ == "__main__":
    main()
