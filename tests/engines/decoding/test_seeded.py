"""engines/decoding/seeded.py alone: a seeded row leaves one token possible, drawn from the row's
distribution (never a token of probability 0), the same for the same seed and position; a row
without a seed is left as it was."""

from __future__ import annotations

import math
import types
from typing import Any

import torch

from engines.decoding.seeded import SeededChoice


def rows(*kwargs: dict[str, Any], generated: int = 0) -> list[Any]:
    return [types.SimpleNamespace(state=types.SimpleNamespace(logit_processor_kwargs=k, generated_tokens=[1] * generated,
                                                              _true_initial_tokens=0, initial_tokens=[])) for k in kwargs]


def test_a_seeded_row_is_drawn_from_its_distribution_and_an_unseeded_one_is_untouched() -> None:
    choice = SeededChoice.make()
    scores = torch.full((2, 10), float("-inf"))
    scores[:, 3], scores[:, 7] = 0.0, 1.0  # the rest masked (probability 0)
    drawn = []
    for seed in range(4000):
        flags = choice.prepare_tensor_args(rows({"seed": seed}, {"temperature": 1.0}))
        assert flags.tolist() == [1, 0]
        out = choice(scores.clone(), flags)
        assert torch.equal(out[1], scores[1])  # no seed: as it was
        assert torch.isfinite(out[0]).sum() == 1  # one token left possible
        drawn.append(int(out[0].argmax()))
    assert set(drawn) == {3, 7}
    share = drawn.count(7) / len(drawn)
    assert abs(share - math.e / (1 + math.e)) < 0.03, share  # 0.731
    # the same seed and position: the same token; another position: its own draw
    again = [int(choice(scores.clone(), choice.prepare_tensor_args(rows({"seed": s})))[0].argmax()) for s in range(200)]
    assert again == drawn[:200]
    later = [int(choice(scores.clone(), choice.prepare_tensor_args(rows({"seed": s}, generated=5)))[0].argmax()) for s in range(200)]
    assert later != again
