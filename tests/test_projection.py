"""`nemo-dcr project`: per-byte costs measured with the real codec, then a cluster model
whose stages respond to the resources they depend on, and clear errors on bad input."""

from __future__ import annotations

import dataclasses
import json

import pytest

from nemo_dcr.cli import main
from nemo_dcr.projection import (GOAL_1T_3PCT_S, PAPER_DENSE_1T_S, Cluster, Costs, measure_costs, project,
                                  wire_bytes_per_change_for)

COSTS = Costs(change_rate=0.03, wire_bytes_per_change=1.2, scan_gbps_per_core=0.2,
              apply_gbps_per_core=0.02, memcpy_gbps_per_core=2.0, elements=1 << 20)


def test_measured_costs_come_from_a_bit_exact_round_trip():
    costs = measure_costs(0.03, elements=1 << 18)
    # +-1 ULP at 3%: a few bits of position entropy plus about one bit of value per change
    assert 0.3 < costs.wire_bytes_per_change < 4.0
    assert costs.op == "add"  # +-1-ULP steps: two add values against xor's carry chains (the default op's pick)
    assert costs.scan_gbps_per_core > 0 and costs.apply_gbps_per_core > 0 and costs.memcpy_gbps_per_core > 0


def test_each_stage_follows_its_resource():
    base = project(Cluster(), COSTS)
    faster_links = project(dataclasses.replace(Cluster(), cross_gbps=2 * Cluster().cross_gbps), COSTS)
    assert faster_links.stages_s["cross-region transfer"] == pytest.approx(base.stages_s["cross-region transfer"] / 2)
    assert faster_links.stages_s["scan (diff + encode)"] == base.stages_s["scan (diff + encode)"]
    more_changes = project(dataclasses.replace(Cluster(), change_rate=0.06), COSTS)
    assert more_changes.wire_bytes == pytest.approx(2 * base.wire_bytes)
    assert more_changes.stages_s["scan (diff + encode)"] == base.stages_s["scan (diff + encode)"]
    assert base.total_s >= max(base.stages_s.values()) and base.serial_s >= base.total_s - 1.0
    assert base.dense_bytes == 2e12 and base.dense_s > base.total_s
    # the wire is what the change rate and the codec say, nothing else
    assert base.wire_bytes == pytest.approx(1e12 * 0.03 * 1.2)


def test_one_replica_needs_no_relay_fan_out():
    small = project(dataclasses.replace(Cluster(), params=8e9, receiver_gpus=8), COSTS)
    assert small.stages_s["relay fan-out"] == 0.0


def test_cli_prints_assumptions_and_the_paper_number(tmp_path, capsys):
    out_json = tmp_path / "p.json"
    assert main(["project", "--elements", str(1 << 16), "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "assumptions:" in out and "the paper: 150 s" in out and "the paper's links" in out
    assert "1T dense 87.5 min (the paper: 87.5 min)" in out and "goal 75 s" in out
    data = json.loads(out_json.read_text())
    assert data["cluster"]["producer_gpus"] == 32 and data["cluster"]["receiver_gpus"] == 64
    assert data["total_s"] > 0 and set(data["stages_s"]) == set(project(Cluster(), COSTS).stages_s)


@pytest.mark.parametrize("flag,value,message", [
    ("--change-rate", "1.5", "--change-rate must be in"),
    ("--cross-gbps", "0", "--cross-gbps must be positive"),
    ("--fanout", "1", "--fanout must be at least 2"),
])
def test_bad_cluster_descriptions_are_named(flag, value, message):
    with pytest.raises(SystemExit, match=message):
        main(["project", flag, value, "--elements", "1024"])


def test_the_dense_reference_crosses_the_papers_links():
    """By default the links are the paper's: its 1T dense reference is reproduced, and the
    delta crosses the same links (like for like)."""
    base = project(Cluster(), COSTS)
    assert base.dense_s == pytest.approx(PAPER_DENSE_1T_S)
    assert base.stages_s["cross-region transfer"] == pytest.approx(base.dense_s * base.wire_bytes / base.dense_bytes)


def test_the_goals_wire_budget_inverts_the_transfer():
    base = project(Cluster(), COSTS)
    need = wire_bytes_per_change_for(base, GOAL_1T_3PCT_S)
    at_budget = project(Cluster(), dataclasses.replace(COSTS, wire_bytes_per_change=need))
    assert at_budget.stages_s["cross-region transfer"] + at_budget.overhead_s == pytest.approx(GOAL_1T_3PCT_S)


def test_conditioned_coding_is_projected_beside_the_plain_one():
    from nemo_dcr.projection import Cluster, ConditionedCosts, Costs, project, report

    costs = Costs(change_rate=0.03, wire_bytes_per_change=0.94, scan_gbps_per_core=1.0, apply_gbps_per_core=0.5,
                  memcpy_gbps_per_core=5.0, elements=1 << 20)
    plain, cond = project(Cluster(), costs), project(Cluster(), costs, ConditionedCosts())
    assert cond.wire_bytes == pytest.approx(plain.wire_bytes * ConditionedCosts().wire_ratio)
    assert {"conditioned encode", "conditioned decode"} <= cond.stages_s.keys()
    assert cond.total_s < plain.total_s
    text = report(plain, cond)
    assert "with baseline-conditioned coding" in text and f"with it {cond.total_s:.2f} s" in text


def test_each_worker_of_a_node_decodes_the_nodes_share_on_its_part_of_the_cores():
    from nemo_dcr.projection import Cluster, ConditionedCosts, project, report

    cond = ConditionedCosts()
    c = Cluster()
    p = project(c, COSTS, cond)
    threads = c.receiver_cores_per_node // c.receiver_gpus_per_node
    share = c.params / c.nodes_per_replica(c.params * 2)
    assert p.stages_s["conditioned decode"] == pytest.approx(
        share / (cond.decode_elements_per_s_per_core * threads * c.decode_thread_efficiency))
    # Twice the GPUs on a node (the same cores): each worker has half the threads, twice the time.
    denser = project(dataclasses.replace(c, receiver_gpus_per_node=16, receiver_gpus=128), COSTS, cond)
    assert denser.stages_s["conditioned decode"] == pytest.approx(2 * p.stages_s["conditioned decode"])
    text = report(project(c, COSTS), p)
    assert "mirrors (vLLM)" in text and "does NOT fit" in text  # 1T: eight whole mirrors exceed a node
    small = dataclasses.replace(c, params=8e9)
    assert "fits" in report(project(small, COSTS), project(small, COSTS, cond)).split("mirrors (vLLM)")[1]
