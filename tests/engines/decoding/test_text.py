"""Stop-string matching and incremental detokenization (with the real tokenizer)."""

from __future__ import annotations

from engines.backends.hf import HFEngine
from engines.decoding.text import IncrementalDetokenizer, StopMatcher


def feed(matcher: StopMatcher, pieces: list[str]) -> str:
    out = "".join(matcher.push(p) for p in pieces)
    return out + matcher.flush()


def test_stop_across_pieces_is_cut_and_held_text_released() -> None:
    m = StopMatcher(("END",))
    assert feed(m, ["hello E", "N", "D world"]) == "hello "
    assert m.stopped
    m = StopMatcher(("END",))
    assert feed(m, ["hello E", "N", "x"]) == "hello ENx"
    assert not m.stopped


def test_earliest_of_several_stops_wins() -> None:
    m = StopMatcher(("b", "abc"))
    assert feed(m, ["xxab", "c"]) == "xxa"


def test_no_stops_passes_through() -> None:
    m = StopMatcher(())
    assert feed(m, ["a", "b"]) == "ab"


def test_detokenizer_matches_full_decode(engine: HFEngine) -> None:
    tok = engine.tokenizer
    text = "Voilà: naïve café — 東京 🚀 costs $5.  Done."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push([i]) for i in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in p for p in pieces)


def test_a_step_decoded_in_one_batch_gives_each_stream_what_decoding_it_alone_gives(engine: HFEngine) -> None:
    # The engine process's reader decodes every stream's windows of a step in one call (fast_decoder's
    # decode_batch); each stream's text must be what transformers' own decode gives it, token by token.
    from engines.decoding.text import decode_windows, fast_decoder

    tok = engine.tokenizer
    assert fast_decoder(tok) is not None  # the embedded model's tokenizer takes the fast path
    texts = ["Voilà: naïve café — 東京 🚀 costs $5.", " Done, and done again.\n\n- a list", "数字 1234567 and ÿ"]
    streams = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    batched = [IncrementalDetokenizer(tok) for _ in streams]
    out = ["" for _ in streams]
    for step in range(max(len(ids) for ids in streams) + 1):
        windows: list[list[int]] = []
        for ids, detok in zip(streams, batched):
            windows += detok.windows(ids[step:step + 1])
        decoded = decode_windows(tok, windows)
        for i, (ids, detok) in enumerate(zip(streams, batched)):
            out[i] += detok.take(decoded[2 * i], decoded[2 * i + 1], final=step >= len(ids))
    assert out == [tok.decode(ids, skip_special_tokens=True) for ids in streams]
