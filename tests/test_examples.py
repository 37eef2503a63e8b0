"""The examples as a user runs them (``make examples``): each command in a fresh process, from
the repository's root, with the line that says it checked what it shows.

They are tests, not a step of their own in ``make test``, so that pytest-xdist runs them beside
the rest of the suite (``make examples`` runs this file).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import _triton_support

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.slow]

# command (after `python`) -> a line its output must have
EXAMPLES = {
    "quickstart": (
        ["examples/quickstart.py"],
        "torch.compile(fullgraph=True): gradients match eager.",
    ),
    "ops": (["-m", "examples.ops"], "check_op(examples::grouped_linear):"),
    "zero_bubble": (
        ["examples/zero_bubble.py", "--check"],
        "check passed: first-step gradients equal one process's",
    ),
    "zero_bubble-compile": (
        ["examples/zero_bubble.py", "--check", "--compile"],
        "check passed: first-step gradients equal one process's",
    ),
    "llama_stages": (
        ["examples/llama_stages.py", "--steps", "2", "--backend", "aot_eager"],
        "first-step gradients against one process's: max relative difference",
    ),
}


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_example_runs_and_checks_itself(name: str, tmp_path: Path) -> None:
    command, says = EXAMPLES[name]
    if command[0] == "examples/zero_bubble.py":
        command = [*command, "--out", str(tmp_path)]  # its pictures, not in the checkout
    env = dict(os.environ)
    if _triton_support.INTERPRET_SET_HERE:  # as `make examples` runs them
        env.pop("TRITON_INTERPRET", None)
    done = subprocess.run(
        [sys.executable, *command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=280
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert says in done.stdout, done.stdout[-3000:]
