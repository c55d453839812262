"""What a benchmark records about the machine it ran on.

Results from different host types must be told apart by their files alone: several hosts
report the same model name ("AMD EPYC" for Zen 3, Zen 4 and Zen 5 alike), and what the
compiled kernels can use (AVX-512 with VBMI2 for the compress-store diff) and the L3 size
move the numbers more than the name says. `machine_info()` is the one description every
benchmark writes under "machine".
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

# Instruction-set extensions, as /proc/cpuinfo spells them, that tell the measured hosts
# apart: the four AVX-512 ones are what `kernels.diff.HAVE_VECTOR_DIFF` requires (without them
# the 16-bit diff takes the bit scan); AVX2 and BMI2 mark the older hosts' level.
ISA_FLAGS = ("avx2", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512_vbmi2")


def cpu_info(cpuinfo: str | None = None, l3: str | None = None) -> dict:
    """The first processor's identity from /proc/cpuinfo's text (read when None): model
    name, vendor, family / model / stepping, the L3 cache's size (`l3`, read from sysfs
    when None) and which of ISA_FLAGS it has. Fields a platform does not report are None
    (isa: empty)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    first: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if first:
                break  # the first processor's block is enough
            continue
        key, sep, value = line.partition(":")
        if sep:
            first.setdefault(key.strip(), value.strip())
    flags = set(first.get("flags", "").split())
    if l3 is None:
        try:
            l3 = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        except OSError:
            l3 = None

    def number(key: str) -> int | None:
        value = first.get(key)
        return int(value) if value is not None and value.isdigit() else None

    return {"cpu": first.get("model name") or platform.processor() or None,
            "cpu_vendor": first.get("vendor_id"), "cpu_family": number("cpu family"),
            "cpu_model": number("model"), "cpu_stepping": number("stepping"),
            "l3_cache": l3 or None, "isa": [f for f in ISA_FLAGS if f in flags]}


def machine_info(**extra) -> dict:
    """Python, platform, core count, memory, the CPU (`cpu_info`) and the versions of numpy
    and torch where loaded, then `extra` (a benchmark's own readings, e.g. load averages)."""
    info = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
            **cpu_info()}
    try:
        info["mem_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        info["mem_gib"] = None
    for name in ("numpy", "torch"):
        module = sys.modules.get(name)
        if module is not None:
            info[name] = getattr(module, "__version__", None)
    info.update(extra)
    return info
