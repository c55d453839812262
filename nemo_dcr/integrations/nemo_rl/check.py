"""`python -m nemo_dcr.integrations.nemo_rl.check CONFIG.yaml`: validate a NeMo RL config's refit block."""

from __future__ import annotations

import sys

from nemo_dcr.integrations.nemo_rl.config import ConfigError, from_generation_config, is_enabled


def main(argv: list[str] | None = None) -> int:
    import yaml

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m nemo_dcr.integrations.nemo_rl.check CONFIG.yaml", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        config = yaml.safe_load(f) or {}
    generation = (config.get("policy") or {}).get("generation")
    if not is_enabled(generation):
        print(f"{argv[0]}: policy.generation.refit_transport is not 'dcr': NeMo-DCR is off")
        return 1
    try:
        settings = from_generation_config(generation)
    except ConfigError as e:
        print(f"{argv[0]}: {e}", file=sys.stderr)
        return 1
    print(f"{argv[0]}: NeMo-DCR refit over {settings.transport} ({settings.op}), "
          f"converter {settings.converter or '<model_type>'}, verify {settings.verify}: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
