"""The checkpoint engine's config, as NeMo RL reads it: the shipped examples pass NeMo RL's
own validation and `create_checkpoint_engine` builds the engine from them; each kind of
mistake is reported with the field's path and the accepted values."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import yaml

from nemo_dcr.integrations.nemo_rl.check import main as check
from nemo_dcr.integrations.nemo_rl.config import ENGINE_PATH, PATH, ConfigError, DCRRefitConfig
from tests.support.launch import REPO
from tests.support.nemo_rl_import import require_nemo_rl

EXAMPLES = sorted((REPO / "examples" / "nemo_rl").glob("*.yaml"))


@pytest.fixture(scope="module")
def nemo_rl():
    src = require_nemo_rl()
    from nemo_rl.utils.checkpoint_engines.base import create_checkpoint_engine
    from nemo_rl.weight_sync.checkpoint_engine_config import checkpoint_engine_refit_config

    return checkpoint_engine_refit_config, create_checkpoint_engine, src / "examples" / "configs"


def example_generation(name: str = "grpo_math_1B_megatron_dcr.yaml") -> dict:
    return yaml.safe_load((REPO / "examples" / "nemo_rl" / name).read_text())["policy"]["generation"]


def test_two_examples_dense_and_moe():
    assert [p.name for p in EXAMPLES] == ["grpo_math_1B_megatron_dcr.yaml", "grpo_moe_megatron_dcr.yaml"]
    assert all(yaml.safe_load(p.read_text())["defaults"] == "grpo_math_1B_megatron.yaml" for p in EXAMPLES)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_nemo_rl_accepts_the_examples_and_builds_the_engine(example, nemo_rl, capsys):
    checkpoint_engine_refit_config, create_checkpoint_engine, configs = nemo_rl
    # what NeMo RL loads: its own GRPO config, inherited, with the example on top
    assert check([str(example), "--configs", str(configs)]) == 0
    assert "NeMo RL's own validation" in capsys.readouterr().out
    gen = copy.deepcopy(yaml.safe_load(example.read_text())["policy"]["generation"])
    transport = gen["refit_cfg"][ENGINE_PATH]["transport"]
    engine_config = checkpoint_engine_refit_config(gen)
    assert engine_config["backend"] == ENGINE_PATH
    kwargs = engine_config["engine_kwargs"][ENGINE_PATH]
    assert kwargs["release_after_refit"] is False and "update_weights_bucket_memory_ratio" not in kwargs
    engine = create_checkpoint_engine(ENGINE_PATH, bucket_size_bytes=4 << 20, engine_kwargs=kwargs)
    assert type(engine).__name__ == "DCRCheckpointEngine" and engine.bucket_size == 4 << 20
    assert engine.settings.transport == transport


def test_nemo_rl_rejects_the_old_spelling(nemo_rl):
    checkpoint_engine_refit_config, _, _ = nemo_rl
    gen = example_generation()
    gen["refit_transport"] = "dcr"
    with pytest.raises(ValueError, match="Unknown vLLM refit transport 'dcr'"):
        checkpoint_engine_refit_config(gen)


def with_block(**changes) -> dict:
    gen = copy.deepcopy(example_generation())
    block = gen["refit_cfg"][ENGINE_PATH]
    for key, value in changes.items():
        if value is None:
            block.pop(key, None)
        else:
            block[key] = value
    return block


@pytest.mark.parametrize("changes,expected", [
    ({"transport": "carrier-pigeon"}, f"{PATH}.transport: 'carrier-pigeon' is not one of: local, relay, s3"),
    ({"transport": None}, f"{PATH}.transport is required"),
    ({"op": "subtract"}, f"{PATH}.op: Input should be 'auto', 'xor' or 'add'"),
    ({"timout_s": 5}, f"{PATH}.timout_s: unknown field (known: "),
    ({"timeout_s": 0}, f"{PATH}.timeout_s: Input should be greater than 0"),
    ({"max_attempts": 0}, f"{PATH}.max_attempts: Input should be greater than or equal to 1"),
    ({"wire_version": 4}, f"{PATH}.wire_version: must be 5 or 6"),
    ({"local": {"dir": "/dev/shm/x", "bogus": 1}}, f"{PATH}.local.bogus: unknown local transport setting"),
    ({"s3": {"bucket": "b"}}, f"{PATH}.s3: settings for a transport that is not selected (transport: local)"),
    ({"transport": "s3", "local": None, "s3": {"region": "x"}}, f"{PATH}.s3.bucket is required by the s3 transport"),
    ({"key_env": ""}, f"{PATH}.key_env: must be a non-empty string"),
    ({"conditioned": "yes"}, f"{PATH}.conditioned: must be true or false (a YAML boolean) (got 'yes')"),
])
def test_each_mistake_names_its_field(changes, expected, nemo_rl):
    with pytest.raises(ConfigError) as err:
        DCRRefitConfig.parse(with_block(**changes))
    assert any(p.startswith(expected) for p in err.value.problems), err.value.problems
    # NeMo RL's factory surfaces the same error when it builds the engine
    _, create_checkpoint_engine, _ = nemo_rl
    with pytest.raises(ConfigError, match="invalid NeMo-DCR refit config"):
        create_checkpoint_engine(ENGINE_PATH, bucket_size_bytes=1 << 20, engine_kwargs=with_block(**changes))


def test_conditioned_coding_is_off_unless_set_to_true():
    assert DCRRefitConfig.parse(with_block()).conditioned is False
    assert DCRRefitConfig.parse(with_block(conditioned=True)).conditioned is True
    for bad in (1, "true", "false", 0):  # a truthy stand-in is refused, not read as a boolean
        with pytest.raises(ConfigError, match=r"\.conditioned: must be true or false"):
            DCRRefitConfig.parse(with_block(conditioned=bad))


def test_every_problem_at_once():
    with pytest.raises(ConfigError) as err:
        DCRRefitConfig.parse(with_block(op="nope", timeout_s=-1, extra_field=True))
    assert len(err.value.problems) == 3


def test_key_from_the_environment(monkeypatch):
    settings = DCRRefitConfig.parse(with_block())
    monkeypatch.delenv("DCR_HMAC_KEY", raising=False)
    with pytest.raises(ConfigError, match="DCR_HMAC_KEY is not set"):
        settings.key()
    monkeypatch.setenv("DCR_HMAC_KEY", "s3cret")
    assert settings.key() == b"s3cret"


def test_check_reports_what_is_wrong(tmp_path, capsys):
    config = yaml.safe_load(EXAMPLES[0].read_text())
    config.pop("defaults")
    config["policy"]["generation"]["colocated"]["enabled"] = True
    config["policy"]["generation"]["refit_cfg"][ENGINE_PATH]["op"] = "subtract"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(config))
    assert check([str(bad)]) == 1
    err = capsys.readouterr().err
    assert "colocated.enabled must be false" in err and f"{PATH}.op" in err
    off = tmp_path / "off.yaml"
    off.write_text(yaml.safe_dump({"policy": {"generation": {"refit_transport": None}}}))
    assert check([str(off)]) == 1 and "NeMo-DCR is off" in capsys.readouterr().err


def test_check_without_nemo_rl_checks_the_block_and_says_so():
    out = subprocess.run([sys.executable, "-m", "nemo_dcr.integrations.nemo_rl.check", str(EXAMPLES[1])],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "NeMo RL is not importable here" in out.stdout and "over s3" in out.stdout
