"""Fault-injection campaign: randomized refits with injected faults across transports.

    python -m tests.fault_campaign --refits 200                  # ~10-15 minutes
    python -m tests.fault_campaign --refits 20 --transports local

Each environment is a real trainer (a small Llama in BF16 with AdamW, one rank) and
three real Hugging Face receivers on threads, over a real transport (local: shared
memory + ZeroMQ; relay: a tree of in-process relay nodes over TCP; s3: a moto server
behind tests/support/s3_fault_proxy.py), with HMAC keys, read-back verification, in-place
retries and a history for catch-up. Every refit steps the trainer, arms at most one fault,
and refits. A supervisor restarts a receiver whose thread died (a fresh model from the
initial checkpoint: it catches up from the history on the next begin).

Faults: a receiver's apply interrupted half-way (`half`), in every attempt (`stuck`: the
transfer must fail closed; the receiver, its bits unknown, catches up from the history at
the next begin), a receiver killed mid-apply (`crash`), a bit flipped after a successful
apply (`silent`), a payload dropped,
duplicated, reordered or corrupted on the wire, a relay node killed and restarted
(`kill_relay`), S3 5xx replies and stalls through the proxy (`s3_5xx`, `s3_timeout`); and
receivers that do not hold the base the producers diff against: one restarted from another
checkpoint of the same shapes (`wrong_base`) or with random weights (`dummy`, as an engine
loaded with dummy weights), and one whose bits flipped in memory between refits
(`bitflip`). Receivers rescan their whole-state digest at every begin, so each of these is
caught there and repaired before anything is written.

Outcomes: converged (committed, every receiver bit-exact against the trainer's dense
state), failed closed (TransferFailed with a reason; every receiver still at the committed
bits or refusing transfers until it catches up), silent mismatch (committed but some
receiver differs: must be 0). Time to recover: from the faulty refit's start to the next
commit. The table is printed; --out writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from nemo_dcr import dtypes, registry
from nemo_dcr.capture import torch_owned_ranges
from nemo_dcr.checkpoint import read_specs
from nemo_dcr.cli import make_checkpoint
from nemo_dcr.errors import TransferFailed
from nemo_dcr.history import DirectoryHistory
from nemo_dcr.layout import ParallelLayout
from nemo_dcr.receiver import Receiver
from nemo_dcr.runtimes.hf import HFRuntime
from nemo_dcr.trainer import TrainerRefit
from nemo_dcr.verify import bit_mismatches
from tests.support.faults import FaultyEnd, FaultyRuntime
from tests.support.transports import open_transport

KEY = b"campaign-key"
COMMON = ("none", "half", "crash", "silent", "drop", "duplicate", "reorder", "corrupt", "stuck",
          "wrong_base", "dummy", "bitflip")
EXTRA = {"local": (), "relay": ("kill_relay",), "s3": ("s3_5xx", "s3_timeout")}


class Env:
    """One transport's trainer, receivers (with a supervisor) and history."""

    def __init__(self, name: str, workdir: Path, checkpoint: Path, other_checkpoint: Path, n_receivers: int = 3,
                 timeout_s: float = 3.0):
        """`other_checkpoint`: the same shapes as `checkpoint`, other weights (`wrong_base`)."""
        from transformers import AutoModelForCausalLM

        self.name, self.checkpoint, self.workdir = name, checkpoint, workdir
        self.other_checkpoint = other_checkpoint
        self.ids = [f"rx{i}" for i in range(n_receivers)]
        self.proxy = None
        config = {"timeout_s": timeout_s}
        if name == "s3":
            self.transport, self.proxy = _s3_behind_proxy(self.ids, timeout_s)
        else:
            if name == "relay":
                config["fanout"] = 1  # a chain rx0 -> rx1 -> rx2: rx1 is an interior relay
            self.transport = open_transport(name, workdir, self.ids, **config)
        self.history = DirectoryHistory(workdir / "history")
        self.receivers: dict[str, Receiver] = {}
        self.runtimes: dict[str, FaultyRuntime] = {}
        self.threads: dict[str, threading.Thread] = {}
        self.kills: dict[str, threading.Event] = {}
        self.started_at: dict[str, float] = {}
        self.commit_seen_at = 0.0
        self.restarts = 0
        self.lock = threading.Lock()  # the supervisor's restarts and `replace` never interleave
        for rx in self.ids:
            self._start(rx)
        self.stop = threading.Event()
        self.supervisor = threading.Thread(target=self._supervise, daemon=True)
        self.supervisor.start()
        self.model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.refit = TrainerRefit(registry.converter("identity", self.model.config), read_specs(checkpoint),
                                  torch_owned_ranges(self.model), ParallelLayout(), self.transport,
                                  state_dir=str(workdir / "state"), key=KEY, max_payload_elements=2000,
                                  timeout_s=timeout_s, max_attempts=4, history=self.history, anchor_every=5,
                                  readback=True)
        self.end = self.refit.producer.end
        self.committed_state = self.expected()

    def _start(self, rx: str, weights: str = "checkpoint") -> None:
        """`weights`: "checkpoint" (version 0), "other" (`other_checkpoint`) or "random"."""
        from transformers import AutoModelForCausalLM

        source = self.other_checkpoint if weights == "other" else self.checkpoint
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
        if weights == "random":
            with torch.no_grad():
                for p in model.parameters():
                    p.normal_()
        rt = self.runtimes[rx] = FaultyRuntime(HFRuntime(model, checkpoint_dir=self.checkpoint))
        r = self.receivers[rx] = Receiver(rx, rt, self.transport.receiver(rx), key=KEY, history=self.history,
                                          rescan=True)
        self.started_at[rx] = time.monotonic()
        stop = self.kills[rx] = threading.Event()
        t = self.threads[rx] = threading.Thread(target=_serve, args=(r, stop), daemon=True)
        t.start()

    def kill(self, rx: str) -> None:
        """The receiver's process dies: its loop stops and its end's sockets vanish."""
        self.kills[rx].set()
        self.threads[rx].join(5)

    def restart(self, rx: str, weights: str = "checkpoint") -> None:
        """A receiver process that died and was started again: new end, fresh weights (v0,
        unless `weights` says otherwise: see `_start`)."""
        self.receivers[rx].end.close()
        self._start(rx, weights)
        self.restarts += 1

    def replace(self, rx: str, weights: str) -> None:
        """Kill a receiver and start it again on other weights (see `_start`)."""
        with self.lock:
            self.kill(rx)
            self.restart(rx, weights)

    def _supervise(self) -> None:
        while not self.stop.wait(0.2):
            with self.lock:
                for rx, t in list(self.threads.items()):
                    if not t.is_alive():
                        self.restart(rx)

    def step(self) -> None:
        ids = torch.randint(0, 300, (2, 16))
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.opt.step()
        self.opt.zero_grad()

    def expected(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items() if k != "lm_head.weight"}

    def wait_serving(self, version: int, timeout_s: float = 10.0) -> list[str]:
        """Wait until every receiver serves `version`, or is a restarted process that came
        up after the commit (it serves an older version and catches up at the next begin).
        Returns the latter."""
        deadline = time.monotonic() + timeout_s
        while True:
            behind = [rx for rx, r in self.receivers.items() if r.serving_version != version]
            late = [rx for rx in behind if self.receivers[rx].serving_version < version
                    and self.started_at[rx] > self.commit_seen_at]
            if len(late) == len(behind) or time.monotonic() > deadline:
                return behind
            time.sleep(0.02)

    def close(self) -> None:
        self.stop.set()
        self.supervisor.join(5)
        self.refit.close(shutdown_receivers=True)
        for t in self.threads.values():
            t.join(10)
        for r in self.receivers.values():
            r.end.close()
        self.transport.cleanup()
        if self.proxy is not None:
            self.proxy.stop()


def _serve(receiver: Receiver, killed: threading.Event) -> None:
    try:
        while not killed.is_set():
            event = receiver.end.poll(0.02)
            if event is not None and not receiver.handle(event):
                return
    except BaseException:  # noqa: BLE001 - a crash ends the thread, like a killed process
        return


def _s3_behind_proxy(ids, timeout_s):
    from tests.support.s3_fault_proxy import FaultProxy
    from tests.support.s3_server import shared_moto

    server = shared_moto()
    bucket = server.new_bucket()
    proxy = FaultProxy(server.endpoint_url, seed=0).start()
    config = server.config(bucket, poll_s=0.02, timeout_s=max(timeout_s, 10.0), read_timeout_s=2.0)
    config["endpoint_url"] = proxy.url
    return registry.transport("s3", config, receivers=ids), proxy


@dataclass
class Outcome:
    transport: str
    fault: str
    result: str  # converged | failed_closed | silent_mismatch
    attempts: int = 0
    seconds: float = 0.0
    recover_s: float | None = None
    reason: str = ""
    injected: bool = True
    details: dict = field(default_factory=dict)


def arm(env: Env, fault: str, rng: random.Random) -> bool:
    """Arm `fault` for the next refit; False when it cannot be armed here."""
    victim = rng.choice(env.ids)
    if fault in ("half", "crash", "silent"):
        env.runtimes[victim].arm(fault, after_calls=rng.randint(1, 3))
    elif fault == "stuck":  # every attempt breaks off: the transfer must fail closed
        rt = env.runtimes[victim]
        rt.arm("half")
        rt.crash_on = set(range(rt.calls + 1, rt.calls + 10_000))
    elif fault in FaultyEnd.KINDS:
        env.refit.producer.end = FaultyEnd(env.end, {f"p0-{rng.randint(0, 3):06d}": fault})
    elif fault in ("wrong_base", "dummy"):  # restarted on bits that are no version of this lineage
        env.replace(victim, "other" if fault == "wrong_base" else "random")
    elif fault == "bitflip":  # memory corruption between two refits
        state = env.receivers[victim].runtime.canonical_state()
        name = rng.choice(sorted(state))
        flat = dtypes.bits_of(state[name].detach()).view(-1)
        flat[rng.randrange(flat.numel())] ^= 1 << rng.randrange(8 * flat.element_size())
    elif fault == "kill_relay":
        rx = env.ids[1]  # interior in the chain
        threading.Thread(target=_kill_and_restart, args=(env, rx, rng.uniform(0.0, 0.3)), daemon=True).start()
    elif fault in ("s3_5xx", "s3_timeout"):
        from tests.support.s3_fault_proxy import Fault

        env.proxy.set_faults(Fault(rng.choice(("500", "503")), rate=0.1) if fault == "s3_5xx"
                             else Fault("timeout", rate=0.02, delay_s=3.0, after=rng.random() < 0.5))
    return True


def _kill_and_restart(env: Env, rx: str, delay: float) -> None:
    time.sleep(delay)
    env.kill(rx)  # mid-transfer; the supervisor starts it again (fresh weights: it catches up)


def disarm(env: Env) -> None:
    env.refit.producer.end = env.end
    for rt in env.runtimes.values():
        rt.crash_on = set()
    if env.proxy is not None:
        env.proxy.clear_faults()


def run(refits: int, transports: list[str], seed: int, workdir: Path, log=print,
        schedule: list[tuple[str, str]] | None = None) -> list[Outcome]:
    """`schedule`: fixed (transport, fault) pairs instead of `refits` random ones."""
    rng = random.Random(seed)
    if schedule is not None:
        refits, transports = len(schedule), sorted({t for t, _ in schedule})
    torch.manual_seed(seed)
    shape = dict(family="llama", hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=300, tied=True)
    checkpoint = make_checkpoint(workdir / "ckpt", **shape, seed=seed)
    other = make_checkpoint(workdir / "other", **shape, seed=seed + 1)
    envs = {name: Env(name, workdir / name, checkpoint, other) for name in transports}
    outcomes: list[Outcome] = []
    pending_recovery: list[tuple[Outcome, float]] = []
    try:
        for i in range(refits):
            if schedule is not None:
                name, fault = schedule[i]
            else:
                name = transports[i % len(transports)]
                fault = rng.choice(COMMON + EXTRA[name])
            env = envs[name]
            arm(env, fault, rng)
            env.step()
            t0 = time.perf_counter()
            out = Outcome(name, fault, "converged")
            try:
                result = env.refit.refit()
                out.attempts = result.attempts
                env.commit_seen_at = time.monotonic()
                behind = env.wait_serving(result.decision.version, timeout_s=30.0)
                if behind:
                    # Restarted after the commit (fresh weights, older version: it catches up at the next
                    # begin), or not yet told of the commit (it adopts it at the next begin).
                    out.reason = f"behind the commit, caught up by the next refit: {behind}"
                bad = {rx: bit_mismatches(env.expected(), r.runtime.canonical_state())
                       for rx, r in env.receivers.items() if r.serving_version == result.decision.version}
                bad = {rx: b for rx, b in bad.items() if b}
                if bad:
                    out.result, out.reason = "silent_mismatch", json.dumps(bad)[:500]
                env.committed_state = env.expected()
            except TransferFailed as e:
                out.result, out.reason = "failed_closed", str(e)[:300]
                out.attempts = int(m.group(1)) if (m := re.search(r"after (\d+) attempt", str(e))) else 0
                # fail closed: each receiver holds the committed bits, or refuses until it catches up
                time.sleep(0.2)
                for rx, r in env.receivers.items():
                    if r.uncertain_state is None and r.lineage is None and bit_mismatches(
                            env.committed_state, r.runtime.canonical_state()):
                        out.result, out.reason = "silent_mismatch", f"{rx} left neither at v nor refusing: {e}"
            out.seconds = time.perf_counter() - t0
            disarm(env)
            if out.result == "converged":
                for prev, start in pending_recovery:
                    if prev.transport == name:
                        prev.recover_s = time.perf_counter() - start
                pending_recovery = [(p, s) for p, s in pending_recovery if p.transport != name]
                if fault != "none":
                    out.recover_s = out.seconds
            elif out.result == "failed_closed":
                pending_recovery.append((out, t0))
            outcomes.append(out)
            log(f"[{i + 1}/{refits}] {name:5s} {fault:10s} -> {out.result} ({out.attempts} attempt(s), "
                f"{out.seconds:.2f} s){' ' + out.reason[:120] if out.reason else ''}")
    finally:
        for env in envs.values():
            env.close()
    return outcomes


def table(outcomes: list[Outcome]) -> tuple[str, dict]:
    rows = defaultdict(lambda: defaultdict(list))
    for o in outcomes:
        rows[(o.transport, o.fault)][o.result].append(o)
    lines = [f"{'transport':9s} {'fault':10s} {'refits':>6s} {'converged':>9s} {'failed closed':>13s} "
             f"{'silent':>6s} {'retried':>7s} {'recover mean/max s':>18s}"]
    summary = {}
    for (tr, fault), by in sorted(rows.items()):
        allo = [o for v in by.values() for o in v]
        rec = [o.recover_s for o in allo if o.recover_s is not None and fault != "none"]
        retried = sum(1 for o in allo if o.attempts > 1)
        row = {"refits": len(allo), "converged": len(by["converged"]), "failed_closed": len(by["failed_closed"]),
               "silent_mismatch": len(by["silent_mismatch"]), "retried": retried,
               "recover_mean_s": sum(rec) / len(rec) if rec else None, "recover_max_s": max(rec) if rec else None}
        summary[f"{tr}/{fault}"] = row
        recs = f"{row['recover_mean_s']:.2f} / {row['recover_max_s']:.2f}" if rec else "-"
        lines.append(f"{tr:9s} {fault:10s} {row['refits']:6d} {row['converged']:9d} {row['failed_closed']:13d} "
                     f"{row['silent_mismatch']:6d} {retried:7d} {recs:>18s}")
    total = {k: sum(r[k] for r in summary.values()) for k in ("refits", "converged", "failed_closed",
                                                              "silent_mismatch", "retried")}
    lines.append(f"{'all':9s} {'':10s} {total['refits']:6d} {total['converged']:9d} {total['failed_closed']:13d} "
                 f"{total['silent_mismatch']:6d} {total['retried']:7d}")
    return "\n".join(lines), {"rows": summary, "total": total}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--refits", type=int, default=200)
    ap.add_argument("--transports", default="local,relay,s3")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    transports = [t for t in args.transports.split(",") if t]
    unknown = set(transports) - set(EXTRA)
    if unknown:
        ap.error(f"unknown transports {sorted(unknown)}; choose from {sorted(EXTRA)}")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    with tempfile.TemporaryDirectory(prefix="dcr-campaign-") as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
        t0 = time.perf_counter()
        try:
            outcomes = run(args.refits, transports, args.seed, Path(tmp))
        finally:
            dist.destroy_process_group()
        text, summary = table(outcomes)
    print(text)
    summary["seconds"] = time.perf_counter() - t0
    summary["args"] = vars(args)
    if args.out:
        Path(args.out).write_text(json.dumps({**summary, "outcomes": [o.__dict__ for o in outcomes]}, indent=1))
    return 1 if summary["total"]["silent_mismatch"] else 0


if __name__ == "__main__":
    sys.exit(main())
