"""A model that fails to load shows as failed, not as loading forever: /readyz names the error, and
`tollgate serve` whose only model cannot load exits non-zero with the reason (issue 26)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.harness import ServerThread
from gateway.app import create_app
from gateway.config import EmbeddingSettings, EngineSettings, Settings
from tests.conftest import SECRET


def create_app_loads(app: Any) -> list[asyncio.Task[None]]:
    loads: list[asyncio.Task[None]] = app.state.model_loads
    assert loads, "the app started no model load"
    return loads


def test_readyz_names_the_load_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'l.db'}", server_secret=SECRET, data_dir=tmp_path,
                        engines=EngineSettings(model_path=str(tmp_path / "no-such-model")), embeddings=EmbeddingSettings(enabled=False))
    from billing import migrate

    migrate.upgrade(settings.resolved_database_url)
    app = create_app(settings)
    with ServerThread(app) as server:
        loads = create_app_loads(app)
        done = asyncio.run_coroutine_threadsafe(asyncio.wait(loads), loads[0].get_loop())  # barrier: every load ended
        done.result(timeout=120)
        r = httpx.get(f"http://127.0.0.1:{server.port}/readyz")
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["code"] == "model_load_failed"
        assert "neither a checkpoint directory nor a .gguf file" in error["message"]
        assert "still loading" not in error["message"]
        assert httpx.get(f"http://127.0.0.1:{server.port}/healthz").status_code == 200  # the process still answers


def test_serve_exits_non_zero_when_its_only_model_cannot_load(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "TOLLGATE_SECRET", "TOLLGATE_MODELS")}
    env.update(TOLLGATE_DATA_DIR=str(tmp_path), TOLLGATE_MODEL_PATH=str(tmp_path / "no-such-model"), TOLLGATE_EMBEDDINGS="off",
               TOLLGATE_PORT=str(port))
    exe = Path(sys.executable).with_name("tollgate")
    done = subprocess.run([str(exe), "serve", "--log-level", "warning"], capture_output=True, text=True, env=env, timeout=180)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "no model could be loaded" in done.stderr
    assert "neither a checkpoint directory nor a .gguf file" in done.stderr
