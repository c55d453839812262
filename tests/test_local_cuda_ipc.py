"""The local transport's CUDA IPC path: a device payload reaches a receiver process as
a device tensor mapped from the producer's memory (no host copy in the transport).
Runs on machines with a CUDA GPU; skipped elsewhere."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest
import torch

from nemo_dcr import registry
from nemo_dcr.errors import TransportError
from nemo_dcr.records import TransferInfo
from tests.support.launch import REPO, worker_env

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

RECEIVER = """
import hashlib, json, sys
from nemo_dcr import registry
end = registry.transport("local", json.loads(sys.argv[1])).receiver("rx0")
while True:
    ev = end.poll(30)
    if ev is None or ev.kind != "payload":
        continue
    t = ev.data
    assert t.is_cuda and str(t.dtype) == "torch.uint8", (t.device, t.dtype)
    print("DIGEST", hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest(), t.device, flush=True)
    end.staged(ev.meta["transfer_id"], ev.meta["producer_id"], ev.meta["payload_id"], None)
    break
end.close()
"""


def test_device_payload_travels_by_cuda_ipc(tmp_path):
    config = {"dir": str(tmp_path / "shm"), "timeout_s": 30}
    t = registry.transport("local", config, receivers=["rx0"])
    env = worker_env()
    env.pop("CUDA_VISIBLE_DEVICES")  # the receiver must see the GPU
    proc = subprocess.Popen([sys.executable, "-c", RECEIVER, json.dumps(config)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    prod = t.producer("p0")
    try:
        payload = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, device="cuda")
        info = TransferInfo("t-cuda", 0, 1, ("p0",))
        prod.send(info, "p0-0", payload)
        try:
            assert prod.flush(info, ["p0-0"]) == {}
        except TransportError as e:
            proc.kill()
            raise AssertionError(f"{e}; the receiver printed:\n{proc.communicate()[0]}") from e
        out, _ = proc.communicate(timeout=60)
        want = hashlib.sha256(payload.cpu().numpy().tobytes()).hexdigest()
        assert f"DIGEST {want} cuda" in out, out
        assert prod.in_flight_bytes == 0 and not prod.in_flight
        assert not any((tmp_path / "shm" / "data").rglob("*.ndcr"))  # nothing went through host shared memory
    finally:
        prod.close()
        if proc.poll() is None:
            proc.kill()
        t.cleanup()
