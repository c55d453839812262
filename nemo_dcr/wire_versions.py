"""The wire format versions this release writes (docs/wire-format.md, "Versioning").

A module of its own, with no imports, so that code run where the compiled kernels must not
load yet can name them: the NeMo RL config is imported by vLLM generation workers before
their engine starts, and vLLM 0.32's CPU start-up fails when numba's LLVM binding is
already loaded (its kernel scan of every module trips over llvmlite's function table).
"""

FORMAT_VERSION = 5  # what payloads are written in by default (and the newest decoders read)
WRITABLE_VERSIONS = (4, 5)  # what `codec.encode` writes: 5, and 4 for receivers that read only 4


def writable_versions_text() -> str:
    """WRITABLE_VERSIONS for error messages: "4 or 5"."""
    return " or ".join(str(v) for v in WRITABLE_VERSIONS)
