"""The torchtitan-shaped example (``examples/llama_stages.py``) on 2 processes (gloo): stages cut
from the model the torchtitan way, each block compiled by ``customgrad.compile``, trained through
ScheduleZBVZeroBubble / ScheduleDualPipeV with customgrad's ``PipelineStage``: float64 gradients
equal one process's, compiled backwards split into I and W graphs, a step does the FLOPs of one
process's forward and full backward (nothing computed twice), and the loss goes down.
torchtitan's own Llama 3 model the same way, where torchtitan is installed."""

from __future__ import annotations

import importlib.util
import pickle
from pathlib import Path

import pytest

from tests import _llama_workers as lw
from tests import _mp_workers as w
from tests._skips import optional_package

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

LAYERS = 4


def _train(tmp_path: Path, schedule: str, which: str) -> lw.Result:
    out = tmp_path / "result.pkl"
    w.spawn(lw.run, (str(out), schedule, which), world=2, timeout=240)
    result: lw.Result = pickle.loads(out.read_bytes())
    return result


def _check(r: lw.Result) -> None:
    assert r.worst < 1e-12, f"gradients differ from one process's by {r.worst:.2e}"
    assert r.split
    # Per block and microbatch, either the weight graph (after the input graph, in I) or the
    # whole graph (a B action: DualPipeV runs most of its backwards whole with 4 microbatches)
    # runs once. The first stage's I runs no input graph (its input needs no gradient).
    n = LAYERS * lw.MICROBATCHES
    assert r.runs["full"] + r.runs["weight"] == n, r.runs
    assert 0 < r.runs["input"] <= r.runs["weight"], r.runs
    assert r.flops == r.reference_flops > 0  # nothing computed twice
    assert r.losses[-1] < r.losses[0]


@pytest.mark.parametrize("schedule", ["ScheduleZBVZeroBubble", "ScheduleDualPipeV"])
def test_example_trains_split_with_one_process_gradients(tmp_path: Path, schedule: str) -> None:
    _check(_train(tmp_path, schedule, "example"))


@pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None,
    reason=optional_package("torchtitan", "make install pins torchtitan 0.3.0"),
)
def test_torchtitan_llama3_trains_split_with_one_process_gradients(tmp_path: Path) -> None:
    _check(_train(tmp_path, "ScheduleZBVZeroBubble", "torchtitan"))
