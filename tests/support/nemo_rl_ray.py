"""The smallest stand-ins for NeMo RL's Ray worker groups, around real Ray actors.

NeMo RL's `CheckpointEngineWeightSynchronizer` reaches its workers only through
`policy.worker_group` / `generation.worker_group` (`run_all_workers_single_data`,
`run_all_workers_multiple_data`), `generation.cfg`, `generation.dp_size` and the two
`prepare_refit_info` calls. NeMo RL's own `RayWorkerGroup` builds every actor in a
virtualenv of its own made with uv and places it with GPU bundles; here the actors
are plain Ray actors (`HostedActor`) in this repository's two virtualenvs, and
`ActorGroup` calls them the same way. With one vLLM worker per engine, "rank 0 only
along TP/PP" is every actor.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from typing import Any


class HostedActor:
    """Hosts an object built from a class path (so the driver need not import it: the
    vLLM actor's classes import vLLM, which only its own virtualenv has)."""

    def __init__(self, class_path: str, *args: Any):
        module, name = class_path.split(":")
        self.obj = getattr(importlib.import_module(module), name)(*args)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        result = getattr(self.obj, method)(*args, **kwargs)
        if inspect.isawaitable(result):  # NeMo RL's policy RPCs are coroutines
            result = asyncio.run(_awaited(result))
        return result


async def _awaited(awaitable):
    return await awaitable


class ActorGroup:
    def __init__(self, actors: list):
        self.workers = list(actors)

    def run_all_workers_single_data(self, method: str, *, run_rank_0_only_axes=None, **kwargs: Any) -> list:
        return [a.call.remote(method, **kwargs) for a in self.workers]

    def run_all_workers_multiple_data(self, method: str, *, method_args: list, run_rank_0_only_axes=None,
                                      common_kwargs: dict | None = None) -> list:
        return [a.call.remote(method, method_args=args, **(common_kwargs or {}))
                for a, args in zip(self.workers, method_args)]


class PolicyStandIn:
    def __init__(self, actors: list):
        self.worker_group = ActorGroup(actors)

    def prepare_refit_info(self) -> dict:
        return {}


class GenerationStandIn:
    def __init__(self, actors: list, async_engine: bool = False):
        self.worker_group = ActorGroup(actors)
        self.dp_size = len(actors)
        self.cfg = {"vllm_cfg": {"async_engine": async_engine}}

    def prepare_refit_info(self, state_dict_info: dict) -> None:
        pass
