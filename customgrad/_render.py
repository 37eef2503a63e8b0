"""Rendering a :class:`customgrad.graph.SplitExplanation`: a text table, Graphviz DOT, a picture."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from customgrad._errors import ArgumentValueError
from customgrad._origin import ValueOrigin, by_module

if TYPE_CHECKING:
    from customgrad.graph import SplitExplanation

__all__ = ["COLORS", "dot", "draw", "table"]

COLORS = {
    "input": "#9ecae1",
    "weight": "#a1d99b",
    "both": "#fdd49e",
    "twice": "#fb6a4a",
    "none": "#e0e0e0",
}


def _shorten(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def _node_rows(self: SplitExplanation) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    header: tuple[str, ...] = ("node", "module", "kind", "runs in", "full", "I", "W", "repeated")
    rows: list[tuple[str, ...]] = [
        (
            n.label,
            n.module,
            n.kind,
            n.runs_in,
            str(n.flops["full"]),
            str(n.flops["input"]),
            str(n.flops["weight"]),
            (f"{n.repeated_flops} TWICE" if n.computes_twice else str(n.repeated_flops)),
        )
        for n in self.nodes
    ]
    if not any(n.module for n in self.nodes if n.kind != "input"):  # no module names
        header = header[:1] + header[2:]
        rows = [r[:1] + r[2:] for r in rows]
    if any(self.outside_flops.values()):
        o = self.outside_flops
        blank = ("",) * (len(header) - 7)
        rows.append(
            ("(outside nodes)", *blank, "deferred", "W", str(o["full"]), str(o["input"]),
             str(o["weight"]), "")
        )  # fmt: skip
    return header, rows


def _module_rows(self: SplitExplanation) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    header = ("module", "nodes", "runs in", "full", "I", "W", "repeated")
    rows: list[tuple[str, ...]] = [
        (
            m.module or "(stage)",
            str(len(m.nodes)),
            m.runs_in,
            str(m.flops["full"]),
            str(m.flops["input"]),
            str(m.flops["weight"]),
            (f"{m.repeated_flops} TWICE" if m.computes_twice else str(m.repeated_flops)),
        )
        for m in self.modules
    ]
    if any(self.outside_flops.values()):
        o = self.outside_flops
        rows.append(
            ("(outside nodes)", "", "W", str(o["full"]), str(o["input"]), str(o["weight"]), "")
        )
    return header, rows


def _kept_lines(origins: Sequence[ValueOrigin], by: str) -> list[str]:
    """What a compiled region's input pass keeps for W, by module and source line (or one
    line per value, ``by="node"``)."""
    lines = ["    I keeps for W (where the forward made each value):"]
    if by == "node":
        for o in origins:
            size = "" if o.nbytes is None else f", {o.nbytes} bytes"
            shape = "?" if o.shape is None else tuple(o.shape)
            lines.append(
                f"      {o.name}: {shape} {o.dtype}{size} from {o.where}"
                + (f" at {o.source}: {o.code}" if o.source else "")
            )
        return lines
    for where, group in by_module(origins).items():
        sizes = [o.nbytes for o in group]
        size = "" if None in sizes else f", {sum(s for s in sizes if s is not None)} bytes"
        n = len(group)
        lines.append(f"      {where}: {n} value{'s' if n > 1 else ''}{size}")
        sources = dict.fromkeys((o.source, o.code) for o in group if o.source)
        lines += [f"        {src}: {_shorten(code, 72)}" for src, code in sources]
    return lines


def table(self: SplitExplanation, by: str = "module") -> str:
    """The explanation as a table, one row per module (or per node), then the FLOP totals
    and advice."""
    grouped = by == "module" and len({m.module for m in self.modules}) > 1
    header, rows = _module_rows(self) if grouped else _node_rows(self)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    text_columns = len(header) - 4

    def fmt(r: Sequence[str]) -> str:
        cells = [c.ljust(w) for c, w in zip(r[:text_columns], widths)]
        cells += [c.rjust(w) for c, w in zip(r[text_columns:], widths[text_columns:])]
        return "  " + "  ".join(cells).rstrip()

    f = self.flops
    grouping = (
        f"{len(self.modules)} modules; rows by module, table('node') for each node"
        if grouped
        else "one row per node"
    )
    lines = [
        f"Split backward of a stage ({len(self.nodes)} autograd nodes, {grouping}; split by "
        f"{self.splitter}; FLOPs by torch's formulas)",
        fmt(header),
        *(fmt(r) for r in rows),
        f"FLOPs: full backward {f['full']}, input pass {f['input']}, weight pass "
        f"{f['weight']}, repeated {self.repeated_flops}.",
    ]
    uncounted: dict[str, int] = {}
    for calls in self.uncounted.values():
        for op, k in calls.items():
            uncounted[op] = uncounted.get(op, 0) + k
    if uncounted:
        ops = ", ".join(f"{op} ({k} calls)" for op, k in sorted(uncounted.items()))
        lines.append(f"Not counted (no FLOP formula; their FLOPs are missing above): {ops}.")
    twice = self.computes_twice
    if twice:
        lines.append("Computes twice (does backward work in both I and W):")
        for n in twice:
            where = f" in {n.module}" if n.module else ""
            lines.append(
                f"  - {n.label}{where} ({n.kind}): {n.repeated_flops} FLOPs repeated; {n.advice()}."
            )
    else:
        lines.append("Nothing computes twice.")
    compiled = [n for n in self.nodes if n.compiled is not None]
    if compiled:
        lines.append("Compiled regions (customgrad.compile):")
        for n in compiled:
            lines.append(f"  - {n.label}: {n.compiled}.")
            if n.kept:
                lines += _kept_lines(n.kept, by)
    auto = [n for n in self.nodes if n.auto_split is not None]
    if auto:
        lines.append("Single backwards (split='auto'):")
        lines += [f"  - {n.label}: {n.auto_split}." for n in auto]
    return "\n".join(lines)


def dot(self: SplitExplanation) -> str:
    """The graph in Graphviz DOT: nodes colored by pass, edges in the gradient's direction."""
    lines = [
        "digraph split {",
        "  rankdir=TB;",
        '  node [shape=box, style="rounded,filled", fontname="Helvetica"];',
    ]
    for i, n in enumerate(self.nodes):
        label = f"{n.label}\\n{n.kind} · {n.runs_in}"
        if n.computes_twice:
            label += f"\\nTWICE ({n.repeated_flops} FLOPs repeated)"
        label = label.replace('"', '\\"')
        lines.append(f'  n{i} [label="{label}", fillcolor="{COLORS[n.color_key]}"];')
    for a, b in self.edges:
        lines.append(f"  n{a} -> n{b};")
    lines.append("}")
    return "\n".join(lines)


def draw(self: SplitExplanation, path: Path) -> Path:
    """Draw the graph to a PNG or SVG file (the suffix picks), laid out in layers by depth."""
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in ("png", "svg"):
        raise ArgumentValueError(
            f"explain_split(...).draw({str(path)!r}): cannot tell the format from the "
            f"suffix {path.suffix!r}. Use a path ending in .png or .svg."
        )
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyBboxPatch, Patch

    layers: dict[int, list[int]] = collections.defaultdict(list)
    for i, n in enumerate(self.nodes):
        layers[n.depth].append(i)
    n_rows = max(layers) + 1 if layers else 1
    n_cols = max((len(v) for v in layers.values()), default=1)
    box_w, box_h, gap_x, gap_y = 2.6, 0.7, 0.4, 0.6
    pos: dict[int, tuple[float, float]] = {}
    for depth, idxs in layers.items():
        row_w = len(idxs) * box_w + (len(idxs) - 1) * gap_x
        x0 = (n_cols * (box_w + gap_x) - gap_x - row_w) / 2
        for k, i in enumerate(idxs):
            pos[i] = (x0 + k * (box_w + gap_x) + box_w / 2, -depth * (box_h + gap_y))

    width = max(6.0, n_cols * (box_w + gap_x))
    height = max(3.0, n_rows * (box_h + gap_y) + 1.2)
    fig = Figure(figsize=(width, height))
    ax = fig.add_subplot()
    ax.set_axis_off()
    for a, b in self.edges:
        (xa, ya), (xb, yb) = pos[a], pos[b]
        ax.annotate(
            "",
            xy=(xb, yb + box_h / 2),
            xytext=(xa, ya - box_h / 2),
            arrowprops={"arrowstyle": "->", "color": "#555555", "lw": 1},
        )
    for i, n in enumerate(self.nodes):
        x, y = pos[i]
        ax.add_patch(
            FancyBboxPatch(
                (x - box_w / 2, y - box_h / 2),
                box_w,
                box_h,
                boxstyle="round,pad=0.02,rounding_size=0.1",
                facecolor=COLORS[n.color_key],
                edgecolor="#333333",
            )
        )
        text = f"{_shorten(n.label, 36)}\n{n.kind} · {n.runs_in}"
        if n.computes_twice:
            text += f" · TWICE ({n.repeated_flops} FLOPs)"
        ax.text(x, y, text, ha="center", va="center", fontsize=7)
    ax.set_xlim(-gap_x, n_cols * (box_w + gap_x))
    ax.set_ylim(-(n_rows - 1) * (box_h + gap_y) - box_h, box_h + 0.2)
    legend = [
        Patch(facecolor=COLORS["input"], label="input pass only"),
        Patch(facecolor=COLORS["weight"], label="weight pass only"),
        Patch(facecolor=COLORS["both"], label="both, split"),
        Patch(facecolor=COLORS["twice"], label="both, computes twice"),
        Patch(facecolor=COLORS["none"], label="did not run"),
    ]
    ax.legend(handles=legend, loc="lower center", ncol=5, fontsize=7, frameon=False,
              bbox_to_anchor=(0.5, -0.08))  # fmt: skip
    f = self.flops
    ax.set_title(
        f"FLOPs: full {f['full']}, I {f['input']}, W {f['weight']}, repeated {self.repeated_flops}",
        fontsize=9,
    )
    fig.savefig(path, format=fmt, bbox_inches="tight")
    return path
