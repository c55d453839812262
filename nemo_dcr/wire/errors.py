"""How a payload's bytes are found bad while they are decoded; `codec.decode` turns either
into `PayloadRejected(payload_id, reason)` (nemo_dcr.errors)."""


class PositionsError(ValueError):
    """Malformed or out-of-range data in a section: positions, values, a stream."""


class Malformed(Exception):
    """A failed check of a payload's framing, header or sections; the message is the reason."""
