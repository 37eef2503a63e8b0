"""Predict a pipeline schedule's step time and bubble from per-action costs.

Renting a cluster to learn what a zero-bubble schedule would give is expensive; the schedule
itself is cheap to replay. This module builds torch's own action lists (``pipeline_order``) and
replays them against per-stage costs.
"""

from __future__ import annotations

import dataclasses

__all__ = ["StageCosts"]


@dataclasses.dataclass(frozen=True)
class StageCosts:
    """Seconds one stage's actions take, per microbatch."""

    forward: float
    backward_input: float
    backward_weight: float
    backward: float | None = None  # a full backward (B); None: backward_input + backward_weight
    send: float = 0.0  # handing an activation or gradient to the next stage's rank
