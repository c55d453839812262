"""The `refit_transport: dcr` block of a NeMo RL config: the shipped example validates,
and each kind of mistake is reported with the path of the field that is wrong."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from nemo_dcr.integrations.nemo_rl.check import main as check
from nemo_dcr.integrations.nemo_rl.config import ConfigError, from_generation_config, is_enabled
from nemo_dcr.records import AUTO, Op

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "nemo_rl" / "grpo_dcr.yaml"
P = "policy.generation.refit_cfg.dcr"


def example_generation() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())["policy"]["generation"]


def with_dcr(**changes) -> dict:
    gen = copy.deepcopy(example_generation())
    for key, value in changes.items():
        if value is None:
            gen["refit_cfg"]["dcr"].pop(key, None)
        else:
            gen["refit_cfg"]["dcr"][key] = value
    return gen


def test_the_shipped_example_validates(monkeypatch, capsys):
    settings = from_generation_config(example_generation())
    assert settings.transport == "s3" and settings.op == AUTO and settings.converter == "qwen3_moe"
    assert settings.transport_config == {"bucket": "my-rl-refit", "region": "us-west-2",
                                         "prefix": "grpo-qwen3-30b/run-1"}
    assert settings.baseline_storage == "mmap" and settings.timeout_s == 600.0
    monkeypatch.setenv("DCR_HMAC_KEY", "s3cret")
    kwargs = settings.trainer_kwargs()
    assert kwargs["key"] == b"s3cret" and kwargs["baseline_dir"] == "/local_nvme/dcr-baseline"
    assert check([str(EXAMPLE)]) == 0 and "OK" in capsys.readouterr().out


@pytest.mark.parametrize("given,settled", [(None, AUTO), ("auto", AUTO), ("xor", Op.XOR), ("add", Op.ADD)])
def test_op_defaults_to_auto_and_takes_xor_or_add(given, settled, monkeypatch):
    monkeypatch.setenv("DCR_HMAC_KEY", "s3cret")
    settings = from_generation_config(with_dcr(op=given))
    assert settings.op == settled
    assert settings.trainer_kwargs()["op"] == settled


def test_off_unless_selected():
    assert not is_enabled({"backend": "vllm"}) and not is_enabled(None)
    assert is_enabled(example_generation())
    with pytest.raises(ConfigError, match="refit_transport must be 'dcr'"):
        from_generation_config({"backend": "vllm"})


def test_a_missing_key_variable_is_named_without_its_value(monkeypatch):
    monkeypatch.delenv("DCR_HMAC_KEY", raising=False)
    with pytest.raises(ConfigError, match=f"{P}.key_env: environment variable DCR_HMAC_KEY is not set"):
        from_generation_config(example_generation()).key()


@pytest.mark.parametrize("changes,message", [
    ({"transport": None}, f"{P}.transport is required"),
    ({"transport": "carrier-pigeon"}, f"{P}.transport: 'carrier-pigeon' is not one of"),
    ({"s3": {"region": "us-west-2"}}, f"{P}.s3.bucket is required by the s3 transport"),
    ({"s3": {"bucket": "b", "bukket": "c"}}, f"{P}.s3.bukket: unknown s3 transport setting"),
    ({"relay": {"nodes": []}}, f"{P}.relay: settings for a transport that is not selected"),
    ({"op": "overwrite"}, f"{P}.op: 'overwrite' is not one of: auto, xor, add"),
    ({"converter": "gpt-17"}, f"{P}.converter: 'gpt-17' is not one of"),
    ({"baseline": {"storage": "mmap"}}, f"{P}.baseline.dir is required when baseline.storage is mmap"),
    ({"baseline": {"storage": "tape", "dir": "/x"}}, f"{P}.baseline.storage: 'tape' is not one of"),
    ({"verify": "sometimes"}, f"{P}.verify: 'sometimes' is not one of: never, every_refit"),
    ({"timeout_s": 0}, f"{P}.timeout_s must be a positive float"),
    ({"max_payload_elements": 2.5}, f"{P}.max_payload_elements must be a positive int"),
    ({"encode_threads": -1}, f"{P}.encode_threads must be an integer >= 0, got -1"),
    ({"encode_threads": "2"}, f"{P}.encode_threads must be an integer >= 0, got '2'"),
    ({"encode_threads": True}, f"{P}.encode_threads must be an integer >= 0, got True"),
    ({"anchors_every": 5}, f"{P}.anchors_every: unknown field"),
    ({"metrics_port": 70000}, f"{P}.metrics_port must be a TCP port number (1-65535), got 70000"),
    ({"metrics_port": "9464"}, f"{P}.metrics_port must be a TCP port number"),
    ({"metrics_port": True}, f"{P}.metrics_port must be a TCP port number"),
])
def test_each_mistake_names_its_field(changes, message):
    with pytest.raises(ConfigError) as info:
        from_generation_config(with_dcr(**changes))
    assert any(p.startswith(message) for p in info.value.problems), info.value.problems


def test_all_problems_at_once_and_transport_specific_rules():
    gen = with_dcr(transport="relay", s3=None, relay={"nodes": []}, op="mul")
    with pytest.raises(ConfigError) as info:
        from_generation_config(gen)
    problems = "\n".join(info.value.problems)
    for expected in (f"{P}.relay.coordinator is required", f"{P}.relay.nodes must be a non-empty list",
                     f"{P}.state_dir is required with the relay transport", f"{P}.op: 'mul'"):
        assert expected in problems
    colocated = with_dcr()
    colocated["colocated"] = {"enabled": True}
    with pytest.raises(ConfigError, match="colocated generation .* use the local transport"):
        from_generation_config(colocated)
    local = with_dcr(transport="local", s3=None, local={"dir": "/dev/shm/job"}, state_dir="/shared/state")
    local["colocated"] = {"enabled": True}
    assert from_generation_config(local).transport_config == {"dir": "/dev/shm/job"}


def test_wire_version_reaches_the_trainer(monkeypatch):
    monkeypatch.setenv("DCR_HMAC_KEY", "s3cret")
    assert from_generation_config(example_generation()).trainer_kwargs()["wire_version"] == 5
    assert from_generation_config(with_dcr(wire_version=4)).trainer_kwargs()["wire_version"] == 4
    for bad in (3, "4", True):
        with pytest.raises(ConfigError, match=rf"{P}.wire_version must be 4, 5 or 6 \(the wire formats payloads can "
                                              rf"be written in\), got {bad!r}"):
            from_generation_config(with_dcr(wire_version=bad))


def test_encode_threads_reach_the_trainer(monkeypatch):
    monkeypatch.setenv("DCR_HMAC_KEY", "s3cret")
    assert from_generation_config(example_generation()).trainer_kwargs()["encode_threads"] == 0
    assert from_generation_config(with_dcr(encode_threads=3)).trainer_kwargs()["encode_threads"] == 3


def test_metrics_port_is_optional():
    assert from_generation_config(example_generation()).metrics_port is None
    assert from_generation_config(with_dcr(metrics_port=9464)).metrics_port == 9464


def test_relay_with_curve_validates():
    relay = {"nodes": [{"id": "vllm0", "endpoint": "tcp://10.0.0.5:5555"}], "coordinator": "tcp://10.0.0.1:5600",
             "curve_secret_env": "DCR_CURVE_SECRET"}
    settings = from_generation_config(with_dcr(transport="relay", s3=None, relay=relay, state_dir="/shared/s"))
    assert settings.transport_config["curve_secret_env"] == "DCR_CURVE_SECRET"
    with pytest.raises(ConfigError, match=f"{P}.relay.curve_secret_env must name an environment variable"):
        from_generation_config(with_dcr(transport="relay", s3=None, relay={**relay, "curve_secret_env": ""},
                                        state_dir="/shared/s"))


def test_recovery_settings_reach_the_trainer(monkeypatch):
    monkeypatch.setenv("DCR_HMAC_KEY", "s3cret")
    settings = from_generation_config(with_dcr(max_attempts=5, readback=True,
                                               history={"store": "s3", "anchor_every": 20, "keep_anchors": 3}))
    kwargs = settings.trainer_kwargs()
    assert (kwargs["max_attempts"], kwargs["readback"], kwargs["history"]) == (5, True, "s3")
    assert (kwargs["anchor_every"], kwargs["keep_anchors"]) == (20, 3)
    assert from_generation_config(example_generation()).trainer_kwargs()["history"] is None  # off by default


@pytest.mark.parametrize("changes,message", [
    ({"max_attempts": 0}, f"{P}.max_attempts must be a positive int"),
    ({"readback": "yes"}, f"{P}.readback must be true or false"),
    ({"history": {"anchor_every": 5}}, f"{P}.history.store is required"),
    ({"history": {"store": "/shared/h", "keep_anchors": 0}}, f"{P}.history.keep_anchors must be an integer >= 1"),
    ({"history": {"store": "/shared/h", "every": 3}}, f"{P}.history.every: unknown field"),
])
def test_recovery_settings_are_checked(changes, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        from_generation_config(with_dcr(**changes))


def test_the_config_loads_no_compiled_kernels():
    """vLLM generation workers import the config before their engine starts, and vLLM's CPU
    start-up fails once numba's LLVM binding is loaded (nemo_dcr/wire_versions.py): the
    config must not import the codec or the kernels."""
    code = ("import sys, nemo_dcr.integrations.nemo_rl.config; "
            "print(sorted(m for m in ('numba', 'llvmlite', 'nemo_dcr.kernels', 'nemo_dcr.codec') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
