"""The upstream's cached prompt tokens (usage.prompt_tokens_details.cached_tokens) reach the ledger
row, /v1/usage and /admin/usage (issue 20), through an `openai` pool configured by models.yaml."""

from __future__ import annotations

import re
from typing import Any

import httpx
import openai

from tests.engines.backends.test_openai_pool import QUESTION, pool_yaml, request_id_of
from tests.fakes.upstream import Behaviour


async def test_upstream_cached_tokens_reach_the_ledger_and_the_usage_api(upstreams: Any, tollgate_with: Any) -> None:
    up, url = upstreams()
    gw = tollgate_with(pool_yaml(url))
    key = await gw.new_key()
    client = openai.AsyncOpenAI(base_url=gw.v1, api_key=key["key"], max_retries=0, timeout=30)
    up.script.append(Behaviour(usage={"prompt_tokens": 120, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 96}}))  # type: ignore[dict-item]
    streamed = [c async for c in await client.chat.completions.create(model="pool", messages=QUESTION, stream=True,
                                                                      stream_options={"include_usage": True})]
    up.script.append(Behaviour(usage={"prompt_tokens": 30, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 16}}))  # type: ignore[dict-item]
    whole = await client.chat.completions.create(model="pool", messages=QUESTION)
    up.script.append(Behaviour(usage={"prompt_tokens": 30, "completion_tokens": 7}))  # says nothing of its cache
    silent = await client.chat.completions.create(model="pool", messages=QUESTION)

    rows = [await gw.ledger_row(request_id_of(i)) for i in (streamed[0].id, whole.id, silent.id)]
    assert [(r["prompt_tokens"], r["cached_tokens"]) for r in rows] == [(120, 96), (30, 16), (30, None)]
    # the client's usage says what the row says (OpenAI's usage.prompt_tokens_details.cached_tokens)
    usages = [streamed[-1].usage, whole.usage, silent.usage]
    assert [(u.prompt_tokens, u.prompt_tokens_details and u.prompt_tokens_details.cached_tokens) for u in usages if u] == [
        (120, 96), (30, 16), (30, None)]
    await gw.flush_ledger()
    async with httpx.AsyncClient(base_url=gw.base_url, headers={"Authorization": f"Bearer {key['key']}"}, timeout=30) as http:
        usage = (await http.get("/v1/usage", params={"group_by": "model"})).json()
    assert usage["totals"]["cached_tokens"] == 112 and usage["totals"]["prompt_tokens"] == 180
    async with gw.admin_client() as admin:
        body = (await admin.get("/admin/usage", params={"account_id": key["account_id"]})).json()
    assert body["totals"][0]["cached_tokens"] == 112
    assert sorted(e["cached_tokens"] or 0 for e in body["entries"]) == [0, 16, 96]

    # the customer dashboard's by-model table shows them in their own column
    async with httpx.AsyncClient(base_url=gw.base_url, timeout=30, headers={"origin": gw.base_url}) as browser:
        form = (await browser.get("/dashboard/login")).text
        csrf = re.search(r'name="csrf_token" value="([^"]+)"', form).group(1)  # type: ignore[union-attr]
        assert (await browser.post("/dashboard/login", data={"csrf_token": csrf, "api_key": key["key"]})).status_code == 303
        html = (await browser.get("/dashboard/account")).text
    header = re.search(r'id="models-table">\s*<thead><tr>(.*?)</tr>', html).group(1)  # type: ignore[union-attr]
    row = re.search(r'<tr data-model="pool">(.*?)</tr>', html, re.S).group(1)  # type: ignore[union-attr]
    columns = re.findall(r"<th>(.*?)</th>", header)
    cells = re.findall(r"<td[^>]*>(.*?)</td>", row)
    assert cells[columns.index("cached prompt tokens")] == "112" and cells[columns.index("prompt tokens")] == "180"


async def test_anthropic_clients_see_the_cached_part_of_the_prompt_as_anthropic_reports_it(upstreams: Any, tollgate_with: Any) -> None:
    """Anthropic's usage splits the prompt: `input_tokens` (not from a cache) + `cache_read_input_tokens`
    + `cache_creation_input_tokens` is the whole of it. 96 of 120 prompt tokens read from the
    upstream's cache are 24 + 96, streamed (message_delta's cumulative usage) and not; before, 120 +
    nothing, which a client's cost tracking counts at the full input price."""
    import anthropic

    up, url = upstreams()
    gw = tollgate_with(pool_yaml(url))
    key = await gw.new_key()
    client = anthropic.AsyncAnthropic(base_url=gw.base_url, api_key=key["key"], max_retries=0, timeout=30)
    cached = {"prompt_tokens": 120, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 96}}
    up.script.append(Behaviour(usage=cached))  # type: ignore[arg-type]
    whole = await client.messages.create(model="pool", max_tokens=16, messages=QUESTION)  # type: ignore[arg-type]
    up.script.append(Behaviour(usage=cached))  # type: ignore[arg-type]
    async with client.messages.stream(model="pool", max_tokens=16, messages=QUESTION) as stream:  # type: ignore[arg-type]
        streamed = await stream.get_final_message()
    for message in (whole, streamed):
        usage = message.usage
        assert (usage.input_tokens, usage.cache_read_input_tokens, usage.cache_creation_input_tokens, usage.output_tokens) == (24, 96, 0, 7), usage
    up.script.append(Behaviour(usage={"prompt_tokens": 30, "completion_tokens": 7}))  # says nothing of its cache
    silent = await client.messages.create(model="pool", max_tokens=16, messages=QUESTION)  # type: ignore[arg-type]
    assert (silent.usage.input_tokens, silent.usage.cache_read_input_tokens) == (30, 0)


async def test_responses_clients_see_the_cached_part_of_the_prompt_the_row_bills(upstreams: Any, tollgate_with: Any) -> None:
    """The Responses API's usage says what the row bills: input_tokens_details.cached_tokens is the
    row's cached_tokens (96 of 120, streamed and not), and never more than the prompt: an upstream
    that says 45 of 30 prompt tokens came from its cache has a row with 30, and so does the usage."""
    up, url = upstreams()
    gw = tollgate_with(pool_yaml(url))
    key = await gw.new_key()
    client = openai.AsyncOpenAI(base_url=gw.v1, api_key=key["key"], max_retries=0, timeout=30)
    cached = {"prompt_tokens": 120, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 96}}
    up.script.append(Behaviour(usage=cached))  # type: ignore[arg-type]
    whole = await client.responses.create(model="pool", input="What is the capital of France?")
    up.script.append(Behaviour(usage=cached))  # type: ignore[arg-type]
    events = [e async for e in await client.responses.create(model="pool", input="What is the capital of France?", stream=True)]
    assert events[-1].type == "response.completed"
    streamed = events[-1].response
    up.script.append(Behaviour(usage={"prompt_tokens": 30, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 45}}))  # type: ignore[dict-item]
    over = await client.responses.create(model="pool", input="What is the capital of France?")

    rows = [await gw.ledger_row(r.id.removeprefix("resp_")) for r in (whole, streamed, over)]
    assert [(r["prompt_tokens"], r["cached_tokens"], r["completion_tokens"]) for r in rows] == [(120, 96, 7), (120, 96, 7), (30, 30, 7)]
    usages = [r.usage for r in (whole, streamed, over)]
    assert [(u.input_tokens, u.input_tokens_details.cached_tokens, u.output_tokens) for u in usages if u] == [  # type: ignore[union-attr]
        (120, 96, 7), (120, 96, 7), (30, 30, 7)]


async def test_an_upstream_saying_more_cached_than_its_prompt_is_the_whole_prompt_cached_everywhere(upstreams: Any,
                                                                                                     tollgate_with: Any) -> None:
    """45 cached of a 30-token prompt: the row counts 30 cached (part of the prompt, as invoices bill
    it), and so does each API's usage: chat's cached_tokens 30, Anthropic's 0 + 30 (never a negative
    input_tokens)."""
    import anthropic

    up, url = upstreams()
    gw = tollgate_with(pool_yaml(url))
    key = await gw.new_key()
    over = {"prompt_tokens": 30, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 45}}
    client = openai.AsyncOpenAI(base_url=gw.v1, api_key=key["key"], max_retries=0, timeout=30)
    up.script.append(Behaviour(usage=over))  # type: ignore[arg-type]
    whole = await client.chat.completions.create(model="pool", messages=QUESTION)
    up.script.append(Behaviour(usage=over))  # type: ignore[arg-type]
    streamed = [c async for c in await client.chat.completions.create(model="pool", messages=QUESTION, stream=True,
                                                                      stream_options={"include_usage": True})]
    claude = anthropic.AsyncAnthropic(base_url=gw.base_url, api_key=key["key"], max_retries=0, timeout=30)
    up.script.append(Behaviour(usage=over))  # type: ignore[arg-type]
    message = await claude.messages.create(model="pool", max_tokens=16, messages=QUESTION)  # type: ignore[arg-type]

    rows = [await gw.ledger_row(rid) for rid in (request_id_of(whole.id), request_id_of(streamed[0].id),
                                                 message.id.removeprefix("msg_"))]
    assert [(r["prompt_tokens"], r["cached_tokens"]) for r in rows] == [(30, 30)] * 3
    chat = [u for u in (whole.usage, streamed[-1].usage) if u]
    assert [(u.prompt_tokens, u.prompt_tokens_details and u.prompt_tokens_details.cached_tokens) for u in chat] == [(30, 30)] * 2
    usage = message.usage
    assert (usage.input_tokens, usage.cache_read_input_tokens, usage.output_tokens) == (0, 30, 7), usage
