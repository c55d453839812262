"""The wire format versions this release writes and reads (docs/wire-format.md, "Versioning").

Two formats, one per need: the host format (5), which a CPU codes and decodes, and the
device format (6), whose prefix-coded records a GPU codes where the changes are. Version 6
is experimental until it is measured on a GPU. Nothing older is written or read: no
earlier version was released.

A module of its own, with no imports (nor does its package import anything), so that code
run where the compiled kernels must not load yet can name them: the NeMo RL config is
imported by vLLM generation workers before their engine starts, and vLLM 0.32's CPU
start-up fails when numba's LLVM binding is already loaded (its kernel scan of every module
trips over llvmlite's function table).
"""

HOST_FORMAT = 5  # rANS-coded on the host; what payloads are written in by default
DEVICE_FORMAT = 6  # experimental: records handed over as tensors are prefix-coded on their device
FORMAT_VERSION = HOST_FORMAT
# What `codec.encode` writes, and what `codec.decode` reads: the same two.
WRITABLE_VERSIONS = (HOST_FORMAT, DEVICE_FORMAT)
READABLE_VERSIONS = WRITABLE_VERSIONS


def writable_versions_text() -> str:
    """WRITABLE_VERSIONS for error messages: "5 or 6"."""
    *first, last = (str(v) for v in WRITABLE_VERSIONS)
    return f"{', '.join(first)} or {last}" if first else last


def readable_versions_text() -> str:
    """What a decoder reads, for its error messages."""
    return f"{HOST_FORMAT}, the host format, and {DEVICE_FORMAT}, the device format"
