"""What reading a spec costs: the spec module's import (pydantic and the models) and the
validation of each spec in specs/ and examples/ (docs/sources.md, "The spec's cost").

    .venv/bin/python -m bench.spec_cost [--repeat N] [--baseline DIR]

``--baseline DIR``: a checkout (e.g. ``git worktree add DIR COMMIT``) whose
``btrfs_ublk_image`` is measured the same way, side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# one child process each: CPU (user + sys) and wall of the interpreter doing only this
STARTS = {
    "python -c pass": "pass",
    "import btrfs_ublk_image.cli (ls, inspect, push start here)": "import btrfs_ublk_image.cli",
    "import btrfs_ublk_image.spec": "import btrfs_ublk_image.spec",
}

# parse_spec: YAML (``_compose``, the same code in both trees) plus validation; the
# validation alone (the hand-written validator's entry point in trees before pydantic)
VALIDATE = """
import json, sys, time
from btrfs_ublk_image import spec
from btrfs_ublk_image.spec import Spec, _compose, parse_spec
validate = getattr(Spec, 'model_validate', None) or (lambda d: spec._validate_model(Spec, d, (), []))
def each(f, n):
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n
out = {}
for path in sys.argv[1:]:
    text = open(path, 'rb').read()
    first = each(lambda: parse_spec(text, path), 1)
    data = _compose(text, path)[1]
    out[path] = [
        first,
        each(lambda: parse_spec(text, path), 200),
        each(lambda: _compose(text, path), 200),
        each(lambda: validate(data), 2000),
    ]
print(json.dumps(out))
"""


def _child(code: str, pythonpath: Path, args: list[str] | None = None) -> tuple[float, float, str]:
    """(CPU s, wall s, stdout) of ``python -c code`` with ``pythonpath`` first."""
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", code, *(args or [])],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        cwd=pythonpath,
    ).stdout
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall, out


def _specs() -> list[Path]:
    found = [*ROOT.glob("specs/**/*.yaml"), *ROOT.glob("examples/**/*.yaml")]
    return sorted(found, key=lambda p: (-p.stat().st_size, str(p)))


def measure(tree: Path, repeat: int) -> dict[str, object]:
    starts: dict[str, tuple[float, float]] = {}
    for label, code in STARTS.items():
        runs = [_child(code, tree)[:2] for _ in range(repeat)]
        starts[label] = (
            statistics.median(c for c, _ in runs),
            statistics.median(w for _, w in runs),
        )
    specs = [str(p) for p in _specs()]
    per_run = [json.loads(_child(VALIDATE, tree, specs)[2]) for _ in range(max(3, repeat // 3))]
    validate = {s: [statistics.median(r[s][i] for r in per_run) for i in range(4)] for s in specs}
    return {"starts": starts, "validate": validate}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=15, help="child processes per figure (median)")
    ap.add_argument("--baseline", type=Path, help="another checkout to measure the same way")
    args = ap.parse_args()
    trees = {"this tree": ROOT}
    if args.baseline is not None:
        trees["baseline"] = args.baseline.resolve()
    results = {name: measure(tree, args.repeat) for name, tree in trees.items()}
    names = list(results)
    print(f"medians of {args.repeat} child processes; CPU = user + sys")
    print("| start | " + " | ".join(f"{n}: CPU ms / wall ms" for n in names) + " |")
    print("|---|" + "---:|" * len(names))
    for label in STARTS:
        cells = []
        for n in names:
            cpu, wall = results[n]["starts"][label]  # type: ignore[index]
            cells.append(f"{cpu * 1e3:.0f} / {wall * 1e3:.0f}")
        print(f"| {label} | " + " | ".join(cells) + " |")
    print()
    what = "parse_spec first / later; YAML; validation alone (ms)"
    print("| spec (bytes) | " + " | ".join(f"{n}: {what}" for n in names) + " |")
    print("|---|" + "---:|" * len(names))
    for spec in _specs():
        cells = []
        for n in names:
            first, later, yaml, alone = results[n]["validate"][str(spec)]  # type: ignore[index]
            cells.append(
                f"{first * 1e3:.2f} / {later * 1e3:.2f}; {yaml * 1e3:.2f}; {alone * 1e3:.3f}"
            )
        rel = spec.relative_to(ROOT)
        print(f"| {rel} ({spec.stat().st_size}) | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
