"""Each adapter of torch's private API (customgrad/_torch/) reads what it says, in the form read:
when a torch upgrade changes a name or a behaviour one relies on, its test here fails instead of
customgrad silently taking a slower fallback or a wrong answer. One test (or a few) per adapter,
named after it; the last tests check that no other module of customgrad uses torch's private
API in any form (imports, attribute chains, private attributes of torch objects)."""

from __future__ import annotations

import ast
import inspect
import threading
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import customgrad as cg
from customgrad._op import autograd_impl
from customgrad._torch import (
    aot,
    dispatcher,
    dynamo,
    engine,
    errors,
    fake,
    functions,
    grouped_mm,
    pipelining,
    transforms,
)

# -- engine ------------------------------------------------------------------------------------


def test_engine_graph_task_id_and_graph_kept() -> None:
    assert engine.graph_task_id() == -1  # outside a backward
    assert engine.graph_kept() is True  # outside a backward: True (keep, the safe answer)
    kept: list[bool] = []
    tasks: list[int] = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2

    def hook(g: torch.Tensor) -> None:
        kept.append(engine.graph_kept())
        tasks.append(engine.graph_task_id())

    y.register_hook(hook)
    y.sum().backward(retain_graph=True)
    y.sum().backward()
    assert kept == [True, False]
    assert tasks[0] >= 0 and tasks[1] >= 0 and tasks[0] != tasks[1]


def test_engine_accumulate_grad_is_a_leafs_node_class() -> None:
    assert engine.ACCUMULATE_GRAD is not type(None)
    x = torch.ones(2, requires_grad=True)
    assert type((x * 2).grad_fn.next_functions[0][0]) is engine.ACCUMULATE_GRAD  # type: ignore[union-attr]


def test_engine_input_shape_reads_what_a_node_takes_at_each_input() -> None:
    # customgrad's weight pass sums a gradient that broadcast in the forward (a bias) to the
    # shape its node takes there, as the engine does.
    b = torch.randn(3, requires_grad=True)
    y = torch.randn(2, 3) + b.exp()
    add = y.grad_fn
    assert add is not None
    exp_node = add.next_functions[1][0]
    assert engine.input_shape(exp_node, 0) == torch.Size([3])
    assert engine.input_shape(add, 0) == torch.Size([2, 3])
    assert engine.input_shape(object(), 0) is None


def test_engine_edge_query_fallback_says_needed_and_logs_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(engine, "_warned_no_query", False)
    with caplog.at_level("WARNING", logger="customgrad"):
        assert engine._every_edge(None) and engine._every_edge(object())
    assert [r.getMessage() for r in caplog.records] == [
        "customgrad: this torch has no torch._C._will_engine_execute_node; split backward "
        "falls back to computing every gradient in every pass."
    ]


def test_engine_will_execute_and_current_node_inside_a_backward() -> None:
    assert engine.will_execute is not None
    assert engine.edge_query is engine.will_execute  # the fallback only on a torch without it
    assert engine.current_node() is None  # outside a backward
    with pytest.raises(RuntimeError):
        engine.will_execute((torch.ones(1, requires_grad=True) * 2).grad_fn)
    seen: list[Any] = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a * b

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            node = engine.current_node()
            assert engine.will_execute is not None
            seen.append(type(node).__name__)
            seen.append([engine.will_execute(fn) for fn, _ in node.next_functions])
            return g, g

    a = torch.ones(2, requires_grad=True)
    b = torch.ones(2, requires_grad=True)
    ha, hb = a * 1, b * 1  # non-leaf edges: the engine answers for them
    out = Probe.apply(ha, hb).sum()
    torch.autograd.grad(out, ha)  # only ha's edge is needed
    assert seen == ["ProbeBackward", [True, False]]


def test_engine_run_backward_frame_names_what_autograd_grad_captures() -> None:
    assert engine.FRAME_READABLE

    def scale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * w

    op = cg.op("test_torch_internals::scale", scale, weights=("w",))
    op.register_save_for_backward(lambda inputs, out: (inputs.x, inputs.w))
    op.register_backward_input(lambda ctx, s, g: {"x": g * s[1]})
    op.register_backward_weight(lambda ctx, s, g: {"w": g * s[0]})
    x = torch.randn(3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    torch.autograd.grad(op(x, w).sum(), (x, w))
    # read at the depth the node's backward reads it: both leaves named, none asked of the engine
    task, captured = autograd_impl(op).captures._last
    assert task != -2 and captured == {id(x), id(w)}


# -- dispatcher --------------------------------------------------------------------------------


def test_dispatcher_library_impls_records_each_torch_library_registration() -> None:
    impls = dispatcher.library_impls()
    assert isinstance(impls, set)
    lib = torch.library.Library("test_torch_internals", "FRAGMENT")
    try:
        lib.define("f(Tensor x) -> Tensor")
        lib.impl("f", lambda x: x.clone(), "CPU")
        assert "test_torch_internals/f/CPU" in impls
        assert isinstance(torch.ops.test_torch_internals.f.default, dispatcher.OpOverload)
        assert isinstance(torch.ops.test_torch_internals.f, dispatcher.OpOverloadPacket)
        assert isinstance(torch.ops.test_torch_internals, dispatcher.OpNamespace)
    finally:
        dispatcher.destroy_library(lib)
    assert "test_torch_internals/f/CPU" not in impls
    assert not hasattr(torch.ops.test_torch_internals, "f")
    assert isinstance(torch.ops.higher_order.cond, dispatcher.HigherOrderOperator)


def test_dispatcher_schema_of_and_overload_name() -> None:
    add = torch.ops.aten.add.Tensor
    assert dispatcher.overload_name(add) == "Tensor"
    assert dispatcher.overload_name(torch.ops.aten.relu.default) == "default"
    assert dispatcher.schema_of(torch.ops.aten.add_.Tensor).is_mutable
    assert not dispatcher.schema_of(add).is_mutable
    assert dispatcher.schema_of(add).name == "aten::add"


def test_dispatcher_keys_guards_and_schemas() -> None:
    assert dispatcher.dispatch_key_for_device("cpu") == "CPU"
    assert dispatcher.dispatch_key_for_device("cuda") == "CUDA"
    with pytest.raises((RuntimeError, ValueError)):
        dispatcher.dispatch_key_for_device("nodevice")
    x = torch.ones(2, requires_grad=True)
    with dispatcher.below_autograd():
        assert (x * 2).grad_fn is None
    with dispatcher.below_ad_inplace_or_view():
        assert (x * 2).grad_fn is None
    keys = dispatcher.AFTER_AD_INPLACE_OR_VIEW
    assert isinstance(keys, torch._C.DispatchKeySet)
    assert keys.has(torch._C.DispatchKey.CPU) and not keys.has(torch._C.DispatchKey.AutogradCPU)
    schema = dispatcher.parse_schema("probe(Tensor x, int[2] w=[-1, -1]) -> Tensor")
    assert [a.name for a in schema.arguments] == ["x", "w"]
    mm = dispatcher.schema_of(torch.ops.aten.mm.default)
    assert mm.name == "aten::mm" and mm.is_mutable is False
    assert dispatcher.schema_of(torch.ops.aten.add_.Tensor).is_mutable is True
    with pytest.raises(RuntimeError):
        dispatcher.parse_schema("probe(Tensor x -> Tensor")


def test_dispatcher_intercepted_sees_each_mode_transform_and_the_profiler() -> None:
    assert dispatcher.intercepted() is False
    assert dispatcher.dispatch_stack_len() == 0 and not dispatcher.function_mode_enabled()
    with TorchDispatchMode():
        assert dispatcher.dispatch_stack_len() == 1 and dispatcher.intercepted()
    with TorchFunctionMode():
        assert dispatcher.function_mode_enabled() and dispatcher.function_stack_len() == 1
        assert dispatcher.intercepted()
    seen: list[bool] = []

    def probe(t: torch.Tensor) -> torch.Tensor:
        seen.append(dispatcher.intercepted())
        return t

    torch.vmap(probe)(torch.ones(2, 2))
    with torch.autograd.profiler.profile():
        seen.append(dispatcher.profiler_enabled())
        seen.append(dispatcher.intercepted())
    assert seen == [True, True, True]
    assert dispatcher.profiler_enabled() is False


def test_dispatcher_infra_modes_and_disabling_modes() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert len(dispatcher.INFRA_MODES) >= 3  # fake, proxy, functional
    assert all(dispatcher.get_dispatch_mode(k) is None for k in dispatcher.INFRA_MODES)
    with FakeTensorMode() as mode:
        assert any(dispatcher.get_dispatch_mode(k) is mode for k in dispatcher.INFRA_MODES)
        with dispatcher.disable_current_modes():
            assert not fake.is_fake(torch.ones(1))
    assert not dispatcher.is_traceable_wrapper_subclass(torch.ones(1))


def test_dispatcher_ambient_state_alias_checks_and_aten_callables() -> None:
    assert dispatcher.any_autocast_enabled() is False
    with torch.autocast("cpu"):
        assert dispatcher.any_autocast_enabled() is True
    assert dispatcher.deterministic() is torch.are_deterministic_algorithms_enabled()
    assert dispatcher.deterministic_warn_only() is (
        torch.is_deterministic_algorithms_warn_only_enabled()
    )
    assert dispatcher.alias_check is not dispatcher._no_alias_check  # the fallback: old torch
    x = torch.ones(3)
    assert dispatcher.alias_check((x,), {}, (x[:1],)) is True
    assert dispatcher.alias_check((x,), {}, (x.clone(),)) is False
    assert dispatcher.is_alias_of(x[1:], x) and not dispatcher.is_alias_of(x.clone(), x)
    function, method = dispatcher.aten_callables("mm")
    assert function is not None and method is not None
    assert dispatcher.aten_callables("no_such_op") == (None, None)


# -- transforms --------------------------------------------------------------------------------


def test_dispatcher_flop_counters_tables_and_counts_on_the_stack() -> None:
    from torch.utils.flop_counter import FlopCounterMode

    assert dispatcher.active_flop_tables() == []
    a = torch.ones(2, 3)
    with FlopCounterMode(display=False) as outer, FlopCounterMode(display=False) as inner:
        assert dispatcher.active_flop_tables() == [outer.flop_registry, inner.flop_registry]
        torch.mm(a, a.mT)
        with dispatcher.flops_uncounted():
            torch.mm(a, a.mT)
            assert inner.get_total_flops() == 48  # counted while it runs
        torch.mm(a, a.mT)
    assert outer.get_total_flops() == inner.get_total_flops() == 48  # and put back after


def test_dispatcher_destroy_library_forgets_its_names_for_a_redefinition() -> None:
    import gc

    name = "test_internals_redefine::op"
    lib = torch.library.Library("test_internals_redefine", "FRAGMENT")
    lib.define("op(Tensor x) -> Tensor")
    dispatcher.destroy_library(lib)
    assert lib._op_defs == set()  # what its finalizer reads
    again = torch.library.Library("test_internals_redefine", "FRAGMENT")
    again.define("op(Tensor x) -> Tensor")
    packet = torch.ops.test_internals_redefine.op
    del lib
    gc.collect()  # the first library's finalizer ran
    assert torch.ops.test_internals_redefine.op is packet, name
    dispatcher.destroy_library(again)


def test_errors_find_what_dynamo_and_aot_autograd_wrapped() -> None:
    import torch._dynamo.exc as dynamo_exc

    class Mine(RuntimeError):
        pass

    inner = Mine("mine")
    try:
        try:
            raise inner
        except Mine as e:
            raise dynamo_exc.Unsupported("graph break") from e
    except dynamo_exc.Unsupported as e:
        wrapper = dynamo_exc.TorchRuntimeError(str(e))
        wrapper.__context__ = e  # as dynamo raises it: from None, over the Unsupported
        wrapper.__suppress_context__ = True
    assert errors.is_dynamo_error(wrapper) and not errors.is_dynamo_error(inner)
    assert errors.wrapped_error(wrapper, Mine) is inner
    failed = dynamo_exc.BackendCompilerFailed(lambda: None, inner, None)
    assert errors.wrapped_error(failed, Mine) is inner  # its inner_exception
    assert errors.wrapped_error(ValueError("other"), Mine) is None
    with pytest.raises(Mine) as info, errors.errors_first(Mine):
        raise wrapper
    assert info.value is inner and info.value.__cause__ is wrapper
    with pytest.raises(ValueError), errors.errors_first(Mine):
        raise ValueError("not dynamo's: left as it is")


def test_transforms_functorch_and_forward_ad_levels() -> None:
    assert transforms.functorch_active() is False
    assert transforms.forward_ad_level() == -1
    assert transforms.unwrap_if_dead is not None
    seen: list[tuple[bool, bool]] = []

    def probe(t: torch.Tensor) -> torch.Tensor:
        seen.append((transforms.functorch_active(), transforms.jvp_transform_active()))
        return t * 2

    torch.vmap(probe)(torch.ones(2, 2))
    torch.func.jvp(probe, (torch.ones(2),), (torch.ones(2),))
    assert seen == [(True, False), (True, True)]
    with fwAD.dual_level():
        assert transforms.forward_ad_level() == 0
    assert transforms.forward_ad_level() == -1


def test_transforms_legacy_batched_sees_is_grads_batched() -> None:
    seen: list[bool] = []
    x = torch.ones(3, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: seen.append(transforms.legacy_batched(g)))
    torch.autograd.grad(y, x, torch.eye(3), is_grads_batched=True)
    assert seen == [True]
    assert transforms.legacy_batched(torch.ones(1)) is False


# -- functions ---------------------------------------------------------------------------------


def test_functions_forward_cls_backward_apply_and_plain_apply() -> None:
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
            pass

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return g * 2

    x = torch.ones(2, requires_grad=True)
    assert functions.forward_cls(Double.apply(x).grad_fn) is Double
    assert functions.forward_cls((x * 2).grad_fn) is None
    calls: list[Any] = []

    def apply(node: Any, *grads: Any) -> Any:
        calls.append(functions.forward_cls(node))
        return (grads[0] * 3,)

    functions.set_backward_apply(Double, apply)
    out = functions.plain_apply(Double)(x)
    assert out.grad_fn is not None and functions.forward_cls(out.grad_fn) is Double
    (g,) = torch.autograd.grad(out.sum(), x)
    assert calls == [Double] and torch.equal(g, torch.full((2,), 3.0))


def test_functions_setup_context_defined_tells_the_two_styles_of_function() -> None:
    class Classic(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    class Separate(torch.autograd.Function):
        @staticmethod
        def forward(x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
            pass

    assert functions.setup_context_defined(Separate)
    assert not functions.setup_context_defined(Classic)


def test_functions_custom_op_of_names_a_torch_library_custom_op() -> None:
    @torch.library.custom_op("test_torch_internals::twice", mutates_args=())
    def twice(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    twice.register_autograd(lambda ctx, g: g * 2)
    x = torch.ones(2, requires_grad=True)
    assert functions.custom_op_of(twice(x).grad_fn) == "test_torch_internals::twice"
    assert functions.custom_op_of((x * 2).grad_fn) is None


# -- fake --------------------------------------------------------------------------------------


def test_fake_types_and_mode_detection() -> None:
    FakeTensorMode = fake.fake_tensor_mode_type()
    assert fake.detect_fake_mode([torch.ones(1)]) is None
    with FakeTensorMode() as mode:
        t = torch.ones(2)
        assert isinstance(t, fake.fake_tensor_type()) and fake.is_fake(t)
        assert fake.detect_fake_mode([t]) is mode
    assert fake.functional_tensor_type().__name__ == "FunctionalTensor"
    assert fake.fake_tensor_type().__module__ == fake.FAKE_TENSOR_LOGGER


def test_fake_device_guards_set_then_a_worker_thread_enters_a_fake_mode() -> None:
    # what _flops does before counting an op's torch ops on fake tensors in a thread of its own
    fake.set_device_guards()
    fake.set_device_guards()  # once per process
    got: list[object] = []

    def work() -> None:
        with fake.fake_tensor_mode_type()(allow_non_fake_inputs=True):
            got.append(torch.ones(2, 3) @ torch.ones(3, 4))

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    assert len(got) == 1 and fake.is_fake(got[0]) and got[0].shape == (2, 4)


# -- pipelining --------------------------------------------------------------------------------


def test_pipelining_ddp_find_tensors_finds_nested_outputs() -> None:
    a, b, c = torch.ones(1), torch.ones(2), torch.ones(3)
    found = pipelining.ddp_find_tensors((a, [b, {"k": c}], 3))
    assert {id(t) for t in found} == {id(a), id(b), id(c)}


def test_pipelining_stage_base_and_torch_split() -> None:
    from torch.distributed.pipelining import PipelineStage

    assert issubclass(PipelineStage, pipelining.stage_base())
    backward_input, backward_weight = pipelining.torch_split()
    assert list(inspect.signature(backward_input).parameters)[1:3] == [
        "output_grads",
        "input_values",
    ]
    assert list(inspect.signature(backward_weight).parameters)[:2] == ["weights", "param_groups"]


def test_pipelining_torch_split_running_sees_torch_s_input_pass_on_this_thread() -> None:
    seen: list[bool] = []

    class Spy(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            seen.append(pipelining.torch_split_running())
            return grad

    x = torch.randn(3, requires_grad=True)
    Spy.apply(x).sum().backward()
    backward_input, _ = pipelining.torch_split()
    y = Spy.apply(x)
    backward_input([y], [torch.ones_like(y)], [x], [])
    assert seen == [False, True]


def test_pipelining_torch_stage_inits_same_rank_where_it_warms_up_without_a_vote() -> None:
    # torch 2.11 batches every stage's init p2p ops; 2.12 to 2.14 vote between neighbours;
    # 2.15 does neither
    from torch.distributed.pipelining import PipelineStage, schedules

    multi = inspect.getsource(schedules.PipelineScheduleMulti._initialize_stages)
    if pipelining.torch_stage_inits_same_rank():  # every stage's init ops, batched
        assert hasattr(PipelineStage, "_get_init_p2p_neighbors_ops")  # customgrad's stage filters
        assert "_get_init_p2p_neighbors_ops()" in multi
    else:  # no init ops batched across the stages of a rank
        assert "_get_init_p2p_neighbors_ops" not in multi


def test_pipelining_runtime_step_runs_actions_as_torch_s_runtime_does(group: None) -> None:
    # Custom functions running every compute action through RuntimeStep, in torch's order, give
    # the step torch's own runtime gives: gradients, losses (loss_kwargs reach the loss),
    # outputs, on DualPipeV's F, I, W, B and OVERLAP_F_B and ZBV's lists.
    import torch.distributed.pipelining as tp

    from customgrad.pipelining import PipelineStage

    def loss_fn(out: torch.Tensor, target: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return scale * ((out - target) ** 2).mean()

    def run(schedule_cls: type, custom: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        torch.manual_seed(0)
        blocks = [torch.nn.Linear(4, 4, dtype=torch.float64) for _ in range(2)]
        stages = [PipelineStage(b, s, 2, torch.device("cpu")) for s, b in enumerate(blocks)]
        schedule = schedule_cls(stages, 4, loss_fn=loss_fn)
        seen: list[str] = []
        if custom:

            def each(action: Any, ctx: Any) -> None:
                step = pipelining.RuntimeStep(ctx)
                for stage, kind, mb in step.parts(action):
                    seen.append(kind)
                    if kind == "F":
                        step.forward(stage, mb)
                    elif kind == "W":
                        step.weight(stage, mb)
                    else:
                        step.backward(stage, mb, full=kind == "B")

            for kind in ("F", "I", "W", "B", "OVERLAP_F_B"):
                pipelining.register_action(schedule, kind, each)
        losses: list[torch.Tensor] = []
        x = torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        # (loss_kwargs from torch 2.13 on; before, step's keywords go to the first stage)
        more = {"loss_kwargs": {"scale": 3.0}} if "loss_kwargs" in step_params else {}
        schedule.step(x, target=x.flip(0), losses=losses, **more)
        assert set(seen) == (set() if not custom else kinds[schedule_cls])
        return [p.grad for b in blocks for p in b.parameters()], losses  # type: ignore[misc]

    step_params = inspect.signature(tp.ScheduleZBVZeroBubble.step).parameters
    kinds = {tp.ScheduleDualPipeV: {"F", "I", "W", "B"}, tp.ScheduleZBVZeroBubble: {"F", "I", "W"}}
    for schedule_cls in kinds:
        (grads, losses), (want, want_losses) = run(schedule_cls, True), run(schedule_cls, False)
        assert all(torch.equal(g, w) for g, w in zip(grads, want))
        assert [v.item() for v in losses] == [v.item() for v in want_losses] != []


# -- dynamo and AOTAutograd --------------------------------------------------------------------


def test_dynamo_compiled_call_and_inductor_config() -> None:
    module = torch.nn.Linear(2, 2)
    assert dynamo.compiled_call(module) is None
    module.compile(backend="eager")
    installed = dynamo.compiled_call(module)
    assert installed is not None
    dynamo.set_compiled_call(module, None)
    assert dynamo.compiled_call(module) is None
    dynamo.set_compiled_call(module, installed)
    assert dynamo.compiled_call(module) is installed
    config = dynamo.inductor_config("max-autotune", None, None)
    assert config["max_autotune"] is True
    assert dynamo.inductor_config(None, {"epilogue_fusion": False}, None) == {
        "epilogue_fusion": False
    }


def test_dynamo_backends_and_optimized_module() -> None:
    from torch._dynamo.backends.common import aot_autograd

    dynamo.load()
    aot_eager, boxed_nop = dynamo.eager_backends()
    assert callable(aot_eager) and callable(boxed_nop)
    assert isinstance(aot_autograd(fw_compiler=boxed_nop), dynamo.aot_autograd_type())
    assert dynamo.lookup_backend("aot_eager") is not None
    module = torch.compile(torch.nn.Linear(2, 2), backend="eager")
    assert isinstance(module, dynamo.optimized_module_type())


SCALE_FOR_CAPTURE = 2.0
LOG_FOR_CAPTURE: list[int] = []


def test_dynamo_capture_graph_inputs_side_effects_guards_and_the_guard_check() -> None:
    x, w = torch.randn(3, 2), torch.randn(2)

    def fn(saved: Any, g: torch.Tensor) -> Any:
        return {"x": g * saved[0] * SCALE_FOR_CAPTURE * torch.nn.functional.relu(saved[1])}

    seen: list[dynamo.Captured] = []

    def on_graph(captured: dynamo.Captured) -> Any:
        seen.append(captured)
        return captured.graph.forward

    out = dynamo.capture(fn, ((x, w), torch.ones(3, 2)), on_graph)
    torch.testing.assert_close(out["x"], x * 2.0 * w.relu())
    (c,) = seen
    assert sorted(source for _, source in c.inputs) == ["g", "saved[0]", "saved[1]"]
    examples = {source: example for example, source in c.inputs}
    assert examples["saved[0]"] is x and examples["saved[1]"] is w  # the tensors passed
    assert [v.shape for v in c.outputs] == [torch.Size([3, 2])]
    assert c.side_effects == []
    assert c.constants == ["G['SCALE_FOR_CAPTURE']"]  # compared by ==: an expression of G, L
    assert "SCALE_FOR_CAPTURE" in c.names and "relu" in c.names
    check = dynamo.guard_check(fn.__code__)
    assert check is not None
    frame = {"saved": (x, w), "g": torch.ones(3, 2)}
    assert check(frame) is True
    assert check({"saved": (x, w), "g": torch.ones(4, 2)}) is False  # another shape
    assert dynamo.readable("G['__import___main__'].seen") == "__main__.seen"
    assert dynamo.readable("G['__import_torch_dot_nn'].F") == "torch.nn.F"
    assert dynamo.readable("L['saved'][0]") == "saved[0]"

    def appends(g: torch.Tensor) -> torch.Tensor:
        LOG_FOR_CAPTURE.append(1)
        return g * 2

    seen.clear()
    dynamo.capture(appends, (torch.ones(2),), on_graph)
    assert [s.endswith("LOG_FOR_CAPTURE") for s in seen[0].side_effects] == [True]


class _Kind:
    def scale(self) -> float:
        return 2.0


KIND = _Kind()


def test_dynamo_capture_tells_what_it_read_that_its_guards_miss() -> None:
    """``reads_compiling`` (dynamo's ``inconsistent_side_effects``), the classes it guards by
    identity or by an object's type, and :func:`dynamo.tracing`, which dynamo runs while
    tracing (True) and which marks nothing."""
    seen: list[dynamo.Captured] = []

    def on_graph(captured: dynamo.Captured) -> Any:
        seen.append(captured)
        return captured.graph.forward

    def asks(g: torch.Tensor) -> torch.Tensor:
        return g * (3.0 if torch.compiler.is_compiling() else 1.0)

    def traced(g: torch.Tensor) -> torch.Tensor:
        return g * (3.0 if dynamo.tracing() else 1.0) * KIND.scale()

    torch.testing.assert_close(
        dynamo.capture(asks, (torch.ones(2),), on_graph), torch.full((2,), 3.0)
    )
    torch.testing.assert_close(
        dynamo.capture(traced, (torch.ones(2),), on_graph), torch.full((2,), 6.0)
    )
    assert [c.reads_compiling for c in seen] == [True, False]
    assert ("G['KIND']", True) in seen[1].classes  # guarded by its type only
    assert dynamo.tracing() is False  # called, not traced
    assert traced(torch.ones(2)).tolist() == [2.0, 2.0]  # called, not traced: False


def test_dynamo_failed_guard_dict_version_bookkeeping_and_class_namespace() -> None:
    def fn(saved: Any, g: torch.Tensor) -> Any:
        return g * SCALE_FOR_CAPTURE

    dynamo.capture(fn, ((), torch.ones(2)), lambda c: c.graph.forward)
    check = dynamo.guard_check(fn.__code__)
    assert check is not None
    frame = {"saved": (), "g": torch.ones(2)}
    assert dynamo.failed_guard(check, frame) is None
    assert callable(dynamo.guard_names()["___namedtuple_fields"])  # what guard expressions call
    assert dynamo.failed_guard(check, {"saved": (), "g": torch.ones(3)}) is not None
    space = types.ModuleType("namespace_probe").__dict__
    before = dynamo.dict_version(space)
    space["x"] = 1
    assert dynamo.dict_version(space) != before
    assert dynamo.bookkeeping("__compiled_fn_3_ab12") and dynamo.bookkeeping("_140234_c3")
    assert dynamo.bookkeeping("__warningregistry__") and not dynamo.bookkeeping("_scale_2")
    namespace = dynamo.class_namespace(_Kind)
    assert namespace is not None and namespace["scale"] is _Kind.__dict__["scale"]
    before = dynamo.dict_version(namespace)
    _Kind.extra = 1  # type: ignore[attr-defined]
    del _Kind.extra  # type: ignore[attr-defined]
    assert dynamo.dict_version(namespace) != before
    assert dynamo.class_namespace(int) is None  # a built-in class: nothing writes to it


def test_dynamo_unsupported_and_backend_error_read_why_it_refused() -> None:
    def branches(g: torch.Tensor) -> torch.Tensor:
        if g.sum() > 0:
            return g
        return -g

    with pytest.raises(Exception) as info:
        dynamo.capture(branches, (torch.ones(2),), lambda c: c.graph.forward)
    refusal = dynamo.unsupported(info.value)
    assert refusal is not None and refusal.kind == "Data-dependent branching"
    assert refusal.line == "if g.sum() > 0:" and refusal.at.endswith(
        f"test_torch_internals.py:{branches.__code__.co_firstlineno + 1}"
    )
    assert refusal.stack[-1][2] == "if g.sum() > 0:"
    assert dynamo.unsupported(ValueError("not dynamo's")) is None

    def fails(c: dynamo.Captured) -> Any:
        raise KeyError("from the backend")

    with pytest.raises(Exception) as info:
        dynamo.capture(lambda g: g * 2, (torch.ones(2),), fails)
    inner = dynamo.backend_error(info.value)
    assert isinstance(inner, KeyError)


def test_aot_is_tangent_tells_the_output_gradients_of_a_backward_graph() -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    def backward(saved: torch.Tensor, tangents_1: torch.Tensor) -> torch.Tensor:
        return saved * tangents_1

    gm = make_fx(backward)(torch.ones(2), torch.ones(2))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert [aot.is_tangent(n) for n in placeholders] == [False, True]


def test_aot_config_tracing_metadata_and_inductor_compilers() -> None:
    import torch._functorch.config as config
    from torch._dynamo.backends.common import aot_autograd

    assert aot.tracing_metadata() is None  # outside a trace
    with aot.config_patch(donated_buffer=False, enable_autograd_cache=False):
        assert config.donated_buffer is False
    compile_fx, compile_fx_inner = aot.inductor_compilers()
    assert {"inner_compile", "config_patches"} <= set(inspect.signature(compile_fx).parameters)
    assert callable(compile_fx_inner)
    seen: list[Any] = []

    _, boxed_nop = dynamo.eager_backends()

    def fw(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        seen.append(aot.tracing_metadata())
        return boxed_nop(gm, example_inputs)

    torch._dynamo.reset()
    f = torch.compile(
        lambda x: (x * 2).sin(),
        backend=aot_autograd(fw_compiler=fw, bw_compiler=boxed_nop),
        fullgraph=True,
    )
    out = f(torch.ones(2, requires_grad=True))
    assert aot.compiled_backward(out.grad_fn) is None  # compiled at its first backward
    out.sum().backward()
    assert callable(aot.compiled_backward(out.grad_fn))
    assert aot.compiled_backward((torch.ones(1, requires_grad=True) * 2).grad_fn) is None
    (meta,) = seen
    # what the compile backend reads and writes there
    assert hasattr(meta, "bw_donated_idxs") and hasattr(meta, "input_info")
    assert hasattr(meta, "tokens") and hasattr(meta, "num_outputs_rng_offset")
    torch._dynamo.reset()


# -- grouped_mm --------------------------------------------------------------------------------


def test_grouped_mm_groups_rows_and_the_reduced_dimension_and_says_what_it_takes() -> None:
    x, w = torch.randn(6, 8), torch.randn(2, 8, 4)
    offs = torch.tensor([2, 6], dtype=torch.int32)
    out = grouped_mm.grouped_mm(x, w, offs)
    torch.testing.assert_close(out, torch.cat([x[:2] @ w[0], x[2:] @ w[1]]))
    g = torch.randn(6, 4)
    dw = grouped_mm.grouped_mm(x.mT, g, offs)  # the groups split the token dimension
    torch.testing.assert_close(dw, torch.stack([x[:2].mT @ g[:2], x[2:].mT @ g[2:]]))
    w_t = torch.randn(2, 8, 8).bfloat16().mT  # torchtitan's layout: the parameter transposed
    assert grouped_mm.takes(x, w) and grouped_mm.takes(x.bfloat16(), w_t)
    assert not grouped_mm.takes(x.bfloat16(), w.bfloat16().mT)  # rows of 8 bytes
    assert not grouped_mm.takes(x.double(), w.double())  # no float64 kernel
    assert not grouped_mm.takes(x[:, :5].contiguous(), w)  # rows of 20 bytes: not aligned
    assert not grouped_mm.takes(x[:0], w)  # empty
    with pytest.raises(RuntimeError, match="strides should be multiple of 16 bytes"):
        grouped_mm.grouped_mm(x[:, :5].contiguous(), w[:, :5], offs)  # why takes() says no


# -- one door ----------------------------------------------------------------------------------

PRIVATE_ATTRS = frozenset(
    {
        "_C",
        "_backward_cls",
        "_compiled_call_impl",
        "_forward_cls",
        "_input_metadata",
        "_opoverload",
        "_overloadname",
        "_schema",
    }
)
"""Private attributes of torch objects that moved between releases, read on any object."""


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _chain(node: ast.expr) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]`` (None when it does not start at a name)."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def private_torch_uses(path: Path) -> list[tuple[int, str]]:
    """Each use of torch's private API in the code of ``path`` (never in strings or comments):
    an import of a private torch module or of a private name from torch, an attribute chain
    through a private name from a name bound to torch (``torch._C.x``,
    ``torch.nn.parallel.distributed._find_tensors``, ``fwad._x`` after ``import ... as fwad``),
    or a private attribute torch moves between releases (:data:`PRIVATE_ATTRS`) on any object
    but ``self``."""
    tree = ast.parse(path.read_text(), str(path))
    torch_names = {"torch"}
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "torch":
                    if any(map(_private, parts)):
                        found.append((node.lineno, f"import {a.name}"))
                    torch_names.add((a.asname or a.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            module = node.module or ""
            if any(map(_private, module.split("."))):
                found.append((node.lineno, f"from {module} import ..."))
            for a in node.names:
                if _private(a.name):
                    found.append((node.lineno, f"from {module} import {a.name}"))
                else:
                    torch_names.add(a.asname or a.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain = _chain(node)
            if chain and chain[0] in torch_names and any(map(_private, chain[1:])):
                found.append((node.lineno, ".".join(chain)))
            elif node.attr in PRIVATE_ATTRS and not (chain and chain[0] == "self"):
                found.append((node.lineno, f"...{node.attr}"))
    first: dict[int, str] = {}
    for line, what in found:  # one per line: the outermost chain comes first
        first.setdefault(line, what)
    return sorted(first.items())


def test_the_scan_sees_each_form_of_private_use(tmp_path: Path) -> None:
    source = tmp_path / "sample.py"
    source.write_text(
        "import torch\n"
        "import torch.autograd.forward_ad as fwad\n"
        "from torch import _TorchCompileInductorWrapper\n"
        "from torch.distributed.pipelining import _backward\n"
        "from torch._dynamo import eval_frame\n"
        "from torch.nn.parallel import distributed\n"
        "x = torch._C._will_engine_execute_node\n"
        "y = torch.nn.parallel.distributed._find_tensors\n"
        "z = distributed._find_tensors\n"
        "w = fwad._current_level\n"
        "s = op._schema.is_mutable\n"
        "m.module._compiled_call_impl = None\n"
        "# torch._C in a comment\n"
        "t = 'torch._C in a string'\n"
        "u = self._schema\n"
        "v = torch.nn.functional.linear\n"
    )
    assert [n for n, _ in private_torch_uses(source)] == [3, 4, 5, 7, 8, 9, 10, 11, 12]


def test_no_module_outside_the_adapters_uses_private_torch_api() -> None:
    root = Path(cg.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] == "_torch":
            continue
        found += [f"{rel}:{n}: {what}" for n, what in private_torch_uses(path)]
    assert not found, "\n".join(found)


def test_aot_tangent_outputs_tells_which_node_output_each_tangent_is() -> None:
    from torch._dynamo.backends.common import aot_autograd

    _, boxed_nop = dynamo.eager_backends()
    seen: list[Any] = []

    def bw(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        tangents = [n for n in gm.graph.find_nodes(op="placeholder") if aot.is_tangent(n)]
        seen.append((aot.tangent_outputs(aot.tracing_metadata()), len(tangents)))
        return boxed_nop(gm, example_inputs)

    def f(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # an output; a view of another output (made again outside the graph, from that one: no
        # gradient of its own); an output that needs no gradient; the view's base
        base = w * 3
        return x * 2, base.t(), x.detach() + 1, base

    torch._dynamo.reset()
    compiled = torch.compile(
        f, backend=aot_autograd(fw_compiler=boxed_nop, bw_compiler=bw), fullgraph=True
    )
    x, w = torch.ones(2, 2, requires_grad=True), torch.ones(2, 3, requires_grad=True)
    a, view, _, base = compiled(x, w)
    assert view.grad_fn is not None and view.grad_fn.next_functions[0] == (a.grad_fn, 3)
    (a.sum() + view.sum() + base.sum()).backward()
    assert seen == [([0, 3], 2)]  # the tangents: a's, then the base's (the view's goes there)
    assert aot.tangent_outputs(None) is None
    torch._dynamo.reset()
