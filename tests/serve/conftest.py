"""A real areno server on a free loopback port, serving a tiny random checkpoint."""

import socket
import threading
import time

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
        cfg = ServeConfig(model_path=str(path), port=self.port, dtype="float32", served_model_name="tiny",
                          max_running_prompts=8, max_model_len=512, **overrides)
        from areno.serve.server import build_app

        torch.manual_seed(0)
        self.app, self.engine = build_app(cfg)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
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


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    s = RunningServer(tiny_ckpt)
    yield s
    s.stop()
