"""The Python in the getting-started page and the home page runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _python_blocks(page: str) -> str:
    text = (DOCS / page).read_text()
    return "\n".join(re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL))


@pytest.mark.parametrize("page", ["index.md", "getting-started.md"])
def test_page_code_runs(page: str) -> None:
    # Op names are global: give each page its own namespace.
    code = _python_blocks(page).replace(
        "mylib::", f"test_docs_{page.split('.')[0].replace('-', '_')}::"
    )
    assert code
    exec(compile(code, str(DOCS / page), "exec"), {"__name__": "docs_page"})


def test_readme_example_runs_and_is_correct() -> None:
    text = (DOCS.parent / "README.md").read_text()
    code = "\n".join(re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL))
    code = code.replace("mylib::", "test_docs_readme::")
    scope: dict[str, object] = {"__name__": "readme"}
    exec(compile(code, "README.md", "exec"), scope)

    import torch

    from customgrad.testing import check_op

    linear = scope["linear"]
    x = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    assert check_op(linear, x, w).ok
    gx, gw = torch.autograd.grad(linear(x, w).sum(), (x, w))  # type: ignore[operator]
    ex, ew = torch.autograd.grad((x @ w.mT).sum(), (x, w))
    torch.testing.assert_close(gx, ex)
    torch.testing.assert_close(gw, ew)
