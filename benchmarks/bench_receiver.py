"""A receiver process for transport benchmarks: stages (reads) every payload and
acknowledges it; exits on 'shutdown'. Usage: python -m benchmarks.bench_receiver
--transport NAME --config JSON --id RX"""

from __future__ import annotations

import argparse
import json

from nemo_dcr import registry


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--transport", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--id", required=True)
    args = ap.parse_args()
    end = registry.transport(args.transport, json.loads(args.config)).receiver(args.id)
    try:
        while True:
            ev = end.poll(1.0)
            if ev is None:
                continue
            if ev.kind == "shutdown":
                break
            if ev.kind == "payload":
                checksum = sum(bytes(ev.data[:: 4096]))  # touch every page: the bytes really arrived
                end.staged(ev.meta["transfer_id"], ev.meta["producer_id"], ev.meta["payload_id"],
                           None if checksum >= 0 else "unreadable")
            elif ev.kind == "begin":
                end.reply("ready", {"transfer_id": ev.meta["transfer_id"], "error": None})
            ev.release()
    finally:
        end.close()


if __name__ == "__main__":
    main()
