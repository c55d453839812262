"""Transports (imported as nemo_dcr.transports.<name>): local, and more behind one contract."""
