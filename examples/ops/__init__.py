"""Example customgrad ops, each checked with ``customgrad.testing.check_op`` in the tests.

The basics:

- :mod:`.linear`: ``examples::linear``, the input/weight pair at its simplest;
- :mod:`.gelu_linear`: ``examples::gelu_linear``, a fused GELU(linear) whose weight half
  recomputes a cheap activation instead of keeping it alive until W;
- :mod:`.triton_scale_shift`: ``examples::scale_shift``, a Triton kernel with a clean CPU
  fallback;
- :mod:`.triton_fused_rms_norm`: ``examples::triton_rms_norm``, RMSNorm in Triton whose backward
  kernel computes the input and the weight gradient in one launch, launched once across I and W.

Six real ops ported from public projects (see ``docs/guides/real-ops.md``):

- :mod:`.silu_and_mul`: ``examples::silu_and_mul``, the SwiGLU gate: a weightless op;
- :mod:`.rms_norm`: ``examples::rms_norm``, Liger-Kernel's RMSNorm: a residual (``rstd``);
- :mod:`.linear_cross_entropy`: ``examples::linear_cross_entropy``, Liger's fused linear
  cross-entropy: gradients computed in the forward as residuals, work handed from I to W with
  ``reduction="none"``, an argument named ``_input``, a second (optional) output;
- :mod:`.lora_linear`: ``examples::lora_linear``, unsloth's LoRA linear: float32 adapters with
  bfloat16 activations, ``grad @ B`` handed from I to W;
- :mod:`.lora_mlp`: ``examples::lora_mlp``, unsloth's fused LoRA SwiGLU MLP: residuals ``e``,
  ``g`` and ``dY @ W_down`` handed from I to W;
- :mod:`.varlen_attention`: ``examples::varlen_attention``, flash-attention's varlen interface:
  a weightless op with a residual (``lse``), a tuple default (``schema=``) and its backward
  kernel as an op of its own;
- :mod:`.grouped_linear`: ``examples::grouped_linear``, TransformerEngine's grouped linear: a
  list of expert weights.
"""

from examples.ops.gelu_linear import gelu_linear
from examples.ops.grouped_linear import grouped_linear
from examples.ops.linear import linear
from examples.ops.linear_cross_entropy import linear_cross_entropy
from examples.ops.lora_linear import lora_linear
from examples.ops.lora_mlp import lora_mlp
from examples.ops.rms_norm import rms_norm
from examples.ops.silu_and_mul import silu_and_mul
from examples.ops.triton_fused_rms_norm import triton_rms_norm
from examples.ops.triton_scale_shift import HAS_TRITON, scale_shift
from examples.ops.varlen_attention import varlen_attention, varlen_attention_backward

__all__ = [
    "HAS_TRITON",
    "gelu_linear",
    "grouped_linear",
    "linear",
    "linear_cross_entropy",
    "lora_linear",
    "lora_mlp",
    "rms_norm",
    "scale_shift",
    "silu_and_mul",
    "triton_rms_norm",
    "varlen_attention",
    "varlen_attention_backward",
]
