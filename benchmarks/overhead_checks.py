"""What each safety check of a customgrad backward costs, measured by taking it out.

Run from the repository's root: ``.venv/bin/python -m benchmarks.overhead_checks`` (``--quick`` for a short run).

The linear op of ``benchmarks/overhead.py`` (input/weight pair, no bias) runs the one backward of
every customgrad node (``customgrad._autograd._node_apply``), which asks the runtime which edges
the pass needs (``customgrad._runtime.needed_edges``: the engine's ``_edge_query``), picks the
pass plan and runs the plan's runner (``customgrad/_codegen.py`` writes it). This script swaps
one function the core calls (or that writes a runner's lines) for a variant without the check,
one check at a time, rewrites the runners, and times forward + ``out.backward(g)`` of each
variant against a plain ``torch.autograd.Function``, all in the same rounds (CPU time, 1 thread,
minimum over rounds):

- ``no in-place watch``: ``customgrad._codegen.watch_lines`` and ``call_lines`` write runners
  that call the registered functions without reading the version counters of the output
  gradients and saved values before and after each (in-place writes to them go unnoticed);
- ``no gradient validation``: the runner's ``check_source`` lines take the needed gradients
  from the returned dict (``r[name]``) without checking its keys or each gradient's type,
  shape, dtype and device;
- ``no engine query``: the runtime's ``_edge_query`` answers "needed" for every edge autograd
  marks as requiring grad, and ``captured_by_caller`` reads no frame, so every
  required gradient is computed, as a plain ``autograd.Function`` does (the query is what makes
  the split backward possible: without it, I and W both compute everything).

A measurement, not a configuration: the variants exist only inside this script, every swap is
undone in a ``finally``, and the script stops with an error if a name it swaps no longer exists
or if a variant does not change what it should (checked on small ops before timing).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import torch

import customgrad as cg
import customgrad._codegen as runners
import customgrad._runtime as runtime
from benchmarks import overhead  # the op and the anchor, defined once
from customgrad._codegen import call_lines
from customgrad._op import registered_ops


def _fail(msg: str) -> SystemExit:
    return SystemExit(f"overhead_checks: {msg}; update benchmarks/overhead_checks.py")


@contextlib.contextmanager
def _swapped(scope: MutableMapping[str, Any], where: str, **new: Any) -> Iterator[None]:
    """Within the block, ``scope[name]`` is ``new[name]``; restored after, whatever happens.
    Every op's runners are written again on entry and on exit (they bake in what was swapped)."""
    missing = [name for name in new if name not in scope]
    if missing:
        raise _fail(f"{where} no longer has {', '.join(missing)}")
    old = {name: scope[name] for name in new}
    try:
        scope.update(new)
        _forget_runners()
        yield
    finally:
        scope.update(old)
        _forget_runners()


def _forget_runners() -> None:
    for op in registered_ops():
        op._impl.runners.forget()


def _variants() -> dict[str, Callable[[], Any]]:
    """Variant name -> a context manager factory that takes one check out."""
    module = vars(runners)

    def unwatched_call(half: str, fn: str, nondifferentiable: bool) -> list[str]:
        if nondifferentiable:  # not on the timed op: the core's own handling
            return list(call_lines(half, fn, nondifferentiable))
        return [f"r = {fn}(ctx, saved, *grads)"]

    def unchecked(
        sig: Any,
        half: str,
        fn: str,
        allowed: Any,
        needed: Any,
        out: str,
        slots: Any = None,
        into: str | None = None,
    ) -> list[str]:
        # the needed gradients, taken as returned (no check of keys, types, shapes, ...)
        names = [n for n in sig.names if n in needed]
        if into:
            return [f"{into}[{n!r}] = r[{n!r}]" for n in names]
        return [f"{out} = {{{', '.join(f'{n!r}: r[{n!r}]' for n in names)}}}"]

    def every_edge(fn: Any) -> bool:
        return True

    def no_frame(depth: int) -> frozenset[int]:
        return frozenset()

    where = "customgrad._codegen"
    return {
        "all checks": contextlib.nullcontext,
        "no in-place watch": lambda: _swapped(
            module, where, watch_lines=lambda: [], call_lines=unwatched_call
        ),
        "no gradient validation": lambda: _swapped(module, where, check_source=unchecked),
        "no engine query": lambda: _swapped(
            vars(runtime),
            "customgrad._runtime",
            _edge_query=every_edge,
            captured_by_caller=no_frame,
        ),
    }


# --- proof that each variant takes its check out ----------------------------------------------


def _probe_ops() -> tuple[cg.CustomOp[..., torch.Tensor], cg.CustomOp[..., torch.Tensor]]:
    """Two ops that break a rule: one writes to its output gradient in place, one returns a
    gradient of the wrong shape (which autograd would silently sum to the input's shape)."""

    @cg.op("cg_bench_checks::scale_inplace", weights=())
    def inplace(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    inplace.register_fake(lambda x: torch.empty_like(x))
    inplace.register_save_for_backward(lambda inputs, out: None)
    inplace.register_backward(lambda ctx, s, g: {"x": g.mul_(2)}, split="phase")

    @cg.op("cg_bench_checks::scale_badshape", weights=())
    def badshape(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    badshape.register_fake(lambda x: torch.empty_like(x))
    badshape.register_save_for_backward(lambda inputs, out: None)
    badshape.register_backward(lambda ctx, s, g: {"x": torch.stack([g, g])}, split="phase")
    return inplace, badshape


def _raises(fn: Callable[[], Any]) -> bool:
    try:
        fn()
    except cg.CustomGradError:
        return True
    return False


def _verify(variants: dict[str, Callable[[], Any]]) -> None:
    """Stop unless each variant changes exactly the behaviour its check is for, through the
    backward of the timed op (engine query) or of ops like it (the other two)."""
    inplace, badshape = _probe_ops()
    x = torch.randn(3, requires_grad=True)

    def run_inplace() -> None:
        inplace(x).backward(torch.ones(3))

    def run_badshape() -> None:
        badshape(x).backward(torch.ones(3))

    op = overhead.CG["linear", "pair"]
    xl = torch.randn(8, 16, requires_grad=True)
    wl = torch.randn(16, 16, requires_grad=True)
    halves: list[str] = []

    def run_input_only() -> list[str]:
        halves.clear()
        op(xl, wl, None).backward(torch.ones(8, 16), inputs=[xl])
        return list(halves)

    def observe(label: str, *_: Any) -> None:
        halves.append(label)

    expected = {
        "all checks": (True, True, ["backward_input"]),
        "no in-place watch": (False, True, ["backward_input"]),
        "no gradient validation": (True, False, ["backward_input"]),
        "no engine query": (True, True, ["backward_input", "backward_weight"]),
    }
    with op._impl.observing(observe):
        for name, variant in variants.items():
            with variant():
                got = (_raises(run_inplace), _raises(run_badshape), run_input_only())
            if got != expected[name]:
                raise _fail(
                    f"{name!r} does not behave as it should (in-place write caught, wrong "
                    f"shape caught, halves run for x alone: expected {expected[name]}, got {got})"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run")
    args = parser.parse_args()
    number, repeat = (200, 3) if args.quick else (1500, 12)

    grad, _, impls = overhead._cases()["linear"]
    function, customgrad = impls["autograd.Function"], impls["customgrad pair"]
    variants = _variants()
    _verify(variants)

    def timed(fn: Callable[[], torch.Tensor]) -> float:
        start = time.process_time()
        for _ in range(number):
            fn().backward(grad)
        return (time.process_time() - start) / number * 1e6

    best = dict.fromkeys(["autograd.Function", *variants], float("inf"))
    for fn in (function, customgrad):
        for _ in range(300):
            fn().backward(grad)
    for _ in range(repeat):
        best["autograd.Function"] = min(best["autograd.Function"], timed(function))
        for name, variant in variants.items():
            with variant():
                best[name] = min(best[name], timed(customgrad))

    base, full = best["autograd.Function"], best["all checks"]
    print(
        f"forward + out.backward(g) of a linear 8x16 by 16x16, CPU us per call "
        f"(min of {repeat} rounds x {number}, 1 thread; torch {torch.__version__})\n"
    )
    print("| customgrad backward | us | / autograd.Function | the check costs |")
    print("|---|---:|---:|---:|")
    print(f"| (plain autograd.Function) | {base:.1f} | 1.00 | |")
    for name in variants:
        cost = "" if name == "all checks" else f"{full - best[name]:+.1f} us"
        print(f"| {name} | {best[name]:.1f} | {best[name] / base:.2f} | {cost} |")


if __name__ == "__main__":
    main()
