"""Workers for ``tests/test_pp_fsdp_compile.py``: PP x FSDP2 with blocks compiled by
``customgrad.compile(block, fullgraph=True)``, torchtitan's configuration.

4 processes (gloo on CPU): a 2-D ``DeviceMesh`` ("dp", "pp") of 2 x 2; each rank holds two
stages of ``ScheduleZBVZeroBubble`` (one block each, the model of ``tests/_pp_dp_worker.py``),
each block ``fully_shard``\\ ed over its "dp" group (``reshard_after_forward=False``) and compiled
with ``fullgraph=True``, in either order. Two steps per order (the first also infers shapes);
the second's gradients against one process's over the whole batch, and how often each compiled
region ran its I and W graphs.
"""

from __future__ import annotations

import datetime
import os
import pickle
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

import customgrad as cg
from customgrad._compile import regions
from customgrad.pipelining import PipelineStage
from tests._pp_dp_worker import (
    BATCH,
    DP,
    MICROBATCHES,
    PP,
    Block,
    WorkerFailed,
    _free_port,
    loss_fn,
    make_batch,
    reference_grads,
    stages_of,
)

ORDERS = ("fully_shard, then compile", "compile, then fully_shard")
STEPS = 2


def run_order(order: str, mesh: Any, device: torch.device) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    n_stages = 2 * PP
    mine = stages_of("ScheduleZBVZeroBubble", pp_rank)
    blocks = {s: Block(seed=s).to(device) for s in mine}
    for block in blocks.values():
        if order == ORDERS[0]:
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False)
            cg.compile(block, backend="aot_eager", fullgraph=True)
        else:
            cg.compile(block, backend="aot_eager", fullgraph=True)
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False)
    stages = [
        PipelineStage(b, s, n_stages, device, group=mesh["pp"].get_group())
        for s, b in blocks.items()
    ]
    schedule = torch.distributed.pipelining.ScheduleZBVZeroBubble(
        stages, n_microbatches=MICROBATCHES, loss_fn=loss_fn
    )
    x, t = make_batch(device)
    half = BATCH // DP
    x, t = x[dp_rank * half : (dp_rank + 1) * half], t[dp_rank * half : (dp_rank + 1) * half]
    args = (x,) if 0 in mine else ()
    kwargs = {"target": t} if n_stages - 1 in mine else {}
    want = reference_grads(n_stages, (), device)
    before = {id(r): dict(r.runs) for r in regions()}
    for _ in range(STEPS):
        for b in blocks.values():
            b.zero_grad(set_to_none=True)
        schedule.step(*args, **kwargs)
    mismatch = []
    for s, b in blocks.items():
        for n, p in b.named_parameters():
            name = f"{s}.{n}"
            g = p.grad
            if g is None:
                mismatch.append(f"{name}: no gradient")
                continue
            g = g.full_tensor()  # type: ignore[attr-defined]
            if not torch.allclose(g, want[name], rtol=1e-10, atol=1e-12):
                mismatch.append(f"{name}: max abs difference {(g - want[name]).abs().max():.3g}")
    runs = {
        r.name: {k: n - before.get(id(r), {}).get(k, 0) for k, n in r.runs.items()}
        for r in regions()
    }
    return {
        "stages": mine,
        "mismatch": mismatch,
        "runs": {k: v for k, v in runs.items() if any(v.values())},
        "status": {r.name: r.status for r in regions()},
    }


def _run(rank: int, port: int, out_path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=PP * DP, timeout=datetime.timedelta(seconds=60)
    )
    try:
        mesh = init_device_mesh("cpu", (DP, PP), mesh_dim_names=("dp", "pp"))
        outcomes = {order: run_order(order, mesh, torch.device("cpu")) for order in ORDERS}
        gathered: list[Any] | None = [None] * (PP * DP) if rank == 0 else None
        dist.gather_object(outcomes, gathered, dst=0)
        if gathered is not None:
            Path(out_path).write_bytes(pickle.dumps(gathered))
    finally:
        dist.destroy_process_group()


def spawn(out_path: str, timeout: float) -> list[dict[str, Any]]:
    """Run both orders on 4 processes; each rank's outcomes (index = global rank). Every worker
    is stopped when one fails or ``timeout`` passes (``WorkerFailed``)."""
    ctx = mp.start_processes(
        _run, args=(_free_port(), out_path), nprocs=PP * DP, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                raise WorkerFailed(f"PP x FSDP2 compiled run still going after {timeout:.0f}s")
    except ProcessException as e:
        raise WorkerFailed(f"a worker failed: {e}") from None
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        for p in ctx.processes:
            p.join(5)
    result: list[dict[str, Any]] = pickle.loads(Path(out_path).read_bytes())
    return result
