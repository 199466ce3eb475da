"""Cost-aware routing: rules from models.yaml pick the model; through the gateway the response
names it and the ledger bills it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from engines.wrappers.fallback import FallbackEngine
from engines.registry import ModelsConfigError, parse_models
from engines.wrappers.router import RouterEngine
from tests.conftest import SECRET, Gateway, ServerThread, bootstrap
from gateway.app import create_app
from gateway.config import Settings

YAML = """models:
  - id: small
    backend: openai
    replicas: [http://127.0.0.1:9/v1]
    context_length: 4096
  - id: large
    backend: openai
    replicas: [http://127.0.0.1:9/v1]
    context_length: 4096
    aliases: [big]
  - id: coder
    backend: openai
    replicas: [http://127.0.0.1:9/v1]
    context_length: 4096
  - id: auto
    backend: router
    default: big
    routes:
      - model: coder
        code: true
      - model: large
        tools: true
      - model: small
        max_prompt_tokens: 40
        max_output_tokens: 64
"""


class Stub:
    """Just what the router asks of a target."""

    def __init__(self, ready: bool = True, capacity: bool = True) -> None:
        self.ready, self.healthy, self._capacity = ready, True, capacity

    def has_capacity(self) -> bool:
        return self._capacity

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return list(range(sum(len(m["content"].split()) for m in messages)))

    def encode_text(self, text: str) -> list[int]:
        return list(range(len(text.split())))


def router(**targets: Stub) -> RouterEngine:
    table = parse_models(YAML, "models.yaml")
    auto = table.build()["auto"]
    assert isinstance(auto, RouterEngine)
    auto.targets = {name: targets.get(name, Stub()) for name in auto.targets}  # type: ignore[misc]
    return auto


def chat(text: str, **kw: Any) -> dict[str, Any]:
    return {"model": "auto", "messages": [{"role": "user", "content": text}], **kw}


def test_rules_pick_the_expected_model() -> None:
    auto = router()
    assert auto.default == "large"  # an alias resolves to its model
    assert auto.choose(chat("hi there", max_tokens=32), "chat") == "small"
    assert auto.choose(chat("hi there"), "chat") == "large"  # unbounded output is not "short"
    assert auto.choose(chat("hi there", max_tokens=500), "chat") == "large"
    assert auto.choose(chat("word " * 100, max_tokens=32), "chat") == "large"  # long prompt
    assert auto.choose(chat("fix this:\n```python\ndef f(x):\n    return x\n```", max_tokens=32), "chat") == "coder"
    assert auto.choose(chat("what is the weather", max_tokens=32, tools=[{"type": "function"}]), "chat") == "large"
    assert auto.choose({"model": "auto", "prompt": "short one", "max_tokens": 8}, "text") == "small"


def test_unavailable_choice_falls_through_to_the_next_match_then_default() -> None:
    auto = router(small=Stub(capacity=False))
    assert auto.choose(chat("hi", max_tokens=8), "chat") == "large"
    auto = router(coder=Stub(ready=False))
    assert auto.choose(chat("```x```", tools=[{"type": "function"}]), "chat") == "large"


def test_models_yaml_problems_name_the_line() -> None:
    with pytest.raises(ModelsConfigError) as err:
        parse_models(YAML.replace("model: coder", "model: codr"), "models.yaml")
    assert "models[3].routes[0].model: no model named 'codr'" in str(err.value)
    with pytest.raises(ModelsConfigError) as err:
        parse_models(YAML.replace("code: true", "kode: true"), "models.yaml")
    assert "unknown route condition 'kode'" in str(err.value)
    with pytest.raises(ModelsConfigError) as err:
        parse_models(YAML.replace("default: big", "default: auto"), "models.yaml")
    assert "is a router" in str(err.value)


# through the gateway -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def routed_gw(engine: Any, fresh_pg_database: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """`small` and `large` are the real model under two ids, `auto` routes between them."""
    from engines.wrappers.router import Rule

    small, large = FallbackEngine("small", [engine]), FallbackEngine("large", [engine])
    auto = RouterEngine("auto", [Rule("small", max_prompt_tokens=60, max_output_tokens=16)], "large", {"small": small, "large": large})
    db_url = fresh_pg_database(migrated=True)
    admin_key = bootstrap(db_url, SECRET)
    settings = Settings(database_url=db_url, server_secret=SECRET, data_dir=tmp_path_factory.mktemp("gw-route"))
    app = create_app(settings, engines={"small": small, "large": large, "auto": auto})
    server = ServerThread(app).__enter__()
    try:
        yield Gateway(f"http://127.0.0.1:{server.port}", settings, admin_key, engine, app, db_url)
    finally:
        server.__exit__()


async def test_routed_request_names_and_bills_the_chosen_model(routed_gw: Gateway, client_for: Any) -> None:
    async with routed_gw.admin_client() as admin:
        for model, price in (("small", "1.000"), ("large", "10.000")):
            r = await admin.post("/admin/prices", json={"model": model, "input_per_million": price, "output_per_million": price})
            assert r.status_code == 201, r.text
    await asyncio.sleep(0.1)
    client = client_for((await routed_gw.new_key())["key"], routed_gw)
    msgs = [{"role": "user", "content": "Say hello."}]
    for max_tokens, expected, per_token in ((8, "small", 1000), (24, "large", 10000)):
        raw = await client.chat.completions.with_raw_response.create(model="auto", messages=msgs, max_tokens=max_tokens, temperature=0)
        resp = raw.parse()
        assert resp.model == expected
        row = await routed_gw.ledger_row(raw.headers["x-request-id"])
        assert row["model"] == expected
        assert row["cost_nanos"] == (row["prompt_tokens"] + row["completion_tokens"]) * per_token
    stream = await client.chat.completions.create(model="auto", messages=msgs, max_tokens=8, temperature=0, stream=True)
    models = {chunk.model async for chunk in stream}
    assert models == {"small"}
    listed = {m.id for m in (await client.models.list()).data}
    assert "auto" in listed


async def test_messages_and_responses_are_routed_as_chat_completions_are(routed_gw: Gateway) -> None:
    """`auto` on /v1/messages and /v1/responses: the router chooses as for the chat completion they
    translate to; the answer names, and the row bills, the chosen model (not the router, which
    serves nothing)."""
    import anthropic
    import openai

    key = (await routed_gw.new_key())["key"]
    claude = anthropic.AsyncAnthropic(base_url=routed_gw.base_url, api_key=key, max_retries=0, timeout=120)
    client = openai.AsyncOpenAI(base_url=routed_gw.v1, api_key=key, max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": "Say hello."}]
    for max_tokens, expected in ((16, "small"), (24, "large")):  # 16: the least the Responses API takes
        raw = await claude.messages.with_raw_response.create(model="auto", max_tokens=max_tokens, messages=msgs)  # type: ignore[arg-type]
        message = await raw.parse()  # the anthropic SDK's async raw response parses asynchronously
        assert message.model == expected and message.content, message
        assert (await routed_gw.ledger_row(raw.headers["request-id"]))["model"] == expected
        raw = await client.responses.with_raw_response.create(model="auto", input="Say hello.", max_output_tokens=max_tokens)
        response = raw.parse()
        assert response.model == expected and response.status in ("completed", "incomplete"), response
        assert (await routed_gw.ledger_row(raw.headers["x-request-id"]))["model"] == expected
    counted = await claude.messages.count_tokens(model="auto", messages=msgs)  # type: ignore[arg-type]
    assert counted.input_tokens > 0
