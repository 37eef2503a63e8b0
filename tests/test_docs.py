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
