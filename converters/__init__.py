"""Model-family converters, one file per family (imported as nemo_dcr.converters.<family>)."""
