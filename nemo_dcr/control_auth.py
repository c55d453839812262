"""HMAC-SHA256 on control messages (begin / commit / abort / verify / shutdown / catalog and the
receivers' ready / applied / verified replies), with the same shared key as payloads.

Payloads carry their own HMAC (`nemo_dcr.wire.codec`). Control messages travel as small JSON
objects through whatever transport is configured, and transports add fields of their own
(`kind`, `receiver`), so a MAC covers exactly the fields its signer put in, listed in
`signed`, plus the message kind. The verifier recomputes it over those fields and also
requires the fields that give the message its meaning (`REQUIRED`), so a valid MAC cannot
be moved onto a message that says something else. A replayed message is harmless by
construction: every one names its transfer (random id) or version, and receivers and the
coordinator ignore messages for a transfer or version that is not the current one.
A shutdown names no transfer, so it carries its time of issue and a nonce: a receiver
takes it only within `SHUTDOWN_MAX_AGE_S` of that time and only once (`shutdown_problem`).
"""

from __future__ import annotations

import hashlib
import hmac
import json

# Fields a message of each kind must have under its MAC.
REQUIRED = {
    "begin": {"transfer_id", "transfer"},
    "commit": {"transfer_id", "version"},
    "abort": {"transfer_id", "reason"},
    "verify": {"transfer_id"},
    "shutdown": {"nonce", "issued_at"},
    "catalog": {"catalog", "version"},
    "ready": {"transfer_id", "receiver", "error"},
    "applied": {"transfer_id", "receiver", "error"},
    "verified": {"transfer_id", "receiver", "version", "digests"},
    # history manifests (nemo_dcr.history): which payloads make up a delta or an anchor
    "deltas": {"version", "payloads"},
    "anchors": {"version", "payloads"},
}


# How old a signed shutdown may be when it arrives (clocks of different hosts included).
SHUTDOWN_MAX_AGE_S = 300.0


def shutdown_problem(meta: dict, seen: set[str], now: float) -> str | None:
    """Why an authenticated shutdown must be ignored (None when it may be taken): it is
    stale, from the future, or its nonce was taken before (`seen`, updated here)."""
    issued, nonce = meta.get("issued_at"), meta.get("nonce")
    if isinstance(issued, bool) or not isinstance(issued, (int, float)) or not isinstance(nonce, str):
        return "a shutdown without its time of issue or nonce"
    if abs(now - issued) > SHUTDOWN_MAX_AGE_S:
        return (f"a shutdown issued {now - issued:.0f} s from now (more than {SHUTDOWN_MAX_AGE_S:.0f} s: replayed, "
                f"or the clocks are that far apart)")
    if nonce in seen:
        return "a replayed shutdown (its nonce was taken already)"
    seen.add(nonce)
    return None


def _mac(key: bytes, kind: str, fields: dict) -> str:
    body = json.dumps({"kind": kind, **fields}, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(key, body, hashlib.sha256).hexdigest()


def sign(key: bytes | None, kind: str, meta: dict) -> dict:
    """`meta` with `signed` (its field names) and `mac`; unchanged without a key."""
    if key is None:
        return meta
    fields = {k: v for k, v in meta.items() if k not in ("mac", "signed", "kind")}
    return {**fields, "signed": sorted(fields), "mac": _mac(key, kind, fields)}


def check(key: bytes | None, kind: str, meta: dict) -> str | None:
    """Why `meta` must not be trusted (None when it may): unsigned, forged, or incomplete."""
    if key is None:
        return None
    mac, signed = meta.get("mac"), meta.get("signed")
    if not isinstance(mac, str) or not isinstance(signed, list) or not all(isinstance(s, str) for s in signed):
        return f"unsigned '{kind}' message (a key is configured: every control message must carry a MAC)"
    missing = REQUIRED.get(kind, set()) - set(signed)
    if missing:
        return f"'{kind}' message signs too little (unsigned: {sorted(missing)})"
    if any(s not in meta for s in signed):
        return f"'{kind}' message lost a signed field"
    if not hmac.compare_digest(mac, _mac(key, kind, {s: meta[s] for s in signed})):
        return f"'{kind}' message has a wrong MAC (forged, altered, or signed with another key)"
    return None
