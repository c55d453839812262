"""Records that turn one set of canonical bits into another (test oracle helper)."""

from __future__ import annotations

import numpy as np

from nemo_dcr.records import Op, Record


def records_for(catalog, old: dict[str, np.ndarray], new: dict[str, np.ndarray], op: Op) -> list[Record]:
    """One record per tensor whose flat unsigned bits differ between `old` and `new`."""
    out = []
    for name in sorted(old):
        pos = np.flatnonzero(old[name] != new[name]).astype(np.uint64)
        if pos.size == 0:
            continue
        o, n = old[name][pos], new[name][pos]
        vals = {Op.XOR: o ^ n, Op.ADD: n - o, Op.OVERWRITE: n}[op]  # unsigned: add wraps
        dtype, shape = catalog[name]
        out.append(Record(name, dtype, shape, op, pos, vals.astype(o.dtype)))
    return out
