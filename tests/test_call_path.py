"""The one call path: every call of every op runs ``CustomOp.__call__`` -> ``_run_call`` ->
``AutogradImpl`` and every backward ``customgrad._autograd._node_apply``, whatever the signature.

Random signatures (Tensor, Optional, float and list arguments), registrations, requires-grad
patterns and backward passes give the gradients torch's autograd computes for the kernel itself;
a backward that returns a wrong gradient is refused with customgrad's error.
"""

from __future__ import annotations

import itertools
import re
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import customgrad as cg
from customgrad.pipelining import stage_backward_input, stage_backward_weight
from tests.conftest import linear_op

_names = itertools.count()
KINDS = {"T": "torch.Tensor", "O": "torch.Tensor | None", "F": "float", "L": "list[torch.Tensor]"}
FAULTS = (
    "none",
    "shape",
    "dtype",
    "missing",
    "unknown",
    "not_dict",
    "extra_none",
    "wrong_half",
    "length",
)


def _define(kinds: str, weights: tuple[int, ...], style: str, fault: str) -> Any:
    """An op ``a0 * 1 + a1 * 2 + ...`` (float args scale the first tensor) with ``fault``
    injected into what its backward returns."""
    trailing = len(kinds) - len(kinds.rstrip("O"))  # trailing Optionals default to None
    params = ", ".join(
        f"a{i}: {KINDS[k]}" + (" = None" if i >= len(kinds) - trailing else "")
        for i, k in enumerate(kinds)
    )
    terms = " + ".join(
        f"(0 if a{i} is None else a{i} * {i + 1})"
        if k == "O"
        else f"sum(t * {i + 1} for t in a{i})"
        if k == "L"
        else f"a{i} * {i + 1}"
        for i, k in enumerate(kinds)
        if k != "F"
    )
    scale = " * ".join([f"a{i}" for i, k in enumerate(kinds) if k == "F"] or ["1.0"])
    scope: dict[str, Any] = {"torch": torch}
    exec(f"def kernel({params}) -> torch.Tensor:\n    return ({terms}) * {scale}\n", scope)
    name = f"test_call_path::op{next(_names)}"
    op = cg.op(name, scope["kernel"], weights=tuple(f"a{i}" for i in weights))
    tensors = [f"a{i}" for i, k in enumerate(kinds) if k != "F"]
    floats = [f"a{i}" for i, k in enumerate(kinds) if k == "F"]

    @op.register_save_for_backward
    def _(inputs: Any, output: torch.Tensor) -> Any:
        scale = 1.0
        for f in floats:
            scale *= getattr(inputs, f)
        return (*(getattr(inputs, t) for t in tensors), scale)

    def grads(allowed: set[str], saved: Any, g: torch.Tensor) -> Any:
        out: dict[str, Any] = {}
        for i, t in enumerate(tensors):
            if t in allowed:
                value = saved[i]
                scale = (int(t[1:]) + 1) * saved[-1]
                if isinstance(value, list):
                    out[t] = [g * scale for _ in value]
                else:
                    out[t] = None if value is None else g * scale
        target = next(iter(sorted(allowed)), None)
        if target is not None and isinstance(out.get(target), list):
            items = out[target]
            if fault == "length":
                out[target] = items[:-1]
            elif items and fault in ("shape", "dtype"):
                items[0] = items[0][:1] if fault == "shape" else items[0].float()
            return out
        if fault == "not_dict":
            return list(out.values())
        if fault == "unknown":
            out["nope"] = g
        if fault == "extra_none" and target is not None:
            out[target] = None
        if target is not None and out.get(target) is not None:
            if fault == "shape":
                out[target] = out[target][:1]
            elif fault == "dtype":
                out[target] = out[target].float()
            elif fault == "missing":
                del out[target]
        return out

    inputs = {t for t in tensors if int(t[1:]) not in weights}
    weight_names = {t for t in tensors if int(t[1:]) in weights}
    if style == "pair":
        wrong = weight_names if fault == "wrong_half" else set()

        if inputs:

            @op.register_backward_input
            def _(ctx: Any, saved: Any, g: torch.Tensor) -> Any:
                return grads(inputs | wrong, saved, g)

        if weight_names:

            @op.register_backward_weight
            def _(ctx: Any, saved: Any, g: torch.Tensor) -> Any:
                return grads(weight_names, saved, g)
    else:  # "phase": called per pass; "auto": traced and split

        @op.register_backward(split=style)
        def _(ctx: Any, saved: Any, g: torch.Tensor) -> Any:
            return grads(inputs | weight_names, saved, g)

    op.reference = scope["kernel"]  # the kernel, differentiated by torch: the reference
    return op


def _run(
    op: Any,
    kinds: str,
    weights: tuple[int, ...],
    requires: tuple[bool, ...],
    present: tuple[bool, ...],
    how: str,
    lengths: tuple[int, ...] = (),
) -> Any:
    """Call the op and run one backward; return the gradients or the error."""
    torch.manual_seed(0)
    args: list[Any] = []
    length = iter(lengths)
    for i, k in enumerate(kinds):
        if k == "F":
            args.append(1.5 + i)
        elif k == "O" and not present[i]:
            args.append(None)
        elif k == "L":  # items alternate whether they require grad, starting with requires[i]
            args.append(
                [
                    torch.randn(3, 4, dtype=torch.float64, requires_grad=requires[i] ^ (j % 2 == 1))
                    for j in range(next(length))
                ]
            )
        else:
            args.append(torch.randn(3, 4, dtype=torch.float64, requires_grad=requires[i]))
    flat = [t for a in args for t in (a if isinstance(a, list) else [a])]
    leaves = [a for a in flat if isinstance(a, torch.Tensor) and a.requires_grad]
    try:
        out = op(*args)
        g = torch.randn_like(out)
        if how == "backward":
            if not out.requires_grad:
                return ("no grad",)
            out.backward(g)
            return [None if a.grad is None else a.grad.clone() for a in leaves]
        if how == "grad_first":
            if not leaves:
                return ("no grad",)
            return list(torch.autograd.grad(out, leaves[:1], g, allow_unused=True))
        ws = [
            t
            for i, a in enumerate(args)
            if i in weights
            for t in (a if isinstance(a, list) else [a])
            if any(t is x for x in leaves)
        ]
        inputs = [a for a in leaves if not any(a is w for w in ws)]
        dinputs, groups = stage_backward_input([out], [g], inputs, ws)
        stage_backward_weight(ws, groups)
        return [*dinputs, *(w.grad for w in ws)]
    except Exception as e:  # the same error on both paths is the point
        return (type(e).__name__, re.sub(r"op\d+", "op", str(e)))


_ERRORS = {
    cls.__name__
    for cls in vars(cg).values()
    if isinstance(cls, type) and issubclass(cls, cg.CustomGradError)
}


@settings(max_examples=100, deadline=None)
@given(
    kinds=st.text(alphabet="TOFL", min_size=1, max_size=4).filter(lambda s: "T" in s or "L" in s),
    data=st.data(),
)
def test_every_signature_gives_the_kernels_own_gradients(kinds: str, data: st.DataObject) -> None:
    tensor_idx = [i for i, k in enumerate(kinds) if k != "F"]
    weights = tuple(data.draw(st.sets(st.sampled_from(tensor_idx))) if tensor_idx else ())
    style = data.draw(st.sampled_from(("pair", "phase", "auto")))
    fault = data.draw(st.sampled_from(FAULTS))
    requires = tuple(data.draw(st.lists(st.booleans(), min_size=len(kinds), max_size=len(kinds))))
    present = tuple(data.draw(st.lists(st.booleans(), min_size=len(kinds), max_size=len(kinds))))
    how = data.draw(st.sampled_from(("backward", "grad_first", "split")))
    lengths = tuple(data.draw(st.integers(0, 3)) for k in kinds if k == "L")
    op = _define(kinds, weights, style, fault)
    got = _run(op, kinds, weights, requires, present, how, lengths)
    want = _run(op.reference, kinds, weights, requires, present, how, lengths)
    if isinstance(want, tuple):  # nothing requires grad: nothing to compare
        assert got == want or (isinstance(got, tuple) and got[0] in _ERRORS)
        return
    if fault != "none" and isinstance(got, tuple):  # a wrong gradient: customgrad's error
        assert got[0] in _ERRORS, got
        return
    assert isinstance(got, list), got
    assert len(got) == len(want)
    for a, b in zip(got, want):
        if fault == "none" or (a is not None and b is not None):
            assert (a is None) == (b is None) or fault == "extra_none"
            if a is not None and b is not None:
                torch.testing.assert_close(a, b)


def test_a_call_records_the_ops_own_node_run_by_the_one_backward() -> None:
    from customgrad._autograd import _node_apply

    op = _define("TTO", (1, 2), "pair", "none")
    x, w = (torch.randn(3, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out = op(x, w)  # the trailing Optional takes its default
    assert type(out.grad_fn).__name__ == f"CustomGrad[{op.name}]Backward"
    assert type(out.grad_fn).apply is _node_apply
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(3, 4, dtype=torch.float64))
    torch.testing.assert_close(w.grad, torch.full((3, 4), 2.0, dtype=torch.float64))


def test_rules_registered_after_the_first_call_are_used() -> None:
    op = _define("TT", (1,), "pair", "none")
    x, w = (torch.randn(3, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    op(x, w).sum().backward()
    op.register_backward_weight(lambda ctx, saved, g: {"a1": g * 10})
    x.grad = w.grad = None
    op(x, w).sum().backward()
    torch.testing.assert_close(w.grad, torch.full((3, 4), 10.0, dtype=torch.float64))


def test_a_node_recorded_before_new_rules_runs_the_new_rules() -> None:
    op = _define("TT", (1,), "pair", "none")
    x, w = (torch.randn(3, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out = op(x, w)
    op.register_backward_weight(lambda ctx, saved, g: {"a1": g * 10})
    out.sum().backward()
    torch.testing.assert_close(w.grad, torch.full((3, 4), 10.0, dtype=torch.float64))


def test_autograd_grad_finds_captured_leaves_without_asking_the_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``autograd.grad`` captures its inputs; the engine's query raises (slowly) for a captured
    leaf, so the node reads the inputs from the caller instead and asks only about the rest
    (``customgrad._runtime.needed_edges``). A ``.backward()`` without ``inputs=`` runs every
    node: nothing is asked."""
    from customgrad import _runtime

    op = _define("TT", (1,), "pair", "none")
    asked: list[object] = []
    will = _runtime._edge_query

    def counting(fn: object) -> bool:
        asked.append(fn)
        return bool(will(fn))

    monkeypatch.setattr(_runtime, "_edge_query", counting)
    x, w = (torch.randn(3, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out = op(x, w)
    (gw,) = torch.autograd.grad(out.sum(), [w], retain_graph=True)
    torch.testing.assert_close(gw, torch.full((3, 4), 2.0, dtype=torch.float64))
    assert len(asked) == 1  # x's edge only (not needed: False without a raise); w's is known
    asked.clear()
    gx, gw = torch.autograd.grad(out.sum(), [x, torch.autograd.graph.get_gradient_edge(w)])
    torch.testing.assert_close(gx, torch.ones(3, 4, dtype=torch.float64))
    torch.testing.assert_close(gw, torch.full((3, 4), 2.0, dtype=torch.float64))
    assert asked == []
    out = op(x, w)
    out.sum().backward()  # no inputs=: the engine runs every node, nothing is asked
    assert asked == []
    torch.testing.assert_close(x.grad, torch.ones(3, 4, dtype=torch.float64))
    x.grad = w.grad = None
    op(x, w).sum().backward(inputs=[w])  # inputs= (nothing captured): every edge is asked
    assert len(asked) == 2
    assert x.grad is None
    torch.testing.assert_close(w.grad, torch.full((3, 4), 2.0, dtype=torch.float64))


def test_a_backward_without_inputs_runs_every_edge_of_a_node_it_reaches() -> None:
    """What the shortcut of ``.backward()`` without ``inputs=`` (``EVERY_EDGE``) relies on: the
    engine's own query answers True for every next edge of a node that runs, here a customgrad
    node in the middle of a graph whose other branch the backward does not reach."""
    from customgrad._torch.engine import will_execute

    if will_execute is None:
        pytest.skip("this torch has no engine query")
    op = _define("TT", (1,), "pair", "none")
    x, w = (torch.randn(3, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    unrelated = torch.randn(3, dtype=torch.float64, requires_grad=True) * 2
    out = op(torch.tanh(x), w)
    answers: list[bool] = []

    def ask(grads: object) -> None:
        assert out.grad_fn is not None
        answers.extend(will_execute(fn) for fn, _ in out.grad_fn.next_functions)
        answers.append(will_execute(unrelated.grad_fn))

    assert out.grad_fn is not None
    out.grad_fn.register_prehook(ask)
    out.sum().backward()
    assert answers == [True, True, False]
    torch.testing.assert_close(w.grad, torch.full((3, 4), 2.0, dtype=torch.float64))


def test_check_op_runs_the_path_a_user_call_runs() -> None:
    from customgrad.testing import check_op

    op = linear_op("test_call_path_check::linear")
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 3, generator=g), torch.randn(5, 3, generator=g)
    report = check_op(op, x, w)
    assert report.calls["input"] == {"backward_input": 1}
    assert report.calls["weight"] == {"backward_weight": 1}


def test_backward_context_is_read_only_and_kept_per_pass_plan() -> None:
    """A backward without shared work gets one context per pass plan, reused by every call
    with that plan: it must not be writable, or one backward could change what the next sees."""
    attempts: list[str] = []
    contexts: list[Any] = []

    @cg.op(f"test_call_path::ctx{next(_names)}", weights=("w",))
    def scale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * w

    scale.register_save_for_backward(lambda inputs, out: (inputs.x, inputs.w))

    @scale.register_backward(split="phase")
    def _(ctx: cg.BackwardContext, saved: Any, g: torch.Tensor) -> dict[str, Any]:
        contexts.append(ctx)
        for attr, value in (("phase", "weight"), ("op", None)):
            try:
                setattr(ctx, attr, value)
            except AttributeError:
                continue
            attempts.append(attr)
        x, w = saved
        return {"x": g * w, "w": (g * x).sum(0)}

    x = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, dtype=torch.float64, requires_grad=True)
    for _ in range(2):
        scale(x, w).backward(torch.ones(3, 2, dtype=torch.float64))
    assert attempts == []  # every write refused
    assert contexts[0] is contexts[1]  # one context for the plan
    assert contexts[1].phase == "full" and contexts[1].op is scale
    assert contexts[1].needs_input_grad("x") and contexts[1].needs_input_grad("w")
    torch.testing.assert_close(x.grad, 2 * w.expand(3, 2))
    torch.testing.assert_close(w.grad, 2 * x.sum(0))
    with pytest.raises(cg.GradientValueError, match=re.escape("no such argument")):
        contexts[1].needs_input_grad("y")


def test_list_ops_past_the_layout_limit_keep_checking_every_item() -> None:
    """Each layout of list lengths gets its own runners (items checked one by one) up to
    MAX_LAYOUTS; past it, calls share runners that read the layout from the node. Both give
    the reference gradients and refuse a wrong item."""
    from customgrad._codegen import MAX_LAYOUTS

    @cg.op("cg_call_path::layouts", weights=("s",))
    def wsum(xs: list[torch.Tensor], s: torch.Tensor) -> torch.Tensor:
        return sum((x * s for x in xs), torch.zeros_like(s))

    wsum.register_fake(lambda xs, s: torch.empty_like(s))
    wsum.register_save_for_backward(lambda inputs, out: (list(inputs.xs), inputs.s))
    bad = {"on": False}

    @wsum.register_backward_input
    def _(ctx: Any, saved: Any, g: torch.Tensor) -> dict[str, Any]:
        xs, s = saved
        grads = [g * s for _ in xs]
        if bad["on"]:
            grads[-1] = grads[-1][:1]
        return {"xs": grads}

    wsum.register_backward_weight(lambda ctx, saved, g: {"s": sum(g * x for x in saved[0])})
    s = torch.randn(3, requires_grad=True)
    for n in range(1, MAX_LAYOUTS + 6):
        xs = [torch.randn(3, requires_grad=True) for _ in range(n)]
        wsum(xs, s).sum().backward()
        for x in xs:
            torch.testing.assert_close(x.grad, s.detach())
    layouts = wsum._impl.runners.layouts()
    assert len(layouts) == MAX_LAYOUTS + 1 and None in layouts  # and the shared set
    for n in (2, MAX_LAYOUTS + 3):  # a layout with its own runners, and one past the limit
        xs = [torch.randn(3, requires_grad=True) for _ in range(n)]
        bad["on"] = True
        with pytest.raises(cg.GradientValueError, match=rf"'xs'\[{n - 1}\] of shape \(1,\)"):
            wsum(xs, s).sum().backward()
        bad["on"] = False


def test_show_code_prints_what_the_one_writer_writes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from customgrad._switches import STATE

    monkeypatch.setattr(STATE, "show_code", True)
    op = linear_op(f"test_call_path::shown{next(_names)}")
    x, w = torch.randn(2, 3, requires_grad=True), torch.randn(4, 3, requires_grad=True)
    op(x, w).sum().backward()
    printed = capsys.readouterr().err
    assert f"# <customgrad kernel call of {op.name}>\ndef run(kernel, args):" in printed
    assert f"# <customgrad pass of {op.name}: full ['weight', 'x']>\ndef run(" in printed
    assert "def call(" not in printed  # no call or node is written: one plain-Python path


def test_a_retired_fastpath_switch_warns_once_naming_its_replacement() -> None:
    import subprocess
    import sys

    from customgrad._switches import MSG_RETIRED

    done = subprocess.run(
        [sys.executable, "-W", "always", "-c", "import customgrad"],
        env={**__import__("os").environ, "CUSTOMGRAD_FASTPATH": "0"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert MSG_RETIRED.splitlines()[0] in done.stderr
    assert done.stderr.count("CUSTOMGRAD_FASTPATH is retired") == 1


def test_calls_that_record_nothing_run_the_kernel_with_its_write_check() -> None:
    """Under no_grad, and with grad on but nothing requiring grad, the call runs the kernel
    itself (the last case of ``CustomOp._run_call``): the same output, no node, and the check of
    the kernel's writes."""

    op = linear_op(f"test_call_path::norecord{next(_names)}")
    x, w = torch.randn(3, 4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    with torch.no_grad():
        out = op(x, w)
    assert out.grad_fn is None
    torch.testing.assert_close(out, x @ w.mT)
    out = op(x, w)  # grad mode on, nothing requires grad
    assert out.grad_fn is None
    torch.testing.assert_close(out, x @ w.mT)

    @cg.op(f"test_call_path::writes{next(_names)}")
    def writes(x: torch.Tensor) -> torch.Tensor:
        x.add_(1)
        return x * 2

    with (
        torch.no_grad(),
        pytest.raises(cg.MutationError, match=re.escape("wrote into argument 'x' in place")),
    ):
        writes(torch.ones(2))


@pytest.mark.parametrize(
    ("args", "arg", "want", "got"),
    [
        ((None, "w"), "x", "a Tensor", "None"),
        ((1.5, "w"), "x", "a Tensor", "a float"),
        (("x", "w", 3), "bias", "a Tensor or None", "a int"),
    ],
    ids=["None for a Tensor", "float for a Tensor", "int for an Optional"],
)
def test_an_argument_of_the_wrong_kind_is_refused_naming_it(
    args: tuple[Any, ...], arg: str, want: str, got: str
) -> None:
    """The call's one loop over Tensor and Optional arguments refuses what the schema does not
    take, with the signature's message (``Signature.check_args``)."""

    @cg.op(f"test_call_path::kinds{next(_names)}", weights=("w", "bias"))
    def lin(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return x @ w.mT

    values = {"x": torch.randn(2, 3, requires_grad=True), "w": torch.randn(4, 3)}
    call = [values[a] if isinstance(a, str) else a for a in args]
    with pytest.raises(
        cg.ArgumentTypeError, match=re.escape(f"argument {arg!r} must be {want}, but got {got}")
    ):
        lin(*call)


def test_an_edge_to_no_node_is_not_needed_and_not_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    # (an input that requires no grad: the engine's query would raise for it, slowly)
    from customgrad import _runtime

    class Edges:
        next_functions = ((None, 0), (object(), 0))

    asked: list[object] = []
    monkeypatch.setattr(_runtime, "_edge_query", lambda fn: asked.append(fn) or True)
    assert list(_runtime.needed_edges(Edges(), None, None) or ()) == [False, True]
    assert asked == [Edges.next_functions[1][0]]
    assert list(_runtime.needed_edges(Edges(), (None, False), None) or ()) == [False, False]
