"""What an `openai` pool forwards is bounded by what the gateway counted, reserved and billed
(engines/backends/upstream_params.py INTERNAL, MULTIPLIERS, priority), and what trtllm-serve's and vLLM's
answers mean (a dead engine's 400, early finish reasons).

The end-to-end tests run a Tollgate on Postgres in front of a scripted upstream
(tests/fakes/upstream.py) that honours the engine-level fields as the real servers do: a
`prompt_token_ids` prompt is billed at its length, `best_of` sequences each generate."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import openai
import pytest
import sqlalchemy as sa

from billing.db import create_engine
from engines.backends.upstream_params import ParamPolicy, ParamRefused, check_params
from tests.engines.backends.test_openai_pool import QUESTION, client_of, pool_yaml, request_id_of
from tests.fakes.upstream import Behaviour

# Facts read from the upstreams' sources (not from the code under test): the fields no tenant may
# set, each with a value that would be honoured.
ENGINE_INTERNAL = {
    "prompt_token_ids": [1] * 5000,  # trtllm-serve chat: replaces the rendered messages
    "prompt_token_ids_b64": "AQAAAA==",  # trtllm-serve chat: the same, base64 int32
    "prompt_embeds": "AAAA",  # vLLM completions: embeddings as the prompt (torch.load on the server)
    "disaggregated_params": {"request_type": "generation_only", "ctx_request_id": 7,
                             "ctx_usage": {"prompt_tokens": 0, "total_tokens": 0}},  # trtllm-serve
    "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1]},  # vLLM
    "ec_transfer_params": {"do_remote_encode": True},  # vLLM
    "lora_request": {"lora_name": "x", "lora_int_id": 1, "lora_path": "/etc"},  # trtllm-serve
    "logits_processors": ["os.system"],  # vLLM (older servers): classes loaded by name
    "vllm_xargs": {"k": 1},  # vLLM
    "request_id": "someone-elses",  # vLLM
    "agent_hierarchy": {"x": 1},  # trtllm-serve SchedulingParams
    "injected_chat_template_kwargs": ["enable_thinking"],  # trtllm-serve, server-populated
    "chat_template": "{% for i in range(100000) %}x{% endfor %}",  # a prompt the gateway did not count
    "documents": [{"title": "t", "text": "long " * 1000}],  # added to the prompt by the template
    "mm_processor_kwargs": {"max_pixels": 12845056},  # vLLM (and trtllm-serve chat): a larger image costs more tokens
    "media_io_kwargs": {"video": {"num_frames": 1024}},  # vLLM (and trtllm-serve chat): more frames, more tokens
}
TRTLLM_ERROR = {"object": "error", "message": "LLM is shutting down", "type": "BadRequestError", "param": None, "code": 400}


async def rows_of(gw: Any, key_id: int) -> list[dict[str, Any]]:
    """The ledger rows of a key, oldest first."""
    await gw.flush_ledger()
    db = create_engine(gw.db_url)
    try:
        async with db.connect() as conn:
            rows = await conn.execute(sa.text(
                "SELECT status, prompt_tokens, completion_tokens FROM ledger_entries WHERE key_id = :k ORDER BY created_at"), {"k": key_id})
            return [dict(r._mapping) for r in rows]
    finally:
        await db.dispose()


async def limited_key(gw: Any, account_id: int, limits: dict[str, Any]) -> dict[str, Any]:
    """A new key of the account with these limits (PATCH /admin/keys/{id})."""
    key = await gw.new_key(account_id)
    async with gw.admin_client() as admin:
        r = await admin.patch(f"/admin/keys/{key['id']}", json={"limits": limits})
        assert r.status_code == 200 and r.json()["limits"] == limits, r.text
    return key


# the policy on its own ---------------------------------------------------------------------------
@pytest.mark.parametrize("config", [None, {"policy": "pass"}, {"policy": "drop", "upstream": "trtllm-serve"},
                                    {"policy": "drop", "upstream": "vllm"}, {"policy": "pass", "drop": ["user"]}])
@pytest.mark.parametrize("name", sorted(ENGINE_INTERNAL))
def test_every_engine_internal_field_is_refused_by_name_whatever_the_policy(config: dict[str, Any] | None, name: str) -> None:
    policy = ParamPolicy.from_config(config)
    for chat in (True, False):
        body = {"model": "m", "messages" if chat else "prompt": QUESTION if chat else "hi", name: ENGINE_INTERNAL[name]}
        with pytest.raises(ParamRefused) as refused:
            policy.apply(body, chat=chat)
        assert refused.value.name == name and f"`{name}`" in str(refused.value)


def test_a_model_may_allow_an_internal_field_and_only_those_listed() -> None:
    policy = ParamPolicy.from_config({"policy": "pass", "allow": ["prompt_token_ids"]})
    body = {"model": "m", "messages": QUESTION, "prompt_token_ids": [1, 2, 3]}
    assert policy.apply(body, chat=True) == [] and body["prompt_token_ids"] == [1, 2, 3]
    with pytest.raises(ParamRefused, match="disaggregated_params"):
        policy.apply({"model": "m", "messages": QUESTION, "disaggregated_params": {"request_type": "generation_only"}}, chat=True)
    # with policy: drop the allowed field must also be one the upstream takes, or it is dropped
    policy = ParamPolicy.from_config({"policy": "drop", "upstream": "vllm", "allow": ["prompt_token_ids"]})
    body = {"model": "m", "messages": QUESTION, "prompt_token_ids": [1]}
    assert policy.apply(body, chat=True) == ["prompt_token_ids"]
    assert "allow lists 'temperature'" in (check_params({"allow": ["temperature"]}) or "")
    assert check_params({"allow": "prompt_token_ids"}) == "allow must be a list of field names"


# vLLM's build_chat_params merges chat_template_kwargs into the template's variables and keeps those
# the template uses plus HF's standard ones (documents, tools); trtllm-serve renders them too.
TEMPLATE_TEXT = {
    "documents": [{"title": "t", "text": "long " * 1000}],
    "tools": [{"type": "function", "function": {"name": "f", "description": "long " * 1000}}],
    "system_note": "long " * 200,  # a variable of the model's template, rendered as it is
    "extra": {"anything": "long " * 100},
}


@pytest.mark.parametrize("config", [None, {"policy": "drop", "upstream": "trtllm-serve"}, {"policy": "drop", "upstream": "vllm"}])
def test_chat_template_variables_carrying_text_are_refused_and_switches_pass(config: dict[str, Any] | None) -> None:
    policy = ParamPolicy.from_config(config)
    for name, value in TEMPLATE_TEXT.items():
        with pytest.raises(ParamRefused) as refused:
            policy.apply({"model": "m", "messages": QUESTION, "chat_template_kwargs": {"enable_thinking": False, name: value}}, chat=True)
        assert refused.value.name == f"chat_template_kwargs.{name}" and "does not count" in str(refused.value)
    with pytest.raises(ParamRefused, match="must be an object"):
        policy.apply({"model": "m", "messages": QUESTION, "chat_template_kwargs": ["documents"]}, chat=True)
    switches = {"enable_thinking": False, "reasoning_effort": "low", "thinking_budget": 128, "documents": None}
    body = {"model": "m", "messages": QUESTION, "chat_template_kwargs": dict(switches)}
    assert policy.apply(body, chat=True) == [] and body["chat_template_kwargs"] == switches
    trusted = ParamPolicy.from_config({**(config or {}), "allow": ["chat_template_kwargs"]})
    body = {"model": "m", "messages": QUESTION, "chat_template_kwargs": {"documents": TEMPLATE_TEXT["documents"]}}
    assert trusted.apply(body, chat=True) == [] and body["chat_template_kwargs"]["documents"] == TEMPLATE_TEXT["documents"]


def test_chat_best_of_beyond_n_is_refused_and_text_best_of_is_the_gateways() -> None:
    policy = ParamPolicy.from_config(None)
    with pytest.raises(ParamRefused) as refused:
        policy.apply({"model": "m", "messages": QUESTION, "best_of": 8}, chat=True)
    assert refused.value.name == "best_of"
    assert policy.apply({"model": "m", "messages": QUESTION, "best_of": 1}, chat=True) == []
    assert policy.apply({"model": "m", "prompt": "hi", "best_of": 2}, chat=False) == []  # parsed and reserved by the gateway


def test_a_tenants_priority_is_never_forwarded_and_classes_map_per_upstream() -> None:
    for config in (None, {"policy": "pass"}, {"policy": "drop", "upstream": "vllm"}, {"policy": "drop", "upstream": "trtllm-serve"}):
        body = {"model": "m", "messages": QUESTION, "priority": -1000}
        assert "priority" in ParamPolicy.from_config(config).apply(body, chat=True) and "priority" not in body
    classes = ("interactive", "standard", "batch")
    vllm = ParamPolicy.from_config({"policy": "drop", "upstream": "vllm", "priority": "by_class"})
    trt = ParamPolicy.from_config({"policy": "pass", "upstream": "trtllm-serve", "priority": "by_class"})
    for p in (vllm, trt):
        p.use_classes(classes)
    # vLLM: an integer, lower first (0 is its default); trtllm-serve: a float in [0, 1], higher first
    assert [vllm.upstream_priority(c) for c in (None, *classes, "unknown")] == [0, 0, 1, 2, 2]
    assert [trt.upstream_priority(c) for c in (None, *classes, "unknown")] == [1.0, 1.0, 0.5, 0.0, 0.0]
    explicit = ParamPolicy.from_config({"priority": {"interactive": 0.9, "batch": 0.1}})
    explicit.use_classes(classes)
    assert (explicit.upstream_priority(None), explicit.upstream_priority("batch"), explicit.upstream_priority("standard")) == (0.9, 0.1, None)
    none = ParamPolicy.from_config(None)
    none.use_classes(classes)
    assert none.upstream_priority("batch") is None  # nothing configured: nothing sent
    assert "needs upstream" in (check_params({"priority": "by_class"}) or "")
    assert "0.0 to 1.0" in (check_params({"policy": "drop", "upstream": "trtllm-serve", "priority": {"batch": 5}}) or "")
    assert "integer" in (check_params({"policy": "drop", "upstream": "vllm", "priority": {"batch": 0.5}}) or "")


# end to end ------------------------------------------------------------------------------------------
async def test_a_tenant_cannot_spend_past_its_reservation_through_engine_fields(upstreams: Any, tollgate_with: Any) -> None:
    up, url = upstreams()
    gw = tollgate_with(pool_yaml(url, extra="health_path: null") + f"""
      - id: trusted
        backend: openai
        context_length: 8192
        replicas: [{url}]
        health_path: null
        params: {{allow: [prompt_token_ids]}}
    """)
    account = await gw.new_account()
    key = await limited_key(gw, account["id"], {"monthly_tokens": 1000})
    client = openai.AsyncOpenAI(base_url=gw.v1, api_key=key["key"], max_retries=0, timeout=30)
    for name, value in [*ENGINE_INTERNAL.items(), ("best_of", 8)]:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model="pool", messages=QUESTION, max_tokens=5, extra_body={name: value})
        error = refused.value.body
        assert refused.value.status_code == 400 and error["param"] == name, (name, error)
        assert error["type"] == "invalid_request_error" and name in error["message"]
    for name, value in TEMPLATE_TEXT.items():
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model="pool", messages=QUESTION, max_tokens=5,
                                                 extra_body={"chat_template_kwargs": {name: value}})
        assert refused.value.status_code == 400 and refused.value.body["param"] == f"chat_template_kwargs.{name}", refused.value.body
    assert up.requests == []  # none reached the upstream
    # refused before admission: nothing held, no row, nothing billed
    assert await rows_of(gw, key["id"]) == []

    # the same tenant's plain request is within its reservation (prompt + max_tokens) and billed as usual
    resp = await client.chat.completions.create(model="pool", messages=QUESTION, max_tokens=5)
    assert resp.usage is not None and resp.usage.total_tokens <= 1000
    # what the refusal prevents: where a model allows prompt_token_ids, the upstream bills that prompt,
    # far past what the gateway counted and reserved (and past the key's 1,000 tokens)
    trusted = await client.chat.completions.create(model="trusted", messages=QUESTION, max_tokens=5,
                                                   extra_body={"prompt_token_ids": ENGINE_INTERNAL["prompt_token_ids"]})
    assert up.requests[-1].body["prompt_token_ids"] == ENGINE_INTERNAL["prompt_token_ids"]
    row = await gw.ledger_row(request_id_of(trusted.id))
    assert row["prompt_tokens"] == 5000 > 1000


async def test_a_text_completion_without_max_tokens_goes_up_bounded_by_what_was_reserved(upstreams: Any, tollgate_with: Any) -> None:
    """OpenAI's text completions default to 16 tokens, which the gateway reserves; trtllm-serve's
    CompletionRequest.max_tokens defaults to None (openai_protocol.py at TRTLLM_SERVE_COMMIT): it
    generates to the end of its context. The bound goes upstream, so the key's limit holds."""
    up, url = upstreams()
    up.default = Behaviour(tokens=["w"] * 40, bounded=True)  # trtllm-serve: without a max_tokens, all 40
    gw = tollgate_with(pool_yaml(url, extra="health_path: null\nparams: {policy: drop, upstream: trtllm-serve}"))
    account = await gw.new_account()
    for stream in (False, True):
        key = await limited_key(gw, account["id"], {"monthly_tokens": 50})
        client = openai.AsyncOpenAI(base_url=gw.v1, api_key=key["key"], max_retries=0, timeout=30)
        if stream:
            chunks = [c async for c in await client.completions.create(model="pool", prompt="hi", stream=True)]
            text, rid = "".join(c.choices[0].text for c in chunks if c.choices), request_id_of(chunks[0].id)
        else:
            resp = await client.completions.create(model="pool", prompt="hi")
            text, rid = resp.choices[0].text, request_id_of(resp.id)
        assert up.requests[-1].body["max_tokens"] == 16 and text == "w" * 16
        row = await gw.ledger_row(rid)
        assert row["completion_tokens"] == 16 and row["prompt_tokens"] + row["completion_tokens"] <= 50, row
    # a bound the client chose goes up as it is (it is what was reserved); none at all is the rest of the
    # gateway's context, reserved as such, and that goes up: the upstream's own default is the rest of
    # its context, which may be larger or, past a prompt it truncated, hold more than was reserved
    client = await client_of(gw)
    engine = gw.app.state.service.engines["pool"]
    await client.completions.create(model="pool", prompt="hi", max_tokens=3)
    assert up.requests[-1].body["max_tokens"] == 3
    await client.completions.create(model="pool", prompt="hi", extra_body={"max_tokens": None})
    assert up.requests[-1].body["max_tokens"] == 8192 - len(engine.renderer.encode_text("hi"))
    chat_room = 8192 - len(engine.renderer.encode_chat(QUESTION))
    await client.chat.completions.create(model="pool", messages=QUESTION)
    assert up.requests[-1].body["max_tokens"] == chat_room and "max_completion_tokens" not in up.requests[-1].body
    await client.chat.completions.create(model="pool", messages=QUESTION, max_completion_tokens=chat_room)
    assert up.requests[-1].body["max_completion_tokens"] == chat_room and "max_tokens" not in up.requests[-1].body
    sent = len(up.requests)
    with pytest.raises(openai.BadRequestError) as info:  # past the room: refused, as the upstream would
        await client.chat.completions.create(model="pool", messages=QUESTION, max_completion_tokens=chat_room + 1)
    assert info.value.code == "context_length_exceeded" and len(up.requests) == sent


async def test_a_pass_through_prompts_tools_are_reserved_before_the_upstream_prefills_them(upstreams: Any, tollgate_with: Any) -> None:
    """The tools go upstream with the body, and its chat template shows them to the model (vLLM even
    with tool_choice "none"): the prompt it bills holds them. The reservation counts them, so a key
    cannot spend past its limit with a long tool list and a small max_tokens."""
    up, url = upstreams()
    gw = tollgate_with(pool_yaml(url, extra="health_path: null"))
    account = await gw.new_account()
    key = await limited_key(gw, account["id"], {"monthly_tokens": 1000})
    client = openai.AsyncOpenAI(base_url=gw.v1, api_key=key["key"], max_retries=0, timeout=30)
    long_tool = [{"type": "function", "function": {"name": "lookup", "description": "a word " * 2500,
                                                   "parameters": {"type": "object", "properties": {}}}}]
    for choice in ("auto", "none"):
        with pytest.raises(openai.RateLimitError):
            await client.chat.completions.create(model="pool", messages=QUESTION, max_tokens=5, tools=long_tool, tool_choice=choice)  # type: ignore[arg-type]
    claude = anthropic.AsyncAnthropic(base_url=gw.base_url, api_key=key["key"], max_retries=0, timeout=30)
    tool = {"name": "lookup", "description": "a word " * 2500, "input_schema": {"type": "object", "properties": {}}}
    with pytest.raises(anthropic.BadRequestError):  # the key's monthly limit: Anthropic's 400 for usage limits
        await claude.messages.create(model="pool", max_tokens=5, messages=[{"role": "user", "content": "hi"}], tools=[tool])  # type: ignore[list-item]
    assert up.requests == []  # refused at admission: nothing prefilled, nothing held
    assert await rows_of(gw, key["id"]) == []
    counted = await claude.messages.count_tokens(model="pool", messages=[{"role": "user", "content": "hi"}], tools=[tool])  # type: ignore[list-item]
    assert counted.input_tokens > 5000
    # the same question with a short tool goes through
    short = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]
    await client.chat.completions.create(model="pool", messages=QUESTION, max_tokens=5, tools=short)  # type: ignore[arg-type]
    assert len(up.requests) == 1


async def test_the_account_class_goes_upstream_as_each_server_ranks_it(upstreams: Any, tollgate_with: Any) -> None:
    up, url = upstreams()
    gw = tollgate_with(pool_yaml(url, model="on-vllm", extra="health_path: null\nparams: {policy: drop, upstream: vllm, priority: by_class}") + f"""
      - id: on-trtllm
        backend: openai
        context_length: 8192
        replicas: [{url}]
        health_path: null
        params: {{policy: pass, upstream: trtllm-serve, priority: by_class}}
      - id: plain
        backend: openai
        context_length: 8192
        replicas: [{url}]
        health_path: null
    """)
    top = await client_of(gw)
    batch_account = await gw.new_account()
    async with gw.admin_client() as admin:
        r = await admin.patch(f"/admin/accounts/{batch_account['id']}", json={"priority": "batch"})
        assert r.status_code == 200, r.text
    batch_key = await gw.new_key(batch_account["id"])
    batch = openai.AsyncOpenAI(base_url=gw.v1, api_key=batch_key["key"], max_retries=0, timeout=30)
    sent = {}
    for who, client in (("top", top), ("batch", batch)):
        for model in ("on-vllm", "on-trtllm", "plain"):
            await client.chat.completions.create(model=model, messages=QUESTION, max_tokens=3, extra_body={"priority": -7})
            sent[who, model] = up.requests[-1].body.get("priority", "absent")
    # default classes: interactive (top), batch
    assert sent == {("top", "on-vllm"): 0, ("top", "on-trtllm"): 1.0, ("top", "plain"): "absent",
                    ("batch", "on-vllm"): 1, ("batch", "on-trtllm"): 0.0, ("batch", "plain"): "absent"}


async def test_trtllm_serves_dead_engine_400_fails_over_and_ejects(upstreams: Any, tollgate_with: Any) -> None:
    dead, dead_url = upstreams("dead")
    alive, alive_url = upstreams("alive")
    lone, lone_url = upstreams("lone")
    dead.default = Behaviour(status=400, error_body=TRTLLM_ERROR)
    gw = tollgate_with(pool_yaml(dead_url, alive_url, extra="health_path: null\neject_after: 3\ncooldown: 600") + f"""
      - id: lone
        backend: openai
        context_length: 8192
        replicas: [{lone_url}]
        health_path: null
    """)
    client = await client_of(gw)
    answered = [await client.chat.completions.create(model="pool", messages=QUESTION, max_tokens=3) for _ in range(3)]
    assert all(a.choices[0].message.content for a in answered)
    replica = gw.pool("pool").replicas[0]
    assert replica.ejected and replica.ejections == 1
    assert len(dead.requests) == 1 and len(alive.requests) == 3  # out of rotation after its one 400
    stream = await client.chat.completions.create(model="pool", messages=QUESTION, max_tokens=3, stream=True)
    assert [c async for c in stream]

    # the same 400 with the words only inside a validation message (a client's text echoed) stays the client's
    echoed = {**TRTLLM_ERROR, "message": "1 validation error for ChatCompletionRequest\nuser: LLM is shutting down"}
    lone.script.append(Behaviour(status=400, error_body=echoed))
    with pytest.raises(openai.BadRequestError, match="validation error"):
        await client.chat.completions.create(model="lone", messages=QUESTION, max_tokens=3)
    replica = gw.pool("lone").replicas[0]
    assert not replica.ejected and replica.failures == 0 and len(lone.requests) == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_upstream_timeout_and_cancelled_are_recorded_as_such(upstreams: Any, tollgate_with: Any, stream: bool) -> None:
    up, url = upstreams()
    gw = tollgate_with(pool_yaml(url, extra="health_path: null"))
    client = await client_of(gw)
    for upstream_reason, recorded, status in (("timeout", "timeout", "completed"), ("cancelled", "cancelled", "interrupted"),
                                              ("abort", "cancelled", "interrupted"), ("stop", "stop", "completed")):
        up.script.append(Behaviour(finish_reason=upstream_reason))
        if stream:
            chunks = [c async for c in await client.chat.completions.create(
                model="pool", messages=QUESTION, max_tokens=20, stream=True, stream_options={"include_usage": True})]
            finish = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
            rid = request_id_of(chunks[0].id)
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "The capital of France is Paris."
        else:
            resp = await client.chat.completions.create(model="pool", messages=QUESTION, max_tokens=20)
            finish, rid = resp.choices[0].finish_reason, request_id_of(resp.id)
        assert finish == ("stop" if upstream_reason == "stop" else "length")  # what OpenAI clients know: cut short
        row = await gw.ledger_row(rid)
        assert (row["finish_reason"], row["status"]) == (recorded, status), upstream_reason
        assert row["completion_tokens"] == 7 and row["estimated"] is False


async def test_refusals_keep_the_apis_shape_on_text_completions(upstreams: Any, tollgate_with: Any) -> None:
    up, url = upstreams()
    gw = tollgate_with(pool_yaml(url, extra="health_path: null"))
    key = await gw.new_key()
    async with httpx.AsyncClient(base_url=gw.v1, headers={"Authorization": f"Bearer {key['key']}"}, timeout=30) as http:
        r = await http.post("/completions", json={"model": "pool", "prompt": "hi", "max_tokens": 3, "prompt_embeds": "AAAA"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_embeds", r.text
        r = await http.post("/completions", json={"model": "pool", "prompt": "hi", "max_tokens": 3, "kv_transfer_params": {"a": 1}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params", r.text
    assert up.requests == []


def test_an_upstream_with_policy_pass_names_the_priority_scale_only() -> None:
    assert "upstream applies only" in (check_params({"policy": "pass", "upstream": "vllm"}) or "")
    assert check_params({"policy": "pass", "upstream": "vllm", "priority": {"batch": 3}}) is None
    assert "integer" in (check_params({"policy": "pass", "upstream": "vllm", "priority": {"batch": 0.5}}) or "")


async def test_an_upstreams_filter_or_function_call_finish_is_a_stop_reason_anthropic_knows(upstreams: Any, tollgate_with: Any) -> None:
    """An upstream's `content_filter` is Anthropic's `refusal`, its legacy `function_call` a `tool_use`:
    never the null a finished message does not carry."""
    up, url = upstreams()
    gw = tollgate_with(pool_yaml(url, extra="health_path: null"))
    claude = anthropic.AsyncAnthropic(base_url=gw.base_url, api_key=(await gw.new_key())["key"], max_retries=0, timeout=30)
    for finish, expected in (("content_filter", "refusal"), ("function_call", "tool_use")):
        up.script += [Behaviour(finish_reason=finish), Behaviour(finish_reason=finish)]
        message = await claude.messages.create(model="pool", max_tokens=16, messages=[{"role": "user", "content": "hi"}])
        async with claude.messages.stream(model="pool", max_tokens=16, messages=[{"role": "user", "content": "hi"}]) as stream:
            streamed = await stream.get_final_message()
        assert (message.stop_reason, streamed.stop_reason) == (expected, expected), finish


# non-text content parts (images, audio, files, video) -----------------------------------------------------
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "iVBORw0KGgo" * 400}}  # data: ~1,200 cl100k tokens as text
LOOK = [{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"}, IMAGE]}]
OTHER_PARTS = [
    {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
    {"type": "file", "file": {"file_data": "data:application/pdf;base64,JVBERi0=", "filename": "a.pdf"}},
    {"type": "video_url", "video_url": {"url": "https://example.com/clip.mp4"}},
]


def bounded_pool(url: str, model: str = "pool", bound: int | None = 2000) -> str:
    return pool_yaml(url, model=model, extra="health_path: null" + (f"\ntokens_per_non_text_part: {bound}" if bound else ""))


async def test_a_non_text_part_without_a_bound_is_refused_before_admission(upstreams: Any, tollgate_with: Any) -> None:
    up, url = upstreams()
    gw = tollgate_with(bounded_pool(url, bound=None))
    account = await gw.new_account()
    key = await limited_key(gw, account["id"], {"monthly_tokens": 100_000})
    client = openai.AsyncOpenAI(base_url=gw.v1, api_key=key["key"], max_retries=0, timeout=30)
    asked = [(LOOK, "messages[0].content[1].type", "image_url")]
    for part in OTHER_PARTS:  # behind a system message and a text-only turn: the indexes are the part's own
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                    {"role": "user", "content": [{"type": "text", "text": "and this?"}, {"type": "text", "text": "look"}, part]}]
        asked.append((messages, "messages[2].content[2].type", part["type"]))
    for messages, param, kind in asked:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as refused:
                await client.chat.completions.create(model="pool", messages=messages, max_tokens=5, stream=stream)  # type: ignore[arg-type]
            error = refused.value.body
            assert refused.value.status_code == 400 and error["type"] == "invalid_request_error", error
            assert error["param"] == param, error
            assert kind in error["message"] and "does not bound the tokens" in error["message"], error
            assert "tokens_per_non_text_part" in error["message"], error
    # vLLM's embeddings given as content are sized by the caller: refused even where the model has a bound
    embeds = [{"role": "user", "content": [{"type": "image_embeds", "image_embeds": "AAAA"}]}]
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model="pool", messages=embeds, max_tokens=5)  # type: ignore[arg-type]
    assert refused.value.body["param"] == "messages[0].content[0].type"
    assert up.requests == []  # nothing reached the upstream
    assert await rows_of(gw, key["id"]) == []  # refused before admission: no row, nothing reserved or billed
    # the other APIs refuse their image blocks and parts themselves, in their own shape (they never reach a pool)
    claude = anthropic.AsyncAnthropic(base_url=gw.base_url, api_key=key["key"], max_retries=0, timeout=30)
    image_block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as blocked:
        await claude.messages.create(model="pool", max_tokens=5, messages=[{"role": "user", "content": [image_block]}])  # type: ignore[list-item]
    assert blocked.value.body["error"]["type"] == "invalid_request_error" and "'image'" in blocked.value.body["error"]["message"]
    with pytest.raises(openai.BadRequestError) as responses:
        await client.responses.create(model="pool", max_output_tokens=16, input=[  # type: ignore[list-item]
            {"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo=", "detail": "auto"}]}])
    assert responses.value.body["param"] == "input[0].content[0].type"
    assert up.requests == [] and await rows_of(gw, key["id"]) == []


async def test_a_non_text_part_is_reserved_at_the_models_bound(upstreams: Any, tollgate_with: Any) -> None:
    up, url = upstreams()
    gw = tollgate_with(bounded_pool(url, bound=2000))
    pool = gw.engines()["pool"]
    text = len(pool.encode_chat([{"role": "user", "content": "What is in this picture?"}]))
    assert len(pool.encode_chat(LOOK)) == text + 2000  # the bound in place of the part (its data not counted as text)
    account = await gw.new_account()

    # a key whose limit is below the bound + the text: refused at admission, nothing sent, nothing held
    short = await limited_key(gw, account["id"], {"monthly_tokens": 2000 + text})
    client = openai.AsyncOpenAI(base_url=gw.v1, api_key=short["key"], max_retries=0, timeout=30)
    for stream in (False, True):
        with pytest.raises(openai.RateLimitError):
            await client.chat.completions.create(model="pool", messages=LOOK, max_tokens=5, stream=stream)  # type: ignore[arg-type]
    assert up.requests == [] and await rows_of(gw, short["id"]) == []
    # the same key takes the question without the picture (what is refused is the picture's bound)
    await client.chat.completions.create(model="pool", messages=[{"role": "user", "content": "What is in this picture?"}], max_tokens=5)
    assert len(up.requests) == 1

    # a key within its limit: served, the part goes upstream unchanged, and the reservation held the bound
    roomy = await limited_key(gw, account["id"], {"tpm": 10_000, "monthly_tokens": 100_000})
    client = openai.AsyncOpenAI(base_url=gw.v1, api_key=roomy["key"], max_retries=0, timeout=30)
    raw = await client.chat.completions.with_raw_response.create(model="pool", messages=LOOK, max_tokens=5)  # type: ignore[arg-type]
    assert raw.parse().choices[0].message.content
    assert up.requests[-1].body["messages"] == LOOK
    reserved = 10_000 - int(raw.headers["x-ratelimit-remaining-tokens"])  # this key's first request this minute
    assert reserved == text + 2000 + 5
    # an upstream that reports no usage: the row is billed what was counted, the bound included
    up.script.append(Behaviour(usage=False))
    resp = await client.chat.completions.create(model="pool", messages=LOOK, max_tokens=5)  # type: ignore[arg-type]
    row = await gw.ledger_row(request_id_of(resp.id))
    assert row["estimated"] is True and row["prompt_tokens"] == text + 2000


def unbounded_and_bounded(url: str) -> str:
    """Two pools on one upstream: `pool` with no bound for non-text content, `bounded` at 2,000 tokens."""
    return bounded_pool(url, bound=None) + f"""
      - id: bounded
        backend: openai
        context_length: 8192
        replicas: [{url}]
        health_path: null
        tokens_per_non_text_part: 2000
    """


async def test_text_parts_count_as_before(upstreams: Any, tollgate_with: Any) -> None:
    up, url = upstreams()
    gw = tollgate_with(unbounded_and_bounded(url))
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital "}, {"type": "text", "text": "of France?"}]}]
    counts = {name: len(gw.engines()[name].encode_chat(parts)) for name in ("pool", "bounded")}
    assert counts["pool"] == counts["bounded"] == len(gw.engines()["pool"].encode_chat(QUESTION))  # the same text as one string
    client = await client_of(gw)
    for model in ("pool", "bounded"):
        up.script.append(Behaviour(usage=False))
        resp = await client.chat.completions.create(model=model, messages=parts, max_tokens=5)  # type: ignore[arg-type]
        assert up.requests[-1].body["messages"] == parts
        assert resp.usage is not None and resp.usage.prompt_tokens == counts[model]


def test_the_template_path_counts_the_bound_whatever_the_template_does_with_the_part(tmp_path: Any) -> None:
    """A local HF tokenizer with a chat template: a template that only takes string content, or one
    that would render a list as its text (the image's data), counts the text and the bound."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from engines.backends.openai_stream import TokenCounter

    strict = ("{% for m in messages %}{% if m['content'] is not string %}{{ raise_exception('string content only') }}{% endif %}"
              "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    verbatim = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    question = [{"role": "user", "content": "What is in this picture?"}]
    for name, template in (("strict", strict), ("verbatim", verbatim)):
        words = Tokenizer(models.WordLevel(vocab={"[UNK]": 0}, unk_token="[UNK]"))
        words.pre_tokenizer = pre_tokenizers.Whitespace()
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]")
        tokenizer.chat_template = template
        tokenizer.save_pretrained(tmp_path / name)
        counter = TokenCounter(str(tmp_path / name), tokens_per_part=300)
        counter.load()
        rendered = counter._hf.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
        assert len(counter.encode_chat(question)) == len(counter.encode_text(rendered))  # through the template, not flattened
        assert len(counter.encode_chat(LOOK)) == len(counter.encode_chat(question)) + 300, name
        assert len(counter.encode_chat(LOOK * 2)) == len(counter.encode_chat(question * 2)) + 600, name


# message fields a template may render, and an assistant's audio ---------------------------------------------
THOUGHT = "Let me weigh every capital of Europe in turn before I answer. " * 40  # ~520 cl100k tokens
SAID = [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Spain?"}]


def with_fields(**fields: Any) -> list[dict[str, Any]]:
    return [SAID[0], {**SAID[1], **fields}, SAID[2]]


async def test_fields_a_template_may_render_are_counted_and_reserved(upstreams: Any, tollgate_with: Any) -> None:
    """vLLM hands its chat template an assistant's `reasoning` (also as `reasoning_content`), a tool
    result's `tool_call_id`, `name`, `task` and a developer message's `tools`, and a template may render
    them: a long reasoning sent back is counted (flattened: cl100k here) and the reservation holds it,
    so a key whose limit only covers the visible text is refused before anything goes upstream."""
    up, url = upstreams()
    gw = tollgate_with(bounded_pool(url, bound=None))
    pool = gw.engines()["pool"]
    plain, thought = len(pool.encode_chat(SAID)), len(pool.encode_text(THOUGHT))
    for name in ("reasoning", "reasoning_content"):
        assert len(pool.encode_chat(with_fields(**{name: THOUGHT}))) >= plain + thought, name
    developer = [{"role": "developer", "content": "Use tools.", "tools": [{"type": "function", "function": {"name": "x" * 300}}]}]
    assert len(pool.encode_chat(developer)) > len(pool.encode_chat([{"role": "developer", "content": "Use tools."}])) + 30
    assert len(pool.encode_chat(with_fields(task=THOUGHT))) >= plain + thought

    account = await gw.new_account()
    short = await limited_key(gw, account["id"], {"monthly_tokens": plain + thought})
    client = openai.AsyncOpenAI(base_url=gw.v1, api_key=short["key"], max_retries=0, timeout=30)
    for stream in (False, True):
        with pytest.raises(openai.RateLimitError):
            await client.chat.completions.create(model="pool", messages=with_fields(reasoning=THOUGHT), max_tokens=5,  # type: ignore[arg-type]
                                                 stream=stream)
    assert up.requests == [] and await rows_of(gw, short["id"]) == []
    await client.chat.completions.create(model="pool", messages=SAID, max_tokens=5)  # type: ignore[arg-type]
    assert len(up.requests) == 1  # the same key takes the conversation without the reasoning


async def test_an_assistants_audio_is_refused_without_a_bound_and_reserved_at_it(upstreams: Any, tollgate_with: Any) -> None:
    """An assistant message's `audio: {id}` (an earlier answer's audio, which OpenAI's API gives the model
    again) is content no tokenizer here counts: refused before admission without
    `tokens_per_non_text_part` (param messages[1].audio), counted at the bound with it."""
    up, url = upstreams()
    gw = tollgate_with(unbounded_and_bounded(url))
    heard = with_fields(audio={"id": "audio_abc123"})
    heard[1].pop("content")  # an audio answer has no text content
    client = await client_of(gw)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model="pool", messages=heard, max_tokens=5, stream=stream)  # type: ignore[arg-type]
        error = refused.value.body
        assert refused.value.status_code == 400 and error["param"] == "messages[1].audio", error
        assert "tokens_per_non_text_part" in error["message"], error
    assert up.requests == []
    bounded = gw.engines()["bounded"]
    assert len(bounded.encode_chat(heard)) == len(bounded.encode_chat([SAID[0], {"role": "assistant"}, SAID[2]])) + 2000
    up.script.append(Behaviour(usage=False))
    resp = await client.chat.completions.create(model="bounded", messages=heard, max_tokens=5)  # type: ignore[arg-type]
    assert up.requests[-1].body["messages"] == heard  # sent as given
    assert resp.usage is not None and resp.usage.prompt_tokens == len(bounded.encode_chat(heard))


@pytest.mark.parametrize(("value", "problem"), [
    ("0", "must be at least 1, got 0"),
    ("-5", "must be at least 1, got -5"),
    ("1.5", "must be an integer, got 1.5"),
    ("true", "must be an integer, got True"),
    ("lots", "must be an integer, got 'lots'"),
    ("9000", "must be at most context_length (8192), got 9000"),
])
def test_a_bad_bound_fails_at_start_naming_its_line(value: str, problem: str, tmp_path: Any) -> None:
    from engines.registry import ModelsConfigError, parse_models
    from gateway.config import EngineSettings, Settings
    from gateway.wiring import build_engines

    text = pool_yaml("http://127.0.0.1:9/v1", extra=f"health_path: null\ntokens_per_non_text_part: {value}")
    with pytest.raises(ModelsConfigError) as err:
        parse_models(text, "models.yaml")
    [line] = err.value.problems
    number = next(n for n, row in enumerate(text.splitlines(), 1) if "tokens_per_non_text_part" in row)
    assert line == f"models.yaml:{number}: models[0].tokens_per_non_text_part: {problem}"
    path = tmp_path / "models.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit, match=r"tokens_per_non_text_part: " + problem.replace("(", r"\(").replace(")", r"\)")):
        build_engines(Settings(engines=EngineSettings(models_file=str(path))))
    good = parse_models(pool_yaml("http://127.0.0.1:9/v1", extra="tokens_per_non_text_part: 8192"), "models.yaml")
    assert good.build()["pool"].candidates[0].counter.tokens_per_part == 8192  # type: ignore[attr-defined]


async def test_messages_on_a_text_completion_are_refused_before_the_upstream(upstreams: Any, tollgate_with: Any) -> None:
    """A pool sends a body with `messages` to the upstream's /chat/completions: on /v1/completions
    those messages were never counted nor checked against the context (only `prompt` was), and the
    text completion's bound did not go with them. Not a field of a text completion: a 400 naming it."""
    up, url = upstreams()
    gw = tollgate_with(pool_yaml(url, extra="health_path: null"))
    key = await limited_key(gw, (await gw.new_account())["id"], {"monthly_tokens": 100})
    client = openai.AsyncOpenAI(base_url=gw.v1, api_key=key["key"], max_retries=0, timeout=30)
    long = [{"role": "user", "content": "word " * 300}]
    with pytest.raises(openai.BadRequestError) as refused:
        await client.completions.create(model="pool", prompt="Hi", extra_body={"messages": long})
    assert refused.value.body["param"] == "messages" and "/v1/chat/completions" in refused.value.body["message"]  # type: ignore[index]
    assert up.requests == [] and await rows_of(gw, key["id"]) == []
    await client.completions.create(model="pool", prompt="Hi", max_tokens=3)  # the same key, a plain one: served
    assert up.requests[-1].path.endswith("/completions") and not up.requests[-1].path.endswith("/chat/completions")


async def test_an_echoed_prompt_is_not_billed_as_completion_when_the_stream_is_cut(upstreams: Any, tollgate_with: Any) -> None:
    """`echo` puts the prompt in front of a text completion's text (vLLM: in its first chunk). A
    stream cut before the upstream's usage is billed from the text relayed, which must not count the
    echoed prompt again as completion tokens (at the output price)."""
    up, url = upstreams()
    gw = tollgate_with(pool_yaml(url, extra="health_path: null"))
    key = await gw.new_key()
    prompt = "word " * 300
    up.script.append(Behaviour(tokens=[prompt, " one", " two", " three"] + [" more"] * 400, token_delay=0.05))
    body = {"model": "pool", "prompt": prompt, "echo": True, "max_tokens": 500, "stream": True}
    async with httpx.AsyncClient(base_url=gw.v1, headers={"Authorization": f"Bearer {key['key']}"}, timeout=30) as c:
        async with c.stream("POST", "/completions", json=body) as resp:
            request_id, seen = resp.headers["x-request-id"], 0
            async for line in resp.aiter_lines():
                seen += line.startswith("data: {")
                if seen == 4:  # the echoed prompt and three tokens
                    break
    row = await gw.ledger_row(request_id)
    assert row["estimated"] is True and 3 <= row["completion_tokens"] < 50, row  # not the prompt's 300 again
