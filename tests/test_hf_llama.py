"""A real Hugging Face ``transformers`` Llama patched by Liger-Kernel at its defaults, unmodified,
cut into two stages and run through ScheduleZBVZeroBubble with customgrad's ``PipelineStage``,
on one process (two stages on rank 0) and on two (gloo, four stages, two per rank): every gradient equals one process's
backward of the model's own forward, and each backward kernel (Liger's in-place RMSNorm, SwiGLU,
the fused linear cross entropy's) is launched per microbatch as often as there (see
:mod:`tests._hf_llama`)."""

from __future__ import annotations

import pickle
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests._skips import optional_package

pytest.importorskip("transformers", reason=optional_package("transformers"))
H = pytest.importorskip("tests._hf_llama", reason=optional_package("liger-kernel"))
from tests import _mp_workers as w  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    # Liger's patched forward passes transformers a keyword transformers deprecates.
    pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning"),
]


@pytest.mark.parametrize("world", [1, 2], ids=["one-process", "two-processes"])
def test_liger_patched_llama_through_zbv_equals_one_process(tmp_path: Path, world: int) -> None:
    ref, ref_counts = H.reference()
    # One process's backward per microbatch: 4 layers x 2 RMSNorms + the final one, a SwiGLU
    # per layer, the fused loss's two scalings (dX and dW).
    per_microbatch = {"_rms_norm_backward_kernel": 9, "_swiglu_backward_kernel": 4,
                      "element_mul_kernel": 2}  # fmt: skip
    assert ref_counts == [Counter(per_microbatch)] * H.MICROBATCHES
    out = tmp_path / "outcome.pkl"
    w.spawn(H.run_zbv, (str(out),), world=world, timeout=240)
    grads, launches = pickle.loads(out.read_bytes())
    assert set(grads) == set(ref)
    for name, want in ref.items():
        torch.testing.assert_close(grads[name], want, rtol=1e-5, atol=1e-7, msg=name)
    assert launches == {k: n * H.MICROBATCHES for k, n in per_microbatch.items()}
