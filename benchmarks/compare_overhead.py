"""Per-call overhead of this tree's customgrad against an earlier commit's, runs alternated.

Run from the repository's root:
``.venv/bin/python -m benchmarks.compare_overhead --against 69a7347`` (``--runs``, ``--quick``).

``benchmarks/overhead.py`` prints each customgrad path as a ratio to a plain
``torch.autograd.Function`` timed in the same run. This script checks out the ``customgrad``
package of ``--against`` (``git archive``) into a temporary directory, then runs this tree's
``benchmarks/overhead.py`` alternately against that package and against this tree's, ``--runs``
times each, and prints the median of each ratio for both and their difference (the stage's
input and weight passes too, against the anchors ``overhead.py`` times them with). Alternating
spreads the load of a shared machine over both; the spread between runs of the same code
(printed too) says how large a difference is noise.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# "| linear | backward | 1.40, 1.36, 1.52 | 0.78, 0.76, 0.85 |"
ROW = re.compile(
    r"^\| (?P<op>[^|]+) \| (?P<path>backward|autograd\.grad) \| (?P<ratios>[\d., ]+) \|"
)
STYLES = ("pair", "phase", "auto")
# "customgrad.pipelining passes / autograd.Function, torch's split: I 1.28, W 0.97, I + W 1.11"
PASSES = re.compile(
    r"^customgrad\.pipelining passes / (?P<anchor>[^:]+): I (?P<i>[\d.]+), W (?P<w>[\d.]+), "
    r"I \+ W (?P<iw>[\d.]+)"
)


def _ratios(package_dir: Path, quick: bool) -> dict[tuple[str, str, str], float]:
    """One run of overhead.py with ``customgrad`` imported from ``package_dir``."""
    env = {**os.environ, "PYTHONPATH": str(package_dir)}
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "overhead.py"),
        *(["--quick"] if quick else []),
    ]
    out = subprocess.run(cmd, env=env, cwd=package_dir, capture_output=True, text=True, check=True)
    found: dict[tuple[str, str, str], float] = {}
    for line in out.stdout.splitlines():
        p = PASSES.match(line)
        if p:  # the stage's passes (a 4-layer MLP of customgrad ops) against an anchor's
            anchor = p["anchor"].split(" [")[0]
            for which, v in (("I", p["i"]), ("W", p["w"]), ("I + W", p["iw"])):
                found["4-layer MLP, " + anchor, which, "customgrad.pipelining"] = float(v)
            continue
        m = ROW.match(line)
        if m:
            values = [float(v) for v in m["ratios"].split(",")]
            # the table of customgrad / Function (pair, phase, auto), then the one-column
            # table of auto / pair, whose rows match the same pattern: kept apart
            styles = STYLES if len(values) == len(STYLES) else ("auto / pair",)
            for style, v in zip(styles, values, strict=True):
                found[m["op"].strip(), m["path"], style] = v
    if not found:
        raise SystemExit(f"compare_overhead: no ratio table in overhead.py's output:\n{out.stdout}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, help="a commit (its customgrad/ is compared)")
    parser.add_argument("--runs", type=int, default=3, help="runs of each (alternated)")
    parser.add_argument("--quick", action="store_true", help="overhead.py --quick (noisier)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="customgrad-old-") as old:
        archive = subprocess.run(
            ["git", "archive", args.against, "customgrad"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", old], input=archive, check=True)
        runs: dict[str, list[dict[tuple[str, str, str], float]]] = {"then": [], "now": []}
        for i in range(args.runs):
            for which, where in (("then", Path(old)), ("now", ROOT)):
                print(f"run {i + 1}/{args.runs}: {which}", file=sys.stderr, flush=True)
                runs[which].append(_ratios(where, args.quick))
    print(
        f"customgrad / autograd.Function, median of {args.runs} alternated runs of "
        f"benchmarks/overhead.py{' --quick' if args.quick else ''}: {args.against} (then) "
        f"against this tree (now); spread: max - min over the runs of the same code\n"
    )
    print("| op | path | style | then | now | now - then | spread then, now |")
    print("|---|---|---|---:|---:|---:|---:|")
    for key in runs["now"][0]:
        then = [r[key] for r in runs["then"] if key in r]
        now = [r[key] for r in runs["now"]]
        if not then:
            continue
        a, b = statistics.median(then), statistics.median(now)
        spread = f"{max(then) - min(then):.2f}, {max(now) - min(now):.2f}"
        print(f"| {key[0]} | {key[1]} | {key[2]} | {a:.2f} | {b:.2f} | {b - a:+.2f} | {spread} |")


if __name__ == "__main__":
    main()
