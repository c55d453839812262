"""A Megatron trainer job refitting a Megatron-inference job, both under torchrun over
the local transport (tests/workers/megatron_trainer_refit.py, tests/workers/megatron_receiver.py),
and the checks of the dense exports both jobs write after loading and after every step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from tests.support.launch import REPO, free_port, torchrun, worker_env

TRAINER = REPO / "tests" / "workers" / "megatron_trainer_refit.py"
INFERENCE = REPO / "tests" / "workers" / "megatron_receiver.py"


def trainer_refits_inference(work: Path, checkpoint: Path, *, trainer_ranks: int, trainer_args: list[str],
                             inference_tp: int, inference_pp: int, inference_args: list[str] = ()
                             ) -> tuple[str, str, list[str]]:
    """Run the inference job (one receiver per rank) and the trainer job against it; both
    write their exports to `work / "out"`. (trainer log, inference log, receiver ids)."""
    out = work / "out"
    out.mkdir()
    receivers = [f"mx{r}" for r in range(inference_tp * inference_pp)]
    transport_config = json.dumps({"dir": str(work / "shm"), "timeout_s": 120})
    inference = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(len(receivers)),
         "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(INFERENCE),
         "--checkpoint", str(checkpoint), "--tp", str(inference_tp), "--pp", str(inference_pp),
         "--transport-config", transport_config, "--out", str(out), *inference_args],
        cwd=REPO, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    inf_out: list[str] = []
    reader = threading.Thread(target=lambda: inf_out.extend(inference.stdout), daemon=True)
    reader.start()
    try:
        trainer_out = torchrun(trainer_ranks, TRAINER, "--checkpoint", str(checkpoint), *trainer_args,
                               "--receivers", ",".join(receivers), "--transport-config", transport_config,
                               "--state-dir", str(work / "state"), "--out", str(out),
                               ok_marker="[megatron_trainer] OK")
        inference.wait(timeout=90)
        reader.join(10)
        rx_log = "".join(inf_out)
        assert inference.returncode == 0 and "[megatron_receiver] OK" in rx_log, rx_log[-5000:]
    finally:
        if inference.poll() is None:
            os.killpg(inference.pid, signal.SIGKILL)
            inference.wait()
    return trainer_out, rx_log, receivers


def check_exports(work: Path, checkpoint: Path, receivers: list[str], steps: int) -> None:
    """The trainer's export after loading is the checkpoint; after every step the inference
    job's export equals the trainer's, digest for digest, and so does every slice an
    inference rank holds, the ranks together holding every element; each step changed bits."""
    from safetensors.torch import load_file

    from nemo_dcr.checkpoint import CheckpointReader, read_specs
    from nemo_dcr.runtimes.megatron.receiver import compare_slice_digests, held_coverage
    from nemo_dcr.verify import state_digests

    out, specs = work / "out", read_specs(checkpoint)
    for version in range(steps + 1):
        trainer = json.loads((out / f"trainer-v{version}.json").read_text())
        if version == 0:
            assert trainer == state_digests(CheckpointReader(checkpoint).state_dict())
        inferred = json.loads((out / f"inference-v{version}.json").read_text())
        assert inferred == trainer, f"v{version}: {sorted(n for n in trainer if inferred.get(n) != trainer[n])}"
        dense = load_file(out / f"trainer-v{version}.safetensors")
        keys = []
        for rx in receivers:
            slices = json.loads((out / f"slices-{rx}-v{version}.json").read_text())
            assert compare_slice_digests(dense, slices) == [], (version, rx)
            keys += list(slices)
        assert held_coverage(specs, keys) == {}
        if version:
            assert json.loads((out / f"trainer-v{version - 1}.json").read_text()) != trainer
    assert not (work / "shm" / "data").exists() or not any((work / "shm" / "data").iterdir())
