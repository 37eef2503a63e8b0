"""Per-pass FLOPs and times of a split backward (I then W) against a full backward.

An MLP of width 1024 made of customgrad ops, of plain ``autograd.Function``\\ s and of
``nn.Linear``, split by torch's ``stage_backward_input`` / ``stage_backward_weight`` and by
customgrad's. Targets: customgrad (I+W)/full FLOPs = 1.00 (plain Function: about 2), time
(I+W)/full <= 1.15.

Run: ``python benchmarks/split.py [--width 1024] [--batch 512] [--depth 4] [--reps 5]
[--device cuda] [--json out.json]`` (``--json``: the table's rows, for ``benchmarks.gpu_check``)
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from typing import Any

import torch
from _models import LAYERS, MLP
from torch import Tensor, nn
from torch.distributed.pipelining import _backward as torch_split

from customgrad import pipelining as cg_split
from customgrad._flops import FlopCounter


def _passes(model: nn.Module, x: Tensor, g: Tensor, split: Any, clock: Any) -> None:
    """Forward, then I and W with ``split``'s functions; ``clock(name)`` marks pass starts."""
    x = x.detach().requires_grad_()
    out = model(x)
    clock("I")
    _, groups = split.stage_backward_input([out], [g], [x], model.parameters())
    clock("W")
    split.stage_backward_weight(model.parameters(), groups)
    clock(None)


def _full(model: nn.Module, x: Tensor, g: Tensor, clock: Any) -> None:
    x = x.detach().requires_grad_()
    out = model(x)
    clock("full")
    out.backward(g)
    clock(None)


def measure(kind: str, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """FLOPs and best times per pass, for each split; runs are interleaved against noise."""
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = MLP(kind, args.width, args.depth).to(device)
    x = torch.randn(args.batch, args.width, device=device)
    g = torch.randn(args.batch, args.width, device=device)
    splits = {"torch": torch_split, "customgrad": cg_split}

    def run(which: str, clock: Any) -> None:
        if which == "full":
            _full(model, x, g, clock)
        else:
            _passes(model, x, g, splits[which], clock)
        model.zero_grad(set_to_none=True)

    flops: dict[str, dict[str, float]] = {}
    times: dict[str, dict[str, list[float]]] = {}
    failed: dict[str, str] = {}
    for which in ("full", *splits):
        with FlopCounter() as counter:

            def mark(name: str | None, c: FlopCounter = counter) -> None:
                c.key = name

            try:
                run(which, mark)
            except RuntimeError as e:  # torch's split with Functions before torch 2.13
                if which == "full":
                    raise
                failed[which] = f"{type(e).__name__}: {str(e).splitlines()[0][:70]}"
                model.zero_grad(set_to_none=True)
                continue
        flops[which] = {k: v for k, v in counter.by_key.items() if k is not None}
        times[which] = {}
    for rep in range(args.reps + 1):  # the first round warms up
        for which in [w for w in ("full", *splits) if w not in failed]:
            marks: list[tuple[str | None, float]] = []

            def clock(name: str | None, marks: list[tuple[str | None, float]] = marks) -> None:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                marks.append((name, time.perf_counter()))

            run(which, clock)
            for (name, t0), (_, t1) in itertools.pairwise(marks):
                if rep and name is not None:
                    times[which].setdefault(name, []).append(t1 - t0)
    result: dict[str, dict[str, Any]] = {}
    for name in splits:
        if name in failed:
            result[name] = {"error": failed[name]}
            continue
        # a pass that ran no counted op (a plain Function's W under customgrad's split) has no key
        r = {f"flops_{k}": flops[name].get(k, 0.0) for k in ("I", "W")}
        r["flops_full"] = flops["full"]["full"]
        r.update({f"time_{k}": min(v) for k, v in times[name].items()})
        r["time_full"] = min(times["full"]["full"])
        result[name] = r
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json", help="also write the rows to this file, as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"MLP width {args.width}, depth {args.depth}, batch {args.batch}, "
        f"torch {torch.__version__}, {args.device}, {torch.get_num_threads()} threads, "
        f"best of {args.reps}"
    )
    header = (
        f"{'layers':18} {'split':10} {'full GF':>8} {'I GF':>7} {'W GF':>7} {'(I+W)/full':>10}"
        f" {'full ms':>8} {'I ms':>7} {'W ms':>7} {'(I+W)/full':>10}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for kind in LAYERS:
        for split_name, r in measure(kind, args).items():
            if "error" in r:
                print(f"{kind:18} {split_name:10} fails on this torch: {r['error']}")
                rows.append({"layers": kind, "split": split_name, "error": r["error"]})
                continue
            f_ratio = (r["flops_I"] + r["flops_W"]) / r["flops_full"]
            t_ratio = (r["time_I"] + r["time_W"]) / r["time_full"]
            rows.append(
                {"layers": kind, "split": split_name, "flops_ratio": f_ratio, "time_ratio": t_ratio}
            )
            print(
                f"{kind:18} {split_name:10} {r['flops_full'] / 1e9:8.2f} {r['flops_I'] / 1e9:7.2f}"
                f" {r['flops_W'] / 1e9:7.2f} {f_ratio:10.2f} {r['time_full'] * 1e3:8.1f}"
                f" {r['time_I'] * 1e3:7.1f} {r['time_W'] * 1e3:7.1f} {t_ratio:10.2f}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    main()
