"""NeMo RL's own checkpoint-engine refit path with NeMo-DCR plugged in, on real parts
(`tests/support/nemo_rl_grpo.py`: a Ray CPU cluster, NeMo RL's synchronizer and worker
mixins, Megatron TP=2 trained with AdamW, vLLM): every refit checked against a fresh
load, a corrupted-payload step that must fail closed, and its recovery.

- The zero-patch tier runs on the pinned NeMo RL snapshot as it is.
- The shard-local tier runs on a copy of the snapshot with
  patches/nemo-rl/checkpoint-engine-shard-local.patch applied, over the same steps, and
  is compared with the zero-patch tier: the same changes, no export read by the policy
  ranks, no dense load into vLLM, and metrics returned by `sync_weights`.
"""

from __future__ import annotations

import pytest

from tests.support.nemo_rl_grpo import patched_nemo_rl, run_grpo
from tests.support.nemo_rl_import import require_nemo_rl
from tests.support.vllm_venv import require_vllm_venv

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def export_tier(tmp_path_factory):
    require_vllm_venv()
    require_nemo_rl()
    return run_grpo(tmp_path_factory.mktemp("export") / "export.json", "--fault")


def refits(result: dict) -> list[dict]:
    return [r for r in result["refits"] if not r.get("failed")]


def test_zero_patch_tier_refits_and_fails_closed(export_tier):
    done = refits(export_tier)
    assert [r["step"] for r in export_tier["refits"]] == [0, 1, 2, 3, "fault", "recovered"]
    for r in done[1:]:
        policy, vllm = r["policy"], r["vllm"]
        # every rank reads the whole export and keeps its disjoint share: together, the model once
        assert all(p["export_stream_bytes"] == policy[0]["dense_bytes"] for p in policy)
        assert sum(p["export_read_bytes"] for p in policy) == policy[0]["dense_bytes"]
        assert policy[0]["wire_bytes"] < policy[0]["dense_bytes"] / 3
        assert 0 < vllm["tensors"] and vllm["load_s"] > 0
        assert r["returned_by_sync_weights"] is None  # unpatched NeMo RL drops what engines return


def test_shard_local_tier_beside_the_zero_patch_tier(export_tier, tmp_path):
    nemo_rl = patched_nemo_rl(tmp_path / "nemo-rl")
    local = run_grpo(tmp_path / "shard_local.json", "--fault", "--shard-local", "--nemo-rl", str(nemo_rl))
    assert [r["step"] for r in local["refits"]] == [r["step"] for r in export_tier["refits"]]
    for a, b in zip(refits(export_tier)[1:], refits(local)[1:]):
        pa, pb = a["policy"][0], b["policy"][0]  # rank 0: every producer's numbers
        assert a["trainer_state"] == b["trainer_state"]  # the same training: the same weights at every step
        assert abs(pa["wire_bytes"] - pb["wire_bytes"]) < 0.1 * pa["wire_bytes"]  # and about the same changes sent
        assert all(p["export_stream_bytes"] == 0 for p in b["policy"])  # nothing exported...
        # ...each rank reads the shards its optimizer owns (TP halves, replicated norms on both)
        assert all(0 < p["owned_read_bytes"] < 0.6 * pb["dense_bytes"] for p in b["policy"])
        assert b["vllm"]["load_s"] == 0 and "tensors" not in b["vllm"]  # applied in place: no dense load
        assert b["returned_by_sync_weights"]["version"] == pb["version"]  # NeMo RL logs them under refit/
    # what benchmarks/nemo_rl_tiers.py reports of such runs
    from benchmarks.nemo_rl_tiers import summary

    rows = {tier: summary(result)["rows"] for tier, result in (("export", export_tier), ("local", local))}
    assert [r["step"] for r in rows["local"]] == [1, 2, 3] == [r["step"] for r in rows["export"]]
    assert all(r["vllm_tensors_loaded"] == 0 and r["export_streamed_per_rank"] == [0, 0] for r in rows["local"])
    assert all(r["vllm_tensors_loaded"] > 0 for r in rows["export"])
