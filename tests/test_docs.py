"""The Python in the documentation runs as written, and excerpts of example files match them.

Blocks fenced as ```` ```python ```` run, on every page (every such block of a page, in order,
in one namespace); blocks with a title (```` ```python title="examples/ops/rms_norm.py" ````)
are excerpts of that file, checked to be in it (``...`` lines separate the excerpt's pieces).
Code that needs several processes or a GPU is shown as ```` ```py ```` (highlighted, not run):
such a block must say how to run it for real (a ``torchrun`` line or an example file).
"""

from __future__ import annotations

import functools
import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from tests._skips import TORCH_SPLIT

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _python_blocks(page: str) -> str:
    text = (DOCS / page).read_text()
    return "\n".join(re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL))


# guides/torch-compile.md: replaced by models/torch-compile.md (written with compiled stages).
# reference/: signatures, generated from the code (whose examples run as doctests).
PAGES = sorted(
    str(p.relative_to(DOCS))
    for p in DOCS.rglob("*.md")
    if "```python\n" in p.read_text()
    and p.relative_to(DOCS).as_posix() != "guides/torch-compile.md"
    and p.relative_to(DOCS).parts[0] != "reference"
)
EXCERPT_PAGES = sorted(
    str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md") if '```python title="' in p.read_text()
)


@functools.cache
def _run_page(page: str) -> dict[str, object]:
    """Run the page's Python once per test session; its names by name."""
    # Op names are global: give each page its own namespace.
    namespace = page.removesuffix(".md").replace("/", "_").replace("-", "_")
    code = (
        _python_blocks(page)
        .replace("mylib::", f"test_docs_{namespace}::")
        .replace("torch.ops.mylib.", f"torch.ops.test_docs_{namespace}.")
    )
    assert code
    # A module of its own, importable as a user's module is (dynamo, which captures traced
    # backwards, reads a function's globals through its module).
    module = types.ModuleType(f"docs_page_{namespace}")
    sys.modules[module.__name__] = module
    scope: dict[str, object] = module.__dict__
    # dont_inherit: the page runs as written, without this module's __future__ imports.
    exec(compile(code, str(DOCS / page), "exec", dont_inherit=True), scope)
    return scope


# pages whose code needs what a release may lack: a capture of the automatic split, torch's own
# split over compiled regions (split-backward.md: a plain Function's backward captured and split,
# and torch's split of it)
PAGE_NEEDS: dict[str, Any] = {
    "pipelines/split-backward.md": TORCH_SPLIT,
    "models/torch-compile.md": TORCH_SPLIT,
    "pipelines/compiled-stages.md": TORCH_SPLIT,
}


@pytest.mark.parametrize(
    "page", [pytest.param(p, marks=PAGE_NEEDS[p]) if p in PAGE_NEEDS else p for p in PAGES]
)
def test_page_code_runs(page: str) -> None:
    _run_page(page)


def test_home_page_op_passes_check_op_and_splits() -> None:
    import torch

    from customgrad.testing import check_op

    scale = _run_page("index.md")["scale"]
    report = check_op(scale, torch.randn(2, 4, 3), torch.randn(3))  # type: ignore[arg-type]
    assert report.ok, str(report)
    assert report.calls["input"] == {"backward_input": 1}
    assert report.calls["weight"] == {"backward_weight": 1}


EXCERPT = re.compile(r'```python title="(examples/[^"]+)"\n(.*?)```', flags=re.DOTALL)


def test_every_page_with_code_is_run() -> None:
    assert {"index.md", "examples/real-ops.md", "troubleshooting.md"} <= set(PAGES)
    assert {"examples/real-ops.md", "writing-ops/op-and-kernels.md"} <= set(EXCERPT_PAGES)


@pytest.mark.parametrize("page", EXCERPT_PAGES)
def test_excerpts_of_example_files_match_the_files(page: str) -> None:
    excerpts = EXCERPT.findall((DOCS / page).read_text())
    if page == "examples/real-ops.md":
        assert len(excerpts) >= 6
    for path, body in excerpts:
        source = (DOCS.parent / path).read_text()
        for piece in re.split(r"^\.\.\.$", body, flags=re.MULTILINE):
            piece = piece.strip("\n")
            assert piece in source, f"{page}: this excerpt is not in {path}:\n{piece}"


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


def test_the_reference_documents_every_public_name() -> None:
    import customgrad
    import customgrad.graph
    import customgrad.ops
    import customgrad.pipelining
    import customgrad.testing

    reference = {
        "customgrad": customgrad,
        "customgrad.testing": customgrad.testing,
        "customgrad.graph": customgrad.graph,
        "customgrad.pipelining": customgrad.pipelining,
        "customgrad.ops": customgrad.ops,
    }
    for name, module in reference.items():
        page = (DOCS / "reference" / f"{name.removeprefix('customgrad.')}.md").read_text()
        documented = set(re.findall(rf"^<!-- api {re.escape(name)}\.(\w+) -->$", page, flags=re.M))
        missing = set(module.__all__) - documented
        assert not missing, f"docs/reference: {name}: not documented: {sorted(missing)}"


def test_the_reference_pages_are_written_from_the_docstrings() -> None:
    # docs/reference/*.md are committed as Markdown (readable on the repository's page); each
    # API block is what tests/_reference.py writes from the code as it is now.
    from tests import _reference as reference

    for page, (committed, written) in reference.pages().items():
        if committed != written:
            old, new = committed.splitlines(), written.splitlines()
            at = next(
                (i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new))
            )
            pytest.fail(
                f"docs/reference/{page} is not what the docstrings give (line {at + 1}: "
                f"{old[at] if at < len(old) else '<end>'!r}, written: "
                f"{new[at] if at < len(new) else '<end>'!r}): run `make reference` and commit it"
            )


def test_the_reference_pages_have_no_directives_left() -> None:
    # mkdocstrings' `::: name` lines render only on the site; the pages are plain Markdown.
    for page in (DOCS / "reference").glob("*.md"):
        assert not re.search(r"^::: ", page.read_text(), flags=re.M), page.name


def test_pipeline_stage_reference_names_torchs_own_arguments() -> None:
    import inspect

    from torch.distributed.pipelining import PipelineStage

    page = (DOCS / "reference" / "pipelining.md").read_text()
    (shown,) = re.findall(r"```text\n(PipelineStage\(.*?\))\n```", page, flags=re.DOTALL)
    names = re.findall(r"(?:^|[(,*]\s*)(\w+)", shown.split("(", 1)[1])
    torchs = set(inspect.signature(PipelineStage.__init__).parameters) - {"self"}
    ours = {"queue", "split_compiled", "run_functions_once", "split_functions"}
    assert set(names) - ours <= torchs, sorted(set(names) - ours - torchs)
    assert {"submodule", "stage_index", "num_stages", "device", "dw_builder"} <= set(names)
    assert ours <= set(names)


def test_troubleshooting_quotes_the_first_line_of_summary() -> None:
    import customgrad

    page = (DOCS / "troubleshooting.md").read_text()
    quoted = (
        "`Backward work done twice over the run: none (N backward calls of customgrad ops). Not "
        "seen: plain autograd.Functions outside customgrad's split.`"
    )
    assert quoted in " ".join(page.split())
    line = customgrad.summary("test_docs_no_such_namespace").repeated
    assert line == quoted.strip("`").replace("(N ", "(0 ")


def test_the_site_reads_in_order_with_next_and_previous_links() -> None:
    config = (DOCS.parent / "mkdocs.yml").read_text()
    assert "    - navigation.footer\n" in config  # next / previous page links
    nav = config[config.index("\nnav:\n") :]
    top = re.findall(r"^  - ([^:]+):", nav, flags=re.M)
    assert top[:3] == ["Home", "Getting started", "Writing ops"]
    assert top[-3:] == ["Troubleshooting", "Concepts", "Reference"]


ROOT = DOCS.parent


def _supported() -> tuple[str, str, str]:
    """The one source of the supported torch range, pyproject.toml's dependency: ``(lowest,
    newest, the first release above)``, e.g. ``("2.11", "2.15", "2.16")``."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    (lower, major, above), *others = re.findall(r'"torch>=(\d+\.\d+),<(\d+)\.(\d+)"', pyproject)
    assert not others
    return lower, f"{major}.{int(above) - 1}", f"{major}.{above}"


def _texts() -> dict[str, str]:
    """Every doc page and every source file whose text or messages may state the range."""
    paths = [ROOT / "README.md", ROOT / "Makefile", *DOCS.rglob("*.md")]
    for folder in ("customgrad", "benchmarks", "examples", "tests"):
        paths += (ROOT / folder).rglob("*.py")
    # (not this file: its comments show wrong ranges)
    return {str(p.relative_to(ROOT)): p.read_text() for p in paths if p != Path(__file__)}


# A range of torch releases ("torch 2.11 to 2.15", "PyTorch 2.13-2.15", "releases (2.11 to
# 2.15)"), a requirement ("torch>=2.11,<2.16") and the cap of the newest release ("torch<2.16").
RANGE = re.compile(
    r"(?:torch|releases)[^.\n]{0,12}?\b(\d+\.\d+)\s*(?:to|-|\u2013|through)\s*(\d+\.\d+)\b", re.I
)
REQUIREMENT = re.compile(r"torch\s*>=\s*(\d+\.\d+)\s*,\s*<\s*(\d+\.\d+)", re.I)
CAP = re.compile(r"torch\s*<\s*(\d+\.\d+)", re.I)


def test_every_statement_of_the_supported_torch_range_is_pyprojects() -> None:
    lower, newest, above = _supported()
    wrong = []
    for path, text in _texts().items():
        flat = " ".join(text.split())
        for m in RANGE.finditer(flat):
            # a range that ends at the newest release, or says it is supported, is the range
            said = flat[max(0, m.start() - 40) : m.end()]
            if (m[2] == newest or "support" in said) and (m[1], m[2]) != (lower, newest):
                wrong.append(f"{path}: {m[0]!r}")
        wrong += [
            f"{path}: {m[0]!r}" for m in REQUIREMENT.finditer(flat) if m.groups() != (lower, above)
        ]
        wrong += [f"{path}: {m[0]!r}" for m in CAP.finditer(flat) if m[1] != above]
    assert not wrong, (
        f"pyproject.toml supports torch>={lower},<{above}; these say otherwise: {wrong}"
    )


def test_the_pages_a_newcomer_reads_state_the_supported_range() -> None:
    lower, newest, above = _supported()
    texts = _texts()
    for path in (
        "README.md",
        "docs/getting-started.md",
        "docs/concepts/compatibility.md",
        "customgrad/_releases.py",
        "customgrad/_torch/__init__.py",
    ):
        assert f"{lower} to {newest}" in " ".join(texts[path].split()), path
    for path in ("docs/getting-started.md", "docs/concepts/compatibility.md"):
        assert f"torch>={lower},<{above}" in texts[path], path
