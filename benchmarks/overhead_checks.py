"""What each safety check of a customgrad backward costs, measured by taking it out.

Run from the repository's root: ``.venv/bin/python -m benchmarks.overhead_checks`` (``--quick`` for a short run).

The linear op of ``benchmarks/overhead.py`` (input/weight pair, no bias) runs the backward that
``customgrad/_fastpath.py`` generates for its signature. This script rebuilds that backward from
its own source with one check removed at a time and times forward + ``out.backward(g)`` of each
variant against a plain ``torch.autograd.Function``, all in the same rounds (CPU time, 1 thread,
minimum over rounds):

- ``no in-place watch``: the version counters of the output gradients and saved tensors are not
  read before and after each user backward (in-place writes to them go unnoticed);
- ``no gradient validation``: the returned dict's keys and each gradient's type, shape, dtype
  and device are not checked;
- ``no engine query``: every gradient that autograd marks as required is computed, as a plain
  ``autograd.Function`` does, instead of asking the engine which ones the running pass needs
  (this is what makes the split backward possible: without it, I and W both compute everything).

A measurement, not a configuration: the variants exist only inside this script, and it stops
with an error if the generated source no longer has the shape it edits.
"""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks import overhead  # the op and the anchor, defined once

_QUERY = re.compile(
    r"(?P<i> +)fn = nf\[e\]\[0\]\n"
    r"(?P=i)if type\(fn\) is _ACC and id\(fn\.variable\) in _captured\(\):\n"
    r"(?P=i)    (?P<set>nmask \|= \d+)[^\n]*\n"
    r"(?P=i)else:\n"
    r"(?:(?P=i)    [^\n]*\n)+?"
    r"(?P=i)        nmask \|= \d+\n"
)
_WATCH_SETUP = re.compile(r" +watched = [^\n]*\n +before = [^\n]*\n")
_WATCH_CHECK = re.compile(r" +if \[\*_map\(_getattr, watched[^\n]*\n +_mutated\([^\n]*\n")
_DICT_CHECK = re.compile(r"(?P<i> +)ok = type\(r\) is dict and r\.keys\(\) <= _ALLOWED_\w+\n")
_GRAD_CHECK = re.compile(
    r"(?P<i> +)ok = \(type\(g\) is _T and m is not None[^\n]*\n +and g\.dtype[^\n]*\n"
)


def _edit(pattern: re.Pattern[str], repl: str, text: str, what: str) -> str:
    new, n = pattern.subn(repl, text)
    if n == 0:
        raise SystemExit(
            f"overhead_checks: the generated backward no longer contains {what}; "
            "update the patterns at the top of benchmarks/overhead_checks.py"
        )
    return new


def _variants(apply_src: str) -> dict[str, str]:
    no_watch = _edit(_WATCH_SETUP, "", apply_src, "the in-place watch's setup")
    no_watch = _edit(_WATCH_CHECK, "", no_watch, "the in-place watch's check")
    no_val = _edit(_DICT_CHECK, r"\g<i>ok = True\n", apply_src, "the dict check")
    no_val = _edit(_GRAD_CHECK, r"\g<i>ok = True\n", no_val, "the gradient check")
    no_query = _edit(_QUERY, r"\g<i>\g<set>\n", apply_src, "the engine query")
    return {
        "all checks": apply_src,
        "no in-place watch": no_watch,
        "no gradient validation": no_val,
        "no engine query": no_query,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run")
    args = parser.parse_args()
    number, repeat = (200, 3) if args.quick else (1500, 12)

    grad, _, impls = overhead._cases()["linear"]
    op = overhead.CG["linear", "pair"]
    function, customgrad = impls["autograd.Function"], impls["customgrad pair"]
    customgrad().backward(grad)  # builds the fast path
    call = op._fast_call
    if call is None:
        raise SystemExit("overhead_checks: the op did not take the fast path")
    namespace = call.__globals__
    source = call.__customgrad_source__
    apply_src = source[source.index("def apply(node, *grads):") :]
    backward_cls = namespace["_c_apply"].__self__._backward_cls
    original = backward_cls.apply
    applies: dict[str, Any] = {}
    for name, text in _variants(apply_src).items():
        scope = dict(namespace)
        exec(text, scope)
        applies[name] = scope["apply"]

    def timed(fn: Callable[[], torch.Tensor]) -> float:
        start = time.process_time()
        for _ in range(number):
            fn().backward(grad)
        return (time.process_time() - start) / number * 1e6

    best = dict.fromkeys(["autograd.Function", *applies], float("inf"))
    try:
        for fn in (function, customgrad):
            for _ in range(300):
                fn().backward(grad)
        for _ in range(repeat):
            best["autograd.Function"] = min(best["autograd.Function"], timed(function))
            for name, apply in applies.items():
                backward_cls.apply = apply
                best[name] = min(best[name], timed(customgrad))
    finally:
        backward_cls.apply = original

    base, full = best["autograd.Function"], best["all checks"]
    print(
        f"forward + out.backward(g) of a linear 8x16 by 16x16, CPU us per call "
        f"(min of {repeat} rounds x {number}, 1 thread; torch {torch.__version__})\n"
    )
    print("| customgrad backward | us | / autograd.Function | the check costs |")
    print("|---|---:|---:|---:|")
    print(f"| (plain autograd.Function) | {base:.1f} | 1.00 | |")
    for name in applies:
        cost = "" if name == "all checks" else f"{full - best[name]:+.1f} us"
        print(f"| {name} | {best[name]:.1f} | {best[name] / base:.2f} | {cost} |")


if __name__ == "__main__":
    main()
