"""unsloth's LoRA MLP Function (ported: :mod:`tests._unsloth_port`), unmodified, through
customgrad's split and the queue: every LoRA gradient equals the full backward's, its backward
runs once per microbatch; torch's split gets them wrong (``inplace=False``) or fails
(``inplace=True``, its default)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.pipelining import _backward as torch_backward

import customgrad.pipelining as cgp
from tests import _unsloth_port as U
from tests._skips import TORCH_SPLIT

CALLS: list[int] = []


def _stage(inplace: bool) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return U.LoraMLP(inplace=inplace), torch.randn(2, 3, 8), torch.randn(2, 3, 8)


def _full(inplace: bool) -> dict[str, torch.Tensor]:
    m, x, g = _stage(inplace)
    x.requires_grad_()
    m(x).backward(g)
    return {"x": x.grad, **{n: p.grad for n, p in m.named_parameters() if p.requires_grad}}


def _run(inplace: bool, how: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    calls = []
    original = U.LoRA_MLP.backward

    def counted(ctx: Any, dy: torch.Tensor) -> Any:
        calls.append(1)
        return original(ctx, dy)

    monkeypatch.setattr(U.LoRA_MLP, "backward", staticmethod(counted))
    m, x, g = _stage(inplace)
    x.requires_grad_()
    params = [p for p in m.parameters() if p.requires_grad]
    if how == "queue":
        queue = cgp.WeightGradQueue()
        queue.backward(m(x), g, inputs=[x])
        queue.runner([(0, 0)], strict=False)()
        dx = x.grad
    else:
        first, second = {
            "customgrad": (cgp.stage_backward_input, cgp.stage_backward_weight),
            "torch": (torch_backward.stage_backward_input, torch_backward.stage_backward_weight),
        }[how]
        (dx,), groups = first([m(x)], [g], [x], params)
        second(params, groups)
    out = {"x": dx, **{n: p.grad for n, p in m.named_parameters() if p.requires_grad}}
    out["calls"] = len(calls)
    return out


@pytest.mark.parametrize("how", ["customgrad", "queue"])
@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "out-of-place"])
def test_lora_mlp_runs_once_with_every_gradient_exact(
    inplace: bool, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    want = _full(inplace)
    got = _run(inplace, how, monkeypatch)
    assert got.pop("calls") == 1
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name)


@TORCH_SPLIT
def test_lora_mlp_under_torch_s_split_is_wrong_out_of_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    want = _full(False)
    got = _run(False, "torch", monkeypatch)
    assert got.pop("calls") == 2
    wrong = {n for n in want if not torch.allclose(got[n], want[n])}
    assert {"gate_A", "gate_B", "up_A", "up_B"} <= wrong


@TORCH_SPLIT
def test_lora_mlp_under_torch_s_split_fails_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _run(True, "torch", monkeypatch)
