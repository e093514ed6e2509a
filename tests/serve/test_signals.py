"""SIGTERM on a real ``python -m areno serve`` process: in-flight requests drain (or, past the graceful window, are
aborted with a clean end), new connections are refused, the process exits 0 and the port is free again. A second
SIGTERM or SIGINT during the drain aborts at once (the same clean end) and exits 128 + the signal's number."""

import json
import signal
import socket
import threading
import time

import httpx
import pytest


def sse_events(response):
    """The parsed ``data:`` payloads of an SSE response, ``[DONE]`` kept as the string."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            yield data if data == "[DONE]" else json.loads(data)


def port_is_free(port: int) -> bool:
    """Whether a new server could listen on ``port`` (as uvicorn does, with SO_REUSEADDR: the closed connections'
    TIME_WAIT entries do not count, a listener left behind does)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def stream_after_sigterm(server, body, *, before_signal=3):
    """Stream ``body`` to /v1/completions, SIGTERM the server after a few chunks, return (events, seconds from the
    signal to the stream's end, whether /health was refused meanwhile)."""
    events, refused = [], False
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        it = sse_events(r)
        for _ in range(before_signal):
            events.append(next(it))
        server.proc.send_signal(signal.SIGTERM)
        t0 = time.time()
        deadline = t0 + 5
        while time.time() < deadline and not refused:  # the listening socket closes at once
            try:
                httpx.get(server.base_url + "/health", timeout=0.5)
                time.sleep(0.1)
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
                refused = True  # refused, or (caught in the backlog at the signal) closed unanswered
        events.extend(it)
        return events, time.time() - t0, refused


def finish_reasons(events):
    return [c["choices"][0]["finish_reason"] for c in events[:-1] if c["choices"] and c["choices"][0]["finish_reason"]]


def test_sigterm_drains_in_flight_stream_and_exits_0(serve):
    server = serve()
    body = {"model": "tiny", "prompt": "drain me", "max_tokens": 200, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    events, _, refused = stream_after_sigterm(server, body)
    assert refused, "the server kept accepting connections after SIGTERM"
    assert events[-1] == "[DONE]"
    assert finish_reasons(events) == ["length"]  # drained: the whole completion came through
    assert events[-2]["usage"]["completion_tokens"] == 200
    assert server.proc.wait(30) == 0, server.output()
    assert "Traceback" not in server.output()
    assert port_is_free(server.port)


def test_sigterm_past_the_window_aborts_cleanly_and_exits_0(serve):
    window = 1.5
    server = serve(env={"ARENO_SERVE_GRACEFUL_SHUTDOWN_S": str(window)})
    chat = {}

    def non_streaming():  # a second, non-streamed request in flight at the signal
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1900,
                "ignore_eos": True}
        chat["r"] = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)

    t = threading.Thread(target=non_streaming)
    t.start()
    deadline = time.time() + 20
    while httpx.get(server.base_url + "/health").json()["active_requests"] < 1:
        assert time.time() < deadline and t.is_alive()
        time.sleep(0.05)
    body = {"model": "tiny", "prompt": "abort me", "max_tokens": 1900, "ignore_eos": True, "stream": True}
    events, took, _ = stream_after_sigterm(server, body)
    assert events[-1] == "[DONE]"  # ended cleanly, not cut mid-body
    assert finish_reasons(events) == ["abort"]
    assert window - 0.5 < took < window + 5
    t.join(30)
    r = chat["r"]
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "abort"
    assert 0 < r.json()["usage"]["completion_tokens"] < 1900
    assert server.proc.wait(20) == 0, server.output()
    assert "aborting 2 in-flight requests" in server.output()
    assert port_is_free(server.port)



@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_second_signal_ends_the_drain_at_once_and_exits_128_plus_signal(serve, sig):
    """A second SIGTERM (or a second Ctrl-C) while the 30 s drain waits on a long stream: the stream is aborted
    with a clean end, the process exits within seconds with 128 + the signal's number, and no traceback."""
    server = serve()
    body = {"model": "tiny", "prompt": "abort me twice", "max_tokens": 1900, "ignore_eos": True, "stream": True}
    events = []
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        it = sse_events(r)
        for _ in range(3):
            events.append(next(it))
        server.proc.send_signal(sig)
        time.sleep(0.5)  # the drain has started: the stream goes on
        events.append(next(it))
        assert server.proc.poll() is None
        server.proc.send_signal(sig)
        t0 = time.time()
        events.extend(it)
    assert server.proc.wait(15) == 128 + sig, server.output()
    took = time.time() - t0
    assert took < 5, f"exit {took:.1f} s after the second signal (the drain window is 30 s)"
    assert events[-1] == "[DONE]"
    assert finish_reasons(events) == ["abort"]
    out = server.output()
    assert "Traceback" not in out and "Event loop is closed" not in out, out
    assert f"signal {int(sig)} during the drain: aborting 1 in-flight requests" in out
    assert port_is_free(server.port)
