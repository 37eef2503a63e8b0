"""``PipelineStage``: torch's pipeline stage, with customgrad's split backward as its core.

torch's schedules (``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``,
``ScheduleDualPipeV``, ...) call a stage's ``backward_maybe_with_nosync`` for every full (B),
input (I) and weight (W) backward. This subclass overrides that one method so those calls go to
:func:`~customgrad.pipelining.stage_backward`, :func:`~customgrad.pipelining.stage_backward_input`
and :func:`~customgrad.pipelining.stage_backward_weight`; nothing in torch is patched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage as _TorchPipelineStage
from torch.nn.parallel import DistributedDataParallel

from customgrad._compiled_modules import split_compiled as _split_compiled
from customgrad._errors import ArgumentTypeError, ArgumentValueError
from customgrad._torch.dispatcher import flops_uncounted
from customgrad._torch.pipelining import ddp_find_tensors
from customgrad.pipelining._backward import (
    run_stage_backward,
    stage_backward,
    stage_backward_input,
    stage_backward_weight,
)
from customgrad.pipelining._errors import PipeliningError
from customgrad.pipelining._queue import WeightGradQueue

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["PipelineStage"]

MSG_DDP_UNREDUCED = """\
customgrad.pipelining.PipelineStage(stage_index={stage}): DDP did not reduce this step's \
gradients: some weights of the stage got their last gradient before the last backward of the \
step, where DDP's reduction runs, so DDP never saw them ready and left the reduction \
unfinished. With queue=, the weights of native modules and plain autograd.Functions get their \
gradients in the input pass (I); only customgrad ops' weights wait for W. Use the plain split, \
which accumulates every weight in W, or FSDP2, which reduces once the step's backwards are done:

    stage = PipelineStage(DDP(module, process_group=dp_group), stage_index, n_stages, device)
    stage = PipelineStage(fully_shard(module, mesh=dp_mesh), stage_index, n_stages, device)
"""

MSG_DDP_FIND_UNUSED = """\
customgrad.pipelining.PipelineStage(stage_index={stage}): DDP(find_unused_parameters=True) \
cannot reduce a split backward: DDP finds unused weights by walking the graph from the stage's \
outputs, but the weight pass (W) starts inside the graph, after the input pass (I) used the \
outputs, so DDP would take every weight for unused and reduce it before W adds its gradient. \
Build DDP with find_unused_parameters=False (the default), or use FSDP2:

    DDP(module, process_group=dp_group)
    fully_shard(module, mesh=dp_mesh)
"""

MSG_NOT_A_MODULE = """\
customgrad.pipelining.PipelineStage: expected the stage's module (an nn.Module) as its first \
argument, got {got}. With torch's tracing frontend (pipeline() / pipe_split()), pass the module \
the pipe made for this stage, not a stage built by pipe.build_stage(...) nor the pipe itself:

    pipe = pipeline(model, mb_args=(example_microbatch,))
    stage = customgrad.pipelining.PipelineStage(
        pipe.get_stage_module(stage_index), stage_index, pipe.num_stages, device
    )
"""

MSG_DONATED = """\
customgrad.pipelining.PipelineStage(stage_index={stage}): a module of this stage was compiled \
with torch.compile / nn.Module.compile, whose compiled backward runs once per backward \
(AOTAutograd's donated buffers), but the schedule splits it into an input and a weight pass. \
Compile it with customgrad.compile, whose backward splits, or let the stage do it (the default, \
split_compiled=True):

    customgrad.compile(block)                 # instead of block.compile() / torch.compile(block)
    PipelineStage(module, stage_index, n_stages, device)   # split_compiled=True

(torch._functorch.config.donated_buffer=False is not a fix: the whole compiled backward then \
runs in I and again in W, and gradients were observed wrong.)
"""

try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - older torch
    FSDPModule = ()  # type: ignore[assignment,misc]


class PipelineStage(_TorchPipelineStage):
    """A ``torch.distributed.pipelining.PipelineStage`` whose backward is customgrad's split.

    Takes the arguments of torch's ``PipelineStage`` (pass ``dw_builder`` by keyword), plus:

    Args:
        queue: a :class:`~customgrad.pipelining.WeightGradQueue`. Each microbatch's forward
            runs under ``queue.microbatch(stage_index, chunk_id)``; its backward (I) runs
            through :meth:`~customgrad.pipelining.WeightGradQueue.backward`, which queues
            customgrad weight halves and leaves those weights alone until W, and the stage's
            ``dw_builder`` runs that microbatch's queued work (W). Deferred weights' ``.grad``
            and post-accumulate-grad hooks see one accumulation, in W. The queue is checked
            empty for this stage when the schedule reduces the stage's gradients (end of step).

    A stage module wrapped in DDP or FSDP2 (``fully_shard``) over a data-parallel group is
    reduced once per step, after every microbatch's gradient: DDP in the step's last backward
    (its last W), FSDP2 when the schedule reduces the stage's gradients right after it. With
    DDP and ``queue=``, weights outside customgrad ops get their gradients in I, before DDP
    reduces, and the step ends with a :class:`~customgrad.pipelining.PipeliningError`: use the
    plain split (no ``queue=``) or FSDP2 there.

        split_compiled: modules of the stage compiled by torch (``nn.Module.compile``, as
            torchtitan does, or ``torch.compile`` wrappers, which torch's zero-bubble schedules
            refuse) are recompiled with :func:`customgrad.compile` and the same options, so their
            backward splits into I and W (one log line names them). False leaves them: a split
            schedule then fails at the first input pass with an error that names
            ``customgrad.compile``.
        run_functions_once: True (the default): a plain ``torch.autograd.Function`` of the
            stage (Liger-Kernel's, unsloth's, flash-linear-attention's, a
            ``torch.library.custom_op``) whose node has edges into the weight side runs its
            backward once, in I, and W receives the weight gradients it returned, with the
            model unchanged. False: W runs its backward again, as torch's stage does (its
            kernels twice, and wrong gradients for a backward that writes its output gradient
            in place, such as Liger's RMSNorm at its default ``in_place=True``).
        split_functions: True (the default), with ``run_functions_once``: such a Function's
            backward is first captured with dynamo and split as a customgrad op's single
            backward is (its input work in I, its weight work in W); one that cannot be
            captured (a Triton launch, Python side effects, a graph break) runs once, its
            reason logged once per class. False: every such Function runs once, in I.

    Example:
        Build stages as with torch and hand them to a torch schedule::

            stage = customgrad.pipelining.PipelineStage(module, rank, world, device)
            schedule = ScheduleZBVZeroBubble([stage0, stage1], n_microbatches, loss_fn=...)
    """

    def __init__(
        self,
        *args: object,
        queue: WeightGradQueue | None = None,
        split_compiled: bool = True,
        run_functions_once: bool = True,
        split_functions: bool = True,
        **kwargs: object,
    ) -> None:
        positional = bool(args)
        submodule = args[0] if positional else kwargs.get("submodule")
        if not isinstance(submodule, torch.nn.Module) or isinstance(
            submodule, torch.distributed.pipelining.Pipe
        ):
            raise ArgumentTypeError(MSG_NOT_A_MODULE.format(got=_describe_stage_arg(submodule)))
        if split_compiled:
            index = args[1] if len(args) > 1 else kwargs.get("stage_index")
            submodule, _ = _split_compiled(
                submodule, f"customgrad.pipelining.PipelineStage(stage_index={index})"
            )
            if positional:
                args = (submodule, *args[1:])
            else:
                kwargs["submodule"] = submodule
        if queue is not None:
            if kwargs.get("dw_builder") is not None:
                raise ArgumentValueError(
                    "customgrad.pipelining.PipelineStage: pass either queue= or dw_builder=, "
                    "not both (a queue brings its own dw_builder)."
                )
            kwargs["dw_builder"] = self._build_dw
        self.queue = queue
        self.run_functions_once = run_functions_once
        self.split_functions = split_functions
        self._bwd_chunk: int | None = None
        # torch's stage checks the rest of its arguments: they go to it as given (its signature
        # differs between torch versions).
        torch_args: tuple[Any, ...] = args
        torch_kwargs: dict[str, Any] = kwargs
        super().__init__(*torch_args, **torch_kwargs)

    def _build_dw(self) -> Callable[[], None]:
        queue = self.queue
        if queue is None:
            return lambda: None
        if self._bwd_chunk is None:  # called outside backward_one_chunk
            return queue.dw_builder(self.stage_index)
        # The microbatch whose backward just ran (a stage without customgrad ops queues none).
        return queue.runner([(self.stage_index, self._bwd_chunk)], strict=False)

    def backward_one_chunk(
        self,
        bwd_chunk_id: int,
        loss: torch.Tensor | None = None,
        full_backward: bool = True,
        last_backward: bool = False,
    ) -> None:
        # The first stage's inputs need no gradient: like torch's stage, it skips I and runs
        # its whole backward in W, as one pass. Every zero-bubble schedule runs that stage's I
        # and W back to back (nothing waits for its I), so splitting it would only add a pass
        # (measured: ZBV on 2 ranks 1-2% slower a step; the simulator: no step-time change).
        self._bwd_chunk = bwd_chunk_id
        try:
            super().backward_one_chunk(
                bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward
            )
        finally:
            self._bwd_chunk = None

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        if last_backward and self.dw_builder is not None and bwd_chunk_id in self.dw_runner:
            # torch's stage runs a dw_builder's W (the queue's) without going through
            # backward_maybe_with_nosync, so DDP's reducer would never be told that this W
            # ends the step and would not reduce at all.
            self._arm_ddp_reducer([], weight_pass=True)
        super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)

    def forward_one_chunk(self, fwd_chunk_id: int, *args: object, **kwargs: object) -> object:
        # torch's arguments (the microbatch's args and kwargs, ...), passed on as given
        torch_args: tuple[Any, ...] = args
        torch_kwargs: dict[str, Any] = kwargs
        if self.queue is None:
            return super().forward_one_chunk(fwd_chunk_id, *torch_args, **torch_kwargs)
        with self.queue.microbatch(self.stage_index, fwd_chunk_id):
            return super().forward_one_chunk(fwd_chunk_id, *torch_args, **torch_kwargs)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        if self.queue is not None:
            self.queue.finish(self.stage_index)
        submod = self.submod
        if isinstance(submod, DistributedDataParallel):
            try:
                submod._check_reducer_finalized()
            except RuntimeError:  # DDP's own message blames unused parameters
                raise PipeliningError(MSG_DDP_UNREDUCED.format(stage=self.stage_index)) from None
        super().perform_reduce_grad(grad_scale_factor)

    if hasattr(_TorchPipelineStage, "start_gradient_reduction"):  # torch >= 2.15

        def start_gradient_reduction(self) -> None:
            # From torch 2.15 the schedules end an FSDP stage's step here, not in
            # perform_reduce_grad: the step's weight work must be done by now.
            if self.queue is not None:
                self.queue.finish(self.stage_index)
            super().start_gradient_reduction()  # type: ignore[misc]

    def _get_init_p2p_neighbors_ops(self) -> list[dist.P2POp]:
        # torch 2.11's schedules batch these ops for every stage, in V schedules also a send and
        # a receive to this rank itself (two neighbouring stages on one rank), which gloo
        # refuses ("Pair is not connected"); torch 2.12 and later leave same-rank neighbours
        # out. Stages on one rank hand tensors over locally: there is nothing to set up.
        ops = super()._get_init_p2p_neighbors_ops()
        return [op for op in ops if op.group_peer != self.group_rank]

    def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
        # The schedule's first step infers the stage's shapes by running the module's real
        # forward with grad enabled (torch 2.13), and a backward (_prepare_backward_infra): the
        # step's FLOP counters do not count them. A DDP module outside no_sync() then expects
        # a backward (prepare_for_backward): the step's first W would all-reduce a partial
        # gradient, twice the reductions and, with a dw_builder, the only one; and DDP's
        # bucket rebuild then sees two backwards and fails its internal assert next step.
        submod = self.submod
        with flops_uncounted():
            if isinstance(submod, DistributedDataParallel):
                with submod.no_sync():
                    return super()._prepare_forward_infra(*args, **kwargs)
            return super()._prepare_forward_infra(*args, **kwargs)

    def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> Any:
        with flops_uncounted():
            return super()._prepare_backward_infra(*args, **kwargs)

    def forward_maybe_with_nosync(self, *args: object, **kwargs: object) -> object:
        return super().forward_maybe_with_nosync(*_viewed(args), **kwargs)  # type: ignore[no-untyped-call]

    if hasattr(_TorchPipelineStage, "_compute_outputs"):  # torch >= 2.13: the shapes' forward

        def _compute_outputs(self, *args: Any, module: nn.Module, **kwargs: Any) -> Any:
            viewed: Any = _viewed(args)  # torch annotates them Tensors; a view is one
            return super()._compute_outputs(*viewed, module=module, **kwargs)

    def _arm_ddp_reducer(self, outputs: object, weight_pass: bool) -> None:
        """Tell a DDP module's reducer that the backward about to run ends the step: the
        gradients it accumulates are all-reduced as they become ready, once."""
        submod = self.submod
        if isinstance(submod, DistributedDataParallel):
            if weight_pass and submod.find_unused_parameters:
                raise PipeliningError(MSG_DDP_FIND_UNUSED.format(stage=self.stage_index))
            submod.reducer.prepare_for_backward(ddp_find_tensors(outputs))

    def backward_maybe_with_nosync(
        self,
        backward_type: str,
        bwd_kwargs: dict[str, object],
        last_backward: bool = False,
    ) -> tuple[tuple[torch.Tensor | None, ...], list[dict[str, object]] | None]:
        def perform() -> tuple[tuple[torch.Tensor | None, ...], list[dict[str, object]] | None]:
            # torch's stage builds these values untyped (its backward_one_chunk): they go to the
            # stage_backward functions as torch's own stage passes them to its own.
            kwargs: dict[str, Any] = bwd_kwargs
            if backward_type == "full":
                queue = self.queue
                inputs = kwargs["input_values"]
                if queue is None:
                    grads = stage_backward(kwargs["stage_output"], kwargs["output_grads"], inputs)
                else:
                    grads = run_stage_backward(
                        kwargs["stage_output"],
                        kwargs["output_grads"],
                        inputs,
                        run=lambda t, g: queue.backward(t, g, inputs=inputs),
                    )
                return grads, None
            if backward_type == "input":
                return stage_backward_input(
                    kwargs["stage_output"],
                    kwargs["output_grads"],
                    kwargs["input_values"],
                    self.submod.parameters(),
                    run_functions_once=self.run_functions_once,
                    split_functions=self.split_functions,
                )
            if backward_type == "weight":
                grads = stage_backward_weight(self.submod.parameters(), kwargs["param_groups"])
                return grads, None
            raise ArgumentValueError(f"Unknown backward type: {backward_type!r}")

        submod = self.submod
        if isinstance(submod, DistributedDataParallel):
            if last_backward:
                # As torch's stage does: tell DDP's reducer which outputs this backward starts at.
                self._arm_ddp_reducer(
                    bwd_kwargs["stage_output"], weight_pass=backward_type == "weight"
                )
                return perform()
            with submod.no_sync():
                return perform()
        if isinstance(submod, FSDPModule):
            submod.set_is_last_backward(False)
            submod.set_reshard_after_backward(False)
            submod.set_requires_gradient_sync(False)
        try:
            return perform()
        except RuntimeError as e:
            if backward_type != "full" and _mentions(e, "donated buffers"):
                raise PipeliningError(MSG_DONATED.format(stage=self.stage_index)) from e
            raise


def _viewed(args: tuple[object, ...]) -> tuple[object, ...]:
    """The stage's inputs as its module gets them: a leaf that requires grad as a view of it.
    torch's ``FlopCounterMode`` (its ``ModuleTracker``) hooks a module's inputs with
    ``register_multi_grad_hook``, which asks the engine about each input's node, and the engine
    refuses to answer for a leaf that the input pass's ``autograd.grad`` captures ("A leaf node
    was passed to _will_engine_execute_node"): a step under a FLOP counter raised in I."""
    return tuple(
        a.view_as(a) if isinstance(a, torch.Tensor) and a.is_leaf and a.requires_grad else a
        for a in args
    )


def _describe_stage_arg(value: object) -> str:
    if isinstance(value, torch.nn.Module):  # the Pipe
        return f"the whole pipe ({type(value).__name__}), not one stage's module"
    if hasattr(value, "submod") and hasattr(value, "stage_index"):
        return f"a stage already built ({type(value).__name__}, e.g. by pipe.build_stage)"
    return f"{type(value).__name__} {value!r}"


def _mentions(error: BaseException, text: str) -> bool:
    """Whether ``error`` or an error it was raised from says ``text``."""
    seen: BaseException | None = error
    for _ in range(8):
        if seen is None:
            return False
        if text in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
