"""The vLLM generation side of NeMo-DCR in NeMo RL.

NeMo RL's vLLM generation workers start `vllm.LLM` with a worker extension
(`worker_extension_cls`) and reach every vLLM worker through `collective_rpc`. With
`refit_transport: dcr` the extension is `nemo_dcr.runtimes.vllm.DCRWorkerExtension`
(or a subclass), and where NeMo RL calls `update_weights_from_collective()` the
generation worker calls `update_weights_via_dcr(llm)`:

    llm = LLM(model=hf_checkpoint_dir, worker_extension_cls=WORKER_EXTENSION, ...)
    start_dcr_receivers(llm, settings, hf_checkpoint_dir, receiver_id=f"vllm{dp_rank}")   # once
    ...
    ok = update_weights_via_dcr(llm, settings=settings)      # per refit: [True] per worker on success

Each worker's receiver stages the trainer's payloads on a background thread as they
arrive, while the engine keeps generating (decode, checksum / HMAC, validation; nothing
is written). `update_weights_via_dcr` then finishes the transfer on every worker through
`collective_rpc`, i.e. between engine steps: the in-place apply (the only generation
pause), the joint commit or abort, and, with `verify: every_refit`, the digest reply.
Afterwards it resets vLLM's prefix cache: cached KV blocks were computed with the old
weights.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from nemo_dcr.integrations.nemo_rl.config import DCRSettings

log = logging.getLogger("nemo_dcr.nemo_rl")

WORKER_EXTENSION = "nemo_dcr.runtimes.vllm.DCRWorkerExtension"


def _rpc(llm_or_collective_rpc) -> Callable:
    rpc = getattr(llm_or_collective_rpc, "collective_rpc", None)
    if rpc is not None:
        return rpc
    if callable(llm_or_collective_rpc):
        return llm_or_collective_rpc
    raise TypeError("expected a vllm.LLM (or anything with collective_rpc) or a collective_rpc callable, "
                    f"got {type(llm_or_collective_rpc).__name__}")


def start_dcr_receivers(llm_or_collective_rpc, settings: DCRSettings, checkpoint_dir: str, *,
                        receiver_id: str = "vllm0", version: int = 0, background: bool = True) -> list[dict]:
    """Open a receiver in every vLLM worker of this engine (once, after the engine loaded
    `checkpoint_dir`, the checkpoint of `version`). Under vLLM TP the workers' ids are
    `<receiver_id>-tp<rank>`; the trainer must list them all
    (`nemo_dcr.integrations.nemo_rl.policy.receiver_ids`). With `background` (default),
    payloads are staged while the engine generates."""
    rpc = _rpc(llm_or_collective_rpc)
    started = rpc("dcr_start", args=(str(checkpoint_dir), settings.transport, dict(settings.transport_config),
                                     receiver_id, settings.key_env, version, settings.history))
    if background:
        rpc("dcr_background_start")
    return list(started)


def dcr_update_details(llm_or_collective_rpc, expected_version: int | None = None, *,
                       settings: DCRSettings | None = None, timeout_s: float | None = None,
                       await_verify: bool | None = None, reset_prefix_cache: bool = True) -> list[dict]:
    """`update_weights_via_dcr`, with each worker's full report: {"ok", "reason",
    "version", "apply_s" (the pause), "stage_s", "staged_before_call", "update_s", ...}."""
    rpc = _rpc(llm_or_collective_rpc)
    if timeout_s is None:
        timeout_s = settings.timeout_s if settings is not None else 300.0
    if await_verify is None:
        await_verify = settings is not None and settings.verify == "every_refit"
    results = [r if isinstance(r, dict) else {"ok": False, "reason": f"worker returned {r!r}"}
               for r in rpc("dcr_update", args=(expected_version, float(timeout_s), bool(await_verify)))]
    for i, r in enumerate(results):
        if not r.get("ok"):
            log.error("NeMo-DCR: vLLM worker %d did not update to version %s: %s", i,
                      r.get("expected_version"), r.get("reason"))
    if reset_prefix_cache and results and all(r.get("ok") for r in results):
        reset = getattr(llm_or_collective_rpc, "reset_prefix_cache", None)
        if reset is not None:
            reset()  # KV blocks cached before belong to the old weights
        else:
            log.warning("NeMo-DCR: weights changed but no reset_prefix_cache() was reachable: reset vLLM's "
                        "prefix cache yourself, or cached prompts mix two weight versions")
    return results


def update_weights_via_dcr(llm_or_collective_rpc, expected_version: int | None = None, *,
                           settings: DCRSettings | None = None, timeout_s: float | None = None,
                           await_verify: bool | None = None) -> list[bool]:
    """The counterpart of NeMo RL's `update_weights_from_collective()`: finish the refit
    to `expected_version` (default: each worker's serving version + 1) on every worker.

    Returns one bool per vLLM worker: True when the worker serves the new version (and
    the prefix cache was reset), False when the transfer aborted or timed out, in which
    case the worker still serves the previous version. NeMo RL's
    `all(r for r in results if r is not None)` then decides.
    llm_or_collective_rpc: a `vllm.LLM` (its `collective_rpc` and `reset_prefix_cache`
    are used) or a bare `collective_rpc(method, args=...)` callable (reset the prefix
    cache yourself then). settings give the timeout and whether to wait for the
    trainer's verify request (`verify: every_refit`).
    """
    return [bool(r.get("ok")) for r in dcr_update_details(
        llm_or_collective_rpc, expected_version, settings=settings, timeout_s=timeout_s, await_verify=await_verify)]


def dcr_stage_status(llm_or_collective_rpc) -> list[dict]:
    """Per worker: serving version, the open transfer and how many payloads are staged."""
    return list(_rpc(llm_or_collective_rpc)("dcr_stage_status"))
