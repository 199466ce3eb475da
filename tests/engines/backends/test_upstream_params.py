"""An `openai` pool's parameter policy (models.yaml `params:`, engines/backends/upstream_params.py; issue 20).

The end-to-end tests run a Tollgate configured by models.yaml in front of a scripted upstream that,
like trtllm-serve (pydantic extra="forbid"), answers 400 to a body with a field it does not know."""

from __future__ import annotations

import logging
import re
from typing import Any

import httpx
import openai
import pytest

from engines.registry import ModelsConfigError, parse_models
from engines.backends.upstream_params import (
    BILLING,
    NEEDED,
    TRTLLM_SERVE,
    UPSTREAM_COMMITS,
    UPSTREAMS,
    ParamPolicy,
    ParamRefused,
    check_params,
)
from tests.engines.backends.test_openai_pool import QUESTION, client_of, pool_yaml, request_id_of
from tests.fakes.upstream import Behaviour

# What an OpenAI SDK client may send that trtllm-serve's ChatCompletionRequest does not declare.
OPENAI_ONLY = {"metadata": {"team": "a"}, "store": False, "prompt_cache_key": "k", "service_tier": "auto"}


def trtllm_like(up: Any) -> None:
    up.accepts = {kind: frozenset(names) for kind, names in TRTLLM_SERVE.items()}


# the built-in lists --------------------------------------------------------------------------------
def test_builtin_lists_are_stamped_and_hold_what_the_gateway_needs() -> None:
    for name, lists in UPSTREAMS.items():
        repo, commit = UPSTREAM_COMMITS[name]
        assert "/" in repo and re.fullmatch(r"[0-9a-f]{40}", commit), name
        for kind in ("chat", "text"):
            names = lists[kind]
            assert len(set(names)) == len(names), f"{name} {kind} lists a name twice"
            assert {"model", "stream", "stream_options", "max_tokens"} <= set(names), (name, kind)
        assert "messages" in lists["chat"] and "prompt" in lists["text"]
        assert "include_usage" in lists["stream_options"]
    # facts read from trtllm-serve's source: fields OpenAI has that it does not declare
    assert not set(OPENAI_ONLY) & set(TRTLLM_SERVE["chat"])
    assert "suffix" in TRTLLM_SERVE["text"] and "suffix" not in TRTLLM_SERVE["chat"]


# the policy on its own -------------------------------------------------------------------------------
def test_drop_policy_keeps_what_the_upstream_accepts_and_counts_the_rest() -> None:
    policy = ParamPolicy.from_config({"policy": "drop", "upstream": "trtllm-serve"})
    body = {"model": "m", "messages": QUESTION, "max_tokens": 9, "temperature": 0.5, "top_k": 4, **OPENAI_ONLY,
            "stream_options": {"include_usage": True, "include_obfuscation": False}}
    removed = policy.apply(body, chat=True)
    assert sorted(removed) == sorted([*OPENAI_ONLY, "stream_options.include_obfuscation"])
    assert body == {"model": "m", "messages": QUESTION, "max_tokens": 9, "temperature": 0.5, "top_k": 4,
                    "stream_options": {"include_usage": True}}
    assert policy.requests_with_drops == 1 and policy.dropped["metadata"] == 1
    assert policy.apply({"model": "m", "messages": QUESTION}, chat=True) == []
    assert policy.requests_with_drops == 1

    # `accept` adds to the built-in list, `drop` removes from it; `pass` with `drop` drops only those
    policy = ParamPolicy.from_config({"policy": "drop", "upstream": "vllm", "accept": ["store"], "drop": ["cache_salt"]})
    body = {"model": "m", "prompt": "hi", "store": True, "cache_salt": "s", "metadata": {}}
    assert sorted(policy.apply(body, chat=False)) == ["cache_salt", "metadata"] and body == {"model": "m", "prompt": "hi", "store": True}
    policy = ParamPolicy.from_config({"policy": "pass", "drop": ["user"]})
    body = {"model": "m", "messages": QUESTION, "user": "u", "anything": 1}
    assert policy.apply(body, chat=True) == ["user"] and body == {"model": "m", "messages": QUESTION, "anything": 1}
    # the default passes everything, untouched
    body = {"model": "m", "messages": QUESTION, **OPENAI_ONLY}
    assert ParamPolicy.from_config(None).apply(body, chat=True) == [] and body == {"model": "m", "messages": QUESTION, **OPENAI_ONLY}


def test_a_billing_bound_the_upstream_does_not_accept_is_refused_not_dropped() -> None:
    policy = ParamPolicy.from_config({"policy": "drop", "accept": ["temperature"]})
    with pytest.raises(ParamRefused) as refused:
        policy.apply({"model": "m", "messages": QUESTION, "max_completion_tokens": 5}, chat=True)
    assert refused.value.name == "max_completion_tokens"
    assert policy.requests_with_drops == 0
    body = {"model": "m", "messages": QUESTION, "max_tokens": None}  # nothing to bound: dropping it changes nothing
    assert policy.apply(body, chat=True) == ["max_tokens"]


@pytest.mark.parametrize(("params", "problem"), [
    ({"policy": "strip"}, "policy must be one of pass, drop"),
    ({"policy": "drop"}, "policy: drop needs upstream"),
    ({"policy": "drop", "upstream": "sglang"}, "upstream must be one of trtllm-serve, vllm"),
    ({"upstream": "vllm"}, "only with policy: drop"),
    ({"policy": "drop", "upstream": "vllm", "drop": ["max_tokens"]}, "bounds what the request is billed"),
    ({"policy": "pass", "drop": ["messages"]}, "is needed by the gateway"),
    ({"policy": "drop", "accept": "temperature"}, "accept must be a list of field names"),
    ({"policy": "drop", "upstream": "vllm", "extra": 1}, "unknown key 'extra'"),
])
def test_models_yaml_reports_a_bad_policy_with_its_line(params: dict[str, Any], problem: str) -> None:
    assert problem in (check_params(params) or "")
    text = pool_yaml("http://127.0.0.1:9/v1", extra=f"params: {params!r}".replace("'", '"'))
    with pytest.raises(ModelsConfigError) as err:
        parse_models(text, "models.yaml")
    [line] = err.value.problems
    assert line.startswith("models.yaml:") and "models[0].params:" in line and problem in line
    assert BILLING.isdisjoint(NEEDED)


def test_models_yaml_accepts_a_policy() -> None:
    table = parse_models(pool_yaml("http://127.0.0.1:9/v1", extra="params: {policy: drop, upstream: trtllm-serve}"), "models.yaml")
    assert table.specs["pool"].params["params"] == {"policy": "drop", "upstream": "trtllm-serve"}


# end to end ------------------------------------------------------------------------------------------
async def test_a_trtllm_serve_pool_drops_what_it_would_refuse_and_bills_as_before(
    upstreams: Any, tollgate_with: Any, caplog: pytest.LogCaptureFixture
) -> None:
    up, url = upstreams()
    trtllm_like(up)
    gw = tollgate_with(pool_yaml(url, extra="health_path: null\nparams: {policy: drop, upstream: trtllm-serve}") + f"""
      - id: plain
        backend: openai
        context_length: 8192
        replicas: [{url}]
        health_path: null
    """)
    client = await client_of(gw)
    with pytest.raises(openai.BadRequestError) as refused:  # without a policy: the upstream's 400
        await client.chat.completions.create(model="plain", messages=QUESTION, max_tokens=7, extra_body=OPENAI_ONLY)
    assert "Extra inputs are not permitted" in str(refused.value)

    caplog.set_level(logging.DEBUG, logger="tollgate.engines.openai")
    up.script.append(Behaviour(usage={"prompt_tokens": 40, "completion_tokens": 7}))
    resp = await client.chat.completions.create(model="pool", messages=QUESTION, max_tokens=7, temperature=0.2,
                                                extra_body={**OPENAI_ONLY, "top_k": 3})
    sent = up.requests[-1].body
    assert not set(OPENAI_ONLY) & set(sent)
    assert (sent["max_tokens"], sent["temperature"], sent["top_k"], sent["messages"]) == (7, 0.2, 3, QUESTION)
    row = await gw.ledger_row(request_id_of(resp.id))
    assert (row["prompt_tokens"], row["completion_tokens"], row["estimated"], row["status"]) == (40, 7, False, "completed")
    policy = gw.engines()["pool"].candidates[0].unwrapped().params
    assert policy.requests_with_drops == 1 and all(policy.dropped[name] == 1 for name in OPENAI_ONLY)
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG and "not forwarded" in r.getMessage()]
    assert len(logged) == 1 and all(name in logged[0] for name in OPENAI_ONLY)

    # streamed, with an inner stream_options field trtllm-serve's StreamOptions does not declare
    stream = await client.chat.completions.create(model="pool", messages=QUESTION, stream=True,
                                                  stream_options={"include_usage": True, "include_obfuscation": False})  # type: ignore[typeddict-unknown-key]
    assert [c async for c in stream][-1].usage is not None
    assert up.requests[-1].body["stream_options"] == {"include_usage": True}


async def test_a_length_bound_the_upstream_does_not_take_is_a_400_before_any_upstream_call(upstreams: Any, tollgate_with: Any) -> None:
    up, url = upstreams()
    gw = tollgate_with(pool_yaml(url, extra="health_path: null\nparams: {policy: drop, accept: [temperature]}"))
    key = await gw.new_key()
    async with httpx.AsyncClient(base_url=gw.v1, headers={"Authorization": f"Bearer {key['key']}"}, timeout=30) as http:
        r = await http.post("/chat/completions", json={"model": "pool", "messages": QUESTION, "max_completion_tokens": 5})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "max_completion_tokens"
        assert up.requests == []
        r = await http.post("/chat/completions", json={"model": "pool", "messages": QUESTION, "temperature": 0.1, "seed": 3})
        assert r.status_code == 200, r.text
    assert set(up.requests[-1].body) == {"model", "messages", "temperature", "stream", "stream_options"}
