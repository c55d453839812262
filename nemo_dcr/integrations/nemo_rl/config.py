"""The settings of NeMo-DCR's NeMo RL checkpoint engine, validated.

NeMo RL selects a checkpoint engine by class path and hands it the block of the same
name under `refit_cfg`:

    policy:
      generation:
        colocated: {enabled: false}
        refit_transport: "nemo_dcr.integrations.nemo_rl:DCRCheckpointEngine"
        refit_cfg:
          "nemo_dcr.integrations.nemo_rl:DCRCheckpointEngine":
            transport: local               # local | relay | s3 (or any registered transport)
            local: {dir: /dev/shm/grpo-run-1}

NeMo RL validates only its own two fields of that block (`update_weights_bucket_memory_
ratio`, `release_after_refit`) and passes the rest through, so `DCRRefitConfig` checks
every other field: unknown fields are errors, and each problem names its full path and
the accepted values.
"""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from nemo_dcr.wire.versions import FORMAT_VERSION, WRITABLE_VERSIONS, writable_versions_text  # not codec: see there

ENGINE_PATH = "nemo_dcr.integrations.nemo_rl:DCRCheckpointEngine"
PATH = f'policy.generation.refit_cfg["{ENGINE_PATH}"]'

# Transport settings each built-in transport accepts and requires.
TRANSPORT_FIELDS = {
    "local": ({"dir", "max_in_flight_bytes", "timeout_s"}, set()),
    "relay": ({"nodes", "coordinator", "coordinator_bind", "fanout", "timeout_s", "max_in_flight_bytes",
               "window_bytes", "window_payloads", "hwm", "local_queue", "curve_secret_env"}, {"nodes", "coordinator"}),
    "s3": ({"bucket", "endpoint_url", "region", "profile", "prefix", "timeout_s", "poll_s", "max_in_flight_bytes",
            "part_size", "multipart_threshold", "upload_concurrency", "prefetch", "ack_concurrency", "max_attempts",
            "addressing_style", "keep_payloads"}, {"bucket"}),
}


class ConfigError(ValueError):
    """Every problem of a refit config, one per line, each naming its field."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid NeMo-DCR refit config:\n  - " + "\n  - ".join(problems))


class DCRRefitConfig(BaseModel):
    """`refit_cfg["nemo_dcr.integrations.nemo_rl:DCRCheckpointEngine"]`."""

    model_config = ConfigDict(extra="forbid")

    transport: str = Field(description="local | relay | s3, or a transport registered under nemo_dcr.transports")
    local: dict[str, Any] | None = None
    relay: dict[str, Any] | None = None
    s3: dict[str, Any] | None = None
    # Where trainer rank 0 keeps the commit records. None: a fresh directory per run (the
    # first refit of a run is dense then anyway). The s3 transport keeps them in its bucket.
    state_dir: str | None = None
    key_env: str | None = Field(None, description="environment variable holding the HMAC key")
    op: Literal["auto", "xor", "add"] = "auto"
    timeout_s: Annotated[float, Field(gt=0)] = 300.0
    max_payload_elements: Annotated[int, Field(gt=0)] = 1 << 20
    encode_threads: Annotated[int, Field(ge=0)] = 0
    # Tries of one transfer; the retries are in place (what receivers finished stays, the
    # rest is re-sent as overwrites).
    max_attempts: Annotated[int, Field(ge=1)] = 3
    wire_version: int = FORMAT_VERSION
    state_digest: bool = True
    # Baseline-conditioned coding (nemo_dcr.wire.conditioned): policy ranks code records
    # against the committed bits both ends hold (smaller under AdamW); vLLM workers that do
    # not hold canonical layout (shard_local: true) keep a canonical host mirror of the
    # tensors they serve (2 bytes a BF16 parameter). true or false only.
    conditioned: bool = False
    # The shard-local tier (needs NeMo RL with patches/nemo-rl/checkpoint-engine-shard-local
    # .patch): capture from the optimizer's owned shards, apply in place in vLLM.
    shard_local: bool = False
    converter: str | None = Field(None, description="shard_local: the family's converter (default: HF model_type)")
    converter_options: dict[str, Any] = Field(default_factory=dict)
    # NeMo RL's own fields of every checkpoint-engine block.
    update_weights_bucket_memory_ratio: Annotated[float, Field(gt=0, lt=1)] = 0.05
    release_after_refit: bool = False

    @field_validator("transport")
    @classmethod
    def _known_transport(cls, value: str) -> str:
        from nemo_dcr import registry

        known = registry.available("nemo_dcr.transports")
        if value not in known:
            raise ValueError(f"{value!r} is not one of: {', '.join(known)}")
        return value

    @field_validator("wire_version")
    @classmethod
    def _writable(cls, value: int) -> int:
        if value not in WRITABLE_VERSIONS:
            raise ValueError(f"must be {writable_versions_text()} (the wire formats payloads can be written in)")
        return value

    @field_validator("converter")
    @classmethod
    def _known_converter(cls, value: str | None) -> str | None:
        from nemo_dcr import registry

        known = registry.available("nemo_dcr.converters")
        if value is not None and value not in known:
            raise ValueError(f"{value!r} is not one of: {', '.join(known)}")
        return value

    @field_validator("conditioned", mode="before")
    @classmethod
    def _true_or_false(cls, value: Any) -> bool:
        if not isinstance(value, bool):  # not "yes", 1 or "false" read as a truth value
            raise ValueError("must be true or false (a YAML boolean)")
        return value

    @field_validator("state_dir", "key_env")
    @classmethod
    def _non_empty(cls, value: str | None) -> str | None:
        if value is not None and not value:
            raise ValueError("must be a non-empty string or left out")
        return value

    @model_validator(mode="after")
    def _transport_section(self) -> DCRRefitConfig:
        problems = []
        for other in ("local", "relay", "s3"):
            if other != self.transport and getattr(self, other) is not None:
                problems.append(f"{other}: settings for a transport that is not selected (transport: {self.transport})")
        section = self.transport_config
        if self.transport in TRANSPORT_FIELDS:
            allowed, required = TRANSPORT_FIELDS[self.transport]
            problems += [f"{self.transport}.{k}: unknown {self.transport} transport setting "
                         f"(known: {', '.join(sorted(allowed))})" for k in sorted(set(section) - allowed)]
            problems += [f"{self.transport}.{k} is required by the {self.transport} transport"
                         for k in sorted(required - set(section))]
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def transport_config(self) -> dict[str, Any]:
        return dict(getattr(self, self.transport, None) or {}) if self.transport in TRANSPORT_FIELDS else {}

    def key(self) -> bytes | None:
        """The HMAC key from the environment (never stored in the config, never logged)."""
        if self.key_env is None:
            return None
        value = os.environ.get(self.key_env)
        if not value:
            raise ConfigError([f"{PATH}.key_env: environment variable {self.key_env} is not set or empty "
                               f"in this process ({os.getpid()}): set it on every policy and vLLM worker"])
        return value.encode()

    def build_transport(self, receivers: list[str] | None = None):
        from nemo_dcr import registry

        return registry.transport(self.transport, self.transport_config, receivers=receivers)

    @classmethod
    def parse(cls, block: Any, where: str = PATH) -> DCRRefitConfig:
        """Validate a raw block; raise ConfigError listing every problem with its path."""
        if not isinstance(block, dict):
            raise ConfigError([f"{where} must be a mapping with at least 'transport', got {type(block).__name__}"])
        try:
            return cls.model_validate(block)
        except ValidationError as e:
            raise ConfigError([_describe(where, err) for err in e.errors()]) from None


def _describe(where: str, err: dict) -> str:
    loc = ".".join(str(p) for p in err["loc"])
    message = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        known = ", ".join(sorted(DCRRefitConfig.model_fields))
        return f"{where}.{loc}: unknown field (known: {known})"
    if err["type"] == "missing":
        return f"{where}.{loc} is required"
    if not loc:  # a whole-block check: its message names the fields
        return "; ".join(f"{where}.{part}" for part in message.split("; "))
    return f"{where}.{loc}: {message} (got {err.get('input')!r})"
