"""Refits with baseline-conditioned coding end to end: a plain PyTorch trainer (FP32 master
weights, AdamW, BF16 served copies) refits a receiver that reads its committed bits in
place and one that keeps a canonical mirror, bit for bit and in fewer bytes than the same
refits coded plainly; a receiver holding neither refuses the conditioned payloads, and the
in-place retry (overwrites) still brings it to the producers' bits."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.support.launch import REPO

SCRIPT = textwrap.dedent("""
    import copy, sys, tempfile, threading
    import torch
    from nemo_dcr import registry
    from nemo_dcr.capture import torch_owned_ranges
    from nemo_dcr.layout import ParallelLayout
    from nemo_dcr.mirror import CanonicalMirror
    from nemo_dcr.receiver import Receiver
    from nemo_dcr.runtimes.store import TensorStoreRuntime
    from nemo_dcr.trainer import TrainerRefit

    class NotCanonical(TensorStoreRuntime):
        canonical_layout = False  # as vLLM: its bits cannot be read in canonical layout

    conditioned = sys.argv[1] == "1"
    without = sys.argv[2] == "1"  # add a receiver with neither its bits nor a mirror
    torch.manual_seed(0)
    master = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 256))
    with torch.no_grad():
        for p in master.parameters():
            p.copy_(torch.randn_like(p) * 0.02)
    served_net = copy.deepcopy(master).bfloat16()  # the trainer's BF16 weights the refit reads
    served_model = {n: p.detach() for n, p in served_net.named_parameters()}
    opt = torch.optim.AdamW(master.parameters(), lr=1e-5)
    tmp = tempfile.mkdtemp()
    names = ["inplace", "mirror"] + (["bare"] if without else [])
    transport = registry.transport("local", {"dir": tmp + "/shm"}, receivers=names)
    stores = {r: {n: t.clone() for n, t in served_model.items()} for r in names}
    logs = []
    rxs = [Receiver("inplace", TensorStoreRuntime(stores["inplace"]), transport.receiver("inplace")),
           Receiver("mirror", NotCanonical(stores["mirror"]), transport.receiver("mirror"),
                    mirror=CanonicalMirror(stores["mirror"]))]
    if without:
        rxs.append(Receiver("bare", NotCanonical(stores["bare"]), transport.receiver("bare"), log=logs.append))
    threads = [threading.Thread(target=rx.serve_forever, daemon=True) for rx in rxs]
    for t in threads:
        t.start()
    specs = {n: ("BF16", tuple(t.shape)) for n, t in served_model.items()}
    refit = TrainerRefit(registry.converter("identity", None), specs, torch_owned_ranges(served_net),
                         ParallelLayout(), transport, state_dir=tmp + "/state", conditioned=conditioned)
    wire = 0
    for step in range(3):
        x = torch.randn(64, 512)
        loss = master(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            for n, p in master.named_parameters():
                served_model[n].copy_(p.bfloat16())
        result = refit.refit()
        assert result.decision.committed, result.decision
        wire += result.wire_bytes
        for r in names:
            assert all(torch.equal(stores[r][n].view(torch.int16), served_model[n].view(torch.int16))
                       for n in served_model), (step, r)
    assert refit.verify() == {r: [] for r in names}
    refit.close(shutdown_receivers=True)
    for t in threads:
        t.join(timeout=30)
    transport.cleanup()
    print("LOG", " | ".join(logs))
    print("WIRE", wire, result.attempts)
""")


def run(conditioned: bool, without: bool = False) -> tuple[int, int, str]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(int(conditioned)), str(int(without))], cwd=REPO,
                         capture_output=True, text=True, timeout=300,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if line.startswith(("LOG", "WIRE")))
    wire, attempts = (int(v) for v in lines["WIRE"].split())
    return wire, attempts, lines["LOG"]


def test_conditioned_refits_are_exact_and_smaller():
    plain, _, _ = run(False)
    coded, attempts, _ = run(True)
    assert attempts == 1
    assert coded < 0.85 * plain, (coded, plain)


def test_a_receiver_without_its_bits_refuses_and_the_retry_repairs_it():
    _, attempts, log = run(True, without=True)
    assert attempts == 2  # the first attempt's conditioned payloads refused, the retry's overwrites taken
    assert "does not hold" in log and "committed bits of" in log, log
