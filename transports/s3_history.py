"""Committed deltas and anchors in the bucket of an s3 transport (`S3Transport.history()`),
where trainer and receivers in different places see the same history."""

from __future__ import annotations

from nemo_dcr.history import History, HistoryMissing
from nemo_dcr.transports.s3_store import Missing, ObjectStore


class S3History(History):
    """History in the bucket of an s3 transport, under `{prefix}/history/`."""

    def __init__(self, transport):
        self.store = ObjectStore(transport.s3)
        self.base = transport.key("history")

    def put(self, name: str, data: bytes) -> None:
        self.store.put(f"{self.base}/{name}", data)

    def get(self, name: str) -> bytes:
        try:
            return self.store.get(f"{self.base}/{name}")
        except Missing:
            raise HistoryMissing(f"history: {name} is missing (in {self.store.at.where}, {self.base}/)") from None

    def names(self, folder: str) -> list[str]:
        prefix = f"{self.base}/{folder}/"
        return sorted({k[len(prefix):].split("/", 1)[0] for k, _ in self.store.list(prefix)})

    def remove(self, folder: str) -> None:
        self.store.delete_prefix(f"{self.base}/{folder}/")

    def close(self) -> None:
        self.store.close()
