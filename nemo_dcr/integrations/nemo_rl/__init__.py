"""NeMo-DCR inside NeMo RL: a checkpoint engine enabled by one config line.

    policy.generation.refit_transport: "nemo_dcr.integrations.nemo_rl:DCRCheckpointEngine"

`DCRCheckpointEngine` is loaded on first use, so that the config tools here work where
NeMo RL is not installed (the engine subclasses NeMo RL's `CheckpointEngine`).
"""

from nemo_dcr.integrations.nemo_rl.config import ENGINE_PATH, ConfigError, DCRRefitConfig

__all__ = ["DCRCheckpointEngine", "DCRRefitConfig", "ConfigError", "ENGINE_PATH"]


def __getattr__(name: str):
    if name == "DCRCheckpointEngine":
        from nemo_dcr.integrations.nemo_rl.engine import DCRCheckpointEngine

        return DCRCheckpointEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
