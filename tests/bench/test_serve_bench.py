"""`tollgate bench` against real local servers: a scripted engine reached directly and through
a Tollgate in front of it, in one run."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from gateway.cli.bench import Pricing, builtin_mix, make_workload, parse_pricing, percentiles
from billing.db import create_engine
from gateway.cli import main as cli
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


def test_builtin_mix_is_fixed_per_seed_and_mixes_kinds() -> None:
    mix = builtin_mix(200, seed=3)
    assert mix.prompts == builtin_mix(200, seed=3).prompts and len(set(mix.prompts)) == 200
    kinds = set(mix.kinds)
    assert kinds == {"short", "document", "code", "writing"}
    for kind, max_tokens in (("short", 48), ("document", 128), ("code", 128), ("writing", 256)):
        assert {mix.output_lens[i] for i, k in enumerate(mix.kinds) if k == kind} == {max_tokens}
    docs = [mix.input_lens[i] for i, k in enumerate(mix.kinds) if k == "document"]
    shorts = [mix.input_lens[i] for i, k in enumerate(mix.kinds) if k == "short"]
    assert min(docs) > 500 and max(shorts) < 60
    assert all("```" in mix.prompts[i] for i, k in enumerate(mix.kinds) if k == "code")


def test_pricing_rounds_like_the_ledger() -> None:
    price = Pricing(Decimal("0.150"), Decimal("0.600"))
    assert price.cost_nanos(17, 7) == 17 * 150 + 7 * 600
    assert Pricing(Decimal("0.0005"), Decimal("0")).cost_nanos(1, 0) == 1  # 0.5 nano rounds half up
    with pytest.raises(SystemExit, match="floats"):
        parse_pricing({"input_per_million": 0.15, "output_per_million": "1"}, "prices.json")


def test_bench_compares_auto_with_one_model_by_cost_and_latency(upstreams: Any, tollgate_with: Any, tmp_path: Path, capsys: Any) -> None:
    """One run, one gateway, two models: the router `auto` over a cheap and a premium model, and
    the premium model alone, on the built-in prompt mix. The bench's cost per model equals what
    the ledger billed, and `auto` costs less because short questions go to the cheap model."""
    cheap_engine, cheap_url = upstreams("cheap")
    premium_engine, premium_url = upstreams("premium")
    for engine in (cheap_engine, premium_engine):
        engine.default = Behaviour(token_delay=0.001)
    tag = uuid.uuid4().hex[:6]
    cheap, premium = f"cheap-{tag}", f"premium-{tag}"
    gw = tollgate_with(f"""
    models:
      - id: {cheap}
        backend: openai
        context_length: 8192
        replicas: [{cheap_url}]
        health_path: null
      - id: {premium}
        backend: openai
        context_length: 8192
        replicas: [{premium_url}]
        health_path: null
      - id: auto-{tag}
        backend: router
        default: {premium}
        routes:
          - model: {premium}
            code: true
          - model: {cheap}
            max_prompt_tokens: 100
            max_output_tokens: 64
    """)

    async def setup() -> tuple[str, int]:
        async with gw.admin_client() as admin:
            for model, ins, outs in ((cheap, "0.100", "0.400"), (premium, "2.500", "10.000")):
                r = await admin.post("/admin/prices", json={"model": model, "input_per_million": ins, "output_per_million": outs})
                assert r.status_code == 201, r.text
        key = await gw.new_key()
        return key["key"], key["id"]

    key, key_id = run_coro(setup())
    models = httpx.get(gw.v1 + "/models", headers={"authorization": f"Bearer {key}"}).json()["data"]
    pricing = {card["id"]: card.get("pricing") for card in models}
    assert pricing[premium] == {"input_per_million": "2.500", "output_per_million": "10.000", "currency": "USD"}
    assert pricing[f"auto-{tag}"] is None  # a router's price is its chosen model's

    out = tmp_path / "bench.json"
    code = cli.main([
        "bench", "--mix", "builtin", "--num-requests", "40", "--concurrency", "4",
        "--base-url", gw.v1, "--api-key", key, "--model", f"auto-{tag}", "--model", premium,
        "--json", str(out), "--no-progress",
    ])
    printed = capsys.readouterr().out
    assert code == 0, printed
    auto, single = json.loads(out.read_text())
    assert (auto["label"], single["label"]) == (f"auto-{tag}", premium)
    assert auto["completed"] == single["completed"] == 40
    assert set(auto["models_used"]) == {cheap, premium}
    assert set(single["models_used"]) == {premium}
    assert set(auto["kinds"]["short"]) == {cheap} and set(auto["kinds"]["code"]) == {premium}
    assert auto["kinds"]["document"] == {premium: auto["kinds"]["document"][premium]}
    assert Decimal(auto["cost_per_1k_requests_usd"]) < Decimal(single["cost_per_1k_requests_usd"])
    assert auto["ttft_ms"]["p50"] > 0 and single["e2e_ms"]["p50"] > 0
    header = printed.splitlines()[0].split()
    assert header == ["metric", f"auto-{tag}", premium, f"{premium}/auto-{tag}"]
    assert any(line.startswith("cost / 1k requests (USD)") for line in printed.splitlines())
    assert f"models used by auto-{tag}: " in printed

    # What the bench priced is what the ledger billed, model by model, to the nano-USD.
    async def billed() -> dict[str, tuple[int, int]]:
        db = create_engine(gw.db_url)
        try:
            deadline = time.monotonic() + 15
            while True:
                async with db.connect() as conn:
                    rows = (await conn.execute(sa.text(
                        "SELECT model, count(*), sum(cost_nanos) FROM ledger_entries WHERE key_id = :k GROUP BY model"), {"k": key_id})).all()
                if sum(r[1] for r in rows) >= 80 or time.monotonic() > deadline:
                    return {r[0]: (int(r[1]), int(r[2])) for r in rows}
                await asyncio.sleep(0.1)
        finally:
            await db.dispose()

    ledger = run_coro(billed())
    bench_by_model: dict[str, list[int]] = {}
    for report in (auto, single):
        for model, entry in report["models_used"].items():
            counts = bench_by_model.setdefault(model, [0, 0])
            counts[0] += entry["requests"]
            counts[1] += entry["cost_nanos"]
    assert {m: tuple(v) for m, v in bench_by_model.items()} == ledger
    assert auto["cost_nanos"] + single["cost_nanos"] == sum(v[1] for v in ledger.values())


def test_bench_prices_from_a_file_and_names_unpriced_models(upstreams: Any, tmp_path: Path, capsys: Any) -> None:
    engine, url = upstreams()
    engine.default = Behaviour()
    mix = tmp_path / "mix.jsonl"
    mix.write_text('{"prompt": "Once upon a time", "max_tokens": 8, "kind": "story"}\n'
                   '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}\n')
    prices = tmp_path / "prices.yaml"
    prices.write_text('m:\n  input_per_million: "1.000"\n  output_per_million: "3"\n')
    out = tmp_path / "bench.json"
    args = ["bench", "--base-url", url, "--model", "m", "--num-requests", "6", "--mix", str(mix), "--json", str(out), "--no-progress"]
    assert cli.main(args + ["--prices", str(prices)]) == 0
    report = json.loads(out.read_text())[0]
    per_request = 17 * 1000 + 7 * 3000  # the scripted engine's usage at the file's prices
    assert report["cost_nanos"] == 6 * per_request
    assert Decimal(report["cost_per_1k_requests_usd"]) == Decimal(per_request * 1000).scaleb(-9)
    assert report["kinds"] == {"line2": {"m": 3}, "story": {"m": 3}}
    bodies = [req.body for req in engine.requests]
    assert sum("prompt" in b for b in bodies) == 3 and sum("messages" in b for b in bodies) == 3
    assert {b["max_tokens"] for b in bodies} == {8, 4}
    capsys.readouterr()
    assert cli.main(args) == 0  # no prices anywhere: reported, not guessed
    report = json.loads(out.read_text())[0]
    assert report["cost_per_1k_requests_usd"] is None and report["unpriced_models"] == ["m"]
    assert "note: no price for m" in capsys.readouterr().out
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"max_tokens": 3}\n')
    with pytest.raises(SystemExit, match="exactly one of `messages` or `prompt`"):
        cli.main(["bench", "--base-url", url, "--model", "m", "--mix", str(bad), "--no-progress"])


def test_models_publish_what_the_callers_account_pays(upstreams: Any, tollgate_with: Any) -> None:
    _, url = upstreams()
    model = f"priced-{uuid.uuid4().hex[:6]}"
    gw = tollgate_with(f"""
    models:
      - id: {model}
        backend: openai
        context_length: 4096
        replicas: [{url}]
        health_path: null
    """)

    async def setup() -> tuple[str, str]:
        plain, reseller = await gw.new_key(), await gw.new_account()
        discounted = await gw.new_key(reseller["id"])
        async with gw.admin_client() as admin:
            r = await admin.post("/admin/prices", json={"model": model, "input_per_million": "1.200", "output_per_million": "4"})
            assert r.status_code == 201, r.text
            r = await admin.post(f"/admin/accounts/{reseller['id']}/prices", json={"model": "*", "multiplier": "0.75"})
            assert r.status_code == 201, r.text
        return plain["key"], discounted["key"]

    plain, discounted = run_coro(setup())

    def pricing(key: str) -> Any:
        return httpx.get(f"{gw.v1}/models/{model}", headers={"authorization": f"Bearer {key}"}).json().get("pricing")

    assert pricing(plain) == {"input_per_million": "1.200", "output_per_million": "4.000", "currency": "USD"}
    deadline = time.monotonic() + 15  # the serving price book refreshes every few seconds
    while pricing(discounted) != {"input_per_million": "0.900", "output_per_million": "3.000", "currency": "USD"}:
        assert time.monotonic() < deadline, pricing(discounted)
        time.sleep(0.2)
