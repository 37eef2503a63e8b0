"""Per-call overhead of customgrad ops against the anchors, measured in the same run.

Run: ``.venv/bin/python benchmarks/overhead.py`` (``--quick`` for a short run).

A small linear (8x16 input, 16x16 weight), as a customgrad op with the input/weight pair
("pair"), with one backward that honours ``ctx.needs_input_grad`` (``split="phase"``) and with
one backward that returns every gradient, split automatically (``split="auto"``, the default),
without and with an ``Optional`` bias, and a ``list[Tensor]`` op (a weighted sum of two
tensors). Each is timed on every ordinary path:

- ``fwd no_grad``: the forward under ``torch.no_grad()``;
- ``backward``: forward + ``out.backward(g)`` (only the op's node runs in the backward);
- ``autograd.grad``: forward + ``torch.autograd.grad(out, inputs, g)`` (the inputs are leaves
  that ``autograd.grad`` captures);

against the same maths as a plain ``torch.autograd.Function`` and as a
``torch.library.custom_op`` with ``register_autograd``. Then the input (I) and weight (W) passes
of a 4-layer MLP (width 16) of customgrad ops through ``customgrad.pipelining``, against the
same passes of ``nn.Linear`` layers and of plain ``autograd.Function`` layers through torch's
own ``stage_backward_input``/``_weight`` (a Function computes its whole backward in both).

Times are **CPU time of this process** (``process_time``), the minimum over rounds that each
time every implementation in turn, with ``torch.set_num_threads(1)``: load on a shared machine
then moves the figures little and the ratios stay stable. They are per-call overheads, not
throughput. The tables end with the ratios the project targets.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.pipelining import _backward as torch_split

import customgrad as cg
from customgrad.pipelining import stage_backward_input, stage_backward_weight

torch.set_num_threads(1)

# --- the maths --------------------------------------------------------------------------------


def _linear(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    out = x @ w.mT
    return out if b is None else out + b


class LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        return _linear(x, w, b)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        x, w = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        return (
            g @ w if need_x else None,
            g.mT @ x if need_w else None,
            g.sum(0) if need_b and ctx.has_bias else None,
        )


class SumFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x0: Tensor, x1: Tensor, s0: Tensor, s1: Tensor) -> Tensor:
        ctx.save_for_backward(x0, x1, s0, s1)
        return x0 * s0 + x1 * s1

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, ...]:
        x0, x1, s0, s1 = ctx.saved_tensors
        return g * s0, g * s1, (g * x0).sum(0), (g * x1).sum(0)


@torch.library.custom_op("cg_bench_co::linear", mutates_args=())
def co_linear(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    return _linear(x, w, b)


co_linear.register_fake(lambda x, w, b=None: x.new_empty(x.shape[0], w.shape[0]))


def _co_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.has_bias = inputs[2] is not None


def _co_bwd(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
    x, w = ctx.saved_tensors
    return g @ w, g.mT @ x, g.sum(0) if ctx.has_bias else None


co_linear.register_autograd(_co_bwd, setup_context=_co_setup)


@torch.library.custom_op("cg_bench_co::wsum", mutates_args=())
def co_wsum(xs: list[Tensor], scales: list[Tensor]) -> Tensor:
    return xs[0] * scales[0] + xs[1] * scales[1]


co_wsum.register_fake(lambda xs, scales: torch.empty_like(xs[0]))


def _co_wsum_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.save_for_backward(*inputs[0], *inputs[1])


def _co_wsum_bwd(ctx: Any, g: Tensor) -> tuple[list[Tensor], list[Tensor]]:
    x0, x1, s0, s1 = ctx.saved_tensors
    return [g * s0, g * s1], [(g * x0).sum(0), (g * x1).sum(0)]


co_wsum.register_autograd(_co_wsum_bwd, setup_context=_co_wsum_setup)


def _cg_linear(name: str, style: str) -> cg.CustomOp[..., Tensor]:
    @cg.op(name, weights=("w", "b"))
    def linear(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
        return _linear(x, w, b)

    linear.register_fake(lambda x, w, b=None: x.new_empty(x.shape[0], w.shape[0]))
    linear.register_save_for_backward(lambda inputs, out: (inputs.x, inputs.w, inputs.b))
    if style == "pair":
        linear.register_backward_input(lambda ctx, s, g: {"x": g @ s[1]})
        linear.register_backward_weight(
            lambda ctx, s, g: {"w": g.mT @ s[0], "b": None if s[2] is None else g.sum(0)}
        )
    elif style == "auto":
        linear.register_backward(
            lambda ctx, s, g: {
                "x": g @ s[1],
                "w": g.mT @ s[0],
                "b": None if s[2] is None else g.sum(0),
            }
        )
    else:

        @linear.register_backward(split="phase")
        def _(ctx: cg.BackwardContext, s: Any, g: Tensor) -> dict[str, Any]:
            x, w, _b = s
            out: dict[str, Any] = {}
            if ctx.needs_input_grad("x"):
                out["x"] = g @ w
            if ctx.needs_input_grad("w"):
                out["w"] = g.mT @ x
            if ctx.needs_input_grad("b"):
                out["b"] = g.sum(0)
            return out

    return linear


def _cg_wsum(name: str, style: str) -> cg.CustomOp[..., Tensor]:
    @cg.op(name, weights=("scales",))
    def wsum(xs: list[Tensor], scales: list[Tensor]) -> Tensor:
        return xs[0] * scales[0] + xs[1] * scales[1]

    wsum.register_fake(lambda xs, scales: torch.empty_like(xs[0]))
    wsum.register_save_for_backward(lambda inputs, out: (*inputs.xs, *inputs.scales))
    if style == "pair":
        wsum.register_backward_input(lambda ctx, s, g: {"xs": [g * s[2], g * s[3]]})
        wsum.register_backward_weight(
            lambda ctx, s, g: {"scales": [(g * s[0]).sum(0), (g * s[1]).sum(0)]}
        )
    elif style == "auto":
        wsum.register_backward(
            lambda ctx, s, g: {
                "xs": [g * s[2], g * s[3]],
                "scales": [(g * s[0]).sum(0), (g * s[1]).sum(0)],
            }
        )
    else:

        @wsum.register_backward(split="phase")
        def _(ctx: cg.BackwardContext, s: Any, g: Tensor) -> dict[str, Any]:
            x0, x1, s0, s1 = s
            out: dict[str, Any] = {}
            if ctx.needs_input_grad("xs"):
                out["xs"] = [g * s0, g * s1]
            if ctx.needs_input_grad("scales"):
                out["scales"] = [(g * x0).sum(0), (g * x1).sum(0)]
            return out

    return wsum


STYLES = ("pair", "phase", "auto")
CG = {("linear", s): _cg_linear(f"cg_bench::linear_{s}", s) for s in STYLES}
CG.update({("wsum", s): _cg_wsum(f"cg_bench::wsum_{s}", s) for s in STYLES})


# --- the cases --------------------------------------------------------------------------------


def _cases() -> dict[str, tuple[Tensor, list[Tensor], dict[str, Callable[[], Tensor]]]]:
    """case -> (output gradient, leaves, {implementation: forward})."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 16, generator=g, requires_grad=True)
    w = torch.randn(16, 16, generator=g, requires_grad=True)
    b = torch.randn(16, generator=g, requires_grad=True)
    xs = [torch.randn(8, 16, generator=g, requires_grad=True) for _ in range(2)]
    ss = [torch.randn(16, generator=g, requires_grad=True) for _ in range(2)]
    grad = torch.ones(8, 16)
    cases: dict[str, tuple[Tensor, list[Tensor], dict[str, Callable[[], Tensor]]]] = {}
    for bias in (False, True):
        bb = b if bias else None
        cases[f"linear{' + Optional bias' if bias else ''}"] = (
            grad,
            [x, w, b] if bias else [x, w],
            {
                "autograd.Function": lambda bb=bb: LinearFn.apply(x, w, bb),
                "custom_op": lambda bb=bb: co_linear(x, w, bb),
                "customgrad pair": lambda bb=bb: CG["linear", "pair"](x, w, bb),
                "customgrad phase": lambda bb=bb: CG["linear", "phase"](x, w, bb),
                "customgrad auto": lambda bb=bb: CG["linear", "auto"](x, w, bb),
            },
        )
    cases["list[Tensor] args"] = (
        grad,
        [*xs, *ss],
        {
            "autograd.Function": lambda: SumFn.apply(*xs, *ss),
            "custom_op": lambda: co_wsum(xs, ss),
            "customgrad pair": lambda: CG["wsum", "pair"](xs, ss),
            "customgrad phase": lambda: CG["wsum", "phase"](xs, ss),
            "customgrad auto": lambda: CG["wsum", "auto"](xs, ss),
        },
    )
    return cases


MODES = ("fwd no_grad", "backward", "autograd.grad")


def _timed(fwd: Callable[[], Tensor], grad: Tensor, leaves: list[Tensor], mode: str) -> Any:
    if mode == "fwd no_grad":

        def run() -> None:
            with torch.no_grad():
                fwd()

    elif mode == "backward":

        def run() -> None:
            fwd().backward(grad)

    else:

        def run() -> None:
            torch.autograd.grad(fwd(), leaves, grad)

    return run


def _time_all(fns: dict[Any, Callable[[], Any]], number: int, repeat: int) -> dict[Any, float]:
    """CPU microseconds per call of each function: the minimum over ``repeat`` rounds.

    Each round times ``number`` calls of every function in turn, so that load that comes and
    goes on a shared machine touches all of them alike.
    """
    best = {key: float("inf") for key in fns}
    for fn in fns.values():
        for _ in range(20):
            fn()
    for _ in range(repeat):
        for key, fn in fns.items():
            start = time.process_time()
            for _ in range(number):
                fn()
            best[key] = min(best[key], (time.process_time() - start) / number * 1e6)
    return best


# --- a stage's I and W passes -------------------------------------------------------------------


class MLP(nn.Module):
    """Linear layers with ReLU between: native ``nn.Linear``, customgrad ops, or plain
    ``autograd.Function`` layers (``kind``)."""

    def __init__(self, kind: str, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.kind = kind
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: Tensor) -> Tensor:
        for i, layer in enumerate(self.layers):
            if self.kind == "native":
                x = layer(x)
            elif self.kind == "customgrad":
                x = CG["linear", "pair"](x, layer.weight, layer.bias)
            else:
                x = LinearFn.apply(x, layer.weight, layer.bias)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


def _time_passes(number: int, repeat: int) -> dict[tuple[str, str], float]:
    """(implementation, pass) -> CPU µs per microbatch of that pass, forward not included.

    Each round builds ``number`` forwards per implementation (untimed), then times I over all
    of them, then W; implementations take turns within a round.
    """
    x = torch.randn(8, 16, requires_grad=True)
    g = torch.ones(8, 16)
    impls = {
        "nn.Linear, torch's split": (
            MLP("native"),
            torch_split.stage_backward_input,
            torch_split.stage_backward_weight,
        ),
        "autograd.Function, torch's split": (
            MLP("function"),
            torch_split.stage_backward_input,
            torch_split.stage_backward_weight,
        ),
        "customgrad ops, customgrad.pipelining": (
            MLP("customgrad"),
            stage_backward_input,
            stage_backward_weight,
        ),
    }
    best = {(impl, p): float("inf") for impl in impls for p in ("I", "W")}
    for r in range(repeat + 1):  # the first round warms up
        for impl, (model, split_in, split_w) in impls.items():
            outs = [model(x) for _ in range(number)]
            start = time.process_time()
            groups = [split_in([out], [g], [x], model.parameters())[1] for out in outs]
            t_in = (time.process_time() - start) / number * 1e6
            del outs
            start = time.process_time()
            for group in groups:
                split_w(model.parameters(), group)
            t_w = (time.process_time() - start) / number * 1e6
            x.grad = None
            if r:
                best[impl, "I"] = min(best[impl, "I"], t_in)
                best[impl, "W"] = min(best[impl, "W"], t_w)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (for CI smoke runs)")
    args = parser.parse_args()
    number, repeat = (100, 3) if args.quick else (500, 15)

    cases = _cases()
    fns: dict[Any, Callable[[], Any]] = {}
    for case, (grad, leaves, impls) in cases.items():
        for impl, fwd in impls.items():
            for mode in MODES:
                fns[case, impl, mode] = _timed(fwd, grad, leaves, mode)
    r = _time_all(fns, number, repeat)

    print(
        f"CPU time per call in µs (process_time, min of {repeat} rounds x {number}, 1 thread; "
        f"torch {torch.__version__})\n"
    )
    print("| op | implementation | " + " | ".join(MODES) + " |")
    print("|---|---|" + "---:|" * len(MODES))
    for case, (_, _, impls) in cases.items():
        for impl in impls:
            cells = " | ".join(f"{r[case, impl, m]:.1f}" for m in MODES)
            print(f"| {case} | {impl} | {cells} |")

    print(
        "\n| op | path | customgrad / Function: pair, phase, auto [<= 1.15] | "
        "customgrad / custom_op: pair, phase, auto [<= 0.60] |"
    )
    print("|---|---|---:|---:|")
    for case in cases:
        for mode in MODES[1:]:
            fn = r[case, "autograd.Function", mode]
            co = r[case, "custom_op", mode]
            ours = [r[case, f"customgrad {s}", mode] for s in STYLES]
            print(
                f"| {case} | {mode} | {', '.join(f'{t / fn:.2f}' for t in ours)} | "
                f"{', '.join(f'{t / co:.2f}' for t in ours)} |"
            )

    # The automatic split's cost: per node, the capture is selected by dynamo's guard manager
    # (customgrad._autosplit), then the generated passes run as a pair's would.
    print("\n| op | path | customgrad auto / customgrad pair [<= 1.20] |")
    print("|---|---|---:|")
    for case in cases:
        for mode in MODES[1:]:
            auto, pair = r[case, "customgrad auto", mode], r[case, "customgrad pair", mode]
            print(f"| {case} | {mode} | {auto / pair:.2f} |")

    pipe = _time_passes(max(1, number // 5), repeat)
    print()
    print("A 4-layer MLP (width 16, batch 8): µs per microbatch and pass, forward excluded")
    print("| implementation | I | W | I + W |")
    print("|---|---:|---:|---:|")
    for impl in sorted({k[0] for k in pipe}):
        i, w = pipe[impl, "I"], pipe[impl, "W"]
        print(f"| {impl} | {i:.1f} | {w:.1f} | {i + w:.1f} |")
    native, ours = "nn.Linear, torch's split", "customgrad ops, customgrad.pipelining"
    function = "autograd.Function, torch's split"
    print()
    for anchor, target in ((native, " [<= 1.10]"), (function, "")):
        ratio = {p: pipe[ours, p] / pipe[anchor, p] for p in ("I", "W")}
        total = (pipe[ours, "I"] + pipe[ours, "W"]) / (pipe[anchor, "I"] + pipe[anchor, "W"])
        print(
            f"customgrad.pipelining passes / {anchor}{target}: "
            f"I {ratio['I']:.2f}, W {ratio['W']:.2f}, I + W {total:.2f}"
        )


if __name__ == "__main__":
    main()
