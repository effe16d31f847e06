"""A live server for tests: engine + uvicorn on a uvloop loop in a background thread, on 127.0.0.1:<free port>."""
from __future__ import annotations

import asyncio
import os
import queue
import re
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import uvicorn

from streamer.engine.async_engine import AsyncEngine
from streamer.engine.data_parallel import make_async_engine
from streamer.server.app import build_app
from streamer.server.connections import HttpLimits, uvicorn_config

REPO = Path(__file__).resolve().parents[1]


class PipedProcess:
    """A subprocess run from the repository, its stdout lines queued (`stdout`) and its stderr kept (`stderr`),
    each pipe drained by a thread so that the process never blocks on a full one."""

    def __init__(self, cmd: list[str], env: Optional[dict[str, str]] = None) -> None:
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
        self.stdout: "queue.Queue[str]" = queue.Queue()
        self.stderr_lines: list[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.stdout.put), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, self.stderr_lines.append), daemon=True).start()

    @staticmethod
    def _pump(pipe, sink) -> None:
        for line in pipe:
            sink(line)

    @property
    def stderr(self) -> str:
        return "".join(self.stderr_lines)


ENGINE_KWARGS: dict[str, Any] = {"dtype": "float32", "num_kv_blocks": 256}


class LiveServer:
    def __init__(self, model_dir: Path, *, api_key: Optional[str] = None, served_model_name: Any = None,
                 max_body_bytes: Optional[int] = None, loras: Optional[dict[str, str]] = None,
                 allow_lora_updates: bool = False, allow_weight_updates: bool = False, transcription: Any = None,
                 http_limits: Optional[HttpLimits] = None, **engine_kwargs: Any) -> None:
        """loras: {name: PEFT folder} registered before serving (as `--lora-modules`). transcription: build_app's
        TranscriptionConfig. http_limits: the HTTP server's deadlines and limits (default: `serve`'s)."""
        self.model_dir = model_dir
        self.app_kwargs = dict(api_key=api_key, served_model_name=served_model_name, max_body_bytes=max_body_bytes,
                               allow_lora_updates=allow_lora_updates, allow_weight_updates=allow_weight_updates,
                               transcription=transcription)
        self.loras = loras or {}
        self.http_limits = http_limits or HttpLimits()
        self.engine_kwargs = {**ENGINE_KWARGS, **engine_kwargs}
        self.engine: Optional[AsyncEngine] = None
        self.server: Optional[uvicorn.Server] = None
        self.app: Any = None
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.port = 0
        self.model_name = ""
        self._ready = threading.Event()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="live-server", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    # ------------------------------------------------------------------ life cycle
    def __enter__(self) -> "LiveServer":
        self._thread.start()
        if not self._ready.wait(180):
            raise TimeoutError("the live server did not start")
        if self._error is not None:
            raise RuntimeError("the live server failed to start") from self._error
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.loop is not None and self.server is not None:
            self.loop.call_soon_threadsafe(setattr, self.server, "should_exit", True)
        self._thread.join(60)

    def _run(self) -> None:
        import uvloop
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(self._main())

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.engine = make_async_engine(str(self.model_dir), **self.engine_kwargs)  # (data_parallel_size=N: N)
        try:
            await self.engine.start()
            for name, path in self.loras.items():
                await self.engine.add_lora(name, path)
            self.app = app = build_app(self.engine, **self.app_kwargs)  # type: ignore[arg-type]
            self.model_name = app.state.server.model_name
            config = uvicorn_config(app, host="127.0.0.1", port=0, limits=self.http_limits, lifespan="off",
                                    log_level="warning", timeout_graceful_shutdown=3)
            self.server = uvicorn.Server(config)
            task = asyncio.ensure_future(self.server.serve())
            while not self.server.started and not task.done():
                await asyncio.sleep(0.01)
            if task.done():
                task.result()
            self.port = self.server.servers[0].sockets[0].getsockname()[1]
            self._ready.set()
            await task
        except BaseException as e:
            self._error = e
            self._ready.set()
        finally:
            await self.engine.stop()

    # ------------------------------------------------------------------ inspection (on the server's loop)
    def call(self, fn: Callable[[], Any], timeout: float = 30) -> Any:
        """Run `fn` on the server's event loop thread (the engine's state belongs to that thread)."""
        async def wrapper() -> Any:
            return fn()
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(wrapper(), self.loop).result(timeout)

    def pool_state(self) -> dict[str, int]:
        def read() -> dict[str, int]:
            core = self.engine.engine  # type: ignore[union-attr]
            return {"free": core.kv.pool.num_free, "blocks": core.kv.num_blocks,
                    "running": core.scheduler.num_running, "waiting": core.scheduler.num_waiting,
                    "streams": len(self.engine._streams)}  # type: ignore[union-attr]
        return self.call(read)

    def wait_idle(self, timeout: float = 60) -> dict[str, int]:
        """Wait until no request holds anything: every KV block free, nothing running or waiting."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.pool_state()
            if s["free"] == s["blocks"] and s["running"] == s["waiting"] == s["streams"] == 0:
                return s
            if time.monotonic() > deadline:
                raise AssertionError(f"the engine did not go idle: {s}")
            time.sleep(0.05)


def metric(text: str, name: str, **labels: str) -> float:
    """A sample's value from Prometheus text (0.0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def sse_events(raw: str) -> list[str]:
    """The data payloads of an SSE body, in order (comments skipped)."""
    return [m.group(1) for m in re.finditer(r"^data: (.*)$", raw, flags=re.M)]
