"""Example customgrad ops, each checked with ``customgrad.testing.check_op`` in the tests.

- :mod:`.linear`: ``examples::linear``, the input/weight pair at its simplest;
- :mod:`.rms_norm`: ``examples::rms_norm``, RMSNorm with a weight, twice differentiable;
- :mod:`.gelu_linear`: ``examples::gelu_linear``, a fused GELU(linear) whose two backward
  halves share one intermediate instead of computing it twice;
- :mod:`.triton_scale_shift`: ``examples::scale_shift``, a Triton CUDA kernel with a clean CPU
  fallback.
"""

from examples.ops.gelu_linear import gelu_linear
from examples.ops.linear import linear
from examples.ops.rms_norm import rms_norm
from examples.ops.triton_scale_shift import HAS_TRITON, scale_shift

__all__ = ["HAS_TRITON", "gelu_linear", "linear", "rms_norm", "scale_shift"]
