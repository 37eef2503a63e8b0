"""customgrad on a GPU machine as it is: one command, no venv, no downloads, bounded in time.

Uses the Python and torch already installed (a supported torch, 2.11 to 2.15), customgrad from
this working tree, and sets ``TRITON_INTERPRET=0`` so that Triton kernels are compiled for the
GPU. Five steps, each in a process of its own with a time limit (a failing or hanging step is
reported and the next one still runs); the whole run stays within ``--budget`` seconds (default
460):

1. ``cuda-tests``: the tests marked ``cuda`` (``pytest -m cuda``): customgrad ops on CUDA
   (kernels, fake, compile), Triton kernels compiled, pipelines with NCCL and streams.
2. ``zero-bubble``: ``ScheduleZBVZeroBubble`` on one device, one process holding both stages of
   the V (as ``benchmarks/compiled.py --device cuda`` does on one GPU), with customgrad's
   ``PipelineStage``; every weight's gradient equal to the unsplit step's (the same blocks, one
   full backward per microbatch), for blocks of customgrad ops, of plain autograd.Functions
   (each backward captured and split automatically) and compiled by ``customgrad.compile`` with
   inductor.
3. ``moe``: the mixture-of-experts grouped GEMM on the device (``customgrad.ops.grouped_mm``:
   ``torch._grouped_mm``; ``triton_grouped_mm``: Triton's kernels compiled), in bfloat16 and
   float32 against a loop over the experts, its split exact (I: the dX GEMMs' FLOPs, W: the dW
   GEMMs'); then ``ScheduleZBVZeroBubble`` on one device with a block of each (router, dispatch,
   grouped experts, combine, shared expert: ``benchmarks/_models.py``'s ``MoEBlock``, no
   torchtitan), every gradient and the step's FLOPs against the unsplit step's.
4. ``split``: ``benchmarks/split.py`` on the device: (I+W)/full FLOPs and time of a split
   backward, customgrad's split and torch's, for customgrad ops, plain Functions and nn.Linear.
5. ``compiled``: ``benchmarks/compiled.py`` on the device: one compiled block's (I+W)/full
   backward time, and ZBV/1F1B step time of compiled and eager blocks.

Steps 3 to 5 are printed as one table. The last line says which steps passed, on which device
(the GPU's name) and torch version::

    python3 -m benchmarks.gpu_check                  # on the GPU machine, from the repo's root
    python3 -m benchmarks.gpu_check --device cpu     # the same steps, small, on CPU (a dry run)
    python3 -m benchmarks.gpu_check --steps zero-bubble moe split

Exit status 0 when every step ran and passed (on CPU: a skipped ``cuda-tests`` counts as
passed only with ``--device cpu``, where it only collects the CUDA tests).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"

STEPS = ("cuda-tests", "zero-bubble", "moe", "split", "compiled")
"""The steps, in the order they run."""

BUDGETS = {"cuda-tests": 185, "zero-bubble": 60, "moe": 40, "split": 40, "compiled": 135}
"""Each step's time limit in seconds on a GPU (the run's ``--budget`` caps their sum)."""

CPU_SLOWER = 4
"""On CPU (``--device cpu``, a dry run on a shared machine) each limit and the budget are this
many times longer: inductor compiles C++ there."""

BUDGET = 460.0
"""The default ``--budget`` on a GPU: the whole run within 8 minutes."""

SIZES = {
    # a model that keeps one H100 busy: ~0.3-3 ms a matmul
    "cuda": {
        "split": ["--width", "4096", "--batch", "8192", "--depth", "4", "--reps", "10"],
        # torch's own stage (nn.Module.compile) left out: one compile less, and before torch
        # 2.13 its split cannot run a compiled block at all
        "compiled": [
            "--dim", "2048", "--hidden", "8192", "--batch", "8192", "--rounds", "4",
            "--reps", "8", "--nproc", "1", "--only", "customgrad", "eager",
        ],
        "zero-bubble": {"dim": 1024, "hidden": 4096, "rows": 512, "microbatches": 4},
        # 8 experts, top-2: 1024 routed rows a microbatch, 128 an expert on average
        "moe": {"dim": 1024, "hidden": 512, "experts": 8, "top_k": 2, "rows": 512,
                "microbatches": 4},
    },
    # a dry run on CPU: the same code paths, small
    "cpu": {
        "split": ["--width", "64", "--batch", "32", "--depth", "2", "--reps", "2"],
        "compiled": [
            "--dim", "32", "--hidden", "64", "--batch", "32", "--microbatches", "4",
            "--rounds", "1", "--reps", "2", "--nproc", "1",
        ],
        "zero-bubble": {"dim": 32, "hidden": 64, "rows": 16, "microbatches": 4},
        "moe": {"dim": 16, "hidden": 16, "experts": 4, "top_k": 2, "rows": 8,
                "microbatches": 4},
    },
}  # fmt: skip


@dataclasses.dataclass
class StepResult:
    """How one step ended: ``status`` is "passed", "failed", "timed out" or "skipped"."""

    name: str
    status: str
    seconds: float
    detail: str = ""
    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)


# --- the steps, each run as a child process ------------------------------------------------


def _child_env(device: str) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(ROOT), str(BENCHMARKS), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    if device == "cuda":
        env["TRITON_INTERPRET"] = "0"  # Triton kernels compiled for the GPU
    return env


def _run(
    name: str, cmd: Sequence[str], timeout: float, env: dict[str, str]
) -> tuple[str, float, str]:
    """Run ``cmd`` for at most ``timeout`` s; return (status, seconds, output)."""
    t0 = time.monotonic()
    print(f"--- {name}: {' '.join(cmd)} (at most {timeout:.0f} s)", flush=True)
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
        status = "passed" if proc.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the step and every process it started
        out, _ = proc.communicate()
        status = "timed out"
    print(out, end="" if out.endswith("\n") else "\n", flush=True)
    return status, time.monotonic() - t0, out


def _last_line(out: str) -> str:
    lines = [ln.strip() for ln in out.strip().splitlines() if ln.strip()]
    return lines[-1][:160] if lines else ""


def step_cuda_tests(device: str, timeout: float, workdir: Path) -> StepResult:
    """``pytest -m cuda`` on a GPU; on CPU, only collect them (what a GPU run would start)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider"]
    cmd += ["--timeout", str(int(max(timeout - 10, 10)))]
    if device != "cuda":
        cmd.append("--collect-only")
    status, seconds, out = _run(
        "cuda-tests", [*cmd, "customgrad", "tests"], timeout, _child_env(device)
    )
    return StepResult("cuda-tests", status, seconds, _last_line(out))


def step_zero_bubble(device: str, timeout: float, workdir: Path) -> StepResult:
    report = workdir / "zero_bubble.json"
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--device", device]
    cmd += ["--child-zero-bubble", str(report)]
    status, seconds, out = _run("zero-bubble", cmd, timeout, _child_env(device))
    rows = json.loads(report.read_text()) if report.exists() else []
    if status == "passed" and not rows:
        status = "failed"
    detail = "; ".join(f"{r['blocks']}: max |grad diff| {r['max_diff']:.1e}" for r in rows)
    return StepResult("zero-bubble", status, seconds, detail or _last_line(out))


def step_moe(device: str, timeout: float, workdir: Path) -> StepResult:
    report = workdir / "moe.json"
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--device", device]
    cmd += ["--child-moe", str(report)]
    status, seconds, out = _run("moe", cmd, timeout, _child_env(device))
    rows = json.loads(report.read_text()) if report.exists() else []
    if status == "passed" and not rows:
        status = "failed"
    table_rows = [
        {"benchmark": "moe", "configuration": r["check"], "flops": r["flops"]} for r in rows
    ]
    worst = max((r["max_diff"] for r in rows), default=0.0)
    detail = f"{len(rows)} checks, max relative difference {worst:.1e}" if rows else ""
    return StepResult("moe", status, seconds, detail or _last_line(out), table_rows)


def step_split(device: str, timeout: float, workdir: Path) -> StepResult:
    report = workdir / "split.json"
    cmd = [sys.executable, str(BENCHMARKS / "split.py"), "--device", device, "--json", str(report)]
    status, seconds, out = _run(
        "split", [*cmd, *SIZES[device]["split"]], timeout, _child_env(device)
    )
    rows = []
    if report.exists():
        for r in json.loads(report.read_text()):
            configuration = f"{r['layers']}, {r['split']}'s split"
            if "error" in r:  # torch's own split with Functions before torch 2.13
                configuration += f" (fails on this torch: {r['error'].split(':')[0]})"
            rows.append({
                "benchmark": "split.py", "configuration": configuration,
                "flops": r.get("flops_ratio"), "time": r.get("time_ratio"),
            })  # fmt: skip
    if status == "passed" and not rows:
        status = "failed"
    return StepResult("split", status, seconds, "" if rows else _last_line(out), rows)


def step_compiled(device: str, timeout: float, workdir: Path) -> StepResult:
    report = workdir / "compiled.json"
    cmd = [sys.executable, str(BENCHMARKS / "compiled.py"), "--device", device]
    cmd += ["--json", str(report), *SIZES[device]["compiled"]]
    status, seconds, out = _run("compiled", cmd, timeout, _child_env(device))
    rows = []
    if report.exists():
        r = json.loads(report.read_text())
        for how, ratio in r.get("block", {}).items():
            rows.append({
                "benchmark": "compiled.py", "configuration": f"one block, {how}",
                "time": ratio,
            })  # fmt: skip
        for label, ratio in r.get("pipeline", {}).items():
            rows.append({
                "benchmark": "compiled.py", "configuration": f"pipeline, {label}",
                "zbv": ratio,
            })  # fmt: skip
    if status == "passed" and not rows:
        status = "failed"
    return StepResult("compiled", status, seconds, "" if rows else _last_line(out), rows)


STEP_FUNCTIONS: dict[str, Callable[[str, float, Path], StepResult]] = {
    "cuda-tests": step_cuda_tests,
    "zero-bubble": step_zero_bubble,
    "moe": step_moe,
    "split": step_split,
    "compiled": step_compiled,
}


# --- the zero-bubble check (in its child process) -------------------------------------------


def zero_bubble_check(device_type: str, report: Path) -> None:
    """ZBV with both stages of the V on this process; gradients against the unsplit step."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import ScheduleZBVZeroBubble

    sys.path.insert(0, str(BENCHMARKS))
    from _models import Block

    import customgrad as cg
    import customgrad.pipelining as cgp

    size = SIZES[device_type]["zero-bubble"]
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, store=dist.HashStore(), rank=0, world_size=1,
        device_id=device if device.type == "cuda" else None,
    )  # fmt: skip
    rows = []
    failures = []
    try:
        gen = torch.Generator().manual_seed(0)
        n_rows = size["rows"] * size["microbatches"]
        x = torch.randn(n_rows, size["dim"], generator=gen).to(device)
        target = torch.randn(n_rows, size["dim"], generator=gen).to(device)

        def loss_fn(out: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.mse_loss(out, tgt)

        for label, impl, compiled in (
            ("customgrad ops", "customgrad", False),
            # the automatic split on this machine's torch: each Function's backward captured
            ("plain autograd.Functions", "function", False),
            ("customgrad.compile (inductor)", "native", True),
        ):

            def blocks(impl: str = impl, compiled: bool = compiled) -> list[torch.nn.Module]:
                g = torch.Generator().manual_seed(1)
                out = [Block(size["dim"], size["hidden"], impl, g).to(device) for _ in range(2)]
                if compiled:
                    for b in out:
                        cg.compile(b, backend="inductor")
                return out

            ref = blocks()
            n = size["microbatches"]
            for xs, ts in zip(x.chunk(n), target.chunk(n)):
                # one full backward a microbatch; the schedule scales gradients by 1/n
                (loss_fn(ref[1](ref[0](xs)), ts) / n).backward()
            split = blocks()
            stages = [cgp.PipelineStage(split[s], s, 2, device) for s in (0, 1)]
            schedule = ScheduleZBVZeroBubble(stages, size["microbatches"], loss_fn=loss_fn)
            schedule.step(x, target=target)
            worst = 0.0
            for (name, p), (_, q) in zip(
                [(n, p) for b in ref for n, p in b.named_parameters()],
                [(n, p) for b in split for n, p in b.named_parameters()],
            ):
                if q.grad is None or p.grad is None:
                    failures.append(f"{label}: {name} has no gradient")
                    continue
                diff = float((p.grad - q.grad).abs().max())
                worst = max(worst, diff)
                if not torch.allclose(q.grad, p.grad, rtol=1e-4, atol=1e-5):
                    failures.append(f"{label}: {name}'s gradient differs by {diff:.2e}")
            if impl == "function":
                split_classes = {name.rpartition(".")[2] for name in cg.summary().split_functions}
                if not {"FnBiasedLinear", "FnRMSNorm"} <= split_classes:
                    failures.append(f"{label}: not split automatically ({cg.summary()})")
            rows.append({"blocks": label, "max_diff": worst})
            print(f"zero-bubble, {label}: max |grad - unsplit grad| = {worst:.2e}", flush=True)
    finally:
        dist.destroy_process_group()
    report.write_text(json.dumps(rows))
    if failures:
        raise SystemExit("zero-bubble: " + "; ".join(failures))


# --- the mixture-of-experts check (in its child process) ------------------------------------


def _relative(a: Any, b: Any) -> float:
    """The largest difference of ``a`` from ``b`` relative to ``b``'s largest magnitude."""
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _loop_grouped_mm(x: Any, w: Any, offs: Any) -> Any:
    """The reference: one matmul per expert in plain torch ops, differentiated by autograd."""
    import torch

    ends = offs.tolist()
    pieces = [x[s:t] @ w[e] for e, (s, t) in enumerate(zip([0, *ends[:-1]], ends))]
    return torch.cat([*pieces, x.new_zeros((x.shape[0] - ends[-1], w.shape[2]))])


def moe_op_checks(device: Any, size: dict[str, int]) -> list[dict[str, Any]]:
    """Each grouped GEMM op in bfloat16 and float32 on ``device`` against the loop, and its
    split: the input pass does the dX GEMMs' FLOPs, the weight pass the dW GEMMs'."""
    import torch

    import customgrad.ops as ops
    from customgrad._flops import FlopCounter
    from customgrad.ops import _triton_grouped_mm
    from customgrad.pipelining import stage_backward_input, stage_backward_weight

    gen = torch.Generator().manual_seed(2)
    m, k, n, e = 2 * size["rows"], size["dim"], size["hidden"], size["experts"]
    counts = torch.multinomial(torch.ones(e), m, replacement=True, generator=gen)
    counts = torch.bincount(counts, minlength=e)
    counts[0], counts[1] = counts[0] + counts[1], 0  # expert 1 gets no tokens
    offs = torch.cumsum(counts, 0, dtype=torch.int32).to(device)
    triton_here = device.type in _triton_grouped_mm.DEVICE_TYPES
    rows = []
    for op, label in (
        (ops.grouped_mm, "grouped_mm"),
        (ops.triton_grouped_mm, "triton_grouped_mm" + ("" if triton_here else " (no Triton)")),
    ):
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(m, k, generator=gen).to(device, dtype).requires_grad_()
            w = torch.randn(e, n, k, generator=gen).to(device, dtype).transpose(-2, -1)
            w = (w / k**0.5).detach().requires_grad_()
            y = op(x, w, offs)
            grad = torch.randn(y.shape, generator=gen).to(device, dtype)
            ref = _loop_grouped_mm(x, w, offs)
            want = torch.autograd.grad(ref, (x, w), grad)
            with FlopCounter() as flops:
                flops.key = "input"
                _, groups = stage_backward_input([y], [grad], [x], iter([w]))
                flops.key = "weight"
                stage_backward_weight(iter([w]), groups)
            assert x.grad is not None and w.grad is not None
            diff = max(_relative(y, ref), _relative(x.grad, want[0]), _relative(w.grad, want[1]))
            gemm = 2 * m * k * n
            exact = flops.by_key == {"input": gemm, "weight": gemm}
            rows.append({
                "check": f"{label}, {str(dtype).removeprefix('torch.')}, split",
                "max_diff": diff, "flops": (flops.total / (2 * gemm)) if exact else None,
            })  # fmt: skip
            print(f"moe, {rows[-1]['check']}: max relative difference {diff:.1e}, "
                  f"FLOPs I {flops.by_key['input']} W {flops.by_key['weight']} (each {gemm})",
                  flush=True)  # fmt: skip
            tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
            if diff > tolerance or not exact:
                raise SystemExit(f"moe: {rows[-1]['check']}: difference {diff:.2e}, FLOPs "
                                 f"{dict(flops.by_key)} where each pass does {gemm}")  # fmt: skip
    return rows


def moe_zero_bubble(device: Any, size: dict[str, int]) -> list[dict[str, Any]]:
    """ZBV on one device, both stages of the V in this process, a ``MoEBlock`` each, with each
    grouped GEMM op: every gradient and the step's FLOPs against the unsplit step's."""
    import torch
    from torch.distributed.pipelining import ScheduleZBVZeroBubble

    sys.path.insert(0, str(BENCHMARKS))
    from _models import MoEBlock

    import customgrad.ops as ops
    import customgrad.pipelining as cgp
    from customgrad._flops import FlopCounter

    gen = torch.Generator().manual_seed(0)
    mb = size["microbatches"]
    x = torch.randn(size["rows"] * mb, size["dim"], generator=gen).to(device)
    target = torch.randn(size["rows"] * mb, size["dim"], generator=gen).to(device)

    def loss_fn(out: Any, tgt: Any) -> Any:
        return torch.nn.functional.mse_loss(out, tgt)

    rows = []
    for op, label in ((ops.grouped_mm, "grouped_mm"), (ops.triton_grouped_mm, "triton_grouped_mm")):

        def blocks(op: Any = op) -> list[torch.nn.Module]:
            g = torch.Generator().manual_seed(1)
            args = (size["dim"], size["hidden"], size["experts"], size["top_k"], g)
            return [MoEBlock(*args, grouped_mm=op).to(device) for _ in range(2)]

        def unsplit_step(ref: list[torch.nn.Module]) -> None:
            for xs, ts in zip(x.chunk(mb), target.chunk(mb)):
                # one full backward a microbatch; the schedule scales gradients by 1/n
                (loss_fn(ref[1](ref[0](xs)), ts) / mb).backward()

        ref = blocks()
        unsplit_step(ref)
        with FlopCounter() as unsplit:  # apart: under a dispatch mode some bfloat16 kernels
            unsplit_step(blocks())  # round otherwise (silu's backward, by one unit)
        split = blocks()
        stages = [cgp.PipelineStage(split[s], s, 2, device) for s in (0, 1)]
        schedule = ScheduleZBVZeroBubble(stages, mb, loss_fn=loss_fn)
        schedule.step(x, target=target)
        worst = 0.0
        for b, c in zip(ref, split):
            for (name, p), q in zip(b.named_parameters(), c.parameters()):
                if p.grad is None or q.grad is None:
                    raise SystemExit(f"moe: ZBV, {label}: {name} has no gradient")
                worst = max(worst, _relative(q.grad, p.grad))
        for b in split:
            b.zero_grad(set_to_none=True)
        with FlopCounter() as step:  # the second step: the first also infers shapes
            schedule.step(x, target=target)
        rows.append({
            "check": f"ZBV, MoE blocks of {label}",
            "max_diff": worst, "flops": step.total / unsplit.total,
        })  # fmt: skip
        print(f"moe, ZBV with {label}: max relative gradient difference {worst:.1e}, step "
              f"FLOPs {step.total} (unsplit {unsplit.total})", flush=True)  # fmt: skip
        if worst > 1e-3 or step.total != unsplit.total:
            raise SystemExit(f"moe: ZBV, {label}: gradients differ by {worst:.2e} (relative), "
                             f"FLOPs {step.total} against {unsplit.total} unsplit")  # fmt: skip
    return rows


def moe_check(device_type: str, report: Path) -> None:
    """The ``moe`` step: :func:`moe_op_checks`, then :func:`moe_zero_bubble`."""
    import torch
    import torch.distributed as dist

    size = SIZES[device_type]["moe"]
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rows: list[dict[str, Any]] = []
    try:
        rows += moe_op_checks(device, size)
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
            world_size=1, device_id=device if device.type == "cuda" else None,
        )  # fmt: skip
        try:
            rows += moe_zero_bubble(device, size)
        finally:
            dist.destroy_process_group()
    finally:
        report.write_text(json.dumps(rows))


# --- table and summary -----------------------------------------------------------------------


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def table(results: Sequence[StepResult]) -> str:
    """The benchmarks' figures as one table."""
    rows = [r for res in results for r in res.rows]
    header = ("benchmark", "configuration", "(I+W)/full FLOPs", "(I+W)/full time", "ZBV/1F1B")
    body = [
        (r["benchmark"], r["configuration"], _fmt(r.get("flops")), _fmt(r.get("time")),
         _fmt(r.get("zbv")))
        for r in rows
    ]  # fmt: skip
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summary(results: Sequence[StepResult], device_name: str, torch_version: str) -> str:
    """The last line: which steps passed, on which device, with which torch."""
    passed = [r.name for r in results if r.status == "passed"]
    others = [f"{r.name} {r.status}" for r in results if r.status != "passed"]
    text = f"gpu_check: {len(passed)}/{len(results)} passed ({', '.join(passed) or 'none'})"
    if others:
        text += f"; {', '.join(others)}"
    return f"{text}; device {device_name}; torch {torch_version}"


def device_name(device: str) -> str:
    import torch

    if device == "cuda":
        if not torch.cuda.is_available():
            return "no CUDA GPU visible"
        return str(torch.cuda.get_device_name(0))
    return "cpu (dry run)"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument(
        "--steps", nargs="+", choices=STEPS, default=list(STEPS), metavar="STEP",
        help=f"steps to run, of {', '.join(STEPS)} (default: all)",
    )  # fmt: skip
    p.add_argument(
        "--budget", type=float,
        help=f"seconds for the whole run (default {BUDGET:.0f}; {CPU_SLOWER}x that on CPU)",
    )  # fmt: skip
    p.add_argument("--child-zero-bubble", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--child-moe", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.budget is None:
        args.budget = BUDGET * (1 if args.device == "cuda" else CPU_SLOWER)
    if args.budget <= 0:
        p.error(f"--budget must be positive, got {args.budget}")
    args.steps = [s for s in STEPS if s in args.steps]  # run order, once each
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child_zero_bubble is not None:
        zero_bubble_check(args.device, args.child_zero_bubble)
        return 0
    if args.child_moe is not None:
        moe_check(args.device, args.child_moe)
        return 0
    import torch

    start = time.monotonic()
    results: list[StepResult] = []
    name = device_name(args.device)
    no_gpu = args.device == "cuda" and not torch.cuda.is_available()
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        for step in args.steps:
            left = args.budget - (time.monotonic() - start)
            if no_gpu:
                results.append(StepResult(step, "skipped", 0.0, "no CUDA GPU visible"))
                continue
            if left < 10:
                results.append(StepResult(step, "skipped", 0.0, "out of --budget"))
                continue
            timeout = min(BUDGETS[step] * (1 if args.device == "cuda" else CPU_SLOWER), left)
            try:
                results.append(STEP_FUNCTIONS[step](args.device, timeout, Path(tmp)))
            except Exception as e:  # a step's own bug: report it, run the others
                results.append(StepResult(step, "failed", 0.0, f"{type(e).__name__}: {e}"))
    print()
    print(table(results))
    print()
    for r in results:
        print(f"{r.name:12} {r.status:10} {r.seconds:6.1f} s  {r.detail}")
    print(summary(results, name, torch.__version__), flush=True)
    return 0 if results and all(r.status == "passed" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
