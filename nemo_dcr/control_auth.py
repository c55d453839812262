"""HMAC-SHA256 on control messages (begin / commit / abort / verify / shutdown / catalog and the
receivers' ready / applied / verified replies), with the same shared key as payloads, and the
session counters that make a captured message unable to act twice.

Payloads carry their own HMAC (`nemo_dcr.wire.codec`). Control messages travel as small JSON
objects through whatever transport is configured, and transports add fields of their own
(`kind`, `receiver`), so a MAC covers exactly the fields its signer put in, listed in
`signed`, plus the message kind. The verifier recomputes it over those fields and also
requires the fields that give the message its meaning (`REQUIRED`), so a valid MAC cannot
be moved onto a message that says something else.

Replays. A coordinator's life is a session: a random id, the time it started, and a
counter that numbers every message it sends (`SESSION`, signed in each). A receiver keeps
the session it last heard and that session's highest counter (`ReplayGuard`), and lets a
message act only when it is the next thing that session said (a higher counter), or when it
opens a newer session (one that started later) and was issued within `MAX_AGE_S` of the
receiver's clock. So a captured message cannot act again in its own session, nor in a later
one, nor long after in a receiver that restarted and forgot. Replies echo the session and
counter of the request they answer (`ANSWER`), and the coordinator takes only answers to the
request it is waiting on.
"""

from __future__ import annotations

import hashlib
import hmac
import json

# Where a coordinator message stands: its session (id, start time), counter and time of issue.
SESSION = {"session", "session_start", "seq", "issued_at"}
# Which request a receiver's reply answers: that request's session and counter.
ANSWER = {"session", "seq"}

# Fields a message of each kind must have under its MAC.
REQUIRED = {
    "begin": {"transfer_id", "transfer"} | SESSION,
    "commit": {"transfer_id", "version"} | SESSION,
    "abort": {"transfer_id", "reason"} | SESSION,
    "verify": {"transfer_id"} | SESSION,
    "shutdown": SESSION,
    "catalog": {"catalog", "version"} | SESSION,
    "ready": {"transfer_id", "receiver", "error"} | ANSWER,
    "applied": {"transfer_id", "receiver", "error"} | ANSWER,
    "verified": {"transfer_id", "receiver", "version", "digests"} | ANSWER,
    # history manifests (nemo_dcr.history): which payloads make up a delta or an anchor; stored, not
    # sent, so no session: each names its version and is read for that version only
    "deltas": {"version", "payloads"},
    "anchors": {"version", "payloads"},
}


# How far from a receiver's clock a message may have been issued when it opens a session the
# receiver has not heard (clocks of different hosts included).
MAX_AGE_S = 300.0


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class ReplayGuard:
    """What a receiver remembers of the coordinators that spoke to it: the current session
    (its id and start) and the highest counter heard in it. Older sessions need no list:
    they started earlier, and that alone refuses them."""

    def __init__(self, max_age_s: float = MAX_AGE_S):
        self.max_age_s = max_age_s
        self.session: str | None = None
        self.start = 0.0
        self.seq = 0

    def problem(self, kind: str, meta: dict, now: float) -> str | None:
        """Why an authenticated coordinator message must not act (None when it may; it is
        then remembered). `now`: this receiver's clock (time.time())."""
        session, start, seq, issued = (meta.get(k) for k in ("session", "session_start", "seq", "issued_at"))
        if not (isinstance(session, str) and _number(start) and _number(issued) and isinstance(seq, int)
                and not isinstance(seq, bool)):
            return f"a '{kind}' without its session, counter or time of issue"
        if session == self.session:
            if seq <= self.seq:
                return (f"a replayed '{kind}': message {seq} of session {session}, which has reached {self.seq} "
                        f"here")
        elif self.session is not None and start <= self.start:
            return (f"a '{kind}' of session {session}, which started before the current session {self.session}: "
                    f"replayed from an earlier coordinator (or its host's clock is behind)")
        elif abs(now - issued) > self.max_age_s:
            return (f"a '{kind}' opening session {session}, issued {abs(now - issued):.0f} s "
                    f"{'ago' if now >= issued else 'ahead'} (more than {self.max_age_s:.0f} s: replayed, "
                    f"or the clocks are that far apart)")
        else:
            self.session, self.start = session, start
        self.seq = seq
        return None


def answering(request: dict) -> dict:
    """The fields a reply echoes to name the request it answers."""
    return {k: request[k] for k in sorted(ANSWER) if k in request}


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
