"""Real libraries' ``torch.autograd.Function``\\ s, unmodified, through customgrad's split.

Liger-Kernel's Functions (the block of :mod:`tests._liger_block`: what
``apply_liger_kernel_to_llama`` puts in a Llama at its defaults) run under Triton's interpreter
on CPU. Through customgrad's ``stage_backward_input``/``stage_backward_weight`` and the
weight-gradient queue, two stages and two microbatches: every gradient equals one process's full
backward, and each backward kernel is launched per microbatch as often as in the full backward.
``run_functions_once=False`` (torch's way) launches them twice and gets wrong gradients, which
is what the default prevents. ScheduleZBVZeroBubble on two processes is in
``test_real_functions_mp.py``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch import Tensor

import customgrad.pipelining as cgp

L = pytest.importorskip("tests._liger_block", reason="liger-kernel is not installed")


def _launches_per_microbatch(run_backward: Any) -> tuple[dict[str, Tensor], list[Counter[str]]]:
    """Gradients of one step of both stages, and each microbatch's backward kernel launches;
    ``run_backward(stage_out, grad, inputs, module)`` runs one stage's backward."""
    with L.liger_kernels():
        first, last = L.build()
        x, target = L.batch()
        counts: list[Counter[str]] = []
        for xm, tm in zip(x.chunk(L.MICROBATCHES), target.chunk(L.MICROBATCHES)):
            h = first(xm)
            h_in = h.detach().requires_grad_()
            loss = last(h_in, tm)
            with L.backward_launches() as launched:
                (dh,) = run_backward([loss], None, [h_in], last)
                run_backward([h], [dh], [], first)
            counts.append(Counter(launched))
        return L.gradients(first, last), counts


def _full(outputs: Any, grads: Any, inputs: Any, module: Any) -> tuple[Tensor | None, ...]:
    torch.autograd.backward(outputs, grads)
    return tuple(i.grad for i in inputs)


def _split(once: bool) -> Any:
    def run(outputs: Any, grads: Any, inputs: Any, module: Any) -> tuple[Tensor | None, ...]:
        dx, groups = cgp.stage_backward_input(
            outputs, grads, inputs, module.parameters(), run_functions_once=once
        )
        cgp.stage_backward_weight(module.parameters(), groups)
        return dx

    return run


def _queued(outputs: Any, grads: Any, inputs: Any, module: Any) -> tuple[Tensor | None, ...]:
    queue = cgp.WeightGradQueue()
    queue.backward(outputs, grads, inputs=inputs)
    queue.runner([(0, 0)], strict=False)()
    queue.finish()
    return tuple(i.grad for i in inputs)


@pytest.mark.parametrize("driver", ["split", "queue"])
def test_liger_block_gradients_and_launches_equal_the_full_backward(driver: str) -> None:
    ref, ref_counts = _launches_per_microbatch(_full)
    got, counts = _launches_per_microbatch(_split(True) if driver == "split" else _queued)
    assert set(got) == set(ref)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], msg=name)
    assert counts == ref_counts
    assert all(c["_rms_norm_backward_kernel"] == 5 and c["element_mul_kernel"] for c in counts)


def test_liger_block_under_torch_s_way_runs_twice_and_is_wrong() -> None:
    # run_functions_once=False re-runs each Function's backward in W, as torch's split does:
    # the in-place RMSNorm reads dX where it wrote over dY, the fused loss scales its kept
    # gradients a second time.
    ref, ref_counts = _launches_per_microbatch(_full)
    got, counts = _launches_per_microbatch(_split(False))
    assert counts[0]["_rms_norm_backward_kernel"] > ref_counts[0]["_rms_norm_backward_kernel"]
    wrong = [n for n in ref if not torch.allclose(got[n], ref[n], rtol=1e-4, atol=1e-6)]
    assert "1.layer.input_layernorm" in wrong and "1.head.lm_head" in wrong, wrong
