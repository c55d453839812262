"""`python -m nemo_dcr.integrations.nemo_rl.check CONFIG.yaml [--configs DIR]`: is this
NeMo RL config's refit ready for NeMo-DCR?

Where NeMo RL is importable, the config is loaded the way NeMo RL loads it (`defaults:`
inherited from the config's folder, or from `--configs`, e.g. NeMo RL's
examples/configs), then checked by NeMo RL's own validation
(`normalize_vllm_refit_config`, `checkpoint_engine_refit_config`), and NeMo RL's
`create_checkpoint_engine` builds the engine from it. Without NeMo RL, only the
engine's block is checked (and the tool says so). Exit status: 0 OK, 1 a problem, 2 usage.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

from nemo_dcr.integrations.nemo_rl.config import ENGINE_PATH, PATH, ConfigError, DCRRefitConfig


def _nemo_rl_available() -> bool:
    try:
        import nemo_rl.weight_sync.checkpoint_engine_config  # noqa: F401
    except ImportError:
        return False
    return True


def load(path: Path, configs: Path | None, with_nemo_rl: bool) -> dict:
    """The config as NeMo RL sees it (inheritance and interpolations resolved)."""
    if with_nemo_rl:
        from omegaconf import OmegaConf

        from nemo_rl.utils.config import load_config_with_inheritance, register_omegaconf_resolvers

        register_omegaconf_resolvers()
        return OmegaConf.to_container(load_config_with_inheritance(path, configs), resolve=True)
    import yaml

    return yaml.safe_load(path.read_text()) or {}


def check(config: dict, with_nemo_rl: bool) -> list[str]:
    """Problems (empty when the refit is ready), NeMo RL's own and this engine's."""
    generation = (config.get("policy") or {}).get("generation") or {}
    transport = generation.get("refit_transport")
    if transport != ENGINE_PATH:
        return [f"policy.generation.refit_transport is {transport!r}, not {ENGINE_PATH!r}: NeMo-DCR is off"]
    problems = []
    if (generation.get("colocated") or {}).get("enabled", True):
        problems.append("policy.generation.colocated.enabled must be false: NeMo RL runs checkpoint engines only "
                        "for non-colocated vLLM (colocated refits stay on its CUDA-IPC path)")
    if (generation.get("vllm_cfg") or {}).get("async_engine"):
        problems.append("policy.generation.vllm_cfg.async_engine: true is not supported yet by NeMo-DCR's engine "
                        "(its update runs on the engine's own thread, not tested under vLLM's async engine)")
    if generation.get("backend", "vllm") != "vllm":
        problems.append(f"policy.generation.backend must be 'vllm' for checkpoint engines, got "
                        f"{generation.get('backend')!r}")
    raw = (generation.get("refit_cfg") or {}).get(ENGINE_PATH)
    if with_nemo_rl:
        from nemo_rl.utils.checkpoint_engines.base import create_checkpoint_engine
        from nemo_rl.weight_sync.checkpoint_engine_config import checkpoint_engine_refit_config

        try:
            engine_config = checkpoint_engine_refit_config(generation)
        except ValueError as e:  # pydantic's ValidationError is one
            return problems + [f"NeMo RL rejects policy.generation: {e}"]
        backend = engine_config["backend"]
        try:
            create_checkpoint_engine(backend, bucket_size_bytes=1 << 20,
                                     engine_kwargs=engine_config["engine_kwargs"][backend])
        except ConfigError as e:
            problems += e.problems
        except (ImportError, AttributeError, TypeError) as e:
            problems.append(f"NeMo RL cannot build {backend!r}: {type(e).__name__}: {e}")
    else:
        try:
            DCRRefitConfig.parse(raw)
        except ConfigError as e:
            problems += e.problems
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nemo_dcr.integrations.nemo_rl.check", description=__doc__.split(
        "\n\n")[0])
    ap.add_argument("config", type=Path)
    ap.add_argument("--configs", type=Path, default=None,
                    help="where the config's `defaults:` live (default: the config's own folder)")
    args = ap.parse_args(argv)
    with_nemo_rl = _nemo_rl_available()
    try:
        config = load(args.config, args.configs, with_nemo_rl)
    except (OSError, ValueError) as e:
        print(f"{args.config}: cannot load: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    raw = copy.deepcopy(((config.get("policy") or {}).get("generation") or {}).get("refit_cfg") or {})
    problems = check(config, with_nemo_rl)  # NeMo RL's validation replaces refit_cfg by its own model
    if problems:
        print(f"{args.config}:\n  - " + "\n  - ".join(problems), file=sys.stderr)
        return 1
    block = DCRRefitConfig.parse(raw.get(ENGINE_PATH))
    checked = ("NeMo RL's own validation and create_checkpoint_engine" if with_nemo_rl
               else f"{PATH} only: NeMo RL is not importable here")
    print(f"{args.config}: NeMo-DCR refit over {block.transport} (op {block.op}): OK ({checked})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
