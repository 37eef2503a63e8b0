"""In CI (``CI=true``) a skip is a result: a skip whose reason is not one of ``tests/_skips.py``'s
(no CUDA GPU, a torch release that lacks a feature, an optional package) fails the run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._skips import allowed, cuda_gpus, optional_package, release_lacks

ROOT = Path(__file__).resolve().parents[1]

SKIPS = """
import pytest
from tests._skips import NO_CUDA, release_lacks

@pytest.mark.skipif(True, reason=NO_CUDA)
def test_gpu(): pass

@pytest.mark.skipif(True, reason=release_lacks("a feature"))
def test_release(): pass

def test_runs(): pass
"""

STRAY = """
import pytest

def test_busy():
    pytest.skip("the machine was too busy")

@pytest.mark.xfail(reason="an expected failure is no skip")
def test_xfail():
    raise AssertionError
"""


@pytest.mark.parametrize(
    "reason",
    ["needs a CUDA GPU", cuda_gpus(4), release_lacks("x"), optional_package("torchtitan", "pip")],
)
def test_named_reasons_are_allowed(reason: str) -> None:
    assert allowed(reason)


@pytest.mark.parametrize(
    "reason", ["the machine was too busy", "TRITON_INTERPRET=0", "torch lacks x", "needs triton"]
)
def test_other_reasons_are_not(reason: str) -> None:
    assert not allowed(reason)


def _pytest(
    tmp_path: Path, source: str, ci: str | None, *options: str
) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_case.py").write_text(source)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = str(ROOT)
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", os.devnull,
         "-p", "tests._skips", *options, "--rootdir", str(tmp_path),
         str(tmp_path / "test_case.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip


def test_ci_accepts_skips_with_named_reasons(tmp_path: Path) -> None:
    done = _pytest(tmp_path, SKIPS, "true")
    assert done.returncode == 0, done.stdout[-2000:]
    assert "1 passed, 2 skipped" in done.stdout


def test_ci_fails_a_run_with_a_skip_outside_the_list(tmp_path: Path) -> None:
    done = _pytest(tmp_path, STRAY, "true")
    assert done.returncode == 1, done.stdout[-2000:]
    assert "skips CI does not accept" in done.stdout
    assert "test_case.py::test_busy: the machine was too busy" in done.stdout
    assert "test_xfail" not in done.stdout.split("skips CI does not accept")[1]


def test_outside_ci_a_skip_is_a_skip(tmp_path: Path) -> None:
    done = _pytest(tmp_path, STRAY, None)
    assert done.returncode == 0, done.stdout[-2000:]
    assert "skips CI does not accept" not in done.stdout


HANGS = (
    STRAY
    + """
import time

def test_hangs():
    time.sleep(120)
"""
)


def test_on_xdist_workers_ci_still_fails_a_stray_skip_and_the_timeout_applies(
    tmp_path: Path,
) -> None:
    # make test runs the suite on 2 pytest-xdist workers: the skips of every worker reach the
    # check, and pyproject's timeout options stop a hanging test there as in a plain run.
    pytest.importorskip("xdist", reason=optional_package("pytest-xdist", "pip install -e '.[dev]'"))
    addopts = (ROOT / "pyproject.toml").read_text().split("addopts = ", 1)[1].split("\n", 1)[0]
    timeout = [o for o in addopts.strip('"').split() if o.startswith("--timeout-")]
    assert timeout == ["--timeout-method=signal"]
    done = _pytest(tmp_path, HANGS, "true", "-n", "2", "--timeout=5", *timeout)
    assert done.returncode == 1, done.stdout[-2000:]
    assert "test_case.py::test_busy: the machine was too busy" in done.stdout
    assert "FAILED test_case.py::test_hangs - Failed: Timeout (>5.0s) from pytest-timeout" in (
        done.stdout
    )
    assert "1 failed, 1 skipped, 1 xfailed" in done.stdout
