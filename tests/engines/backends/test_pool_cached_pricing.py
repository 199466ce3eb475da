"""Cached-input pricing end to end (issue 25): an `openai` pool whose upstream reports
usage.prompt_tokens_details.cached_tokens; the price posted through /admin/prices with a
cached-input price; each ledger row's cost to the nano; an upstream that says nothing pays the
input price for the whole prompt; the quota reserves the uncached worst case."""

from __future__ import annotations

from typing import Any

import openai

from tests.engines.backends.test_openai_pool import QUESTION, pool_yaml, request_id_of
from tests.fakes.upstream import Behaviour


async def test_cached_prompt_tokens_are_priced_at_the_cached_price(upstreams: Any, tollgate_with: Any) -> None:
    up, url = upstreams()
    gw = tollgate_with(pool_yaml(url))
    key = await gw.new_key()
    async with gw.admin_client() as admin:
        r = await admin.post("/admin/prices", json={
            "model": "pool", "input_per_million": "2.000", "output_per_million": "8.000", "cached_input_per_million": "0.500"})
        assert r.status_code == 201, r.text
        assert r.json()["cached_input_per_million"] == "0.500"
        bad = await admin.post("/admin/prices", json={"model": "pool", "input_per_million": "1", "output_per_million": "1",
                                                      "cached_input_per_million": 0.5})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "cached_input_per_million"
    client = openai.AsyncOpenAI(base_url=gw.v1, api_key=key["key"], max_retries=0, timeout=30)
    up.script.append(Behaviour(usage={"prompt_tokens": 120, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 96}}))  # type: ignore[dict-item]
    streamed = [c async for c in await client.chat.completions.create(model="pool", messages=QUESTION, stream=True)]
    up.script.append(Behaviour(usage={"prompt_tokens": 30, "completion_tokens": 7}))  # says nothing of its cache
    silent = await client.chat.completions.create(model="pool", messages=QUESTION)
    rows = [await gw.ledger_row(request_id_of(i)) for i in (streamed[0].id, silent.id)]
    # 24 x 2,000 + 96 x 500 + 7 x 8,000 nano-USD; then 30 x 2,000 + 7 x 8,000
    assert [r["cost_nanos"] for r in rows] == [24 * 2000 + 96 * 500 + 7 * 8000, 30 * 2000 + 7 * 8000] == [152_000, 116_000]
