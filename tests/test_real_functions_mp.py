"""Liger-Kernel's Functions, unmodified, through ScheduleZBVZeroBubble on two processes
(customgrad's ``PipelineStage``): gradients equal to one process's, and each backward kernel
launched as often in the step as in one process's backward (see :mod:`tests._liger_block`)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from tests._skips import optional_package

# liger_kernel first: a failed import of tests._liger_block can stay half-made in
# sys.modules (the doctest collection imports it too)
pytest.importorskip("liger_kernel", reason=optional_package("liger-kernel"))
L = pytest.importorskip("tests._liger_block", reason=optional_package("liger-kernel"))
from tests import _mp_workers as w  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _step(tmp_path: Path, run_once: bool) -> dict[str, object]:
    out = tmp_path / "outcome.pkl"
    w.spawn(L.run_zbv, (str(out), run_once), world=2, timeout=200)
    outcome: dict[str, object] = pickle.loads(out.read_bytes())
    return outcome


def test_zbv_liger_stages_run_each_function_once(tmp_path: Path) -> None:
    _, ref_launches = L.pipeline_reference_in_interpreter()
    outcome = _step(tmp_path, run_once=True)
    assert outcome["problems"] == []
    assert outcome["launches"] == dict(ref_launches)


def test_zbv_liger_stages_torch_s_way_is_wrong(tmp_path: Path) -> None:
    # run_functions_once=False: what torch's stage does (the table): the in-place
    # RMSNorm's and the fused loss's weight gradients wrong, the backward kernels run again.
    _, ref_launches = L.pipeline_reference_in_interpreter()
    outcome = _step(tmp_path, run_once=False)
    problems = outcome["problems"]
    assert isinstance(problems, list)
    assert any("head.lm_head" in p for p in problems), problems
    assert any("input_layernorm" in p for p in problems), problems
    launches = outcome["launches"]
    assert isinstance(launches, dict)
    assert launches["_rms_norm_backward_kernel"] > ref_launches["_rms_norm_backward_kernel"]


@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "out-of-place"])
def test_zbv_unsloth_lora_stages_run_once_and_exact(tmp_path: Path, inplace: bool) -> None:
    from tests import _unsloth_port as U

    out = tmp_path / "outcome.pkl"
    w.spawn(U.run_zbv, (str(out), inplace), world=2, timeout=200)
    outcome = pickle.loads(out.read_bytes())
    _, ref_calls = U.zbv_reference(inplace)
    assert outcome["problems"] == []
    assert outcome["calls"] == ref_calls == U.STAGES * U.MICROBATCHES
