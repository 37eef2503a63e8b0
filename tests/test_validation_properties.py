"""Property tests of gradient validation over random signatures and random returned dicts.

Every invalid dict raises a CustomGradError (never an internal error, never a wrong gradient);
every valid dict gives the reference gradients (None meaning zero).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import customgrad as cg

_ids = itertools.count()

KINDS = ("tensor", "optional", "list", "int")
ANNOTATIONS = {
    "tensor": "torch.Tensor",
    "optional": "Optional[torch.Tensor]",
    "list": "list[torch.Tensor]",
    "int": "int",
}
VALID = ("correct", "none", "omit_unneeded")
INVALID = ("wrong_shape", "wrong_dtype", "not_tensor", "omit_needed", "list_length")


@dataclass
class Arg:
    name: str
    kind: str
    present: bool  # Optional given a tensor (else None)
    length: int  # list length
    shape: tuple[int, ...]
    needed: bool  # requires grad (so the full backward needs it)


@st.composite
def signatures(draw: st.DrawFn) -> list[Arg]:
    n = draw(st.integers(1, 4))
    args = []
    for i in range(n):
        kind = draw(st.sampled_from(KINDS))
        args.append(
            Arg(
                name=f"a{i}",
                kind=kind,
                present=draw(st.booleans()) if kind == "optional" else kind != "int",
                length=draw(st.integers(0, 3)) if kind == "list" else 0,
                shape=tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2))),
                needed=draw(st.booleans()),
            )
        )
    if not any(a.kind == "tensor" for a in args):
        args.append(Arg("t", "tensor", True, 0, (2,), True))
    return args


def define(args: list[Arg]) -> tuple[cg.CustomOp[..., torch.Tensor], dict[str, Any]]:
    """An op computing sum_i c_i * sum(t_i) * ones(2); gradient of t_i is c_i * sum(g)."""
    params = ", ".join(f"{a.name}: {ANNOTATIONS[a.kind]}" for a in args)
    body = ["    total = torch.zeros(2, dtype=torch.float64)"]
    for i, a in enumerate(args):
        if a.kind == "tensor":
            body.append(f"    total = total + {i + 1} * {a.name}.sum()")
        elif a.kind == "optional":
            body.append(f"    if {a.name} is not None: total = total + {i + 1} * {a.name}.sum()")
        elif a.kind == "list":
            body.append(f"    for t in {a.name}: total = total + {i + 1} * t.sum()")
        else:
            body.append(f"    total = total + {a.name}")
    src = f"def fn({params}) -> torch.Tensor:\n" + "\n".join(body) + "\n    return total\n"
    scope: dict[str, Any] = {"torch": torch, "Optional": __import__("typing").Optional}
    exec(src, scope)
    op = cg.op(f"test_prop{next(_ids)}::fn", scope["fn"])
    op.register_fake(lambda *a: torch.empty(2, dtype=torch.float64))
    op.register_save_for_backward(lambda inputs, output: inputs)
    return op, scope


def make_value(a: Arg) -> Any:
    if a.kind == "int":
        return 3
    if a.kind == "optional" and not a.present:
        return None
    if a.kind == "list":
        return [
            torch.randn(a.shape, dtype=torch.float64, requires_grad=a.needed)
            for _ in range(a.length)
        ]
    return torch.randn(a.shape, dtype=torch.float64, requires_grad=a.needed)


def takes_grad(a: Arg) -> bool:
    return a.kind in ("tensor", "list") or (a.kind == "optional" and a.present)


def is_needed(a: Arg) -> bool:
    return a.needed and takes_grad(a) and not (a.kind == "list" and a.length == 0)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(args=signatures(), data=st.data())
def test_random_dicts_raise_or_give_reference_gradients(
    args: list[Arg], data: st.DataObject
) -> None:
    op, _ = define(args)
    choices = {}
    for a in args:
        options = ["correct", "none"] if is_needed(a) else list(VALID)
        if takes_grad(a):
            options += ["wrong_shape", "wrong_dtype", "not_tensor"]
            if is_needed(a):
                options.append("omit_needed")
            if a.kind == "list":
                options.append("list_length")
        else:
            options = ["omit_unneeded", "int_key"] if a.kind == "int" else ["omit_unneeded", "none"]
        choices[a.name] = data.draw(st.sampled_from(options), label=a.name)
    extra_key = data.draw(st.booleans(), label="unknown key")
    invalid = extra_key or any(c in INVALID or c == "int_key" for c in choices.values())

    def backward(ctx: cg.BackwardContext, inputs: Any, g: torch.Tensor) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for i, a in enumerate(args):
            choice = choices[a.name]
            value = getattr(inputs, a.name)
            coef = float(i + 1)

            def grad_like(t: torch.Tensor, coef: float = coef) -> torch.Tensor:
                return torch.full_like(t, coef) * g.sum()

            if choice == "correct":
                out[a.name] = (
                    [grad_like(t) for t in value] if a.kind == "list" else grad_like(value)
                )
            elif choice == "none":
                out[a.name] = None
            elif choice == "wrong_shape":
                bad = torch.zeros(7, dtype=torch.float64)
                out[a.name] = [bad] * len(value) if a.kind == "list" and value else bad
            elif choice == "wrong_dtype":
                if a.kind == "list":
                    out[a.name] = [grad_like(t).float() for t in value] or 1.0
                else:
                    out[a.name] = grad_like(value).float()
            elif choice == "not_tensor":
                out[a.name] = [1.0] * len(value) if a.kind == "list" and value else 1.0
            elif choice == "list_length":
                out[a.name] = [grad_like(t) for t in value] + [None]
            elif choice == "int_key":
                out[a.name] = torch.zeros(())
        if extra_key:
            out["not_an_argument"] = None
        return out

    op.register_backward(backward)
    values = [make_value(a) for a in args]
    leaves = []
    for a, v in zip(args, values, strict=True):
        if is_needed(a):
            leaves.extend(v if a.kind == "list" else [v])
    out = op(*values)
    if not leaves:
        assert not out.requires_grad
        return
    try:
        grads = torch.autograd.grad(out.sum(), leaves, allow_unused=True)
    except cg.CustomGradError:
        assert invalid, "a valid dict was rejected"
        return
    except Exception as e:  # pragma: no cover - the property being tested
        raise AssertionError(f"internal error instead of a CustomGradError: {e!r}") from e
    assert not invalid, "an invalid dict was accepted"
    k = 0
    for i, a in enumerate(args):
        if not is_needed(a):
            continue
        for t in v if (v := values[i]) is not None and a.kind == "list" else [values[i]]:
            got = grads[k]
            k += 1
            if choices[a.name] == "correct":
                torch.testing.assert_close(got, torch.full_like(t, float(i + 1)) * 2)
            else:
                assert got is None or torch.count_nonzero(got) == 0


GRADS = st.sampled_from(
    ["ok", "none", "wrong_shape", "wrong_dtype", "not_tensor", "omit", "list_length", "item_bad"]
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shapes=st.lists(st.tuples(st.integers(1, 3), st.integers(1, 3)), min_size=1, max_size=3),
    kinds=st.lists(GRADS, min_size=3, max_size=3),
    needed=st.lists(st.booleans(), min_size=3, max_size=3),
    extra_key=st.booleans(),
    half=st.sampled_from(["full", "input", "weight"]),
    list_len=st.one_of(st.none(), st.integers(0, 2)),
)
def test_inline_check_and_full_check_agree(
    shapes: list[tuple[int, int]],
    kinds: list[str],
    needed: list[bool],
    extra_key: bool,
    half: str,
    list_len: int | None,
) -> None:
    """A pass's runner checks a plain dict of valid gradients inline (the node's common case,
    ``check_source``'s lines) and hands anything else to the full check: both must accept the
    same dicts, and an invalid one must raise the same error as the full check alone. The
    first argument is a ``list[Tensor]`` of ``list_len`` items when that is not None."""
    from customgrad._codegen import write_check
    from customgrad._layout import _slots
    from customgrad._signature import Signature
    from customgrad._validate import collect_grads

    names = [f"t{i}" for i in range(len(shapes))]
    kind_of = ["list[torch.Tensor]" if i == 0 and list_len is not None else "torch.Tensor"
               for i in range(len(names))]  # fmt: skip
    params = ", ".join(f"{n}: {k}" for n, k in zip(names, kind_of))
    scope: dict[str, Any] = {"torch": torch}
    exec(f"def fn({params}) -> torch.Tensor:\n    return torch.zeros(1)\n", scope)
    weights = tuple(names[1:])
    sig = Signature("prop::collect", str(torch.library.infer_schema(scope["fn"], mutates_args=())),
                    scope["fn"], weights)  # fmt: skip
    allowed = {"full": sig.tensor_set, "input": sig.input_set, "weight": sig.weight_set}[half]

    def meta(shape: tuple[int, int]) -> Any:
        return (torch.Size(shape), torch.float64, torch.device("cpu"))

    lens = None if list_len is None else (list_len,)
    metas = [meta(s) for s in shapes]
    if list_len is not None:
        metas = [meta(shapes[0])] * list_len + metas[1:]
    slots = None if lens is None else _slots(sig, lens)
    need = frozenset(n for n, k in zip(names, needed) if k and n in allowed)
    result: dict[str, Any] = {}
    for i, (name, shape, kind) in enumerate(zip(names, shapes, kinds)):
        if kind == "omit":
            continue
        good = torch.zeros(shape, dtype=torch.float64)
        bad = {
            "ok": good,
            "none": None,
            "wrong_shape": torch.zeros((*shape, 1), dtype=torch.float64),
            "wrong_dtype": torch.zeros(shape, dtype=torch.float32),
            "not_tensor": 1.0,
            "list_length": good,
            "item_bad": torch.zeros((*shape, 1), dtype=torch.float64),
        }[kind]
        if i == 0 and list_len is not None:
            n = list_len + (1 if kind == "list_length" else 0)
            result[name] = None if kind == "none" else [good] * max(0, n - 1) + [bad] * min(n, 1)
        else:
            result[name] = bad
    if extra_key:
        result["unknown"] = None

    def outcome(run: Any) -> tuple[str, Any]:
        try:
            got = run()
        except cg.CustomGradError as e:
            return type(e).__name__, str(e)
        return "ok", {
            k: v if v is None or isinstance(v, torch.Tensor) else [t is None for t in v]
            for k, v in got.items()
        }

    full = outcome(lambda: collect_grads(sig, half, fn, result, allowed, need, metas, slots))
    # written for any layout (reading the call's slots), for this one layout, and adding the
    # gradients to a dict (the second half of a pass)
    for inline in (
        outcome(lambda: write_check(sig, half, allowed, need)(fn, result, metas, slots)),
        outcome(lambda: write_check(sig, half, allowed, need, slots)(fn, result, metas, None)),
        outcome(lambda: write_check(sig, half, allowed, need, into=True)(fn, result, metas, slots)),
    ):
        assert inline[0] == full[0] and str(inline[1]) == str(full[1])
        if inline[0] == "ok":
            assert inline[1].keys() == full[1].keys() == need & result.keys()


def fn(ctx: Any, saved: Any, grad: Any) -> dict[str, Any]:
    """The location the messages name."""
    return {}
