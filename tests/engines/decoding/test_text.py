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
