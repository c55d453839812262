"""A receiver process holding a fine-grained FP8 rollout checkpoint in memory
(`TensorStoreRuntime`) and refitted in place over a transport. Prints
"[<id>] shut down at version <n>" when the trainer shuts it down."""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True, help="the FP8 checkpoint folder (version 0)")
    ap.add_argument("--id", required=True)
    ap.add_argument("--transport", default="local")
    ap.add_argument("--transport-config", required=True)
    args = ap.parse_args()

    from nemo_dcr import registry
    from nemo_dcr.receiver import Receiver
    from nemo_dcr.runtimes.store import TensorStoreRuntime

    runtime = TensorStoreRuntime.from_checkpoint(args.checkpoint)
    end = registry.transport(args.transport, json.loads(args.transport_config)).receiver(args.id)
    receiver = Receiver(args.id, runtime, end, log=lambda m: print(m, flush=True))
    dtypes = sorted({d for d, _ in runtime.catalog().values()})
    print(f"[{args.id}] serving version 0: {len(runtime.catalog())} tensors ({', '.join(dtypes)})", flush=True)
    try:
        receiver.serve_forever(0.05)
    finally:
        end.close()
    print(f"[{args.id}] shut down at version {receiver.serving_version}", flush=True)


if __name__ == "__main__":
    main()
