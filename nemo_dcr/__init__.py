"""NeMo-DCR: bit-exact Delta-Compressed Refit for disaggregated RL."""

import os as _os

__version__ = "0.1.0"

# In a source checkout, converters/ and transports/ sit beside this package at the
# repository root (an install maps them to nemo_dcr.converters / nemo_dcr.transports).
# Let the checkout resolve them the same way, whichever copy of nemo_dcr is imported.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(__path__[0], "converters")) and _os.path.isfile(
    _os.path.join(_root, "converters", "__init__.py")
):
    __path__.append(_root)
