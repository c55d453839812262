"""NeMo-DCR: bit-exact Delta-Compressed Refit for disaggregated RL."""

__version__ = "0.1.0"
