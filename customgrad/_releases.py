"""What the supported torch releases (2.11 to 2.15) cannot all do, as named errors.

The differences themselves are probed by behaviour in :mod:`customgrad._torch`; this module
turns the ones that no adapter can work around into a :class:`~customgrad.UnsupportedTorchError`
that names the release that can, and what to use instead.
"""

from __future__ import annotations

import torch

from customgrad._errors import UnsupportedTorchError
from customgrad._torch.functions import handles_keep_nodes
from customgrad._torch.pipelining import torch_split_running

__all__ = ["MSG_TORCH_SPLIT", "refuse_torch_split"]

MSG_TORCH_SPLIT = """\
{op}: torch {version}'s own split backward (torch.distributed.pipelining.PipelineStage under a \
zero-bubble schedule, or stage_backward_input / stage_backward_weight of \
torch.distributed.pipelining._backward) cannot run customgrad ops: on torch 2.11 and 2.12 its \
weight pass reads autograd.Function nodes that its input pass freed (and it has other bugs, \
fixed in torch 2.13). Use customgrad's stage or split, which run on torch 2.11 and later, or \
torch 2.13 or later:

    stage = customgrad.pipelining.PipelineStage(module, stage_index, n_stages, device)
    dinputs, groups = customgrad.pipelining.stage_backward_input(outputs, grads, inputs, weights)
    customgrad.pipelining.stage_backward_weight(weights, groups)
"""


def refuse_torch_split(op: str) -> None:
    """Raise :data:`MSG_TORCH_SPLIT` for ``op`` when torch's own split is running on a release
    that cannot run customgrad ops (a Function node's handle does not keep its node alive).

    Called by a customgrad node whose backward runs a partial pass with no customgrad route;
    costs nothing on torch 2.13 and later."""
    if not handles_keep_nodes() and torch_split_running():
        raise UnsupportedTorchError(MSG_TORCH_SPLIT.format(op=op, version=torch.__version__))
