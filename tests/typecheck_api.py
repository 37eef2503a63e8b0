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
