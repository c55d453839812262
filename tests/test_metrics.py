"""Refit metrics: the flat dict a logger takes, scraped from the Prometheus endpoint."""

from __future__ import annotations

import mmap
import urllib.request

from nemo_dcr.metrics import PrometheusExporter, page_faults
from tests.support.launch import free_port


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_every_number_of_a_refit_is_a_gauge_and_outcomes_are_counted():
    port = free_port()
    exporter = PrometheusExporter(port=port)
    try:
        exporter.observe({"version": 1, "committed": True, "wire_bytes": 4096, "pause_s": 0.25,
                          "producer_diff_s": 0.5, "note": "not a number"})
        exporter.observe({"version": 2, "committed": False, "wire_bytes": 512, "pause_s": 0.0})
        exporter.observe_failure()
        got = scrape(port)
    finally:
        exporter.close()
    assert got["nemo_dcr_version"] == 2 and got["nemo_dcr_wire_bytes"] == 512 and got["nemo_dcr_committed"] == 0
    assert got["nemo_dcr_producer_diff_s"] == 0.5
    assert got["nemo_dcr_refits_total"] == 3 and got["nemo_dcr_refits_failed_total"] == 2
    assert not any("note" in k for k in got)


def test_page_faults_count_first_touches():
    pages = 4096
    with mmap.mmap(-1, pages * mmap.PAGESIZE) as m:
        m.madvise(mmap.MADV_NOHUGEPAGE)  # one fault per page, whatever the transparent huge page setting
        before = page_faults()
        for i in range(pages):
            m[i * mmap.PAGESIZE] = 1  # first touch of each page
        first = page_faults() - before
        before = page_faults()
        for i in range(pages):
            m[i * mmap.PAGESIZE] = 2  # touched already: no fault
        again = page_faults() - before
    assert first >= pages and again < pages // 10
