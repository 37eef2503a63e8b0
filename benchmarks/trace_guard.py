"""What deciding "may this trace be reused?" costs per backward call, against its anchors.

Run: ``.venv/bin/python -m benchmarks.trace_guard``.

customgrad reuses a traced backward only while it is proven to read nothing but its arguments
and immutable values (``customgrad._guards.TraceGuard``: after the first proof, one identity
check per place the function read). The alternative the project weighed is torch.compile's own
capture and guards (dynamo): it handles every way Python reads state, but each call of a
dynamo-compiled function pays for its frame evaluation and guards. This script times, per call,
the same small backward (a linear's two matmuls on 8x16 by 16x16 tensors)

- called directly (the floor),
- through ``torch.compile(fullgraph=True)`` with a backend that runs dynamo's captured graph
  as it is (dynamo's per-call cost, with nothing compiled to speed it up),
- after ``TraceGuard.check()`` (customgrad's per-call cost),

as CPU time of this process, the minimum over rounds, with one thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from customgrad._guards import TraceGuard

ROUNDS = 7
CALLS = 3000


def backward(ctx: Any, saved: Any, g: torch.Tensor) -> dict[str, torch.Tensor]:
    x, w = saved
    return {"x": g @ w, "weight": g.mT @ x}


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
    x, w, g = torch.randn(8, 16), torch.randn(16, 16), torch.randn(8, 16)
    saved = (x, w)
    dynamo = torch.compile(backward, backend=lambda gm, _: gm.forward, fullgraph=True)
    guard = TraceGuard(backward)

    def guarded() -> Any:
        guard.check()
        return backward(None, saved, g)

    times = {
        "called directly": per_call(lambda: backward(None, saved, g)),
        "dynamo's capture and guards": per_call(lambda: dynamo(None, saved, g)),
        "TraceGuard.check() + call": per_call(guarded),
    }
    floor = times["called directly"]
    print(f"{'per backward call':<30} {'us':>8} {'over the call':>14}")
    for name, us in times.items():
        print(f"{name:<30} {us:8.2f} {us - floor:+13.2f}")


if __name__ == "__main__":
    main()
