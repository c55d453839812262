"""The wire format versions this release writes (docs/wire-format.md, "Versioning").

A module of its own, with no imports, so that code run where the compiled kernels must not
load yet can name them: the NeMo RL config is imported by vLLM generation workers before
their engine starts, and vLLM 0.32's CPU start-up fails when numba's LLVM binding is
already loaded (its kernel scan of every module trips over llvmlite's function table).
"""

FORMAT_VERSION = 5  # what payloads are written in by default (and the newest decoders read)
# What `codec.encode` writes: 5; 4 for receivers that read only 4; 6 for records coded on
# the device that holds them (prefix codes).
WRITABLE_VERSIONS = (4, 5, 6)


def writable_versions_text() -> str:
    """WRITABLE_VERSIONS for error messages: "4, 5 or 6"."""
    *first, last = (str(v) for v in WRITABLE_VERSIONS)
    return f"{', '.join(first)} or {last}" if first else last
