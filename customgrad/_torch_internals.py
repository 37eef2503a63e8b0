"""Deprecated door: adapters' names under their old module, for the modules not yet converted
(``_autograd.py``, ``_pass.py``, ``_autosplit.py``). Nothing is defined here; each name is the
object of its adapter in :mod:`customgrad._torch` (engine, dispatcher, transforms). New code
imports the adapter for its concept from :mod:`customgrad._torch`; remove this module once
no module imports it.
"""

from __future__ import annotations

from customgrad._torch.dispatcher import library_impls as library_impls
from customgrad._torch.engine import ACCUMULATE_GRAD as ACCUMULATE_GRAD
from customgrad._torch.engine import FRAME_READABLE as FRAME_READABLE
from customgrad._torch.engine import captured_by_caller as captured_by_caller
from customgrad._torch.engine import graph_kept as graph_kept
from customgrad._torch.engine import graph_task_id as graph_task_id
from customgrad._torch.engine import will_execute as will_execute
from customgrad._torch.transforms import legacy_batched as legacy_batched

__all__ = [
    "ACCUMULATE_GRAD",
    "FRAME_READABLE",
    "captured_by_caller",
    "graph_kept",
    "graph_task_id",
    "legacy_batched",
    "library_impls",
    "will_execute",
]
