"""A plain PyTorch trainer in one process builds `TrainerRefit` without creating a
process group itself; ranks started by a launcher are told to create theirs.
`refit.verify()` proves the receiver's whole state and catches bits changed outside
refits."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.support.launch import REPO

SCRIPT = textwrap.dedent("""
    import os, sys, tempfile, threading
    import torch, torch.distributed as dist
    from nemo_dcr import registry
    from nemo_dcr.capture import torch_owned_ranges
    from nemo_dcr.layout import ParallelLayout
    from nemo_dcr.receiver import Receiver
    from nemo_dcr.runtimes.store import TensorStoreRuntime
    from nemo_dcr.trainer import TrainerRefit

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32).bfloat16()
    tmp = tempfile.mkdtemp()
    transport = registry.transport("local", {"dir": tmp + "/shm"}, receivers=["rx0"])
    served = {n: p.detach().clone() for n, p in model.named_parameters()}
    rx = Receiver("rx0", TensorStoreRuntime(served), transport.receiver("rx0"))
    thread = threading.Thread(target=rx.serve_forever, daemon=True)
    thread.start()
    specs = {n: ("BF16", tuple(p.shape)) for n, p in model.named_parameters()}
    refit = TrainerRefit(registry.converter("identity", None), specs, torch_owned_ranges(model),
                         ParallelLayout(), transport, state_dir=tmp + "/state")
    assert dist.is_initialized() and dist.get_world_size() == 1
    with torch.no_grad():
        model.weight[0, :8] += 1.0
    result = refit.refit()
    assert result.decision.committed
    assert all(torch.equal(served[n].view(torch.int16), p.detach().view(torch.int16))
               for n, p in model.named_parameters())
    assert refit.verify() == {"rx0": []}  # the whole state, against the producers' digest
    served["bias"][3] += 1.0  # bits changed outside refits: verify reads the state anew
    problems = refit.verify()["rx0"]
    assert len(problems) == 1 and "state digest" in problems[0], problems
    refit.close(shutdown_receivers=True)
    thread.join(timeout=30)
    transport.cleanup()
    print("OK")
""")


def test_one_process_needs_no_process_group(tmp_path):
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-3000:]


def test_a_launched_rank_without_a_group_is_told_what_to_do():
    code = ("from nemo_dcr.trainer import ensure_process_group\n"
            "try:\n    ensure_process_group()\nexcept RuntimeError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "WORLD_SIZE": "2"})
    assert "call torch.distributed.init_process_group" in out.stdout, out.stderr[-2000:]
