"""A fault-injecting HTTP/1.1 reverse proxy in front of a real S3 server (tests only).

`FaultProxy(upstream_url)` listens on 127.0.0.1:<free port> and forwards every request to
the upstream server as it came: method, request target (path and query), headers in their
order and case (Host and the SigV4 `Authorization` included: SigV4 signs Host, so it is
forwarded unchanged) and the body, streamed, with chunked framing (aws-chunked uploads)
passed through byte for byte. Only what is the proxy's own business is not forwarded:
`Expect: 100-continue` (the proxy answers it to the client itself) and the hop-by-hop
`Connection` / `Keep-Alive` headers (none of them is signed). Responses come back with
their status, headers and body; a chunked upstream response is re-chunked.

Faults are `Fault` rules, set and changed at runtime from any thread (`set_faults`,
`add_fault`, `clear_faults`). For each request the first matching rule whose coin (a
`random.Random(seed)` under a lock: the same request order gives the same faults) comes
up injects one of:

- "500" / "503": an S3 XML error (InternalError / SlowDown), as S3 sends them;
- "timeout": no answer for `delay_s` (longer than the client's read timeout), then the
  connection is closed;
- "reset": the answer is cut off halfway (status and headers, half the body) and the
  connection reset (RST).

With `after=True` the request reaches the server first and only its answer is lost: the
client cannot tell whether it took effect (what a retry must cope with). Rules filter by
operation (`ops`: GET, PUT, POST, HEAD, DELETE, and LIST for a GET of the bucket; a batch
delete, POST ?delete, counts as DELETE), by a regular expression searched in the object
key (LIST: its prefix; batch delete: any key in the request; keys are read from path-style
URLs) and by one searched in the raw query string (e.g. "uploadId" for a multipart upload's
parts and completion). `injected` counts what was injected, per kind; `requests` what was seen, per operation.

Use it as a context manager: on exit it stops accepting, wakes every delayed handler,
shuts the open connections down and joins every thread it started.
"""

from __future__ import annotations

import http.client
import random
import re
import socket
import struct
import threading
import uuid
from collections import Counter
from dataclasses import dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit
from xml.sax.saxutils import escape, unescape

KINDS = ("500", "503", "timeout", "reset")
OPS = ("GET", "PUT", "POST", "HEAD", "DELETE", "LIST")
_ERRORS = {"500": ("Internal Server Error", "InternalError", "We encountered an internal error. Please try again."),
           "503": ("Slow Down", "SlowDown", "Please reduce your request rate.")}
_NOT_FORWARDED = {"expect", "connection", "keep-alive", "proxy-connection"}
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection"}
_CHUNK = 1 << 16


@dataclass
class Fault:
    """One rule: inject `kind` into `rate` of the matching requests (at most `limit` times)."""

    kind: str
    rate: float = 1.0
    ops: tuple[str, ...] = ()  # empty: every operation
    key: str | None = None  # regular expression searched in the object key; None: any
    query: str | None = None  # regular expression searched in the raw query string; None: any
    after: bool = False  # forward first: the server acts, its answer is lost
    delay_s: float = 2.0  # "timeout": how long the client gets no answer
    limit: int | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"fault kind {self.kind!r} is not one of {KINDS}")
        bad = set(self.ops) - set(OPS)
        if bad:
            raise ValueError(f"fault ops {sorted(bad)} are not among {OPS}")
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"fault rate must be in [0, 1], got {self.rate}")
        self._key = re.compile(self.key) if self.key is not None else None
        self._query = re.compile(self.query) if self.query is not None else None
        self._count = 0

    def matches(self, op: str, keys: list[str], query: str) -> bool:
        return (not self.ops or op in self.ops) and (self._key is None or any(self._key.search(k) for k in keys)) \
            and (self._query is None or bool(self._query.search(query))) \
            and (self.limit is None or self._count < self.limit)


class FaultProxy:
    """The proxy (see the module docstring). `url` is its endpoint once started."""

    def __init__(self, upstream_url: str, *, seed: int = 0, upstream_timeout_s: float = 60.0):
        up = urlsplit(upstream_url)
        if up.scheme != "http" or not up.hostname:
            raise ValueError(f"upstream must be an http://host:port URL, got {upstream_url!r}")
        self.upstream = (up.hostname, up.port or 80)
        self.upstream_timeout_s = upstream_timeout_s
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._faults: list[Fault] = []
        self.injected: Counter = Counter()  # kind -> injections
        self.requests: Counter = Counter()  # op -> requests seen
        self._stopping = threading.Event()
        self._sockets: set[socket.socket] = set()  # open client and upstream connections
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    # --- configuration (any thread) -------------------------------------------------

    def set_faults(self, *faults: Fault, seed: int | None = None) -> None:
        """Replace the rules (and with `seed`, restart the coin sequence). The proxy keeps
        copies: limits count from here, and the same rules can be set again."""
        with self._lock:
            self._faults = [replace(f) for f in faults]
            if seed is not None:
                self._rng.seed(seed)

    def add_fault(self, fault: Fault) -> None:
        with self._lock:
            self._faults.append(replace(fault))

    def clear_faults(self) -> None:
        self.set_faults()

    def counts(self) -> dict:
        """What was seen and injected so far (a snapshot for reports)."""
        with self._lock:
            return {"requests": dict(self.requests), "injected": dict(self.injected)}

    def _decide(self, op: str, keys: list[str], query: str) -> Fault | None:
        with self._lock:
            self.requests[op] += 1
            for f in self._faults:
                if f.matches(op, keys, query) and self._rng.random() < f.rate:
                    f._count += 1
                    self.injected[f.kind] += 1
                    return f
        return None

    # --- life cycle -----------------------------------------------------------------

    def start(self) -> FaultProxy:
        if self._server is not None:
            raise RuntimeError("the proxy is already running")
        self._stopping.clear()
        server = _Server(("127.0.0.1", 0), _Handler)
        server.proxy = self  # type: ignore[attr-defined]
        self._server = server
        self.url = f"http://127.0.0.1:{server.server_address[1]}"
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="s3-fault-proxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop accepting, end every connection and join every thread; idempotent."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()  # the accept loop returns
        self._thread.join()
        self._stopping.set()  # delayed handlers wake up
        with self._lock:
            open_sockets = list(self._sockets)
        for s in open_sockets:  # idle keep-alive handlers and upstream reads see EOF
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        server.server_close()  # closes the listener and joins the handler threads

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _track(self, s: socket.socket, on: bool) -> None:
        with self._lock:
            (self._sockets.add if on else self._sockets.discard)(s)
        if on and self._stopping.is_set():  # opened after stop() took its list: end it here
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _classify(method: str, target: str, body_keys: list[str] | None = None) -> tuple[str, list[str]]:
    """(operation, keys) of a path-style S3 request."""
    parts = urlsplit(target)
    _, _, key = unquote(parts.path).lstrip("/").partition("/")
    query = parse_qs(parts.query, keep_blank_values=True)
    if method == "GET" and not key and "uploads" not in query:
        return "LIST", [query.get("prefix", [""])[0]]
    if method == "POST" and "delete" in query:
        return "DELETE", body_keys or []
    return method, [key]


def _keys_in(xml: bytes) -> list[str]:
    return [unescape(k) for k in re.findall(r"<Key>(.*?)</Key>", xml.decode("utf-8", "replace"))]


class _Server(ThreadingHTTPServer):
    daemon_threads = False  # ThreadingMixIn joins only non-daemon handler threads on server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as botocore's pooled connections expect
    timeout = 120  # an idle or stuck client connection does not hold a thread forever

    def setup(self):
        super().setup()
        self.proxy: FaultProxy = self.server.proxy
        self.proxy._track(self.connection, True)

    def finish(self):
        try:
            super().finish()
        finally:
            self.proxy._track(self.connection, False)

    def handle(self):
        try:
            super().handle()
        except OSError:  # the client went away (it timed out, or was reset): nothing to answer
            self.close_connection = True

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass  # quiet: tests read `injected` / `requests` instead

    def do_GET(self):
        self._proxy()

    do_PUT = do_POST = do_HEAD = do_DELETE = do_GET

    # --- one request ----------------------------------------------------------------

    def _proxy(self) -> None:
        method, target = self.command, self.path
        chunked = "chunked" in self.headers.get("Transfer-Encoding", "").lower()
        length = int(self.headers.get("Content-Length") or 0)
        op, keys = _classify(method, target)
        body = None
        if op == "DELETE" and method == "POST":
            body = self._read_body(chunked, length)  # a small XML list: its keys decide the match
            op, keys = _classify(method, target, _keys_in(body))
        fault = self.proxy._decide(op, keys, urlsplit(target).query)
        if fault is not None and not fault.after:
            if body is None:
                self._read_body(chunked, length)  # drain: the connection stays in step
            return self._inject(fault, method, None)
        try:
            response = self._forward(method, target, chunked, length, body)
        except (OSError, http.client.HTTPException) as e:  # the upstream failed: a gateway error, as proxies say
            self.close_connection = True
            return self._send_error_xml(method, "502", ("Bad Gateway", "BadGateway", f"upstream: {e!r}"))
        try:
            if fault is not None:
                return self._inject(fault, method, response)
            self._relay(method, response)
        finally:
            response.close()

    def _read_body(self, chunked: bool, length: int, sink=None) -> bytes:
        """The request body, raw (chunked framing kept), streamed into `sink` or returned."""
        out = [] if sink is None else None
        emit = out.append if sink is None else sink
        if chunked:
            while True:
                line = self.rfile.readline(65537)
                emit(line)
                size = int(line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:  # trailers up to the blank line
                    while True:
                        line = self.rfile.readline(65537)
                        emit(line)
                        if line in (b"\r\n", b"\n", b""):
                            break
                    break
                left = size + 2  # data and its CRLF
                while left:
                    piece = self.rfile.read(min(left, _CHUNK))
                    if not piece:
                        raise ConnectionError("client closed the connection mid-body")
                    emit(piece)
                    left -= len(piece)
        else:
            left = length
            while left:
                piece = self.rfile.read(min(left, _CHUNK))
                if not piece:
                    raise ConnectionError("client closed the connection mid-body")
                emit(piece)
                left -= len(piece)
        return b"".join(out) if out is not None else b""

    def _forward(self, method, target, chunked, length, body) -> _Upstream:
        """Send the request upstream (the body streamed from the client unless given); its response."""
        conn = http.client.HTTPConnection(*self.proxy.upstream, timeout=self.proxy.upstream_timeout_s)
        conn.connect()
        sock = conn.sock  # http.client drops its reference when the response will close the connection
        self.proxy._track(sock, True)
        try:
            conn.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():  # order, case and duplicates as received
                if name.lower() not in _NOT_FORWARDED:
                    conn.putheader(name, value)
            conn.endheaders()
            if body is not None:
                conn.send(body)
            else:
                self._read_body(chunked, length, sink=conn.send)
            resp = conn.getresponse()
        except BaseException:
            self.proxy._track(sock, False)
            conn.close()
            raise
        return _Upstream(resp, conn, sock, self.proxy)

    def _head_bytes(self, status, reason, headers, extra=()) -> bytes:
        lines = [f"HTTP/1.1 {status} {reason}"]
        lines += [f"{k}: {v}" for k, v in headers if k.lower() not in _HOP_BY_HOP]
        lines += [f"{k}: {v}" for k, v in extra]
        if self.close_connection:
            lines.append("Connection: close")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def _relay(self, method: str, resp: _Upstream) -> None:
        status, reason, headers = resp.status, resp.reason, resp.headers
        names = {k.lower() for k, _ in headers}
        bodyless = method == "HEAD" or status in (204, 304) or 100 <= status < 200
        if bodyless or "content-length" in names:
            self.wfile.write(self._head_bytes(status, reason, headers))
            while not bodyless and (piece := resp.read(_CHUNK)):
                self.wfile.write(piece)
        elif resp.chunked:  # decoded by http.client: framed again for the client
            self.wfile.write(self._head_bytes(status, reason, headers, [("Transfer-Encoding", "chunked")]))
            while piece := resp.read(_CHUNK):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\n\r\n")
        else:  # delimited by the upstream closing: measured here
            data = resp.read()
            self.wfile.write(self._head_bytes(status, reason, headers, [("Content-Length", str(len(data)))]) + data)

    def _inject(self, fault: Fault, method: str, resp: _Upstream | None) -> None:
        if fault.kind in _ERRORS:
            return self._send_error_xml(method, fault.kind, _ERRORS[fault.kind])
        self.close_connection = True
        if fault.kind == "timeout":
            self.proxy._stopping.wait(fault.delay_s)  # the client gives up first; stop() ends the wait
            return
        # "reset": half of the answer (or of its head, when it has no body), then RST.
        if resp is None:
            status, reason, headers, data = 200, "OK", [("Content-Length", "0")], b""
        else:
            status, reason, headers = resp.status, resp.reason, resp.headers
            data = b"" if method == "HEAD" else resp.read()
        head = self._head_bytes(status, reason, headers)
        self.wfile.write(head + data[: len(data) // 2] if data else head[: len(head) // 2])
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.proxy._track(self.connection, False)
        # Close the descriptor now (rfile/wfile only wrap the socket object): with SO_LINGER 0, an RST.
        socket.close(self.connection.detach())

    def _send_error_xml(self, method: str, status: str, what: tuple[str, str, str]) -> None:
        reason, code, message = what
        request_id = uuid.uuid4().hex[:16].upper()
        body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                f"<Message>{escape(message)}</Message><Resource>{escape(unquote(urlsplit(self.path).path))}"
                f"</Resource><RequestId>{request_id}</RequestId></Error>").encode()
        headers = [("Content-Type", "application/xml"), ("x-amz-request-id", request_id),
                   ("Content-Length", str(len(body)))]
        self.wfile.write(self._head_bytes(int(status), reason, headers) + (b"" if method == "HEAD" else body))


class _Upstream:
    """The upstream's response; closing it closes (and untracks) its connection."""

    def __init__(self, resp: http.client.HTTPResponse, conn: http.client.HTTPConnection, sock: socket.socket,
                 proxy: FaultProxy):
        self.resp, self.conn, self.sock, self.proxy = resp, conn, sock, proxy
        self.status, self.reason, self.headers, self.chunked = resp.status, resp.reason, resp.getheaders(), resp.chunked

    def read(self, amt=None) -> bytes:
        return self.resp.read(amt)

    def close(self) -> None:
        self.proxy._track(self.sock, False)
        self.resp.close()
        self.conn.close()
