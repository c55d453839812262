"""Control messages under a shared key: signed by the coordinator and the receivers,
checked on arrival; forged or unsigned ones change nothing. And an end-to-end check that
every receiver applied exactly the payloads the producers sent, whatever the manifests
said on the way."""

from __future__ import annotations

import time

import pytest

from nemo_dcr.commit import Coordinator
from nemo_dcr.commit_log import DirectoryCommitLog
from nemo_dcr.control_auth import check, sign
from nemo_dcr.errors import TransferFailed
from tests.support.wait import serving
from tests.test_local_refit import Setup, checkpoint  # noqa: F401 - the module-scoped checkpoint fixture

pytestmark = pytest.mark.usefixtures("single_rank_group")
KEY = b"shared-control-key"


def test_sign_and_check():
    place = {"session": "s", "session_start": 1.0, "seq": 1, "issued_at": 2.0}
    meta = sign(KEY, "commit", {"transfer_id": "t1", "version": 3, **place})
    assert check(KEY, "commit", meta) is None
    assert check(KEY, "commit", {**meta, "kind": "commit", "receiver": "rx0"}) is None  # transport fields
    assert "wrong MAC" in check(KEY, "commit", {**meta, "version": 4})
    assert "wrong MAC" in check(b"other", "commit", meta)
    assert "wrong MAC" in check(KEY, "abort", {**meta, "reason": "x", "signed": meta["signed"] + ["reason"]})
    assert "unsigned" in check(KEY, "commit", {"transfer_id": "t1", "version": 3})
    assert "signs too little" in check(KEY, "commit", sign(KEY, "commit", {"transfer_id": "t1", **place}))
    assert "signs too little" in check(KEY, "commit", sign(KEY, "commit", {"transfer_id": "t1", "version": 3}))
    assert check(None, "commit", {"anything": 1}) is None and sign(None, "commit", {"a": 1}) == {"a": 1}


def test_forged_control_messages_change_nothing(checkpoint, tmp_path):  # noqa: F811
    s = Setup(checkpoint, tmp_path, key=KEY)
    try:
        s.step()
        assert s.refit.refit().decision.version == 1
        # an intruder that reaches the receivers' sockets but lacks the key
        log = DirectoryCommitLog(tmp_path / "intruder")
        forger = Coordinator(s.transport.coordinator(), log, timeout_s=2, key=b"guessed-key")
        forger.shutdown()
        forger._broadcast("abort", {"transfer_id": "v1-v2-any", "reason": "forged"})
        unsigned = Coordinator(s.transport.coordinator(), log, timeout_s=2)
        unsigned.shutdown()
        forger.end.close()
        unsigned.end.close()
        time.sleep(0.5)
        assert all(t.is_alive() for t in s.threads)  # nobody shut down
        s.step()
        result = s.refit.refit()
        assert result.decision.committed and result.decision.version == 2
        serving(s.receivers, 2)
    finally:
        s.close()


def _shutdown(session: str, start: float, seq: int, issued_at: float) -> dict:
    return sign(KEY, "shutdown", {"session": session, "session_start": start, "seq": seq, "issued_at": issued_at})


def test_a_captured_shutdown_cannot_be_replayed(checkpoint, tmp_path):  # noqa: F811
    """A signed shutdown sent again later is ignored: from a session older than the one a
    receiver heard, opening a session more than MAX_AGE_S off its clock, or already taken
    (tests/test_control_replay.py replays every kind from real runs)."""
    import torch

    from nemo_dcr import registry
    from nemo_dcr.control_auth import MAX_AGE_S
    from nemo_dcr.receiver import Receiver
    from nemo_dcr.runtimes.store import TensorStoreRuntime
    from nemo_dcr.transport import Event

    s = Setup(checkpoint, tmp_path, key=KEY)
    try:
        s.step()
        assert s.refit.refit().decision.version == 1
        captured = _shutdown("s-1", 0.0, 1, time.time() - MAX_AGE_S - 60)
        replayer = s.transport.coordinator()  # an intruder that reaches the receivers' sockets
        replayer.broadcast("shutdown", captured)  # a replay, minutes late
        replayer.close()
        time.sleep(0.5)
        assert all(t.is_alive() for t in s.threads)  # nobody shut down
        s.step()
        assert s.refit.refit().decision.committed
    finally:
        s.close()
    end = registry.transport("local", {"dir": str(tmp_path / "shm2")}, receivers=["rx"]).receiver("rx")
    rx = Receiver("rx", TensorStoreRuntime({"w": torch.zeros(4)}), end, key=KEY)
    try:
        stale = _shutdown("s-2", time.time() - MAX_AGE_S - 90, 1, time.time() - MAX_AGE_S - 60)
        assert rx.handle(Event("shutdown", stale)) is True  # opens a session, long after it was issued
        fresh = _shutdown("s-3", time.time(), 1, time.time())
        assert rx.handle(Event("shutdown", dict(fresh))) is False  # taken: stop
        assert rx.handle(Event("shutdown", dict(fresh))) is True  # the same message again: ignored
        ahead = _shutdown("s-4", time.time() + 1, 1, time.time() + MAX_AGE_S + 60)
        assert rx.handle(Event("shutdown", ahead)) is True
        assert rx.handle(Event("shutdown", sign(KEY, "shutdown", {"issued_at": time.time()}))) is True  # too little
    finally:
        end.close()


def test_a_receiver_with_another_key_is_named(checkpoint, tmp_path):  # noqa: F811
    s = Setup(checkpoint, tmp_path, key=KEY, receiver_key=b"other-key")
    try:
        s.step()
        with pytest.raises(TransferFailed, match=r"rx0: .*wrong MAC"):
            s.refit.refit()
        assert all(r.serving_version == 0 for r in s.receivers) and s.refit.baseline.version == 0
    finally:
        s.close()


class _LosingEnd:
    """A producer end that loses one payload and edits it out of the manifest."""

    def __init__(self, end, lose: str):
        self.end, self.lose = end, lose

    def send(self, transfer, payload_id, data):
        if payload_id != self.lose:
            self.end.send(transfer, payload_id, data)

    def flush(self, transfer, payload_ids):
        return self.end.flush(transfer, [p for p in payload_ids if p != self.lose])

    def close(self):
        self.end.close()


def test_a_payload_missing_from_both_data_and_manifest_aborts(checkpoint, tmp_path):  # noqa: F811
    s = Setup(checkpoint, tmp_path)
    try:
        s.step()
        s.refit.producer.end = _LosingEnd(s.refit.producer.end, "p0-000001")
        with pytest.raises(TransferFailed, match="applied other payloads than the producers sent"):
            s.refit.refit()
        assert all(r.serving_version == 0 for r in s.receivers) and s.refit.baseline.version == 0
        s.refit.producer.end = s.refit.producer.end.end
        result = s.refit.refit()  # the next transfer, against the committed baseline, is whole again
        assert result.decision.committed and result.decision.version == 1
    finally:
        s.close()


def _tiny_refit(tmp_path, trainer_key: bytes, receiver_key: bytes, exit_s: float):
    """A two-tensor model, one receiver on a thread over the local transport; returns what
    the receiver's `serve_forever` raised (or None) once it stopped."""
    import threading

    import torch

    from nemo_dcr import registry
    from nemo_dcr.capture import torch_owned_ranges
    from nemo_dcr.layout import ParallelLayout
    from nemo_dcr.receiver import Receiver
    from nemo_dcr.runtimes.store import TensorStoreRuntime
    from nemo_dcr.trainer import TrainerRefit

    model = torch.nn.Linear(32, 32).bfloat16()
    transport = registry.transport("local", {"dir": str(tmp_path / "shm"), "timeout_s": 5}, receivers=["rx0"])
    served = {n: p.detach().clone() for n, p in model.named_parameters()}
    logged, raised = [], []
    rx = Receiver("rx0", TensorStoreRuntime(served), transport.receiver("rx0"), key=receiver_key,
                  key_mismatch_exit_s=exit_s, log=logged.append)

    def serve() -> None:
        try:
            rx.serve_forever(0.05)
        except Exception as e:  # noqa: BLE001 - the test looks at it
            raised.append(e)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    intruder = transport.coordinator()
    intruder.broadcast("verify", sign(b"intruder-key", "verify", {"transfer_id": "v-x", "dump_dir": None}))
    intruder.close()
    specs = {n: ("BF16", tuple(p.shape)) for n, p in model.named_parameters()}
    refit = TrainerRefit(registry.converter("identity", None), specs, torch_owned_ranges(model), ParallelLayout(),
                         transport, state_dir=str(tmp_path / "state"), key=trainer_key, max_attempts=1)
    with torch.no_grad():
        model.weight.add_(0.01)
    committed = True
    try:
        refit.refit()
    except TransferFailed:
        committed = False
    refit.close(shutdown_receivers=True)
    thread.join(exit_s + 10)
    if not thread.is_alive():
        rx.end.close()  # left to the garbage collector, its zmq context can block the interpreter's exit
    transport.cleanup()
    return committed, thread.is_alive(), raised, logged


def test_a_receiver_with_another_key_stops_by_itself_and_says_why(tmp_path):
    """Nothing from the trainer authenticates, its shutdown included: the receiver stops
    `key_mismatch_exit_s` after the first rejected message, naming the key."""
    from nemo_dcr.errors import KeyMismatch

    committed, alive, raised, logged = _tiny_refit(tmp_path, KEY, b"other-key", exit_s=1.0)
    assert not committed and not alive
    assert len(raised) == 1 and isinstance(raised[0], KeyMismatch) and "HMAC key" in str(raised[0])
    assert any("no refit and no shutdown can reach it" in m for m in logged)


def test_a_forged_message_does_not_stop_a_receiver_with_the_right_key(tmp_path):
    """A forged message first, then the trainer's: the key is right, the receiver keeps
    serving until the trainer's shutdown."""
    committed, alive, raised, logged = _tiny_refit(tmp_path, KEY, KEY, exit_s=1.0)
    assert committed and not alive and raised == []
    assert any("ignored a 'verify' control message" in m for m in logged)
