"""Chat and text completions through the official openai SDK against the real model."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.conftest import MODEL, Gateway

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def request_id_of(completion_id: str) -> str:
    return completion_id.split("-", 1)[1]


async def test_chat_non_streaming_answers_and_meters(gateway: Gateway, customer: dict[str, Any], client_for: Any) -> None:
    client = client_for(customer["key"])
    resp = await client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=30)
    assert resp.object == "chat.completion"
    assert resp.model == MODEL
    assert "Paris" in resp.choices[0].message.content
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.prompt_tokens > 10
    assert 0 < resp.usage.completion_tokens <= 30
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens

    row = await gateway.only_row(request_id_of(resp.id))
    assert row["status"] == "completed"
    assert row["finish_reason"] == "stop"
    assert row["account_id"] == customer["account_id"]
    assert row["key_id"] == customer["id"]
    assert row["model"] == MODEL
    assert (row["prompt_tokens"], row["completion_tokens"]) == (resp.usage.prompt_tokens, resp.usage.completion_tokens)
    assert (row["prompt_tokens"], row["completion_tokens"]) == await gateway.produced.counts(request_id_of(resp.id))  # the engine's own ids
    assert row["ttft_ms"] is not None and row["total_ms"] >= row["ttft_ms"] > 0
    assert row["queue_ms"] is not None and row["queue_ms"] >= 0


async def test_a_one_body_answer_is_sized_not_chunked(customer: dict[str, Any], client_for: Any) -> None:
    raw = await client_for(customer["key"]).chat.completions.with_raw_response.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=5)
    body = await raw.http_response.aread()
    assert raw.headers["content-length"] == str(len(body))
    assert "transfer-encoding" not in raw.headers
    assert raw.parse().usage.completion_tokens <= 5


async def test_chat_streaming_usage_chunk_equals_ledger_row(gateway: Gateway, customer: dict[str, Any], client_for: Any) -> None:
    client = client_for(customer["key"])
    stream = await client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=30, stream=True, stream_options={"include_usage": True}
    )
    pieces, finish, usage, ids = [], None, None, set()
    async for chunk in stream:
        ids.add(chunk.id)
        assert chunk.object == "chat.completion.chunk"
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
    assert len(ids) == 1
    assert finish == "stop"
    assert "Paris" in "".join(pieces)
    assert usage is not None
    request_id = request_id_of(ids.pop())
    row = await gateway.only_row(request_id)
    assert row["status"] == "completed"
    assert row["prompt_tokens"] == usage.prompt_tokens
    assert row["completion_tokens"] == usage.completion_tokens
    assert (row["prompt_tokens"], row["completion_tokens"]) == await gateway.produced.counts(request_id)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


@pytest.mark.parametrize("kind", ["chat", "text"])
async def test_with_include_usage_every_other_chunk_says_usage_null(customer: dict[str, Any], client_for: Any, kind: str) -> None:
    """OpenAI's stream_options.include_usage: "All other chunks will also include a `usage` field,
    but with a null value" (the SDK's ChatCompletionStreamOptionsParam); without it, none has one."""
    client = client_for(customer["key"])
    for include in (True, False):
        request: dict[str, Any] = {"model": MODEL, "max_tokens": 5, "temperature": 0, "stream": True}
        if include:
            request["stream_options"] = {"include_usage": True}
        if kind == "chat":
            raw = await client.chat.completions.with_raw_response.create(messages=QUESTION, **request)
        else:
            raw = await client.completions.with_raw_response.create(prompt="Once upon a time", **request)
        text = (await raw.http_response.aread()).decode()
        chunks = [json.loads(b.removeprefix("data: ")) for b in text.split("\n\n") if b.startswith("data: {")]
        assert len(chunks) >= 3 and text.rstrip().endswith("data: [DONE]")
        if include:
            assert all("usage" in c and c["usage"] is None for c in chunks[:-1]), [c for c in chunks[:-1] if "usage" not in c]
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1
        else:
            assert not any("usage" in c for c in chunks), chunks


async def test_stream_without_include_usage_sends_no_usage_chunk(customer: dict[str, Any], client_for: Any) -> None:
    client = client_for(customer["key"])
    stream = await client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=5, stream=True)
    chunks = [c async for c in stream]
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("kind", ["chat", "text"])
async def test_greedy_streamed_text_equals_non_streamed(customer: dict[str, Any], client_for: Any, kind: str) -> None:
    client = client_for(customer["key"])
    if kind == "chat":
        messages = [{"role": "user", "content": "Write two sentences about the sea."}]
        full = await client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=40)
        stream = await client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=40, stream=True)
        streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        expected = full.choices[0].message.content
    else:
        full = await client.completions.create(model=MODEL, prompt="The history of Rome", temperature=0, max_tokens=40)
        stream = await client.completions.create(model=MODEL, prompt="The history of Rome", temperature=0, max_tokens=40, stream=True)
        streamed = "".join([c.choices[0].text async for c in stream if c.choices])
        expected = full.choices[0].text
    assert len(expected) > 20
    assert streamed == expected


async def test_text_completion_non_streaming_and_streaming(gateway: Gateway, customer: dict[str, Any], client_for: Any) -> None:
    client = client_for(customer["key"])
    resp = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    assert resp.object == "text_completion"
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 12
    row = await gateway.only_row(request_id_of(resp.id))
    assert (row["prompt_tokens"], row["completion_tokens"], row["finish_reason"]) == (resp.usage.prompt_tokens, 12, "length")
    assert (row["prompt_tokens"], row["completion_tokens"]) == await gateway.produced.counts(request_id_of(resp.id))

    stream = await client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == resp.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12
    row = await gateway.only_row(request_id_of(chunks[0].id))
    assert (row["prompt_tokens"], row["completion_tokens"]) == await gateway.produced.counts(request_id_of(chunks[0].id)) == (resp.usage.prompt_tokens, 12)


async def test_completion_accepts_token_id_prompt(gateway: Gateway, customer: dict[str, Any], client_for: Any) -> None:
    client = client_for(customer["key"])
    ids = gateway.engine.encode_text("Once upon a time")
    by_ids = await client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    by_text = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0)
    assert by_ids.usage.prompt_tokens == len(ids)
    assert by_ids.choices[0].text == by_text.choices[0].text


async def test_max_completion_tokens_is_honoured(customer: dict[str, Any], client_for: Any) -> None:
    client = client_for(customer["key"])
    resp = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a long story about dragons."}], max_completion_tokens=5, temperature=0
    )
    assert resp.usage.completion_tokens == 5
    assert resp.choices[0].finish_reason == "length"


async def test_stop_sequence_cuts_output(gateway: Gateway, customer: dict[str, Any], client_for: Any) -> None:
    client = client_for(customer["key"])
    plain = await client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=30)
    assert " is " in plain.choices[0].message.content
    cut = await client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=30, stop=[" is"])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == plain.choices[0].message.content.split(" is")[0]
    assert cut.usage.completion_tokens < plain.usage.completion_tokens
    stream = await client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=30, stop=" is", stream=True)
    streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert streamed == cut.choices[0].message.content
    row = await gateway.only_row(request_id_of(cut.id))
    assert row["status"] == "completed" and row["completion_tokens"] == cut.usage.completion_tokens
    assert (row["prompt_tokens"], row["completion_tokens"]) == await gateway.produced.counts(request_id_of(cut.id))


# Cases whose text re-tokenizes to another count than the ids the engine generated: the stop string's
# own token is generated (and billed) but not sent; a character cut by max_tokens leaves a partial one.
TEXT_AND_IDS_DIFFER = {
    "stop string": dict(api="chat", messages=QUESTION, stop=[" is"], max_tokens=30),
    "multi-byte characters": dict(api="text", prompt="Emoji: 🎉🎉🎉🎉", max_tokens=5),
}


@pytest.mark.parametrize("case", TEXT_AND_IDS_DIFFER)
@pytest.mark.parametrize("stream", [False, True])
async def test_billed_tokens_are_the_engines_ids_not_its_text(gateway: Gateway, customer: dict[str, Any], client_for: Any, case: str, stream: bool) -> None:
    client = client_for(customer["key"])
    fields = dict(TEXT_AND_IDS_DIFFER[case])
    create = client.chat.completions.create if fields.pop("api") == "chat" else client.completions.create
    extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    answer = await create(model=MODEL, temperature=0, **fields, **extra)
    chunks = [c async for c in answer] if stream else [answer]
    request_id, usage = request_id_of(chunks[0].id), chunks[-1].usage
    produced = await gateway.produced.finished(request_id)
    # The case must separate the two counts, or it proves nothing.
    assert len(gateway.engine.encode_text(produced.text)) != len(produced.ids), (produced.text, produced.ids)
    row = await gateway.only_row(request_id)
    assert (row["prompt_tokens"], row["completion_tokens"]) == (usage.prompt_tokens, usage.completion_tokens) == (produced.prompt, len(produced.ids))


async def test_sampling_parameters_are_accepted(customer: dict[str, Any], client_for: Any) -> None:
    client = client_for(customer["key"])
    resp = await client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0.8, top_p=0.9, seed=7, user="end-user-1", max_tokens=8,
        extra_body={"some_unknown_field": {"ignored": True}},
    )
    assert resp.usage.completion_tokens <= 8
    assert resp.choices[0].finish_reason in ("stop", "length")


async def test_a_seed_makes_a_sampled_answer_reproducible_whatever_runs_beside_it(gateway: Gateway, customer: dict[str, Any],
                                                                                   client_for: Any) -> None:
    """temperature 1 with a seed: the same seed gives the same answer, alone or in a batch with other
    sampled requests (the engine's sampler is shared); other seeds give other answers; n choices of
    one seeded request differ from each other and come back the same on a repeat."""
    import asyncio

    client = client_for(customer["key"])
    story = [{"role": "user", "content": "Tell me a story about a dragon."}]

    async def sample(seed: int | None, n: int = 1) -> list[str]:
        resp = await client.chat.completions.create(model=MODEL, messages=story, temperature=1.0, seed=seed, max_tokens=24, n=n)
        return [c.message.content or "" for c in sorted(resp.choices, key=lambda c: c.index)]

    alone = await sample(11)
    crowded = await asyncio.gather(*(sample(s) for s in (None, 11, None, 12, None)))
    assert crowded[1] == alone and await sample(11) == alone
    assert len({alone[0], crowded[3][0], (await sample(13))[0]}) == 3, (alone, crowded[3])
    pair = await sample(11, n=2)
    assert pair[0] != pair[1] and await sample(11, n=2) == pair


async def test_models_endpoint_lists_the_served_model(customer: dict[str, Any], client_for: Any) -> None:
    client = client_for(customer["key"])
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL, "all-minilm-l6-v2"]  # the embedding model too (test_anthropic.py)
    assert (await client.models.retrieve(MODEL)).id == MODEL
