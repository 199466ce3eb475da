"""TokenProgress: one request's token ids as engine outputs (engines/decoding/text.py), with and
without stop strings. Without any, no stop matcher is built; the text and finish reasons are the
same as a matcher that never matches would give."""

from __future__ import annotations

from typing import Any

import pytest

from engines.decoding.text import TokenProgress
from engines.base import FINISH_LENGTH, FINISH_STOP, EngineRequest, SamplingParams

EOS = 0


class CharTokenizer:
    """id n -> the n-th letter; id 0 is the end of sequence (skipped as special)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i - 1) for i in ids if i != EOS)


def run(stop: tuple[str, ...], steps: list[list[int]], max_tokens: int = 10) -> tuple[str, Any]:
    request = EngineRequest("r", max_tokens, SamplingParams(stop=stop))
    progress = TokenProgress(CharTokenizer(), request, 3, {EOS})
    text, last = "", None
    for i, ids in enumerate(steps):
        out = progress.advance(ids, i == len(steps) - 1, None, None)
        if out is not None:
            text += out.text
            last = out
            if out.finished:
                break
    return text, last


@pytest.mark.parametrize("stop", [(), ("",)])
def test_without_stop_strings_the_text_is_every_token_and_no_matcher_is_built(stop: tuple[str, ...]) -> None:
    request = EngineRequest("r", 4, SamplingParams(stop=stop))
    assert TokenProgress(CharTokenizer(), request, 3, {EOS})._stops is None
    text, last = run(stop, [[1, 2], [3], [4]], max_tokens=4)
    assert (text, last.finish_reason, last.stop_sequence, last.completion_tokens) == ("abcd", FINISH_LENGTH, None, 4)


def test_end_of_sequence_before_max_tokens_is_a_stop() -> None:
    text, last = run((), [[1], [2, EOS]])
    assert (text, last.finish_reason) == ("ab", FINISH_STOP)


def test_a_stop_string_cuts_the_text_and_is_named() -> None:
    text, last = run(("cd",), [[1, 2], [3], [4, 5], [6]])
    assert (text, last.finish_reason, last.stop_sequence) == ("ab", FINISH_STOP, "cd")


def test_text_held_back_for_a_possible_stop_comes_out_at_the_end() -> None:
    text, last = run(("cx",), [[1, 2], [3]], max_tokens=3)
    assert (text, last.finish_reason, last.stop_sequence) == ("abc", FINISH_LENGTH, None)
