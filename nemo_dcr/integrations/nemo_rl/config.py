"""The `refit_transport: dcr` block of a NeMo RL config, validated.

NeMo RL users configure generation under `policy.generation`; delta refit is one more
choice there, beside NeMo RL's own collective / CUDA-IPC refit:

    policy:
      generation:
        backend: vllm
        colocated: {enabled: false}
        refit_transport: dcr
        refit_cfg:
          dcr:
            transport: s3                      # local | relay | s3 (or any registered transport)
            s3: {bucket: rl-refit, region: us-west-2, prefix: job-42}
            converter: qwen3                   # registry name; default: the HF model_type
            state_dir: /shared/job-42/dcr      # commit records (the s3 transport keeps them in the bucket)
            metrics_port: 9464                 # optional: Prometheus endpoint on the trainer's rank 0

Every problem is reported at once, each naming its full path (`policy.generation.
refit_cfg.dcr.<field>`), before anything starts. Unknown fields are errors, not ignored:
a misspelt option must not silently fall back to a default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from nemo_dcr import registry
from nemo_dcr.wire_versions import FORMAT_VERSION, WRITABLE_VERSIONS, writable_versions_text  # not codec: see there
from nemo_dcr.records import AUTO

PATH = "policy.generation.refit_cfg.dcr"
VERIFY_MODES = ("never", "every_refit")
BASELINE_STORAGE = ("memory", "mmap")

# Transport settings each built-in transport accepts (beyond its defaults) and requires.
_TRANSPORT_FIELDS = {
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


@dataclass(frozen=True)
class DCRSettings:
    """What the trainer side and the receivers need, resolved from the config."""

    transport: str
    transport_config: dict
    converter: str | None
    converter_options: dict = field(default_factory=dict)
    op: str = AUTO  # auto | xor | add, as TrainerRefit takes it
    state_dir: str | None = None
    baseline_storage: str = "memory"
    baseline_dir: str | None = None
    key_env: str | None = None
    verify: str = "every_refit"
    timeout_s: float = 300.0
    max_payload_elements: int = 1 << 20
    encode_threads: int = 0  # per trainer rank: threads that encode payloads while the rank diffs on
    wire_version: int = FORMAT_VERSION  # the wire format payloads are written in (4: for receivers not yet reading 5)
    metrics_port: int | None = None  # Prometheus endpoint on the trainer's rank 0 (None: off)
    max_attempts: int = 1  # tries of one transfer (retries are in place, as overwrites); see docs/nemo-rl.md
    readback: bool = False  # receivers read applied regions back; checked before the commit
    history: str | None = None  # a directory or "s3": deltas and anchors for catch-up (None: off)
    anchor_every: int = 0
    keep_anchors: int = 2

    def key(self) -> bytes | None:
        """The HMAC key from the environment (never stored in the config, never logged)."""
        if self.key_env is None:
            return None
        value = os.environ.get(self.key_env)
        if not value:
            raise ConfigError([f"{PATH}.key_env: environment variable {self.key_env} is not set or empty"])
        return value.encode()

    def converter_name(self, hf_config) -> str:
        return self.converter or str(getattr(hf_config, "model_type", "") or "identity")

    def trainer_kwargs(self) -> dict:
        """Keyword arguments for `nemo_dcr.trainer.TrainerRefit` (besides what the worker knows)."""
        return {"state_dir": self.state_dir, "op": self.op, "key": self.key(), "timeout_s": self.timeout_s,
                "max_payload_elements": self.max_payload_elements, "encode_threads": self.encode_threads,
                "wire_version": self.wire_version,
                "baseline_dir": self.baseline_dir if self.baseline_storage == "mmap" else None,
                "max_attempts": self.max_attempts, "readback": self.readback, "history": self.history,
                "anchor_every": self.anchor_every, "keep_anchors": self.keep_anchors}

    def build_transport(self, receivers: list[str] | None = None):
        return registry.transport(self.transport, self.transport_config, receivers=receivers)


def is_enabled(generation_cfg: dict | None) -> bool:
    """True when `policy.generation` selects delta refit."""
    return bool(generation_cfg) and generation_cfg.get("refit_transport") == "dcr"


def from_generation_config(generation_cfg: dict) -> DCRSettings:
    """Validate `policy.generation` and return the settings; raise ConfigError listing every problem."""
    problems: list[str] = []
    if not isinstance(generation_cfg, dict):
        raise ConfigError([f"policy.generation must be a mapping, got {type(generation_cfg).__name__}"])
    if generation_cfg.get("refit_transport") != "dcr":
        raise ConfigError([f"policy.generation.refit_transport must be 'dcr' to use NeMo-DCR, "
                           f"got {generation_cfg.get('refit_transport')!r}"])
    colocated = bool((generation_cfg.get("colocated") or {}).get("enabled"))
    cfg = (generation_cfg.get("refit_cfg") or {}).get("dcr")
    if not isinstance(cfg, dict):
        raise ConfigError([*problems, f"{PATH} is missing: it needs at least 'transport' and that transport's "
                                      f"section (e.g. transport: s3 with s3: {{bucket: ...}})"])
    checker = _Checker(problems)
    known = {"transport", "converter", "converter_options", "op", "state_dir", "baseline", "key_env", "verify",
             "timeout_s", "max_payload_elements", "encode_threads", "metrics_port", "max_attempts", "readback",
             "history", "wire_version",
             *registry.available("nemo_dcr.transports")}
    for unknown in sorted(set(cfg) - known):
        problems.append(f"{PATH}.{unknown}: unknown field (known: {', '.join(sorted(known))})")

    transport = checker.choice(cfg, "transport", registry.available("nemo_dcr.transports"), required=True)
    transport_config = cfg.get(transport, {}) if transport else {}
    if transport and not isinstance(transport_config, dict):
        problems.append(f"{PATH}.{transport} must be a mapping of {transport} transport settings")
        transport_config = {}
    if transport in _TRANSPORT_FIELDS:
        allowed, required = _TRANSPORT_FIELDS[transport]
        for unknown in sorted(set(transport_config) - allowed):
            problems.append(f"{PATH}.{transport}.{unknown}: unknown {transport} transport setting "
                            f"(known: {', '.join(sorted(allowed))})")
        for missing in sorted(required - set(transport_config)):
            problems.append(f"{PATH}.{transport}.{missing} is required by the {transport} transport")
    if transport == "relay" and not (isinstance(transport_config.get("nodes"), list) and transport_config["nodes"]):
        problems.append(f"{PATH}.relay.nodes must be a non-empty list of {{id: ..., endpoint: tcp://host:port}}")
    curve = transport_config.get("curve_secret_env") if transport == "relay" else None
    if curve is not None and (not isinstance(curve, str) or not curve):
        problems.append(f"{PATH}.relay.curve_secret_env must name an environment variable (the CURVE secret "
                        f"stays in the environment), got {curve!r}")
    if colocated and transport not in (None, "local"):
        problems.append(f"{PATH}.transport: colocated generation (policy.generation.colocated.enabled) shares the "
                        f"trainer's nodes; use the local transport (shared memory / CUDA IPC), not {transport}")
    for other in sorted(set(cfg) & set(registry.available("nemo_dcr.transports")) - {transport}):
        problems.append(f"{PATH}.{other}: settings for a transport that is not selected (transport: {transport})")

    converter = cfg.get("converter")
    if converter is not None:
        checker.choice(cfg, "converter", registry.available("nemo_dcr.converters"))
    options = checker.mapping(cfg, "converter_options")
    op = checker.choice(cfg, "op", (AUTO, "xor", "add"), default=AUTO)
    state_dir = checker.string(cfg, "state_dir")
    if transport in ("local", "relay") and state_dir is None:
        problems.append(f"{PATH}.state_dir is required with the {transport} transport: the coordinator keeps "
                        f"its commit records there (a directory that survives the trainer's restarts)")
    baseline = checker.mapping(cfg, "baseline")
    storage = checker.choice(baseline, "storage", BASELINE_STORAGE, default="memory", where=f"{PATH}.baseline")
    baseline_dir = checker.string(baseline, "dir", where=f"{PATH}.baseline")
    for unknown in sorted(set(baseline) - {"storage", "dir"}):
        problems.append(f"{PATH}.baseline.{unknown}: unknown field (known: dir, storage)")
    if storage == "mmap" and baseline_dir is None:
        problems.append(f"{PATH}.baseline.dir is required when baseline.storage is mmap")
    key_env = checker.string(cfg, "key_env")
    verify = checker.choice(cfg, "verify", VERIFY_MODES, default="every_refit")
    timeout_s = checker.positive(cfg, "timeout_s", 300.0, float)
    max_payload = checker.positive(cfg, "max_payload_elements", 1 << 20, int)
    encode_threads = checker.integer(cfg, "encode_threads", 0, low=0)
    wire_version = cfg.get("wire_version", FORMAT_VERSION)
    if isinstance(wire_version, bool) or wire_version not in WRITABLE_VERSIONS:
        problems.append(f"{PATH}.wire_version must be {writable_versions_text()} (the wire formats payloads can "
                        f"be written in), got {wire_version!r}")
        wire_version = FORMAT_VERSION
    metrics_port = cfg.get("metrics_port")
    if metrics_port is not None and (isinstance(metrics_port, bool) or not isinstance(metrics_port, int)
                                     or not 1 <= metrics_port <= 65535):
        problems.append(f"{PATH}.metrics_port must be a TCP port number (1-65535), got {metrics_port!r}")
        metrics_port = None
    max_attempts = checker.positive(cfg, "max_attempts", 1, int)
    readback = cfg.get("readback", False)
    if not isinstance(readback, bool):
        problems.append(f"{PATH}.readback must be true or false, got {readback!r}")
    history = checker.mapping(cfg, "history")
    for unknown in sorted(set(history) - {"store", "anchor_every", "keep_anchors"}):
        problems.append(f"{PATH}.history.{unknown}: unknown field (known: anchor_every, keep_anchors, store)")
    store = checker.string(history, "store", where=f"{PATH}.history")
    if history and store is None:
        problems.append(f"{PATH}.history.store is required: a directory both sides can read, or 's3' "
                        f"(the s3 transport's bucket)")
    if store == "s3" and transport != "s3":
        problems.append(f"{PATH}.history.store 's3' keeps the history in the s3 transport's bucket; "
                        f"with the {transport} transport give a shared directory")
    anchor_every = checker.integer(history, "anchor_every", 10, low=0, where=f"{PATH}.history")
    keep_anchors = checker.integer(history, "keep_anchors", 2, low=1, where=f"{PATH}.history")
    if problems:
        raise ConfigError(problems)
    return DCRSettings(transport=transport, transport_config=dict(transport_config), converter=converter,
                       converter_options=dict(options), op=op, state_dir=state_dir, baseline_storage=storage,
                       baseline_dir=baseline_dir, key_env=key_env, verify=verify, timeout_s=timeout_s,
                       max_payload_elements=max_payload, encode_threads=encode_threads, wire_version=wire_version,
                       metrics_port=metrics_port,
                       max_attempts=max_attempts, readback=readback, history=store, anchor_every=anchor_every,
                       keep_anchors=keep_anchors)


class _Checker:
    def __init__(self, problems: list[str]):
        self.problems = problems

    def _where(self, where: str | None, name: str) -> str:
        return f"{where or PATH}.{name}"

    def choice(self, cfg: dict, name: str, options, *, default=None, required: bool = False, where=None):
        value = cfg.get(name, default)
        if value is None:
            if required:
                self.problems.append(f"{self._where(where, name)} is required (one of: {', '.join(options)})")
            return None
        if value not in options:
            self.problems.append(f"{self._where(where, name)}: {value!r} is not one of: {', '.join(options)}")
            return None
        return value

    def mapping(self, cfg: dict, name: str) -> dict:
        value = cfg.get(name) or {}
        if not isinstance(value, dict):
            self.problems.append(f"{PATH}.{name} must be a mapping, got {type(value).__name__}")
            return {}
        return value

    def string(self, cfg: dict, name: str, where=None) -> str | None:
        value = cfg.get(name)
        if value is not None and (not isinstance(value, str) or not value):
            self.problems.append(f"{self._where(where, name)} must be a non-empty string, got {value!r}")
            return None
        return value

    def integer(self, cfg: dict, name: str, default: int, *, low: int, where=None) -> int:
        value = cfg.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            self.problems.append(f"{self._where(where, name)} must be an integer >= {low}, got {value!r}")
            return default
        return value

    def positive(self, cfg: dict, name: str, default, kind: type) -> Any:
        value = cfg.get(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 or (
                kind is int and int(value) != value):
            self.problems.append(f"{PATH}.{name} must be a positive {kind.__name__}, got {value!r}")
            return default
        return kind(value)
