"""Replayed control messages act no more. Every kind a refit sends (begin, commit, abort,
verify, shutdown, catalog, and the receivers' ready / applied / verified) is taken off a real
run over the local transport and sent again, as it was on the wire: later in the same
coordinator session, and into a newer one (a restarted trainer on the same receivers). Each
is ignored with a logged reason, and nothing changes: serving version, bits, the receivers
keep running, and the next refit commits."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from nemo_dcr import registry
from nemo_dcr.capture import torch_owned_ranges
from nemo_dcr.control_auth import MAX_AGE_S, ReplayGuard
from nemo_dcr.errors import TransferFailed
from nemo_dcr.layout import ParallelLayout
from nemo_dcr.receiver import Receiver
from nemo_dcr.runtimes.store import TensorStoreRuntime
from nemo_dcr.trainer import TrainerRefit
from nemo_dcr.transports.local import _Sockets
from nemo_dcr.verify import state_digests
from tests.support.wait import serving, until

pytestmark = pytest.mark.usefixtures("single_rank_group")
KEY = b"replay-test-key"
IDS = ["rx0", "rx1"]
DOWN = ("begin", "commit", "abort", "verify", "shutdown", "catalog")  # coordinator -> receivers
UP = ("ready", "applied", "verified")  # receivers -> coordinator


class _LosingEnd:
    """A producer end that loses its first payload and leaves it out of the manifest (the
    transfer then aborts: the receivers applied other payloads than the producers sent)."""

    def __init__(self, end):
        self.end, self.lost = end, None

    def send(self, transfer, payload_id, data):
        self.lost = self.lost or payload_id
        if payload_id != self.lost:
            self.end.send(transfer, payload_id, data)

    def flush(self, transfer, payload_ids):
        return self.end.flush(transfer, [p for p in payload_ids if p != self.lost])

    def close(self):
        self.end.close()


class Run:
    """Two receivers (tensor stores) on threads over the local transport, and a trainer;
    every control message is recorded as it goes on the wire: the coordinator's broadcasts
    and the receivers' replies."""

    def __init__(self, tmp_path):
        self.tmp = tmp_path
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 16)).bfloat16()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.specs = {n: ("BF16", tuple(p.shape)) for n, p in self.model.named_parameters()}
        self.transport = registry.transport("local", {"dir": str(tmp_path / "shm"), "timeout_s": 10}, receivers=IDS)
        self.logged: list[str] = []
        self.sent: list[tuple[str, str, dict]] = []  # (direction, kind, message as sent)
        self.receivers = []
        for rx in IDS:
            served = {n: p.detach().clone() for n, p in self.model.named_parameters()}
            r = Receiver(rx, TensorStoreRuntime(served), self.transport.receiver(rx), key=KEY, log=self.logged.append)
            self._record(r.end, "reply", "up", rx)
            self.receivers.append(r)
        self.threads: list[threading.Thread] = []
        self.serve()
        self.refit = self.trainer()

    def _record(self, end, method: str, direction: str, receiver: str | None = None) -> None:
        send = getattr(end, method)

        def recorded(kind, meta):
            self.sent.append((direction, kind, {**meta, **({"receiver": receiver} if receiver else {})}))
            return send(kind, meta)

        setattr(end, method, recorded)

    def trainer(self) -> TrainerRefit:
        """A trainer (a new coordinator session) resuming from the commit log."""
        refit = TrainerRefit(registry.converter("identity", None), self.specs, torch_owned_ranges(self.model),
                             ParallelLayout(), self.transport, state_dir=str(self.tmp / "state"), key=KEY,
                             max_payload_elements=256, timeout_s=10, max_attempts=1, assume_committed=True)
        self._record(refit.coordinator.end, "broadcast", "down")
        return refit

    def serve(self) -> None:
        self.threads = [threading.Thread(target=r.serve_forever, args=(0.02,), daemon=True) for r in self.receivers]
        for t in self.threads:
            t.start()

    def step(self) -> None:
        self.model(torch.randn(4, 32, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        self.opt.step()
        self.opt.zero_grad()

    def state(self) -> list:
        """What must not change: each receiver's version, bits, open transfer, and that it runs."""
        return [(r.serving_version, state_digests(r.runtime.canonical_state()), r.current, r.lineage, t.is_alive())
                for r, t in zip(self.receivers, self.threads)]

    def replay(self, messages) -> None:
        """Send `messages` again as they were on the wire, like a peer that reaches the sockets."""
        net = _Sockets(self.transport)
        try:
            for direction, kind, meta in messages:
                targets = ([self.transport.endpoint("rx", rx) for rx in IDS] if direction == "down"
                           else [self.transport.endpoint("coord")])
                for endpoint in targets:
                    net.send(endpoint, {**meta, "kind": kind}, endpoint)
        finally:
            net.close()

    def ignored(self, kind: str, reason: str) -> bool:
        return all(any(m.startswith(f"[{rx}] ignored a '{kind}' control message: ") and reason in m
                       for m in self.logged) for rx in IDS)

    def close(self) -> None:
        self.refit.close(shutdown_receivers=True)
        for r, t in zip(self.receivers, self.threads):
            t.join(timeout=10)
            r.stop()
            t.join(timeout=10)
            r.end.close()
        self.transport.cleanup()


def _passed_over(caplog, kind: str, receiver: str) -> bool:
    return any(f"ignored a '{kind}' reply of '{receiver}'" in r.getMessage() and "another request" in r.getMessage()
               for r in caplog.records)


def test_replay_of_every_control_message_changes_nothing(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="nemo_dcr.transport")
    run = Run(tmp_path)
    try:
        # --- session A: a run that sends every kind once ------------------------------
        run.step()
        assert run.refit.refit().decision.version == 1
        assert run.refit.verify() == {"rx0": [], "rx1": []}
        run.refit.coordinator.announce_catalog(run.specs)
        run.step()
        run.refit.producer.end = _LosingEnd(run.refit.producer.end)
        with pytest.raises(TransferFailed, match="applied other payloads"):
            run.refit.refit()  # aborted everywhere
        run.refit.producer.end = run.refit.producer.end.end
        run.refit.coordinator.shutdown()
        for t in run.threads:
            t.join(timeout=10)
            assert not t.is_alive()  # the shutdown was taken
        captured = list(run.sent)
        assert {k for d, k, _ in captured if d == "down"} == set(DOWN)
        assert {(k, m["receiver"]) for d, k, m in captured if d == "up"} == {(k, rx) for k in UP for rx in IDS}

        # --- replayed later in session A ----------------------------------------------
        run.serve()  # the receivers' host serves on (their memory of the session is kept)
        before = run.state()
        caplog.clear()
        run.replay(captured)
        until(lambda: all(run.ignored(kind, "a replayed") for kind in DOWN), what="every replay ignored")
        assert run.state() == before
        run.step()
        result = run.refit.refit()  # session A goes on: its new messages act
        assert result.decision.committed and result.decision.version == 2
        serving(run.receivers, 2)
        assert run.refit.verify() == {"rx0": [], "rx1": []}
        for kind in UP:  # the replayed replies reached the coordinator: none answers a current request
            for rx in IDS:
                assert _passed_over(caplog, kind, rx), (kind, rx)

        # --- replayed into session B (a restarted trainer on the same receivers) ------
        run.refit.close()
        caplog.clear()
        run.refit = run.trainer()
        run.step()
        assert run.refit.refit().decision.version == 3  # a newer session is taken
        serving(run.receivers, 3)
        before = run.state()
        run.replay(captured)
        until(lambda: all(run.ignored(kind, "which started before the current session") for kind in DOWN),
              what="every replay of the earlier session ignored")
        assert run.state() == before
        run.step()
        assert run.refit.refit().decision.version == 4
        serving(run.receivers, 4)
        assert run.refit.verify() == {"rx0": [], "rx1": []}
        for kind in UP:
            for rx in IDS:
                assert _passed_over(caplog, kind, rx), (kind, rx)
    finally:
        run.close()


def test_replay_of_a_ready_is_no_answer_to_a_later_begin(tmp_path):
    """A reply reaches the coordinator's check only when it names the transfer being
    collected: here a captured 'ready' is replayed while its transfer is begun again. It
    answers an earlier begin, so it is not taken as the receivers' answer."""
    run = Run(tmp_path)
    try:
        run.step()
        coordinator = run.refit.coordinator
        info = coordinator.new_transfer(run.refit.producer_ids, base_digest=run.refit.state_digest)
        assert coordinator.begin(info) == []
        ready = [m for m in run.sent if m[0] == "up" and m[1] == "ready"]
        coordinator.shutdown()  # the receivers hold still: the replays reach the coordinator first
        for t in run.threads:
            t.join(timeout=10)
        run.replay(ready)
        coordinator.timeout_s = 2
        problems = coordinator.begin(info)
        assert sorted(p.split(":")[0] for p in problems) == IDS
        assert all("answers message" in p and "replayed, or late" in p for p in problems), problems
        run.serve()
        coordinator.abort(info, "test over")
        coordinator.timeout_s = 10
        run.step()
        assert run.refit.refit().decision.version == 1
        serving(run.receivers, 1)
    finally:
        run.close()


def test_replay_guard_rules():
    """The rule a receiver applies to authenticated coordinator messages."""
    now = time.time()

    def msg(session, start, seq, issued=now):
        return {"session": session, "session_start": start, "seq": seq, "issued_at": issued}

    guard = ReplayGuard()
    assert "opening session a" in guard.problem("begin", msg("a", now, 1, now - MAX_AGE_S - 1), now)
    assert guard.problem("begin", msg("a", now, 1), now) is None
    assert guard.problem("commit", msg("a", now, 3), now) is None  # counters may skip (a message to others)
    assert "a replayed 'commit'" in guard.problem("commit", msg("a", now, 3), now)
    assert "a replayed 'begin'" in guard.problem("begin", msg("a", now, 2), now)
    assert guard.problem("verify", msg("a", now, 4, now - 10 * MAX_AGE_S), now) is None  # its session is open
    assert "started before" in guard.problem("begin", msg("old", now - 1, 9), now)
    assert "started before" in guard.problem("begin", msg("twin", now, 9), now)
    assert "opening session b" in guard.problem("begin", msg("b", now + 1, 1, now + MAX_AGE_S + 1), now)
    assert guard.problem("begin", msg("b", now + 1, 1), now) is None  # a newer session, fresh
    assert "started before" in guard.problem("shutdown", msg("a", now, 99), now)  # a is over
    assert "without its session" in guard.problem("abort", {"seq": 5}, now)
    assert "without its session" in guard.problem("abort", msg("b", now + 1, True), now)


def test_replay_of_a_catalog_does_not_rebuild_a_mirror(tmp_path, caplog, monkeypatch):
    """NeMo RL's vLLM side builds its canonical mirror from the trainer's catalog: a replayed
    catalog of an earlier trainer (another model) must not rebuild it."""
    from nemo_dcr.commit import Coordinator
    from nemo_dcr.commit_log import DirectoryCommitLog
    from nemo_dcr.integrations.nemo_rl.config import DCRRefitConfig
    from nemo_dcr.integrations.nemo_rl.mirror import MirrorReceiver

    monkeypatch.setenv("DCR_REPLAY_KEY", KEY.decode())
    settings = DCRRefitConfig(transport="local", local={"dir": str(tmp_path / "shm")}, key_env="DCR_REPLAY_KEY")
    transport = registry.transport("local", {"dir": str(tmp_path / "shm")}, receivers=["rollout0"])
    mirror = MirrorReceiver(settings, "rollout0", transport)
    caplog.set_level(logging.INFO, logger="nemo_dcr.nemo_rl")

    def announce(specs: dict) -> dict:
        coordinator = Coordinator(transport.coordinator(), DirectoryCommitLog(tmp_path / "state"), key=KEY)
        sent = []
        end_broadcast = coordinator.end.broadcast
        coordinator.end.broadcast = lambda kind, meta: (sent.append(meta), end_broadcast(kind, meta))
        coordinator.announce_catalog(specs)
        coordinator.end.close()
        deliver()
        return sent[0]

    def deliver() -> None:
        event = mirror.end.poll(5)
        assert event is not None and event.kind == "catalog"
        mirror._on_catalog(event)

    try:
        earlier = announce({"w": ("BF16", (4, 4))})
        assert set(mirror.receiver.runtime.tensors) == {"w"}
        announce({"w": ("BF16", (4, 4)), "b": ("BF16", (4,))})  # a later trainer, another model
        built = mirror.receiver
        assert set(built.runtime.tensors) == {"w", "b"}
        net = _Sockets(transport)
        net.send(transport.endpoint("rx", "rollout0"), {**earlier, "kind": "catalog"}, "rollout0")
        net.close()
        deliver()
        assert mirror.receiver is built and set(built.runtime.tensors) == {"w", "b"}
        assert any("ignored a catalog" in r.getMessage() and "started before the current session" in r.getMessage()
                   for r in caplog.records)
    finally:
        mirror.close()
        transport.cleanup()
