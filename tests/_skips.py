"""Why a test may skip: the reasons a CI run accepts (``tests/conftest.py`` fails a run with
``CI=true`` on a skip whose reason matches none of :data:`ALLOWED`).

Three kinds: no CUDA GPU (or not enough), a torch release that lacks a feature (named with the
release), an optional package that is not installed. Build reasons with these helpers.
"""

from __future__ import annotations

import os
import re
from typing import Any

import pytest
import torch

from customgrad._torch import dynamo, functions, pipelining
from tests import _triton_support

__all__ = [
    "ALLOWED",
    "FREEZE_RECOMPILES",
    "GRAPH_FREED_AFTER_I",
    "NO_CUDA",
    "TORCH_SPLIT",
    "TORCH_SPLIT_RUNS_FUNCTIONS",
    "TORCH_STAGE_V",
    "TRITON_CHILD_INTERPRETER",
    "UNBACKED_SLICE_WRITES",
    "allowed",
    "cuda_gpus",
    "optional_package",
    "release_lacks",
]

NO_CUDA = "needs a CUDA GPU"


def cuda_gpus(n: int) -> str:
    return f"needs {n} CUDA GPUs"


def release_lacks(what: str) -> str:
    """A reason for a feature the installed torch release lacks."""
    return f"torch {torch.__version__} lacks {what}"


def optional_package(name: str, how: str = "") -> str:
    return f"optional package {name} is not installed{f' ({how})' if how else ''}"


ALLOWED = re.compile(
    r"needs (a|\d+) CUDA GPUs?\b|torch \d+\.\d+\S* lacks |optional package \S+ is not installed"
    r"|triton \d+\.\d+\S*'s interpreter lacks "
)
"""A skip reason CI accepts starts with one of these."""


def allowed(reason: str) -> bool:
    return ALLOWED.match(reason) is not None


TORCH_SPLIT = pytest.mark.skipif(
    not functions.handles_keep_nodes(),
    reason=release_lacks(
        "a split in torch's own stage_backward_input/stage_backward_weight that runs "
        "autograd.Function nodes (fixed in torch 2.13; on this release customgrad refuses it "
        "for its ops and compiled regions with UnsupportedTorchError, pinned in "
        "tests/test_releases.py)"
    ),
)
"""For tests of torch's own split (its stage, its ``_backward`` functions)."""

TORCH_STAGE_V = pytest.mark.skipif(
    pipelining.torch_stage_inits_same_rank(),
    reason=release_lacks(
        "V schedules on torch's own PipelineStage with two stages on one gloo rank (its init "
        "ops send to the rank itself; customgrad's stage drops them)"
    ),
)
"""For tests that run torch's own ``PipelineStage`` under a V schedule on one gloo rank."""

GRAPH_FREED_AFTER_I = pytest.mark.skipif(
    not functions.handles_keep_nodes(),
    reason=release_lacks(
        "freeing the graph after the input pass: a Function node's handle does not keep its "
        "node alive, so customgrad keeps the stage's graph until W (docs: compatibility)"
    ),
)
"""For tests that check what the input pass frees."""

TORCH_SPLIT_RUNS_FUNCTIONS = functions.handles_keep_nodes()
"""Whether torch's own split can run ``autograd.Function`` nodes, customgrad ops among them
(torch 2.13 and later); elsewhere customgrad refuses it (``UnsupportedTorchError``)."""


# --- in CI, a skip is a result: reasons outside ALLOWED fail the run ---------------------------
# Loaded as a pytest plugin (``-p tests._skips`` in pyproject.toml's addopts).

_refused: list[str] = []


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return text.removeprefix("Skipped: ")


def _note(report: pytest.CollectReport | pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = _reason(report)
        if not allowed(reason):
            _refused.append(f"{report.nodeid}: {reason}")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _note(report)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _note(report)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _in_ci() and _refused and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _in_ci() and _refused:
        terminalreporter.section("skips CI does not accept", sep="=", red=True)
        terminalreporter.line(
            "CI=true: a skip must say why with a reason of tests/_skips.py (no CUDA GPU, a torch "
            "release that lacks a feature, an optional package); these did not:"
        )
        for line in _refused:
            terminalreporter.line(f"  {line}")


# --- torch's own PipelineStage in the multi-process tests -------------------------------------

V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
SPLIT_SCHEDULES = ("ScheduleZBVZeroBubble", "ScheduleInterleavedZeroBubble", "ScheduleDualPipeV")


def torch_stage_lacks(stage: str, schedule: str, functions: bool) -> str | None:
    """What this torch release lacks to run a pipeline case on torch's own ``PipelineStage``
    (``stage`` "torch", or "queue": torch's stage with a queue's ``dw_builder``), or None.
    ``functions``: the stages hold ``autograd.Function`` nodes (customgrad ops, plain Functions,
    compiled blocks)."""
    if stage not in ("torch", "queue"):
        return None
    if schedule in V_SHAPED and pipelining.torch_stage_inits_same_rank():
        return release_lacks(
            "V schedules on torch's own PipelineStage with neighbouring stages on one rank "
            "(its init ops send to the rank itself)"
        )
    split = stage == "torch" and schedule in SPLIT_SCHEDULES
    if split and functions and not TORCH_SPLIT_RUNS_FUNCTIONS:
        return release_lacks(
            "a split in torch's own PipelineStage that runs autograd.Function nodes "
            "(customgrad refuses it with UnsupportedTorchError)"
        )
    return None


def _writes_slices_of_unbacked_sizes() -> bool:
    """Whether dynamo captures ``out[a:b] = y`` with ``a, b = t.tolist()`` (unbacked sizes):
    torch 2.13 and later; 2.11's and 2.12's dynamo refuse a guard on a data-dependent
    expression. Probed by that behaviour, in this thread (on torch 2.11 a compile after this
    probe ran in a thread of its own crashed the process)."""

    def write(x: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
        start, end = bounds.tolist()
        out = torch.zeros_like(x)
        out[start:end] = x[start:end] * 2
        return out

    compiled = torch.compile(write, backend="eager", fullgraph=True, dynamic=False)
    try:
        return bool(compiled(torch.ones(4), torch.tensor([1, 3]))[2] == 2)
    except Exception:  # dynamo refuses the data-dependent guard
        return False


UNBACKED_SLICE_WRITES = pytest.mark.skipif(
    not _writes_slices_of_unbacked_sizes(),
    reason=release_lacks(
        "dynamo's capture of a write into a slice whose bounds it read from a tensor "
        "(out[a:b] = y, a and b unbacked: torch 2.13 and later); a backward that writes each "
        "expert's rows that way runs once there, right"
    ),
)
"""For tests of a grouped GEMM whose backward writes each expert's rows by sizes it read."""


TRITON_CHILD_INTERPRETER = pytest.mark.skipif(
    _triton_support.INDEX_SHIMMED,
    reason=f"triton {_triton_support.triton_version()}'s interpreter lacks __index__ of a "
    "1-element array under numpy 2.4, which a loop bound read from a tensor needs (this test "
    "session shims it; a child process it starts, such as gpu_check's, runs the interpreter as it "
    "is; compiled Triton on a GPU is unaffected)",
)
"""For tests that run Triton kernels in a child process under the interpreter."""


FREEZE_RECOMPILES = pytest.mark.skipif(
    not dynamo.guards_parameter_requires_grad(),
    reason=release_lacks(
        "a recompile when a compiled module's weight is frozen between calls: dynamo keeps the "
        "graph traced with the old requires_grad, whose backward computes the frozen weight's "
        "gradient (torch.compile alike; customgrad._torch.dynamo.guards_parameter_requires_grad)"
    ),
)
"""For tests that check what a compiled module's backward computes after a weight is frozen."""
