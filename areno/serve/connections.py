"""What one connection may hold of the server: a read timeout and a cap on open connections (uvicorn's HTTP/1.1
protocol with both added; it has only an idle keep-alive timeout between requests).

- ``--read-timeout-s``: a request's headers and then its body must each arrive within this many seconds of their
  first byte (of the connection, for the first request). A client that trickles bytes (slowloris) or sends
  nothing is closed when its time is up: a 408 where no request was read yet, else the connection is dropped
  (the route sees the client gone). Time spent computing or streaming the answer is not limited.
- ``--max-connections``: connections open at once; the next one gets a 503 naming the flag and is closed, so a
  flood ends before the process runs out of file descriptors (its default leaves a quarter of the soft
  ``RLIMIT_NOFILE`` to the model files, the engine processes' pipes and the server's own sockets).
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger("areno.serve")

DEFAULT_READ_TIMEOUT_S = 30.0
NOFILE_WHEN_UNLIMITED = 1 << 16


def default_max_connections() -> int:
    """Three quarters of the soft file-descriptor limit (at least 16)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft <= 0:
        soft = NOFILE_WHEN_UNLIMITED
    return max(16, soft * 3 // 4)


def _plain_response(status: str, text: str) -> bytes:
    body = text.encode()
    return (f"HTTP/1.1 {status}\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


def guarded_protocol(read_timeout_s: float, max_connections: int):
    """uvicorn's h11 protocol class with the read timeout (0: none) and the connection cap (module doc)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        read_timer = None
        refused = False

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self.refused = True
                transport.write(_plain_response("503 Service Unavailable",
                                                f"this server is at its cap of {max_connections} open connections "
                                                "(--max-connections); retry later"))
                transport.close()
                return
            self._track()

        def data_received(self, data: bytes) -> None:
            if self.refused:
                return
            super().data_received(data)
            self._track()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _reading(self) -> bool:
            """Waiting for a request's headers or the rest of its body."""
            cycle = self.cycle
            return cycle is None or cycle.response_complete or cycle.more_body

        def _track(self) -> None:
            """Start the clock when a read begins (headers, then the body); stop it when the request is in."""
            if not read_timeout_s:
                return
            if not self._reading():
                self._disarm()
            elif self.read_timer is None:
                self.read_timer = self.loop.call_later(read_timeout_s, self._timed_out, self.cycle)

        def _disarm(self) -> None:
            if self.read_timer is not None:
                self.read_timer.cancel()
                self.read_timer = None

        def _timed_out(self, cycle) -> None:
            self.read_timer = None
            if not self._reading() or self.transport.is_closing():
                return
            if self.cycle is not cycle and self.cycle is not None and self.cycle.more_body:
                self._track()  # the headers came in time; the body gets its own clock
                return
            if self.cycle is None or self.cycle.response_complete:  # no request read: say why before closing
                self.transport.write(_plain_response("408 Request Timeout", f"the request was not received within "
                                                     f"{read_timeout_s:g} s (--read-timeout-s)"))
            log.debug("closing %s: read timeout (%g s)", self.client, read_timeout_s)
            self.transport.close()

    return GuardedH11Protocol
