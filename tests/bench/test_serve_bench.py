"""`tollgate bench` against real local servers: a scripted engine reached directly and through
a Tollgate in front of it, in one run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.serve_bench import make_workload, percentiles
from gateway import cli
from tests.conftest import run_coro
from tests.engines.conftest import models_db, tollgate_with, upstreams  # noqa: F401  (fixtures)
from tests.fakes.upstream import Behaviour


def test_workload_lengths_are_fixed_or_ranged() -> None:
    fixed = make_workload(20, 64, 32, 0.0, seed=1)
    assert fixed.input_lens == [64] * 20 and fixed.output_lens == [32] * 20
    assert len(set(fixed.prompts)) == 20  # unique prefixes: no shared prompt cache
    ranged = make_workload(200, 100, 50, 0.5, seed=1)
    assert min(ranged.input_lens) >= 50 and max(ranged.input_lens) <= 150 and len(set(ranged.input_lens)) > 10
    assert min(ranged.output_lens) >= 25 and max(ranged.output_lens) <= 75
    assert make_workload(5, 10, 5, 0.5, seed=7).prompts == make_workload(5, 10, 5, 0.5, seed=7).prompts


def test_percentiles() -> None:
    values = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    assert percentiles(values) == pytest.approx({"mean": 50.5, "p50": 50.0, "p90": 90.0, "p99": 99.0})
    assert percentiles([])["p50"] is None


def test_bench_compares_tollgate_with_the_engine_directly(upstreams: Any, tollgate_with: Any, tmp_path: Path, capsys: Any) -> None:
    engine, engine_url = upstreams()
    engine.default = Behaviour(token_delay=0.002)
    gw = tollgate_with(f"""
    models:
      - id: fronted
        backend: openai
        context_length: 8192
        replicas: [{engine_url}]
        upstream_model: engine-model
        health_path: null
    """)
    key = run_coro(gw.new_key())["key"]
    out = tmp_path / "bench.json"
    code = cli.main([
        "bench", "--num-requests", "12", "--concurrency", "4", "--input-len", "32", "--output-len", "16",
        "--base-url", gw.v1, "--label", "tollgate", "--api-key", key, "--model", "fronted",
        "--base-url", engine_url, "--label", "direct", "--api-key", "none", "--model", "engine-model",
        "--json", str(out), "--no-progress",
    ])
    printed = capsys.readouterr().out
    assert code == 0
    reports = json.loads(out.read_text())
    assert [r["label"] for r in reports] == ["tollgate", "direct"]
    for r in reports:
        assert (r["completed"], r["failed"], r["concurrency"]) == (12, 0, 4)
        assert r["output_tokens"] == 12 * 7 and r["prompt_tokens"] == 12 * 17  # the engine's usage, relayed by Tollgate
        assert r["usage_reported"] is True
        assert 0 < r["ttft_ms"]["p50"] <= r["e2e_ms"]["p50"] <= r["e2e_ms"]["p99"]
        assert r["itl_ms"]["mean"] > 0 and r["request_throughput"] > 0
    assert len(engine.requests) == 24
    assert {req.body["model"] for req in engine.requests} == {"engine-model"}
    assert all(len(req.body["messages"][0]["content"]) > 32 for req in engine.requests)
    header = printed.splitlines()[0].split()
    assert header == ["metric", "tollgate", "direct", "direct/tollgate"]
    assert any(line.startswith("output tokens/s") for line in printed.splitlines())


def test_bench_reports_failures_and_request_rate(upstreams: Any, tmp_path: Path, capsys: Any) -> None:
    engine, url = upstreams()
    engine.default = Behaviour(status=500, error_message="engine down")
    out = tmp_path / "bench.json"
    code = cli.main(["bench", "--base-url", url, "--model", "m", "--num-requests", "5", "--request-rate", "100", "--json", str(out), "--no-progress"])
    assert code == 1
    report = json.loads(out.read_text())[0]
    assert (report["completed"], report["failed"], report["request_rate"], report["concurrency"]) == (0, 5, 100.0, None)
    assert "engine down" in report["errors"][0]
    assert "errors from target1" in capsys.readouterr().out
