"""A relay-tree node for transport tests, as its own process (no torch, no model).

Modes:
  normal  - the relay end plus a receiver loop like tests/test_local_transport.py's
            drain(): record each payload (id, size, BLAKE2b), ack it (rejecting the ids in
            --reject, after --delay seconds), answer begin with 'ready' (unless
            --no-reply) and verify with 'verified'; exit on 'shutdown'.
  deaf    - the relay runs, but the local receiver never polls (a hung receiver).
  dead    - a bare ZeroMQ ROUTER bound at the node's endpoint that never reads or
            answers (a hung relay).
On exit it writes {"events": [...], "stats": {...}} as JSON to --out. Prints READY once
its endpoint is bound. With --mpi PORT_BASE the node list comes from nodes_from_mpi
(launched under mpirun; --config then holds the rest of the configuration).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from nemo_dcr.transports.relay import RelayTransport, nodes_from_mpi  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--id")
    p.add_argument("--out", required=True)
    p.add_argument("--mode", default="normal", choices=["normal", "deaf", "dead"])
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--reject", default="")
    p.add_argument("--no-reply", action="store_true")
    p.add_argument("--mpi", type=int, help="port base: take the node list from MPI_COMM_WORLD")
    args = p.parse_args()
    config = json.loads(args.config)
    rx = args.id
    if args.mpi is not None:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        config["nodes"] = nodes_from_mpi(comm, args.mpi, host="127.0.0.1")
        rx = config["nodes"][comm.Get_rank()]["id"]
        args.out = f"{args.out}.{rx}"
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    t = RelayTransport(config)

    if args.mode == "dead":
        import zmq

        ctx = zmq.Context()
        s = ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVHWM, 2)
        s.setsockopt(zmq.RCVBUF, 4096)
        s.bind(t.endpoint(t.index(rx)))
        print("READY", flush=True)
        while not stop:
            time.sleep(0.05)
        s.close(0)
        ctx.term()
        return 0

    end = t.receiver(rx)
    print("READY", json.dumps(config["nodes"]) if args.mpi is not None else "", flush=True)
    events: list = []
    reject = set(filter(None, args.reject.split(",")))
    try:
        while not stop:
            if args.mode == "deaf":
                time.sleep(0.05)
                continue
            ev = end.poll(0.05)
            if ev is None:
                continue
            meta = ev.meta
            if ev.kind == "payload":
                time.sleep(args.delay)
                pid = meta["payload_id"]
                data = bytes(ev.data)
                events.append(["payload", pid, len(data), hashlib.blake2b(data, digest_size=16).hexdigest()])
                end.staged(meta["transfer_id"], meta["producer_id"], pid, "bad" if pid in reject else None)
            else:
                events.append([ev.kind, meta])
                if ev.kind == "begin" and not args.no_reply:
                    end.reply("ready", {"transfer_id": meta["transfer_id"], "error": None})
                elif ev.kind == "verify":
                    end.reply("verified", {"transfer_id": meta["transfer_id"], "seen": len(events)})
                elif ev.kind == "shutdown":
                    break
            ev.release()
    finally:
        stats = dict(end.stats)
        end.close()
        with open(args.out + ".tmp", "w") as f:
            json.dump({"events": events, "stats": stats}, f)
        os.replace(args.out + ".tmp", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
