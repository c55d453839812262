"""A fast slice of the decoder fuzz campaign (the long run: `python -m tests.fuzz_decoder`):
every mutated payload is rejected cleanly or is a valid payload; no crash, hang or memory
blow-up, and the runtime keeps its bits."""

from __future__ import annotations

from tests.fuzz_decoder import run, table


def test_mutated_payloads_are_rejected_cleanly():
    result = run(2500, seed=7)
    outcomes = result["outcomes"]
    assert not {"CRASH", "HANG", "MEMORY"} & set(outcomes), table(result)
    assert result["runtime_untouched"]
    assert outcomes["rejected cleanly"] > 0.9 * sum(outcomes.values()), table(result)
    # every kind of damage was tried
    kinds = {k.split("-")[0] if k.startswith("bomb") else k for k in result["mutations"]}
    assert {"truncate", "flip", "reseal-body", "reseal-lie", "bomb", "wrong-key", "strip-mac", "version"} <= kinds
