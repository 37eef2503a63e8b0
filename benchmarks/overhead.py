"""Per-call overhead of customgrad ops against the anchors, measured in the same run.

Run: ``.venv/bin/python benchmarks/overhead.py`` (``--quick`` for a short run).

For a 16-element ``x * 2`` and an 8x16 linear, times in microseconds per call: forward under
``no_grad``, forward with grad, and forward + backward (``out.backward(grad)``, so that only the
op's own node runs in the backward), for

- eager torch,
- a plain ``torch.autograd.Function``,
- a ``torch.autograd.Function`` around a ``Library.define``/``impl`` op,
- the ``Library.define``/``impl`` op alone (forward under ``no_grad`` only),
- ``torch.library.custom_op`` + ``register_autograd``,
- customgrad, called as the ``CustomOp`` and through ``torch.ops``.

Times are **CPU time of this process** (``timeit`` with ``timer=time.process_time``), the
minimum over rounds that each time every implementation in turn, with
``torch.set_num_threads(1)``: other load on a shared machine then moves the figures little, and
the ratios stay stable. They are per-call overheads, not throughput.

It prints a markdown table, and the ratios the project targets: customgrad forward+backward
against the plain Function (<= 1.15) and against custom_op (<= 0.7), and customgrad forward
under no_grad against the define/impl op (<= 1.5).
"""

from __future__ import annotations

import argparse
import time
import timeit
from collections.abc import Callable
from typing import Any

import torch

import customgrad as cg

torch.set_num_threads(1)

# --- x * 2 -------------------------------------------------------------------------------


class DoubleFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * 2


class LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x @ w.mT

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return g @ w, g.mT @ x


_lib = torch.library.Library("cg_bench_lib", "FRAGMENT")
_lib.define("double(Tensor x) -> Tensor")
_lib.define("linear(Tensor x, Tensor w) -> Tensor")
_lib.impl("double", lambda x: x * 2, "CompositeExplicitAutograd")
_lib.impl("linear", lambda x, w: x @ w.mT, "CompositeExplicitAutograd")
lib_double = torch.ops.cg_bench_lib.double.default
lib_linear = torch.ops.cg_bench_lib.linear.default


class LibDoubleFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return lib_double(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * 2


class LibLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return lib_linear(x, w)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return g @ w, g.mT @ x


@torch.library.custom_op("cg_bench_co::double", mutates_args=())
def co_double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


co_double.register_fake(lambda x: torch.empty_like(x))
co_double.register_autograd(lambda ctx, g: g * 2)


@torch.library.custom_op("cg_bench_co::linear", mutates_args=())
def co_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w.mT


def _co_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.save_for_backward(*inputs)


def _co_bwd(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x, w = ctx.saved_tensors
    return g @ w, g.mT @ x


co_linear.register_fake(lambda x, w: x.new_empty(x.shape[0], w.shape[0]))
co_linear.register_autograd(_co_bwd, setup_context=_co_setup)


@cg.op("cg_bench::double")
def cg_double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


cg_double.register_fake(lambda x: torch.empty_like(x))
cg_double.register_save_for_backward(lambda inputs, output: None)
cg_double.register_backward(lambda ctx, saved, g: {"x": g * 2})


@cg.op("cg_bench::linear", weights=("w",))
def cg_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w.mT


cg_linear.register_fake(lambda x, w: x.new_empty(x.shape[0], w.shape[0]))
cg_linear.register_save_for_backward(lambda inputs, output: (inputs.x, inputs.w))
cg_linear.register_backward_input(lambda ctx, saved, g: {"x": g @ saved[1]})
cg_linear.register_backward_weight(lambda ctx, saved, g: {"w": g.mT @ saved[0]})


def _time_all(
    fns: dict[tuple[str, str, str], Callable[[], Any]], number: int, repeat: int
) -> dict[tuple[str, str, str], float]:
    """CPU microseconds per call of each function: the minimum over ``repeat`` rounds.

    Each round times ``number`` calls of every function in turn, so that load that comes and
    goes on a shared machine touches all of them alike.
    """
    best = {key: float("inf") for key in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeat):
        for key, fn in fns.items():
            t = timeit.timeit(fn, number=number, timer=time.process_time)
            best[key] = min(best[key], t / number * 1e6)
    return best


MODES = ("fwd no_grad", "fwd grad", "fwd+bwd")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (for CI smoke runs)")
    args = parser.parse_args()
    number, repeat = (200, 3) if args.quick else (1000, 15)

    x16 = torch.randn(16, requires_grad=True)
    g16 = torch.ones(16)
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)
    g8 = torch.ones(8, 16)
    cases: dict[str, tuple[torch.Tensor, dict[str, Callable[[], torch.Tensor]]]] = {
        "x*2": (
            g16,
            {
                "eager": lambda: x16 * 2,
                "autograd.Function": lambda: DoubleFn.apply(x16),
                "Function(define/impl)": lambda: LibDoubleFn.apply(x16),
                "define/impl op": lambda: lib_double(x16),
                "custom_op": lambda: co_double(x16),
                "customgrad": lambda: cg_double(x16),
                "customgrad torch.ops": lambda: torch.ops.cg_bench.double.default(x16),
            },
        ),
        "linear 8x16": (
            g8,
            {
                "eager": lambda: x @ w.mT,
                "autograd.Function": lambda: LinearFn.apply(x, w),
                "Function(define/impl)": lambda: LibLinearFn.apply(x, w),
                "define/impl op": lambda: lib_linear(x, w),
                "custom_op": lambda: co_linear(x, w),
                "customgrad": lambda: cg_linear(x, w),
                "customgrad torch.ops": lambda: torch.ops.cg_bench.linear.default(x, w),
            },
        ),
    }
    fns: dict[tuple[str, str, str], Callable[[], Any]] = {}
    for case, (grad, impls) in cases.items():
        for impl, f in impls.items():

            def no_grad(f: Callable[[], torch.Tensor] = f) -> None:
                with torch.no_grad():
                    f()

            def fwd(f: Callable[[], torch.Tensor] = f) -> None:
                f()

            def fwd_bwd(f: Callable[[], torch.Tensor] = f, grad: torch.Tensor = grad) -> None:
                f().backward(grad)

            for mode, g in zip(MODES, (no_grad, fwd, fwd_bwd)):
                if impl == "define/impl op" and mode != "fwd no_grad":
                    continue
                fns[(case, impl, mode)] = g
    results = _time_all(fns, number, repeat)

    print(
        f"CPU time per call in µs (process_time, min of {repeat} rounds x {number}, 1 thread; "
        f"torch {torch.__version__})\n"
    )
    print("| op | implementation | " + " | ".join(MODES) + " |")
    print("|---|---|" + "---:|" * len(MODES))
    for case, (_, impls) in cases.items():
        for impl in impls:
            cells = [results.get((case, impl, m)) for m in MODES]
            shown = " | ".join("-" if c is None else f"{c:.1f}" for c in cells)
            print(f"| {case} | {impl} | {shown} |")

    print(
        "\n| op | cg fwd+bwd / Function [<= 1.15] | cg fwd+bwd / custom_op [<= 0.70] | "
        "cg no_grad / define-impl [<= 1.50] |"
    )
    print("|---|---:|---:|---:|")
    r = results
    for case in cases:
        cg_fb = r[(case, "customgrad", "fwd+bwd")]
        print(
            f"| {case} | {cg_fb / r[(case, 'autograd.Function', 'fwd+bwd')]:.2f} "
            f"| {cg_fb / r[(case, 'custom_op', 'fwd+bwd')]:.2f} "
            f"| {r[(case, 'customgrad', 'fwd no_grad')] / r[(case, 'define/impl op', 'fwd no_grad')]:.2f} |"
        )


if __name__ == "__main__":
    main()
