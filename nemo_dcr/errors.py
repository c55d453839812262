"""Errors the library raises. Each names what was wrong."""


class DCRError(Exception):
    """Base class for NeMo-DCR errors."""


class PayloadRejected(DCRError):
    """A payload failed validation; nothing from it was written."""

    def __init__(self, payload_id: str | None, reason: str):
        self.payload_id = payload_id
        self.reason = reason
        super().__init__(f"payload {payload_id or '<unknown>'} rejected: {reason}")


class ConverterError(DCRError):
    """A converter table does not describe the model exactly (caught at start-up)."""


class ApplyError(DCRError):
    """A record could not be applied through the runtime's loader (fails closed).

    An adapter's failed `apply` has put every bit back (the `RuntimeAdapter` contract),
    unless `bits_unknown`: then what it wrote may stay, and only overwrites can repair it."""

    def __init__(self, message: str, *, bits_unknown: bool = False):
        super().__init__(message)
        self.bits_unknown = bits_unknown


class TransferFailed(DCRError):
    """A transfer did not commit; baselines and serving versions stay at the base."""


class TransportError(DCRError):
    """A transport could not deliver within its configured limits."""


class Unsupported(DCRError, ValueError):
    """A model or parallel configuration this version cannot place or capture."""


class NotInstalled(DCRError, ImportError):
    """NeMo-DCR's own metadata (its entry points) is missing: the package is not installed."""


class KeyMismatch(DCRError):
    """A receiver's HMAC key is not its producers': none of their control messages
    authenticated, a shutdown included, so it stopped by itself."""
