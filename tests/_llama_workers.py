"""What ``tests/test_llama_stages.py`` runs on 2 processes: the torchtitan-shaped example's
stages (or torchtitan's own Llama 3, cut by torchtitan's own helpers), compiled per block,
through a V-shaped schedule."""

from __future__ import annotations

import copy
import pickle
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
from torch import Tensor, nn

import customgrad
import customgrad.pipelining as cgp
from customgrad._compile import regions
from customgrad._flops import FlopCounter
from examples import llama_stages as ex
from tests import _torchtitan as tt

STEPS, MICROBATCHES, ROWS = 3, 4, 8


@dataclass
class Result:
    worst: float
    """The first step's largest relative gradient difference from one process's."""
    losses: list[float]
    runs: dict[str, int]
    """Compiled backward graphs run in the last step, over both ranks, by kind."""
    split: bool
    """Every compiled region split (none fell back)."""
    flops: int
    """FLOPs of the last step, over both ranks."""
    reference_flops: int
    """FLOPs of one process's forward and full backward of the same microbatches."""


class TorchtitanPipeline(ex.Pipeline):
    """:class:`examples.llama_stages.Pipeline` for torchtitan's own Llama 3: its stages cut by
    torchtitan's ``pipeline_parallel`` helpers (:func:`tests._torchtitan.stages`), each block
    compiled by ``customgrad.compile``, on customgrad's ``PipelineStage``."""

    def __init__(
        self, model: nn.Module, device: torch.device, schedule: str, microbatches: int,
        backend: str,
    ) -> None:  # fmt: skip
        rank, world = dist.get_rank(), dist.get_world_size()
        self.n_stages = 2 * world
        mine = tt.stages(model.to(device), schedule, rank, world)
        self.mine, self.stages = list(mine), list(mine.values())
        for stage in self.stages:
            for block in stage.layers.values():  # type: ignore[operator]
                customgrad.compile(block, backend=backend)
        stages = [cgp.PipelineStage(m, s, self.n_stages, device) for s, m in mine.items()]
        self.schedule = getattr(pipelining, schedule)(stages, microbatches, loss_fn=ex.loss_fn)
        self.microbatches = microbatches
        self.device = device


def _torchtitan_batch(rows: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    tokens = torch.randint(tt.VOCAB, (rows, tt.SEQ + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def run(out_path: str, schedule: str, which: str) -> None:
    torch.manual_seed(0)  # the same model on every rank
    titan = which == "torchtitan"
    model = tt.model("llama3") if titan else ex.Transformer(ex.ModelArgs())
    model = model.to(torch.float64)
    device = torch.device("cpu")
    reference = copy.deepcopy(model)
    make = TorchtitanPipeline if titan else ex.Pipeline
    pipe = make(model, device, schedule, MICROBATCHES, backend="aot_eager")
    gen = torch.Generator().manual_seed(0)
    x, y = _torchtitan_batch(ROWS, gen) if titan else ex.batch(model, ROWS, gen)
    weights = [p for m in pipe.stages for p in m.parameters()]
    optimizer = torch.optim.AdamW(weights, lr=1e-2)
    losses = [pipe.step(x, y)]  # compiles every region
    worst = ex.worst_difference(pipe.stages, reference, x, y, MICROBATCHES)
    for _ in range(STEPS - 1):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        before = _runs()
        with FlopCounter() as counter:
            losses.append(pipe.step(x, y))
        runs = {k: n - before[k] for k, n in _runs().items()}
    with FlopCounter() as ref:
        ex.worst_difference([], reference, x, y, MICROBATCHES)  # forward and full backward
    flops = torch.tensor([counter.total])
    dist.all_reduce(flops)
    everyone: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (runs, all(r.status == "split" for r in regions())))
    if dist.get_rank() == 0:
        total = {k: sum(r[0][k] for r in everyone) for k in runs}  # type: ignore[index]
        split = all(r[1] for r in everyone)  # type: ignore[index]
        result = Result(worst, losses, total, split, int(flops.item()), ref.total)
        Path(out_path).write_bytes(pickle.dumps(result))


def _runs() -> dict[str, int]:
    total = {"full": 0, "input": 0, "weight": 0}
    for region in regions():
        for k, n in region.runs.items():
            total[k] += n
    return total
