"""n / best_of on an engine that serves one choice per request (the hf engine, `Engine.max_choices`
1): refused with a 400 naming the field, before any quota is held or any row written. The trtllm
engine serves n > 1 (tests/engines/test_trtllm.py)."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.conftest import MODEL, Gateway

QUESTION = [{"role": "user", "content": "Say hi."}]


async def test_n_above_one_on_the_hf_engine_is_a_400_naming_n(gateway: Gateway, client_for: Any) -> None:
    assert gateway.app.state.service.engines[MODEL].max_choices == 1
    key = await gateway.new_key()
    client = client_for(key["key"])
    calls = [
        ("n", lambda: client.chat.completions.create(model=MODEL, messages=QUESTION, n=2, max_tokens=2)),
        ("n", lambda: client.chat.completions.create(model=MODEL, messages=QUESTION, n=2, max_tokens=2, stream=True)),
        ("n", lambda: client.completions.create(model=MODEL, prompt="Hi", n=2, max_tokens=2)),
        ("best_of", lambda: client.completions.create(model=MODEL, prompt="Hi", best_of=2, max_tokens=2)),
    ]
    for param, call in calls:
        with pytest.raises(openai.BadRequestError) as refused:
            await call()
        error = refused.value.body
        assert (error["param"], error["code"], error["type"]) == (param, "unsupported_parameter", "invalid_request_error")
        assert f"{param} > 1 is not supported" in error["message"]
    await gateway.flush_ledger()
    assert await gateway.ledger_count(key_id=key["id"]) == 0  # refused before admission: nothing metered
    served = await client.chat.completions.create(model=MODEL, messages=QUESTION, n=1, max_tokens=2)
    assert len(served.choices) == 1  # n=1 is served as before
