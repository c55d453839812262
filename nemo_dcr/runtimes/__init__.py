"""Runtime adapters: how each framework (HF, vLLM, Megatron) is built, read and written."""
