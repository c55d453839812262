"""Import NeMo RL from its pinned source snapshot (`../shared/third_party/nemo-rl`).

The snapshot goes on sys.path; nothing of it is copied. One stand-in: the package
`nemo_rl.models.policy` is entered as a namespace, without running its `__init__`, which
asserts transformers < 5.12 (a tokenizer patch of NeMo RL's; the test environments run
newer transformers, and none of the modules used here needs that patch).
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

NEMO_RL = Path(__file__).resolve().parents[3] / "shared" / "third_party" / "nemo-rl"  # the pinned snapshot


def import_nemo_rl(src: Path | None = None) -> Path:
    """Make `nemo_rl` importable here from `src` (default: $DCR_NEMO_RL_SRC, else the
    pinned snapshot); returns the source folder. Raises ImportError when it is missing."""
    src = Path(src or os.environ.get("DCR_NEMO_RL_SRC") or NEMO_RL)
    if not (src / "nemo_rl" / "__init__.py").exists():
        raise ImportError(f"NeMo RL's source is not at {src} (set DCR_NEMO_RL_SRC)")
    if str(src) not in sys.path:
        sys.path.insert(0, str(src))
    name = "nemo_rl.models.policy"
    if name not in sys.modules:
        stand_in = types.ModuleType(name)
        stand_in.__path__ = [str(src / "nemo_rl" / "models" / "policy")]
        sys.modules[name] = stand_in
    return src


def require_nemo_rl() -> Path:
    """`import_nemo_rl()` for tests: skip without the snapshot; under CI=true its absence
    is a failure."""
    import pytest

    try:
        return import_nemo_rl()
    except ImportError as e:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI: {e}", pytrace=False)
        pytest.skip(str(e))
