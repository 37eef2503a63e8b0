"""A real Hugging Face ``transformers`` Llama, patched by Liger-Kernel at its defaults, unmodified.

``apply_liger_kernel_to_llama()`` with no arguments puts Liger's Functions in the model:
RMSNorm with ``in_place=True`` (its backward writes dX over dY), SwiGLU, rope, and the fused
linear cross entropy (``LigerForCausalLMLoss``, whose backward scales the gradients it computed
in the forward by the loss's output gradient), here with the loss divided by the microbatch
count (torchtitan's rescale). A tiny ``LlamaConfig`` (4 layers) builds the model; it is cut into
stages the torchtitan way (each stage a shallow copy of the ``LlamaModel`` holding only its
layers, the embedding in the first, the final norm in the last; the modules themselves are the
model's), and the last stage holds ``lm_head``, which the schedule's ``loss_fn`` calls through
Liger's loss as the patched model's forward does. Kernels run on CPU in Triton's interpreter.
Importing this module needs transformers and liger-kernel (the tests skip without them, naming
the package).
"""

from __future__ import annotations

import copy
import pickle
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._skips import optional_package

pytest.importorskip("transformers", reason=optional_package("transformers"))
L = pytest.importorskip("tests._liger_block", reason=optional_package("liger-kernel"))

from liger_kernel.transformers import apply_liger_kernel_to_llama  # noqa: E402
from liger_kernel.transformers.model.loss_utils import LigerForCausalLMLoss  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

VOCAB, HIDDEN, INTER, HEADS, LAYERS = 32, 16, 32, 2, 4
BATCH, SEQ, MICROBATCHES = 2, 4, 2
KERNELS = ("_rms_norm_backward_kernel", "_swiglu_backward_kernel", "element_mul_kernel")
"""The Liger kernels that run in backward only (rope's also runs in the forwards the schedule
makes to infer shapes)."""


def build(seed: int = 0) -> Any:
    """The tiny Llama, patched by Liger at its defaults (the patch is global, as in a user's
    script: call it before building the model)."""
    apply_liger_kernel_to_llama()
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=2 * SEQ,
        use_cache=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def batch(seed: int = 1) -> Tensor:
    """Token ids of every microbatch (the labels are the ids: the loss shifts them)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (BATCH * MICROBATCHES, SEQ), generator=gen)


def loss(model: Any, hidden: Tensor, labels: Tensor) -> Tensor:
    """The patched ``LlamaForCausalLM.forward``'s loss from the last hidden states, divided by
    the microbatch count."""
    out: Tensor = LigerForCausalLMLoss(
        hidden_states=hidden, lm_head_weight=model.lm_head.weight, labels=labels, hidden_size=HIDDEN
    )
    return out / MICROBATCHES


class Stage(nn.Module):
    """Layers ``lo:hi`` of the model's ``LlamaModel`` (a shallow copy holding only those), with
    the embedding in the first stage and the final norm in the last; the last also holds
    ``lm_head`` (its weight's gradient is the stage's), which the loss calls."""

    def __init__(self, model: Any, lo: int, hi: int) -> None:
        super().__init__()
        inner = copy.copy(model.model)
        inner._modules = dict(inner._modules)
        inner.layers = nn.ModuleList(list(model.model.layers)[lo:hi])
        self.first, self.last = lo == 0, hi == LAYERS
        if not self.first:
            inner.embed_tokens = None
        if not self.last:
            inner.norm = nn.Identity()
        self.model = inner
        if self.last:
            self.lm_head = model.lm_head

    def forward(self, x: Tensor) -> Tensor:
        if self.first:
            out = self.model(input_ids=x, use_cache=False)
        else:
            out = self.model(inputs_embeds=x, use_cache=False)
        hidden: Tensor = out.last_hidden_state
        return hidden


def stages(model: Any, n: int) -> list[Stage]:
    """The model cut in ``n`` stages of as many layers each."""
    per = LAYERS // n
    return [Stage(model, i * per, (i + 1) * per) for i in range(n)]


def names(model: Any) -> dict[int, str]:
    """Each parameter's name in the whole model, by ``id`` (stages share the parameters)."""
    return {id(p): n for n, p in model.named_parameters()}


def reference() -> tuple[dict[str, Tensor], list[Counter[str]]]:
    """One process, the unmodified model's own forward (``labels=``): the gradients of the
    step and each microbatch's backward kernel launches."""
    with L.liger_kernels():
        model = build()
        counts: list[Counter[str]] = []
        for ids in batch().chunk(MICROBATCHES):
            out = model(input_ids=ids, labels=ids, use_cache=False)
            with L.backward_launches() as launched:
                (out.loss / MICROBATCHES).backward()
            counts.append(Counter({k: launched[k] for k in KERNELS}))
        grads = {n: p.grad for n, p in model.named_parameters()}
    return grads, counts


def run_zbv(out_path: str) -> None:
    """A ScheduleZBVZeroBubble step with customgrad's ``PipelineStage``, two stages on this rank
    (the V: rank ``r`` of ``world`` holds stages ``r`` and ``2 * world - 1 - r``). Rank 0 writes every parameter's
    gradient (by its name in the model) and the step's backward kernel launches."""
    import torch.distributed as dist
    from torch.distributed.pipelining import ScheduleZBVZeroBubble

    import customgrad.pipelining as cgp

    rank, world = dist.get_rank(), dist.get_world_size()
    with L.liger_kernels():
        model = build()
        by_id = names(model)
        n = 2 * world
        mods = stages(model, n)
        mine = sorted({rank, n - 1 - rank})
        built = [cgp.PipelineStage(mods[s], s, n, torch.device("cpu")) for s in mine]

        def loss_fn(output: Tensor, target: Tensor) -> Tensor:
            return loss(model, output, target)

        schedule = ScheduleZBVZeroBubble(built, MICROBATCHES, loss_fn=loss_fn, scale_grads=False)
        ids = batch()
        args = [ids] if 0 in mine else []
        kwargs = {"target": ids} if n - 1 in mine else {}
        # The first step also infers shapes (a forward and a backward of each stage): count the
        # second.
        schedule.step(*args, **kwargs)
        model.zero_grad(set_to_none=True)
        with L.backward_launches() as launched:
            schedule.step(*args, **kwargs)
        grads = {by_id[id(p)]: p.grad for s in mine for p in mods[s].parameters()}
        counts = {k: launched[k] for k in KERNELS}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, (grads, counts))
    if rank == 0:
        all_grads: dict[str, Tensor] = {}
        total: Counter[str] = Counter()
        for g, c in everyone:
            all_grads.update(g)
            total.update(c)
        Path(out_path).write_bytes(pickle.dumps((all_grads, dict(total))))
