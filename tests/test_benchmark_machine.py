"""benchmarks/machine.py: the machine description every benchmark writes tells host types
apart by family, model, L3 and the instruction sets the kernels choose by."""

from __future__ import annotations

import json
import os

from benchmarks.machine import ISA_FLAGS, cpu_info, machine_info

# Two processors (the second's fields must not leak into the first's), as Linux prints them.
CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC
stepping\t: 1
flags\t\t: fpu sse2 avx2 bmi2 avx512f avx512bw avx512vl avx512_vbmi2 avx512_vnni

processor\t: 1
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 207
model name\t: Intel(R) Xeon(R)
flags\t\t: fpu avx2
"""


def test_cpu_info_reads_the_first_processor_and_the_kernels_isa_flags():
    info = cpu_info(CPUINFO, l3="32768K")
    assert info == {"cpu": "AMD EPYC", "cpu_vendor": "AuthenticAMD", "cpu_family": 26, "cpu_model": 2,
                    "cpu_stepping": 1, "l3_cache": "32768K",
                    "isa": ["avx2", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512_vbmi2"]}


def test_cpu_info_without_avx512_or_fields_says_none():
    info = cpu_info("processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu avx2 avx512f\n", l3="")
    assert info["cpu"] == "Some CPU" and info["isa"] == ["avx2", "avx512f"]
    assert info["cpu_family"] is None and info["cpu_model"] is None and info["l3_cache"] is None


def test_machine_info_of_this_machine_is_json_with_extras_last():
    info = json.loads(json.dumps(machine_info(load_average=[1.0, 2.0, 3.0], cpus="overridden")))
    assert info["cpus"] == "overridden" and info["load_average"] == [1.0, 2.0, 3.0]
    assert info["python"] and info["platform"] and set(info["isa"]) <= set(ISA_FLAGS)
    if os.path.exists("/proc/cpuinfo"):
        assert info["cpu"] and isinstance(info["cpu_family"], int)
