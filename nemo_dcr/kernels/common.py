"""The kernels' compiler switch: numba when it is installed (and NEMO_DCR_NO_NUMBA is not 1),
plain Python otherwise, and the decorators every kernel is compiled with."""

from __future__ import annotations

import os


try:
    if os.environ.get("NEMO_DCR_NO_NUMBA") == "1":
        raise ImportError("disabled by NEMO_DCR_NO_NUMBA=1")
    import numba as _numba
except ImportError:  # pragma: no cover - exercised by the fallback tests through .py_func
    _numba = None

HAVE_NUMBA = _numba is not None


def _jit(f):
    if _numba is None:
        f.py_func = f  # same attribute as a numba dispatcher: the pure-Python function
        return f
    return _numba.njit(cache=True, nogil=True)(f)


def _jit_inline(f):
    """_jit for a helper of a hot loop, inlined by numba into its callers (so that the
    callers' scalars stay in registers across calls)."""
    if _numba is None:
        f.py_func = f
        return f
    return _numba.njit(cache=True, nogil=True, inline="always")(f)


# The project's compiled-kernel decorators, for kernels kept in the modules they serve.
jit, jit_inline = _jit, _jit_inline
