"""The transport contract: three ends (producer, receiver, coordinator) behind one
interface, found by name through the `nemo_dcr.transports` entry-point group.

Data plane: producers `send` encoded payloads (opaque bytes) to every receiver and
`flush` a manifest; receivers see each payload at least once and answer `staged`.
Control plane: the coordinator `broadcast`s begin / commit / abort / verify and
`collect`s the receivers' replies. Control messages are small JSON objects.

Every wait is bounded by a timeout and fails with a `TransportError` that names the
peers that did not answer.
"""

from __future__ import annotations

import json
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from nemo_dcr.errors import TransportError
from nemo_dcr.records import TransferInfo

log = logging.getLogger(__name__)


@dataclass
class Event:
    """What a receiver end delivers.

    kind: "begin" | "payload" | "manifest" | "commit" | "abort" | "verify" | "shutdown" | "catalog".
    For "payload", `data` holds the encoded bytes (a buffer valid until `release()`).
    """

    kind: str
    meta: dict
    data: Any = None
    _release: Any = field(default=None, repr=False)

    def release(self) -> None:
        if self._release is not None:
            self._release()
            self._release = None


class ProducerEnd(ABC):
    # Whether `send` takes a payload as a device tensor too (the local transport: CUDA IPC);
    # the others take bytes only.
    carries_device_tensors = False

    @abstractmethod
    def send(self, transfer: TransferInfo, payload_id: str, data: bytes) -> None:
        """Deliver one payload to every receiver; blocks while in-flight bytes are at the bound."""

    @abstractmethod
    def flush(self, transfer: TransferInfo, payload_ids: list[str]) -> dict:
        """Send this producer's manifest; wait until every receiver staged every payload.

        Returns {receiver_id: {payload_id: reason}} for payloads a receiver rejected
        (empty when all were staged); raises TransportError on timeout.
        """

    @abstractmethod
    def close(self) -> None: ...


class ReceiverEnd(ABC):
    @abstractmethod
    def poll(self, timeout_s: float) -> Event | None:
        """Next event, or None after `timeout_s`."""

    @abstractmethod
    def staged(self, transfer_id: str, producer_id: str, payload_id: str, error: str | None) -> None:
        """Tell the payload's producer it was staged (error=None) or rejected (why)."""

    @abstractmethod
    def reply(self, kind: str, meta: dict) -> None:
        """Answer the coordinator (ready / applied / verified)."""

    @abstractmethod
    def close(self) -> None: ...


class CoordinatorEnd(ABC):
    @abstractmethod
    def broadcast(self, kind: str, meta: dict) -> None:
        """Send a control message to every receiver."""

    @abstractmethod
    def collect(self, kind: str, transfer_id: str, timeout_s: float) -> dict[str, dict]:
        """Replies of `kind` for `transfer_id` from every receiver.

        Raises TransportError naming the receivers that did not answer in time.
        """

    @staticmethod
    def passed_over(msg: dict, kind: str, transfer_id: str) -> None:
        """Log a reply `collect` read and left out: it answers another request (a late
        answer to an earlier one, or a replayed one)."""
        log.info("coordinator: ignored a %r reply of %r for transfer %r while collecting %r for %r: it answers "
                 "another request (late, or replayed)", msg.get("kind"), msg.get("receiver"), msg.get("transfer_id"),
                 kind, transfer_id)

    @abstractmethod
    def close(self) -> None: ...


class Transport(ABC):
    """A deployment's wiring, built from the same configuration in every process."""

    name = "abstract"

    def __init__(self, config: dict | None = None, *, receivers: list[str] | None = None):
        self.config = dict(config or {})
        self.receivers = list(receivers or [])

    @abstractmethod
    def producer(self, producer_id: str) -> ProducerEnd: ...

    @abstractmethod
    def receiver(self, receiver_id: str) -> ReceiverEnd: ...

    @abstractmethod
    def coordinator(self) -> CoordinatorEnd: ...

    def commit_log(self, state_dir: str):
        """Where the coordinator keeps commit records, when the transport keeps them
        itself (a `nemo_dcr.commit_log.CommitLog`, e.g. conditional writes in object storage);
        None (the default): files in `state_dir` (`nemo_dcr.commit_log.commit_log_for`)."""
        return None

    def history(self):
        """The transport's own store of committed deltas and anchors (a
        `nemo_dcr.history.History`), used when a history is configured by the transport's
        name; None (the default): it keeps none, give a directory."""
        return None

    def cleanup(self) -> None:
        """Remove whatever the transport left behind (segments, sockets, objects)."""


def dumps(msg: dict) -> bytes:
    return json.dumps(msg, separators=(",", ":"), sort_keys=True).encode()


def loads(raw: bytes) -> dict:
    try:
        msg = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TransportError(f"malformed control message: {e}") from None
    if not isinstance(msg, dict) or "kind" not in msg:
        raise TransportError("malformed control message: not an object with a 'kind'")
    return msg
