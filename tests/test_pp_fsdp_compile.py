"""PP x FSDP2 with regional compile, torchtitan's way: ``customgrad.compile(block,
fullgraph=True)`` (FSDP2's pre-forward hook is ``torch._dynamo.disable``\\ d) before or after
``fully_shard``, 4 gloo processes on a 2 x 2 mesh, ZBV; one process's gradients, and the
compiled regions split: one I and one W graph per microbatch on every stage but the first, and
no full backward there (the first stage's runs whole, once, in W).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests import _pp_fsdp_compile_worker as w

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("pp_fsdp_compile") / "outcomes.pkl"
    return w.spawn(str(out), timeout=360)


@pytest.mark.parametrize("order", w.ORDERS)
def test_compiled_fsdp2_blocks_give_one_process_gradients_under_zbv(
    outcomes: list[dict[str, Any]], order: str
) -> None:
    # before: torch._dynamo.exc.Unsupported at the first forward, in either order
    for rank, o in enumerate(outcomes):
        assert o[order]["mismatch"] == [], (rank, o[order])
        status = o[order]["status"]
        assert status and set(status.values()) == {"split"}, (rank, o[order])


@pytest.mark.parametrize("order", w.ORDERS)
def test_compiled_fsdp2_blocks_split_into_i_and_w(
    outcomes: list[dict[str, Any]], order: str
) -> None:
    backwards = w.STEPS * w.MICROBATCHES  # per stage
    for rank, o in enumerate(outcomes):
        runs = o[order]["runs"]
        assert runs and all(name.startswith("Block (graph ") for name in runs), (rank, runs)
        total = {k: sum(r[k] for r in runs.values()) for k in ("full", "input", "weight")}
        stages = o[order]["stages"]
        split_stages = len([s for s in stages if s != 0])
        # every rank holds a stage past the first (ZBV: ranks hold stages r and 3 - r), whose
        # block runs one W graph per microbatch and never its full backward; the first
        # stage's (inputs without gradient) runs its whole backward, once, in W
        assert split_stages > 0, (rank, stages)
        assert total["full"] == (backwards if 0 in stages else 0), (rank, stages, runs)
        assert total["weight"] == split_stages * backwards, (rank, stages, runs)
        # (the last stage's region runs its I graph once more than its W graph in a step)
        assert total["input"] >= total["weight"], (rank, stages, runs)
