"""Each adapter of torch's private API (customgrad/_torch/) reads what it says, in the form read:
when a torch upgrade changes a name or a behaviour one relies on, its test here fails instead of
customgrad silently taking a slower fallback or a wrong answer. One test (or a few) per adapter,
named after it; a last test checks that no other module of customgrad names a private torch
module outside the modules still to be converted."""

from __future__ import annotations

import inspect
import re
import tokenize
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
    fake,
    functions,
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


def test_engine_will_execute_and_current_node_inside_a_backward() -> None:
    assert engine.will_execute is not None
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
    assert dispatcher.alias_check is not None
    x = torch.ones(3)
    assert dispatcher.alias_check((x,), {}, (x[:1],)) is True
    assert dispatcher.alias_check((x,), {}, (x.clone(),)) is False
    assert dispatcher.is_alias_of(x[1:], x) and not dispatcher.is_alias_of(x.clone(), x)
    function, method = dispatcher.aten_callables("mm")
    assert function is not None and method is not None
    assert dispatcher.aten_callables("no_such_op") == (None, None)


# -- transforms --------------------------------------------------------------------------------


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


# -- pipelining --------------------------------------------------------------------------------


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
    # torch 2.11 batches every stage's init p2p ops; 2.12 and later vote between neighbours
    from torch.distributed.pipelining import PipelineStage, schedules

    assert hasattr(PipelineStage, "_get_init_p2p_neighbors_ops")  # what customgrad's stage filters
    multi = inspect.getsource(schedules.PipelineScheduleMulti._initialize_stages)
    if pipelining.torch_stage_inits_same_rank():  # every stage's init ops, batched
        assert "_get_init_p2p_neighbors_ops()" in multi
    else:  # PipelineStages vote with their neighbours instead
        assert "stage._warmup_forward_vote(" in inspect.getsource(schedules)


# -- dynamo and AOTAutograd --------------------------------------------------------------------


def test_dynamo_backends_and_optimized_module() -> None:
    from torch._dynamo.backends.common import aot_autograd

    dynamo.load()
    aot_eager, boxed_nop = dynamo.eager_backends()
    assert callable(aot_eager) and callable(boxed_nop)
    assert isinstance(aot_autograd(fw_compiler=boxed_nop), dynamo.aot_autograd_type())
    assert dynamo.lookup_backend("aot_eager") is not None
    module = torch.compile(torch.nn.Linear(2, 2), backend="eager")
    assert isinstance(module, dynamo.optimized_module_type())


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


# -- one door ----------------------------------------------------------------------------------

PRIVATE = re.compile(
    r"torch\._(C|functorch|dynamo|inductor|guards|subclasses|library|ops)\b"
    r"|torch\.library\._|torch\.utils\._|_forward_cls|_backward_cls"
    r"|torch\.distributed\.pipelining(\.stage)? import _|pipelining\.stage\._|fwad\._"
    r"|profiler\._is_profiler_enabled"
)


def _code_lines(path: Path) -> dict[int, str]:
    """The code of each line of ``path``, strings and comments left out."""
    skip = {tokenize.STRING, tokenize.COMMENT, getattr(tokenize, "FSTRING_MIDDLE", -1)}
    lines: dict[int, str] = {}
    with path.open("rb") as f:
        for tok in tokenize.tokenize(f.readline):
            if tok.type not in skip:
                lines[tok.start[0]] = lines.get(tok.start[0], "") + tok.string
    return lines


def test_no_module_outside_the_adapters_names_a_private_torch_module() -> None:
    root = Path(cg.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] == "_torch":
            continue
        for n, code in _code_lines(path).items():
            if PRIVATE.search(code):
                found.append(f"{rel}:{n}: {code}")
    assert not found, "\n".join(found)
