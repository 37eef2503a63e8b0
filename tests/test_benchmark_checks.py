"""``benchmarks/overhead_checks.py`` swaps the functions a runner is written from; its own check
(each variant takes out exactly its check) must keep passing as the core changes."""

from __future__ import annotations


def test_each_overhead_check_variant_takes_out_its_check() -> None:
    from benchmarks import overhead, overhead_checks

    grad, _, impls = overhead._cases()["linear"]
    impls["customgrad pair"]().backward(grad)  # builds the fast path
    call = overhead.CG["linear", "pair"]._fast_call
    assert call is not None
    overhead_checks._verify(overhead_checks._variants(call.__globals__))
