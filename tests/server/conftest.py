"""A real uvicorn server on a free port, in a thread, serving a tiny model."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest
import uvicorn

from inferd.config import make_engine_config
from inferd.engine.engine import Engine
from inferd.server.app import create_app
from inferd.server.cli import _DrainingServer
from inferd.server.state import ServerSettings
from tests.net import free_port

MODEL_NAME = "tiny"


@dataclass
class RunningServer:
    url: str
    app: object
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def state(self):
        return self.app.state.inferd

    @property
    def engine(self) -> Engine:
        return self.state.async_engine.engine

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until the step thread has nothing left; then the block invariant must hold."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.state.async_engine.stats
            idle = not self.state.async_engine.num_in_flight and st.num_running == 0 and st.num_waiting == 0
            if idle and not self.engine.has_unfinished_requests():
                break
            time.sleep(0.02)
        self.engine.check_idle()


def start_server(
    model_dir,
    drain_timeout: float = 5.0,
    api_key: str | None = None,
    settings: dict | None = None,
    **engine_kwargs,
) -> RunningServer:
    """`settings`: ServerSettings fields beyond the names, the key, the waiting limit and the drain timeout."""
    kwargs = dict(max_model_len=512, kv_cache_memory=64 << 20, num_threads=2, dtype="float32") | engine_kwargs
    max_waiting = kwargs.pop("max_waiting_requests", 0)
    engine = Engine(make_engine_config(str(model_dir), **kwargs))
    settings = ServerSettings(
        [MODEL_NAME, "tiny-alias"],
        api_key=api_key,
        max_waiting_requests=max_waiting,
        drain_timeout=drain_timeout,
        **(settings or {}),
    )
    app = create_app(engine, settings)
    port = free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=drain_timeout
    )
    server = _DrainingServer(config, on_exit=app.state.inferd.begin_drain)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    return RunningServer(f"http://127.0.0.1:{port}", app, server, thread)


@pytest.fixture(scope="module")
def server(tiny_models):
    srv = start_server(tiny_models["llama"])
    yield srv
    srv.stop()
