"""Where a benchmark writes its results.

A full run writes benchmarks/results/NAME.json (the committed numbers BENCHMARKS.md
quotes); a --smoke run, unless --out says otherwise, writes NAME_smoke.json in the temp
dir, so that checking a benchmark still runs never overwrites its committed results.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def results_path(name: str, out: str | None, smoke: bool) -> Path:
    """The JSON path for a run: `out` when given, else by `smoke` as the module says."""
    if out:
        return Path(out)
    if smoke:
        return Path(tempfile.gettempdir()) / f"{name}_smoke.json"
    return RESULTS / f"{name}.json"
