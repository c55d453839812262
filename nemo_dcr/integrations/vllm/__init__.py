"""NeMo-DCR as a vLLM weight-transfer engine, `backend: "dcr"`.

vLLM loads this package's `vllm.general_plugins` entry point (`register`) in every
process it starts; it registers the worker-side engine (`engine.DCRWeightTransferEngine`)
and the trainer-side one (`trainer.DCRTrainerEngine`) under the name "dcr". Then

    LLM(model, weight_transfer_config={"backend": "dcr"})
    vllm serve MODEL --weight-transfer-config '{"backend": "dcr"}'

refit through vLLM's own weight-update API (`init_weight_transfer_engine`,
`start_weight_update`, `update_weights`, `finish_weight_update`, offline or over the
RL HTTP routes), with no other change. See docs/vllm.md.
"""

from __future__ import annotations

BACKEND = "dcr"


def register() -> None:
    """The `vllm.general_plugins` hook: register both engines once per process."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "nemo_dcr.integrations.vllm.engine",
                                                    "DCRWeightTransferEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, "nemo_dcr.integrations.vllm.trainer",
                                                     "DCRTrainerEngine")
