"""A real areno server on a free loopback port, serving a tiny random checkpoint: in this process
(``RunningServer``, the ``server`` fixture) or as a ``python -m areno serve`` process (``ServeProcess``, the ``serve``
fixture)."""

import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
import uvicorn

from areno.config import ServeConfig
from areno.testing import make_tiny_checkpoint


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    def __init__(self, path, **overrides):
        self.port = free_port()
        settings = {"max_running_prompts": 8, "max_model_len": 512, **overrides}
        cfg = ServeConfig(model_path=str(path), port=self.port, dtype="float32", served_model_name="tiny", **settings)
        from areno.serve.server import build_app, connection_options

        torch.manual_seed(0)
        self.app, self.engine = build_app(cfg)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    **connection_options(cfg)))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.05)
        self.base_url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("serve_ckpt"), family="qwen3", seed=3)


@pytest.fixture(scope="session")
def tools_server(tmp_path_factory):
    """A 1-layer random checkpoint served with room for tools in the prompt (their rendering takes ~460 tokens):
    the server the tool_choice and agent-framework client tests share (forced calls need no trained model)."""
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("tools_ckpt"), family="qwen3", seed=4, num_hidden_layers=1)
    s = RunningServer(ckpt, max_model_len=2048)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    s = RunningServer(tiny_ckpt)
    yield s
    s.stop()


class ServeProcess:
    def __init__(self, ckpt, *extra, env=None):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "areno", "serve", "--model-path", str(ckpt), "--port", str(self.port),
               "--dtype", "float32", "--served-model-name", "tiny", *extra]
        self.proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.log: list[str] = []
        self._reader = threading.Thread(target=lambda: self.log.extend(self.proc.stdout), daemon=True)
        self._reader.start()
        deadline = time.time() + 90
        while True:
            assert self.proc.poll() is None, f"server exited early:\n{self.output()}"
            assert time.time() < deadline, f"server did not come up:\n{self.output()}"
            try:
                if httpx.get(self.base_url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)

    def output(self) -> str:
        return "".join(self.log)

    def rss(self) -> int:
        """The server process's resident memory, in bytes (Linux /proc)."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return kib * 1024

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def serve(tiny_ckpt):
    started = []

    def start(*extra, env=None):
        started.append(ServeProcess(tiny_ckpt, *extra, env=env))
        return started[-1]

    yield start
    for p in started:
        p.kill()


THINKING = "<think>\nweather\n</think>\n\n"  # the reasoning the thinking tool caller writes before its call


@pytest.fixture(scope="session")
def thinking_tool_ckpt(tmp_path_factory):
    """A tiny qwen3 checkpoint overfit to answer test_tool_calls_e2e's conversation with a ``<think>`` block and then
    its get_weather call (the Responses API's reasoning and function_call items)."""
    from tests.serve.test_tool_calls_e2e import CALL, overfit_tool_caller

    src = make_tiny_checkpoint(tmp_path_factory.mktemp("think_src"), family="qwen3", seed=5, num_hidden_layers=1)
    return overfit_tool_caller(src, tmp_path_factory.mktemp("think_ckpt") / "model",
                               target=THINKING + CALL + "<|im_end|>")


@pytest.fixture(scope="module")
def thinking_server(thinking_tool_ckpt):
    s = RunningServer(thinking_tool_ckpt)
    yield s
    s.stop()
