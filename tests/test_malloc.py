"""keep_freed_memory: memory freed after one round of staging is reused by the next round
without page faults (in a fresh process: the setting is process-wide)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

ROUNDS = """
import json, sys
import numpy as np
from nemo_dcr.malloc import keep_freed_memory
from nemo_dcr.metrics import page_faults
kept = keep_freed_memory() if sys.argv[1] == "keep" else False
faults = []
for _ in range(3):  # stage ~200 MB as decoded records (16 MB + 4 MB arrays), free it all
    before = page_faults()
    staged = []
    for k in range(10):
        a = np.empty(2 << 20, np.int64)
        a[:] = k
        v = np.empty(2 << 20, np.uint16)
        v[:] = k
        staged.append((a, v))
    del staged
    faults.append(page_faults() - before)
print(json.dumps({"kept": kept, "faults": faults}))
"""


def rounds(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", ROUNDS, mode], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout)


def test_freed_staging_memory_is_reused_without_page_faults():
    kept = rounds("keep")
    if not kept["kept"]:
        pytest.skip("not glibc: keep_freed_memory changes nothing here")
    released = rounds("release")
    # Without it, every round touches fresh pages again; with it, only the first does.
    assert min(released["faults"][1:]) > 1000, released
    assert max(kept["faults"][1:]) < released["faults"][1] // 20, (kept, released)
