"""Shared fixtures."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def single_rank_group(tmp_path_factory):
    """A one-process gloo group, for trainer code that coordinates ranks (TrainerRefit)."""
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
