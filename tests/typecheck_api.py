"""Checked by mypy (``make typecheck``), never run: CustomOp calls carry fn's signature.

Each ``type: ignore[...]`` below must be needed; mypy's ``warn_unused_ignores`` (strict mode)
fails the build if ParamSpec typing ever stops catching these mistakes.
"""

from __future__ import annotations

import torch

import customgrad as cg


def _define() -> None:
    @cg.op("typecheck_api::scale", weights=("w",))
    def scale(x: torch.Tensor, w: torch.Tensor, *, factor: float = 1.0) -> torch.Tensor:
        return x * w * factor

    out: torch.Tensor = scale(torch.ones(2), torch.ones(2), factor=2.0)
    del out
    scale(torch.ones(2), "w")  # type: ignore[arg-type]
    scale(torch.ones(2))  # type: ignore[call-arg]
    scale(torch.ones(2), torch.ones(2), factr=2.0)  # type: ignore[call-arg]
    bad: int = scale(torch.ones(2), torch.ones(2))  # type: ignore[assignment]
    del bad

    linear = cg.op("typecheck_api::double", lambda x: x * 2)
    del linear

    @scale.register_fake
    def _(x: torch.Tensor, w: torch.Tensor, *, factor: float = 1.0) -> torch.Tensor:
        return torch.empty_like(x)

    _(torch.ones(1), torch.ones(1))  # register_* return the function they were given

    # check_op takes an op of any signature (generic over it, not CustomOp[..., object])
    from customgrad.testing import check_op

    report = check_op(scale, torch.ones(2), torch.ones(2), factor=2.0, checks=("opcheck",))
    del report
    check_op(scale, torch.ones(2), checks=["nope"], dtype="float")  # type: ignore[arg-type]

    # the callback protocols, where a user names them: a backward returns gradients by name
    def bwd(ctx: cg.BackwardContext, saved: object, /, *grads: object) -> dict[str, torch.Tensor]:
        return {}

    def not_grads(ctx: cg.BackwardContext, saved: object, /, *grads: object) -> int:
        return 0

    rule: cg.BackwardFn = bwd
    wrong: cg.BackwardFn = not_grads  # type: ignore[assignment]
    del rule, wrong


def _pipelining() -> None:
    from customgrad.pipelining import ActionTimer, StageCosts, simulate

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (out - target).square().mean()

    timed = ActionTimer().time_loss(loss_fn)  # keeps loss_fn's signature
    loss: torch.Tensor = timed(torch.ones(1), torch.ones(1))
    del loss
    timed(torch.ones(1))  # type: ignore[call-arg]
    simulate("1F1B", 2, 4, StageCosts(1.0, 1.0, 1.0))
    simulate(3, 2, 4, StageCosts(1.0, 1.0, 1.0))  # type: ignore[arg-type]
