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

NEMO_RL = Path(os.environ.get("DCR_NEMO_RL_SRC", Path(__file__).resolve().parents[3] / "shared" / "third_party"
                              / "nemo-rl"))


def import_nemo_rl() -> Path:
    """Make `nemo_rl` importable here; returns the source folder. Raises ImportError
    when the snapshot is missing."""
    if not (NEMO_RL / "nemo_rl" / "__init__.py").exists():
        raise ImportError(f"NeMo RL's source is not at {NEMO_RL} (set DCR_NEMO_RL_SRC)")
    if str(NEMO_RL) not in sys.path:
        sys.path.insert(0, str(NEMO_RL))
    name = "nemo_rl.models.policy"
    if name not in sys.modules:
        stand_in = types.ModuleType(name)
        stand_in.__path__ = [str(NEMO_RL / "nemo_rl" / "models" / "policy")]
        sys.modules[name] = stand_in
    return NEMO_RL
