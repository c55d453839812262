"""What `nemo-dcr demo` runs, shipped with the package so the demo needs no source checkout.

- `trainer`: the trainer side of the demo, a complete refit loop (run under torchrun as
  `python -m torch.distributed.run --nproc-per-node N -m nemo_dcr.demo.trainer ...`).
- `harness`: Megatron-core training helpers the trainer uses (process groups, a GPT built
  from a Hugging Face config, random batches, one optimizer step).
- `megatron_cpu`: what lets megatron-core run on a CPU-only torch build (gloo).

The library proper (everything outside this package) never imports it.
"""
