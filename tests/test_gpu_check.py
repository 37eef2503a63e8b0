"""``python3 -m benchmarks.gpu_check``: the one command a GPU machine runs as it is. What runs
without a GPU is checked here: its arguments, the steps on CPU (``--device cpu``), a run without
a visible GPU, the table and the last line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check
from benchmarks.gpu_check import StepResult
from tests._skips import TORCH_SPLIT_RUNS_FUNCTIONS, TRITON_CHILD_INTERPRETER

ROOT = Path(__file__).resolve().parents[1]


def test_arguments_default_to_every_step_on_cuda_in_run_order() -> None:
    args = gpu_check.parse_args([])
    assert (args.device, args.steps, args.budget) == ("cuda", list(gpu_check.STEPS), 460.0)
    assert sum(gpu_check.BUDGETS.values()) <= args.budget <= 8 * 60 - 20  # within 8 minutes
    args = gpu_check.parse_args(["--steps", "split", "cuda-tests", "split", "--device", "cpu"])
    assert (args.device, args.steps, args.budget) == ("cpu", ["cuda-tests", "split"], 4 * 460.0)
    assert gpu_check.parse_args(["--budget", "30"]).budget == 30.0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "bench"], "invalid choice: 'bench'"),
        (["--device", "mps"], "invalid choice: 'mps'"),
        (["--budget", "0"], "--budget must be positive, got 0.0"),
    ],
)
def test_bad_arguments_are_refused(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_last_line_says_what_passed_on_which_device_and_torch() -> None:
    results = [
        StepResult("cuda-tests", "passed", 100.0),
        StepResult("zero-bubble", "failed", 20.0, "customgrad ops: w1's gradient differs"),
        StepResult("moe", "passed", 30.0),
        StepResult("split", "timed out", 50.0),
        StepResult("compiled", "passed", 90.0),
    ]
    line = gpu_check.summary(results, "NVIDIA H100 80GB HBM3", "2.11.0+cu130")
    assert line == (
        "gpu_check: 3/5 passed (cuda-tests, moe, compiled); zero-bubble failed, split timed "
        "out; device NVIDIA H100 80GB HBM3; torch 2.11.0+cu130"
    )


def test_table_has_one_row_per_figure() -> None:
    results = [
        StepResult("split", "passed", 1.0, rows=[
            {"benchmark": "split.py", "configuration": "nn.Linear, torch's split",
             "flops": 1.0, "time": 1.0625},
        ]),
        StepResult("compiled", "passed", 1.0, rows=[
            {"benchmark": "compiled.py", "configuration": "pipeline, eager", "zbv": "0.982"},
        ]),
    ]  # fmt: skip
    lines = gpu_check.table(results).splitlines()
    assert re.split(r"\s{2,}", lines[0]) == [
        "benchmark", "configuration", "(I+W)/full FLOPs", "(I+W)/full time", "ZBV/1F1B",
    ]  # fmt: skip
    assert re.split(r"\s{2,}", lines[2]) == [
        "split.py", "nn.Linear, torch's split", "1.000", "1.062", "-",
    ]  # fmt: skip
    assert re.split(r"\s{2,}", lines[3]) == ["compiled.py", "pipeline, eager", "-", "-", "0.982"]


def test_without_a_gpu_every_step_is_reported_skipped(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible: the steps would run")
    assert gpu_check.main([]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == (
        "gpu_check: 0/5 passed (none); cuda-tests skipped, zero-bubble skipped, moe skipped, "
        "split skipped, compiled skipped; device no CUDA GPU visible; "
        f"torch {torch.__version__}"
    )


def test_a_failing_step_is_reported_and_the_others_still_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(device: str, timeout: float, workdir: Path) -> StepResult:
        raise OSError("no such file")

    ran = []

    def fine(device: str, timeout: float, workdir: Path) -> StepResult:
        ran.append(device)
        return StepResult("split", "passed", 0.1)

    monkeypatch.setitem(gpu_check.STEP_FUNCTIONS, "zero-bubble", broken)
    monkeypatch.setitem(gpu_check.STEP_FUNCTIONS, "split", fine)
    assert gpu_check.main(["--device", "cpu", "--steps", "zero-bubble", "split"]) == 1
    assert ran == ["cpu"]
    out = capsys.readouterr().out
    assert re.search(r"^zero-bubble +failed +0\.0 s +OSError: no such file$", out, re.M)
    assert (
        out.strip()
        .splitlines()[-1]
        .startswith("gpu_check: 1/2 passed (split); zero-bubble failed; device cpu (dry run)")
    )


def test_a_hanging_step_is_stopped_at_its_limit() -> None:
    status, seconds, _ = gpu_check._run(
        "hang", [sys.executable, "-c", "import time; time.sleep(60)"], 2, {}
    )
    assert status == "timed out" and seconds < 30


def test_split_step_on_cpu(tmp_path: Path) -> None:
    result = gpu_check.step_split("cpu", 240, tmp_path)
    assert result.status == "passed", result.detail
    rows = {r["configuration"].split(" (")[0]: r for r in result.rows}
    assert len(rows) == 6
    # FLOP ratios: a customgrad op's backward is never repeated, under either split; a plain
    # Function's whole backward runs once under customgrad's split, in I and again in W under
    # torch's. Before torch 2.13 torch's split cannot run autograd.Functions (customgrad ops
    # among them): its rows say so.
    for layers, ours, torch_s in (
        ("customgrad op", 1.0, 1.0),
        ("autograd.Function", 1.0, 2.0),
        ("nn.Linear", 1.0, 1.0),
    ):
        assert rows[f"{layers}, customgrad's split"]["flops"] == ours
        theirs = rows[f"{layers}, torch's split"]
        if layers == "nn.Linear" or TORCH_SPLIT_RUNS_FUNCTIONS:
            assert theirs["flops"] == torch_s
        else:
            assert theirs["flops"] is None
            assert "fails on this torch" in theirs["configuration"]


@pytest.mark.slow
def test_zero_bubble_step_on_cpu(tmp_path: Path) -> None:
    """ZBV with both stages on one process, customgrad ops, plain Functions (split by their
    capture, or the step fails) and customgrad.compile'd blocks (inductor), gradients against
    the unsplit step."""
    result = gpu_check.step_zero_bubble("cpu", 280, tmp_path)
    assert result.status == "passed", result.detail
    rows = json.loads((tmp_path / "zero_bubble.json").read_text())
    assert [r["blocks"] for r in rows] == [
        "customgrad ops",
        "plain autograd.Functions",
        "customgrad.compile (inductor)",
    ]
    assert all(r["max_diff"] < 1e-4 for r in rows)


@pytest.mark.slow
@TRITON_CHILD_INTERPRETER
def test_moe_step_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The grouped GEMM ops against a loop over the experts with their split's FLOPs, then ZBV
    with MoE blocks against the unsplit step (Triton's kernels in its interpreter here, as the
    suite runs them), where torchtitan cannot be imported (the GPU machines have none)."""
    blocker = tmp_path / "no_torchtitan" / "torchtitan"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('no torchtitan on the GPU machines')")
    monkeypatch.setenv("PYTHONPATH", str(blocker.parent))
    result = gpu_check.step_moe("cpu", 240, tmp_path)
    assert result.status == "passed", result.detail
    rows = json.loads((tmp_path / "moe.json").read_text())
    assert [r["check"] for r in rows] == [
        "grouped_mm, bfloat16, split", "grouped_mm, float32, split",
        "triton_grouped_mm, bfloat16, split", "triton_grouped_mm, float32, split",
        "ZBV, MoE blocks of grouped_mm", "ZBV, MoE blocks of triton_grouped_mm",
    ]  # fmt: skip
    assert all(r["flops"] == 1.0 for r in rows)  # I + W == full; the step's == unsplit's
    assert all(r["max_diff"] < 2e-2 for r in rows[:4]) and all(
        r["max_diff"] < 1e-3 for r in rows[4:]
    )
    assert [r["configuration"] for r in result.rows] == [r["check"] for r in rows]


def test_the_command_runs_from_the_repository_root() -> None:
    """As docs/getting-started.md says to run it (``python3 -m benchmarks.gpu_check``)."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--help"], cwd=ROOT, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "--steps STEP [STEP ...]" in done.stdout
