"""``benchmarks/overhead_checks.py`` swaps the functions a runner is written from; its own check
(each variant takes out exactly its check) must keep passing as the core changes. The pipeline
benchmarks start as many processes as the GPUs allow."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_each_overhead_check_variant_takes_out_its_check() -> None:
    from benchmarks import overhead_checks

    overhead_checks._verify(overhead_checks._variants())


CHECK_NPROC = """
import torch
import compiled, pipeline  # as the scripts run: benchmarks/ first on the path
torch.cuda.is_available = lambda: True
for gpus, want in ((1, 1), (2, 2), (8, 2)):
    torch.cuda.device_count = lambda gpus=gpus: gpus
    assert compiled.parse_args(["--device", "cuda"]).nproc == want, gpus
    assert pipeline.parse_args(["--device", "cuda"]).nproc == want, gpus
    assert compiled.parse_args([]).nproc == 2  # CPU: gloo, 2 processes
assert compiled.parse_args(["--device", "cuda", "--nproc", "1"]).nproc == 1
print("ok")
"""


def test_cuda_benchmarks_spawn_one_process_per_gpu() -> None:
    """With one GPU, ``--device cuda`` spawns one rank (both stages of the V), never two NCCL
    ranks on one device; with two or more, two ranks; on a CPU, two. (In a process of its own:
    the scripts import their ops as top-level modules.)"""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "benchmarks"), str(root)])}
    done = subprocess.run(
        [sys.executable, "-c", CHECK_NPROC], cwd=root, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_the_trace_guard_benchmark_times_a_capture_made_by_a_split_pass(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``benchmarks/trace_guard.py`` finds the one capture its input pass made (a full backward
    captures nothing) and prints a row per thing it times."""
    from benchmarks import trace_guard

    monkeypatch.setattr(trace_guard, "ROUNDS", 1)
    monkeypatch.setattr(trace_guard, "CALLS", 3)
    trace_guard.main()
    rows = [line.split("|")[1].strip() for line in capsys.readouterr().out.splitlines()[3:]]
    assert rows == [
        "backward called directly",
        "dynamo's guard manager (C++)",
        "customgrad's check of a capture",
        "AutoSplitter.select (per node)",
        "through the compiled frame",
        "the check in forward + input pass",
    ]
