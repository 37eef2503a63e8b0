"""Bytes kept alive between I and W, per microbatch: torch's split, customgrad's split, the queue.

Every tensor created during a microbatch's forward and input pass (I) is tracked by its
storage (a weak reference follows the storage itself, so tensors held only inside autograd
nodes or closures count). After I, the caller drops what a pipeline stage drops (its outputs,
its input gradients, which go to the previous stage); what is still alive is what the weight
pass (W) keeps: saved activations, captured output gradients, deferred work. The stage's input
and output gradient, the parameters and their ``.grad`` are not counted.

"W needs" is the lower bound: for each layer, its input and its output gradient (the first
layer's input is the stage input, not counted).

Run: ``python benchmarks/split_memory.py [--width 512] [--batch 256] [--depth 4]``
"""

from __future__ import annotations

import argparse
import gc
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from _models import LAYERS, MLP
from torch import Tensor
from torch.distributed.pipelining import _backward as torch_split
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from customgrad import pipelining as cg_split


class Tracker(TorchDispatchMode):
    """Weak references to the storage of every tensor an op creates."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[weakref.ref[Any], int]] = {}

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, Tensor):
                s = t.untyped_storage()
                self.storages.setdefault(id(s), (weakref.ref(s), s.nbytes()))
        return out

    def alive(self, exclude: set[int]) -> int:
        gc.collect()
        total = 0
        for ref, nbytes in self.storages.values():
            s = ref()
            if s is not None and s.data_ptr() not in exclude:
                total += nbytes
        return total


def kept_between_i_and_w(kind: str, mode: str, args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    # sin saves its input, which W does not need
    model = MLP(kind, args.width, args.depth, act=torch.sin)
    x = torch.randn(args.batch, args.width, requires_grad=True)
    g = torch.randn(args.batch, args.width)
    queue = cg_split.WeightGradQueue()
    tracker = Tracker()
    with tracker:
        if mode == "queue":
            with queue.microbatch(0, 0):
                out = model(x)
            queue.backward(out, g, inputs=[x])
            finish: Callable[[], None] = lambda: queue.run(0, 0)  # noqa: E731
        else:
            split = torch_split if mode == "torch split" else cg_split
            out = model(x)
            dinputs, groups = split.stage_backward_input([out], [g], [x], model.parameters())
            del dinputs  # sent to the previous stage

            def finish() -> None:
                split.stage_backward_weight(model.parameters(), groups)

        x.grad = None
        del out
        owned = [*model.parameters(), x, g] + [
            p.grad for p in model.parameters() if p.grad is not None
        ]
        exclude = {t.untyped_storage().data_ptr() for t in owned}
        kept = tracker.alive(exclude)
    finish()
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    args = parser.parse_args()
    act = args.batch * args.width * 4
    need = (2 * args.depth - 1) * act
    print(
        f"MLP of {args.depth} layers (sin after each), width {args.width}, batch {args.batch}, "
        f"fp32; one activation = {act / 2**20:.2f} MiB"
    )
    print(f"W needs (layer inputs and output gradients): {need / 2**20:.2f} MiB")
    header = f"{'layers':18} {'mode':16} {'kept MiB':>9} {'activations':>12} {'/ W needs':>10}"
    print(header)
    print("-" * len(header))
    for kind in LAYERS:
        for mode in ("torch split", "customgrad split", "queue"):
            if mode == "queue" and kind != "customgrad op":
                continue  # only customgrad ops queue weight work
            kept = kept_between_i_and_w(kind, mode, args)
            print(f"{kind:18} {mode:16} {kept / 2**20:9.2f} {kept / act:12.1f} {kept / need:10.2f}")


if __name__ == "__main__":
    main()
