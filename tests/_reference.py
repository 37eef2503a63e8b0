"""Write the API reference (``docs/reference/*.md``) from the docstrings, as plain Markdown.

The pages are committed, so they read on the repository's page as on the site. Each page is
prose written by hand with one generated block per public name::

    <!-- api customgrad.op -->
    ... generated: the heading, the signature, the docstring as Markdown ...
    <!-- /api -->

(``<!-- api customgrad.graph module -->`` writes a module's docstring only.) This script
rewrites every block from the code; the prose around the blocks is kept as it is. Docstrings are
Google style (``Args:``, ``Returns:``, ``Raises:``, ``Attributes:``, ``Example:``); their Sphinx
roles (``:func:`summary```) become links to the name's block where the reference has one.

    python -m tests._reference           # rewrite the pages (make reference)
    python -m tests._reference --check   # exit 1, naming the pages, if a page is not up to date

``tests/test_docs.py`` fails when a committed page differs from what this writes.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import importlib
import inspect
import re
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PAGES = {  # page -> the module whose __all__ it documents
    "customgrad.md": "customgrad",
    "testing.md": "customgrad.testing",
    "graph.md": "customgrad.graph",
    "pipelining.md": "customgrad.pipelining",
    "ops.md": "customgrad.ops",
}
BLOCK = re.compile(r"<!-- api (?P<name>[\w.]+)(?P<module> module)? -->\n.*?<!-- /api -->", re.S)
SECTION = re.compile(r"^(Args|Returns|Yields|Raises|Attributes|Examples?|Note|Warning):\s*$")
ITEM = re.compile(r"^(?P<name>\*{0,2}[\w.]+)(?: \((?P<type>[^)]*)\))?:(?: (?P<text>.*))?$")
ROLE = re.compile(r":(?:func|class|meth|attr|data|mod|exc|obj):`(?P<target>[^`]+)`")
WIDTH = 96  # a signature longer than this gets one parameter per line


@dataclasses.dataclass(frozen=True)
class Entry:
    """A documented name: the page and anchor of its heading."""

    page: str
    anchor: str


def anchor(title: str) -> str:
    """The anchor GitHub and mkdocs (``toc``'s default slug) both give a heading."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def reference_dir() -> Path:
    return ROOT / "docs" / "reference"


# ---------------------------------------------------------------------------------------------
# What a name is


def resolve(name: str) -> Any:
    """The object a dotted public name names (``customgrad.CustomOp.register_fake``)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            obj = inspect.getattr_static(obj, part) if inspect.isclass(obj) else getattr(obj, part)
        return obj
    raise LookupError(name)


def members(cls: type) -> Iterator[tuple[str, Any]]:
    """A class's public methods and properties with a docstring, its own first, then those of
    its customgrad bases (in source order)."""
    seen: set[str] = set()
    for base in cls.__mro__:
        if not base.__module__.startswith("customgrad") or issubclass(base, BaseException):
            continue
        for key, value in vars(base).items():
            if key.startswith("_") or key in seen:
                continue
            func = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
            if not (inspect.isfunction(func) or isinstance(value, property)):
                continue
            if not _own_doc(value.fget if isinstance(value, property) else func):
                continue
            seen.add(key)
            yield key, value


def _own_doc(obj: Any) -> str:
    """The object's own docstring, cleaned (not one inherited from a base, e.g. torch's)."""
    doc = getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc) if isinstance(doc, str) else ""


@functools.cache
def module_values(module: str) -> dict[str, tuple[str, str | None]]:
    """A module's top-level assignments: ``name -> (source of the value, its docstring)``."""
    path = inspect.getsourcefile(importlib.import_module(module))
    assert path is not None
    source = Path(path).read_text()
    body = ast.parse(source).body
    found: dict[str, tuple[str, str | None]] = {}
    for node, after in zip(body, [*body[1:], None]):
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            target = node.targets[0].id
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
            target = node.target.id
        else:
            continue
        doc = None
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            doc = inspect.cleandoc(str(after.value.value))
        text = ast.get_source_segment(source, node) or ""
        found[target] = (text, doc)
    return found


# ---------------------------------------------------------------------------------------------
# Signatures


def _annotation(a: Any) -> str:
    if a is inspect.Parameter.empty:
        return ""
    return a if isinstance(a, str) else inspect.formatannotation(a)


def _default(v: Any) -> str:
    if inspect.isfunction(v) or inspect.isbuiltin(v) or inspect.isclass(v):
        return f"{v.__module__}.{v.__qualname__}"
    text = repr(v)
    if " at 0x" in text:
        raise ValueError(f"a default without a stable repr: {text}")
    return text


def signature(title: str, obj: Callable[..., Any], *, drop_self: bool = False) -> str:
    """``title(params) -> returns`` as Python, one parameter a line when it is long."""
    sig = inspect.signature(obj)
    params = list(sig.parameters.values())
    if drop_self and params and params[0].name in ("self", "cls"):
        params = params[1:]
    parts: list[str] = []
    star = False
    for i, p in enumerate(params):
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        if p.kind is p.VAR_POSITIONAL:
            star = True
        prefix = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
        text = prefix + p.name
        ann = _annotation(p.annotation)
        if ann:
            text += f": {ann}"
        if p.default is not p.empty:
            text += f" = {_default(p.default)}" if ann else f"={_default(p.default)}"
        parts.append(text)
        nxt = params[i + 1] if i + 1 < len(params) else None
        if p.kind is p.POSITIONAL_ONLY and (nxt is None or nxt.kind is not p.POSITIONAL_ONLY):
            parts.append("/")
    ret = _annotation(sig.return_annotation)
    tail = f" -> {ret}" if ret and ret != "None" else ""
    line = f"{title}({', '.join(parts)}){tail}"
    if len(line) <= WIDTH:
        return line
    return f"{title}(\n" + "".join(f"    {p},\n" for p in parts) + f"){tail}"


# ---------------------------------------------------------------------------------------------
# Docstrings as Markdown


class Writer:
    """Turns docstrings into Markdown, linking the names the reference documents."""

    def __init__(self, index: dict[str, Entry], page: str) -> None:
        self.index = index
        self.page = page

    def link(self, target: str, context: str) -> str:
        short = target.startswith("~")
        target = target.lstrip("~")
        shown = target.rsplit(".", 1)[-1] if short else target
        entry = None
        scopes = [context]
        while "." in scopes[-1]:
            scopes.append(scopes[-1].rsplit(".", 1)[0])
        for scope in [*scopes, "customgrad", ""]:
            entry = self.index.get(f"{scope}.{target}" if scope else target)
            if entry is not None:
                break
        code = f"`{shown}`"
        if entry is None:
            return code
        page = "" if entry.page == self.page else entry.page
        return f"[{code}]({page}#{entry.anchor})"

    def inline(self, text: str, context: str) -> str:
        text = ROLE.sub(lambda m: self.link(m["target"], context), text)
        text = re.sub(r"``([^`]+)``", r"`\1`", text)
        return text.replace("\\ ", "")

    def wrap(self, text: str, context: str, first: str = "", rest: str = "") -> list[str]:
        """One paragraph of docstring lines as Markdown, wrapped at the page's width."""
        text = self.inline(" ".join(text.split()), context)
        return textwrap.wrap(
            text,
            WIDTH + 4,
            initial_indent=first,
            subsequent_indent=rest,
            break_long_words=False,
            break_on_hyphens=False,
        ) or [first.rstrip()]

    def paragraphs(self, lines: list[str], context: str) -> list[str]:
        """Prose: paragraphs and bullet lists wrapped; ``text::`` + an indented block as a
        Python block; doctests as ``pycon`` blocks."""
        out: list[str] = []
        i = 0
        while i < len(lines):
            line = lines[i]
            if not line.strip():
                out.append("")
                i += 1
            elif line.startswith(">>>"):
                block = []
                while i < len(lines) and lines[i].strip():
                    block.append(lines[i])
                    i += 1
                out += ["```pycon", *block, "```"]
            else:
                bullet = re.match(r"^(\s*)([-*]|\d+\.) ", line)
                indent = len(line) - len(line.lstrip())
                start = i
                i += 1
                while (
                    i < len(lines)
                    and lines[i].strip()
                    and not lines[i].startswith(">>>")
                    and not re.match(r"^\s*([-*]|\d+\.) ", lines[i])
                    and not lines[start:i][-1].rstrip().endswith("::")
                    and (bullet or len(lines[i]) - len(lines[i].lstrip()) == indent)
                ):
                    i += 1
                text = " ".join(lines[start:i])
                literal = text.rstrip().endswith("::")
                if literal:
                    text = text.rstrip()[:-2].rstrip() + ":"
                if bullet:
                    pad = " " * (len(bullet[0]))
                    out += self.wrap(text.strip()[len(bullet[0]) - indent :], context,
                                     bullet[0], pad)  # fmt: skip
                else:
                    out += self.wrap(text, context)
                if literal:
                    block = []
                    while i < len(lines) and (not lines[i].strip() or lines[i].startswith(" ")):
                        block.append(lines[i])
                        i += 1
                    while block and not block[-1].strip():
                        block.pop()
                    while block and not block[0].strip():
                        block.pop(0)
                    code = textwrap.dedent("\n".join(block)).split("\n")
                    out += ["", "```python", *code, "```"]
                    if i < len(lines):
                        out.append("")
        return out

    def items(
        self, lines: list[str], context: str, types: dict[str, str], raises: bool = False
    ) -> list[str]:
        """An ``Args:``-style section as a list: ``name (type): text`` items (``raises``: the
        names are exceptions, linked where the reference documents them)."""
        out: list[str] = []
        body = textwrap.dedent("\n".join(lines)).split("\n")
        heads = [j for j, line in enumerate(body) if not line.startswith(" ") and ITEM.match(line)]
        for k, j in enumerate(heads):
            m = ITEM.match(body[j])
            assert m is not None
            end = heads[k + 1] if k + 1 < len(heads) else len(body)
            name = m["name"]
            kind = m["type"] or ("" if raises else types.get(name.lstrip("*"), ""))
            head = f"- **{self.link(name, context) if raises else f'`{name}`'}**"
            if kind:
                head += f" (`{kind}`)"
            text = " ".join([m["text"] or "", *(x.strip() for x in body[j + 1 : end])]).strip()
            if not text:
                out.append(head)
                continue
            lines_ = self.wrap(f"{head}: {text}", context, "", "  ")
            out += lines_
        return out

    def docstring(self, doc: str, context: str, types: dict[str, str]) -> list[str]:
        lines = doc.split("\n")
        out: list[str] = []
        i = 0
        while i < len(lines):
            m = SECTION.match(lines[i])
            if not m:
                start = i
                while i < len(lines) and not SECTION.match(lines[i]):
                    i += 1
                out += self.paragraphs(lines[start:i], context)
                continue
            name = m[1]
            i += 1
            start = i
            while i < len(lines) and (not lines[i].strip() or lines[i].startswith(" ")):
                i += 1
            section = lines[start:i]
            while section and not section[-1].strip():
                section.pop()
            if out and out[-1]:
                out.append("")
            out.append(f"**{name}:**")
            out.append("")
            if name in ("Args", "Attributes", "Raises"):
                out += self.items(section, context, types, raises=name == "Raises")
            else:
                out += self.paragraphs(textwrap.dedent("\n".join(section)).split("\n"), context)
            if i < len(lines):
                out.append("")
        while out and not out[-1]:
            out.pop()
        return out


# ---------------------------------------------------------------------------------------------
# Blocks


def _python(code: str) -> list[str]:
    return ["```python", code, "```"]


def _types(obj: Any) -> dict[str, str]:
    """Parameter and attribute annotations by name (for the list items' types)."""
    found: dict[str, str] = {}
    target = obj
    if inspect.isclass(obj):
        for klass in reversed(obj.__mro__):
            for k, v in vars(klass).get("__annotations__", {}).items():
                found[k] = _annotation(v)
        target = obj.__init__ if "__init__" in vars(obj) else None
    if target is not None and callable(target):
        try:
            params = inspect.signature(target).parameters.values()
        except (TypeError, ValueError):
            params = []  # type: ignore[assignment]
        for p in params:
            ann = _annotation(p.annotation)
            if ann:
                found[p.name] = ann
    return found


def _bases(cls: type) -> list[str]:
    shown = []
    for base in cls.__bases__:
        if base is object or base.__module__ in ("typing", "typing_extensions"):
            continue
        private = base.__name__.startswith("_") or base.__module__.split(".")[-1].startswith("_")
        if private and base.__module__.startswith("customgrad"):
            continue
        module = base.__module__
        shown.append(base.__name__ if module == "builtins" else f"{module}.{base.__qualname__}")
    return shown


def render(name: str, module_only: bool, writer: Writer, level: int = 3) -> list[str]:
    obj = resolve(name)
    hashes = "#" * level
    out = [f"{hashes} `{name}`", ""]
    if module_only:
        return writer.docstring(_own_doc(obj), name, {})
    if inspect.isclass(obj):
        if issubclass(obj, BaseException):
            pass
        elif getattr(obj, "_is_protocol", False) and "__call__" in vars(obj):
            out += _python(signature(name, obj.__call__, drop_self=True))
            out.append("")
        elif "__init__" in vars(obj) or dataclasses.is_dataclass(obj):
            out += _python(signature(f"class {name}", obj))
            out.append("")
        else:
            out += _python(f"class {name}")
            out.append("")
        bases = _bases(obj)
        if bases:
            out += ["Bases: " + ", ".join(writer.link(b, name) for b in bases) + ".", ""]
        out += writer.docstring(_own_doc(obj), name, _types(obj))
        for key, value in members(obj):
            out += ["", *render_member(f"{name}.{key}", value, writer, level + 1)]
        return out
    if callable(obj) and not _is_alias(obj):
        out += _python(signature(name, obj))
        out.append("")
        out += writer.docstring(_own_doc(obj), name, _types(obj))
        return out
    module, attr = name.rsplit(".", 1)
    source, doc = _value(module, attr)
    out += _python(source)
    if doc:
        out += ["", *writer.docstring(doc, name, {})]
    return out


def _is_alias(obj: Any) -> bool:
    return type(obj).__module__ in ("typing", "typing_extensions")


def _value(module: str, attr: str) -> tuple[str, str | None]:
    """The source of a module-level value and its docstring, where it is defined."""
    mod = importlib.import_module(module)
    for where in (module, *(m for m in sys.modules if m.startswith(module + "."))):
        found = module_values(where).get(attr)
        if found is not None and getattr(sys.modules[where], attr, None) is getattr(mod, attr):
            return found
    raise LookupError(f"{module}.{attr}: no assignment found")


def render_member(name: str, value: Any, writer: Writer, level: int) -> list[str]:
    hashes = "#" * level
    out = [f"{hashes} `{name}`", ""]
    owner = name.rsplit(".", 1)[0]
    if isinstance(value, property):
        ann = _annotation(inspect.signature(value.fget).return_annotation)  # type: ignore[arg-type]
        out += _python(f"{name}: {ann}" if ann else name)
        doc = _own_doc(value.fget)
        fn: Any = value.fget
    else:
        fn = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
        out += _python(signature(name, fn, drop_self=not isinstance(value, staticmethod)))
        doc = _own_doc(fn)
    out += ["", *writer.docstring(doc, owner, _types(fn))]
    return out


# ---------------------------------------------------------------------------------------------
# Pages


def index() -> dict[str, Entry]:
    """Every name the pages' blocks document, and its members, with its page and anchor."""
    found: dict[str, Entry] = {}
    for page in PAGES:
        text = (reference_dir() / page).read_text()
        for m in BLOCK.finditer(text):
            name = m["name"]
            if m["module"]:
                continue
            found[name] = Entry(page, anchor(name))
            obj = resolve(name)
            if inspect.isclass(obj):
                for key, _ in members(obj):
                    found[f"{name}.{key}"] = Entry(page, anchor(f"{name}.{key}"))
    return found


def write_page(page: str, text: str, names: dict[str, Entry]) -> str:
    writer = Writer(names, page)

    def block(m: re.Match[str]) -> str:
        body = render(m["name"], bool(m["module"]), writer)
        head = f"<!-- api {m['name']}{m['module'] or ''} -->"
        return "\n".join([head, *body, "<!-- /api -->"])

    return BLOCK.sub(block, text)


def pages() -> dict[str, tuple[str, str]]:
    """``page -> (committed text, generated text)``."""
    names = index()
    out = {}
    for page in PAGES:
        text = (reference_dir() / page).read_text()
        out[page] = (text, write_page(page, text, names))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if a page is not up to date")
    args = parser.parse_args(argv)
    stale = []
    for page, (old, new) in pages().items():
        if old != new:
            stale.append(page)
            if not args.check:
                (reference_dir() / page).write_text(new)
    if args.check and stale:
        print(f"not up to date: {', '.join(stale)}; run `make reference`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
