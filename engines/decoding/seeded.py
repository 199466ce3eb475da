"""Per-request seeds for the `hf` engine: the same seed, prompt and sampling parameters, the same sample.

transformers' continuous batching samples every row of a batch with one `torch.multinomial` on the
process's shared random state, so a request's sample depends on what else ran before and beside it.
`SeededChoice` is the last of the manager's per-request logits processors (after temperature and
top-p, see engines/decoding/guided.py for how they are called): for each row of a request that
carries a seed it draws the next token itself, from the row's final distribution, with a generator
seeded by the request's seed and the token's position, and leaves that token the only one possible.
The shared sampler then picks it for certain. Rows without a seed are left alone.

What stays best effort, as OpenAI and vLLM say of `seed`: the logits themselves may differ in their
last bits with the batch a request runs in, which can change a draw where two tokens' chances are
almost equal. With CUDA graphs or a compiled step (no Python per step) or asynchronous batching, the
engine cannot honour a seed and says so (`install` returns False).
"""

from __future__ import annotations

from typing import Any

# A token's generator seed: the request's seed and the token's position mixed, so that neighbouring
# seeds and positions do not share streams.
_MIX = 0x9E3779B97F4A7C15


def token_seed(seed: int, position: int) -> int:
    return (seed * _MIX + position * 0xBF58476D1CE4E5B9 + 1) % (1 << 63)


def captured(config: Any) -> bool:
    """Whether the manager's steps run without Python per step (CUDA graphs, a compiled step)."""
    return any(config.cuda_graph_booleans) or config.varlen_compile_config is not None or config.decode_compile_config is not None


class SeededChoice:
    """The continuous batching logits processor. Built lazily as the library's subclass, so that
    importing this module imports neither torch nor transformers."""

    @staticmethod
    def make() -> Any:
        import torch
        from transformers.generation.continuous_batching.cb_logits_processors import ContinuousBatchingLogitsProcessor

        class _SeededChoice(ContinuousBatchingLogitsProcessor):
            supported_kwargs: dict[str, type] = {"seed": int}
            ignored_kwargs: tuple[str, ...] = ()

            def __init__(self) -> None:
                self._rows: list[tuple[int, int]] = []  # this step's seeded rows: (row, the token's seed)

            def fill_defaults(self, int32_tensor: Any) -> None:
                int32_tensor.fill_(0)

            def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> Any:
                rows = []
                for i, future in enumerate(requests_with_new_token):
                    seed = future.state.logit_processor_kwargs.get("seed")
                    if seed is None:
                        continue
                    state = future.state
                    position = len(state.generated_tokens)
                    if state._true_initial_tokens:  # re-queued: what it generated before is part of its prompt now
                        position += len(state.initial_tokens) - state._true_initial_tokens
                    rows.append((i, token_seed(seed, position)))
                self._rows = rows
                flags = torch.zeros(len(requests_with_new_token), dtype=torch.int32)
                for i, _ in rows:
                    flags[i] = 1
                return flags

            def __call__(self, scores: Any, tensor_arg: Any) -> Any:
                for i, seed in self._rows:
                    # Inverse transform sampling: ~0.1 ms a row on a CPU core (torch.multinomial: ~1.2 ms).
                    # right=True: a token of probability 0 (masked, cut by top-p) is never the one found.
                    cumulative = torch.cumsum(torch.softmax(scores[i].float(), dim=-1), dim=0)
                    generator = torch.Generator(device=scores.device)
                    generator.manual_seed(seed)
                    draw = torch.rand(1, generator=generator, device=scores.device) * cumulative[-1]
                    token = torch.searchsorted(cumulative, draw, right=True).clamp_(max=cumulative.numel() - 1)
                    scores[i].fill_(float("-inf"))
                    scores[i, token] = 0.0
                return scores

        return _SeededChoice()


def install(manager: Any) -> bool:
    """Puts `SeededChoice` last among the manager's per-request logits processors. Call before
    `manager.start()`, after any processor that must come before it. Returns whether seeds are
    honoured with this manager."""
    config = manager.continuous_batching_config
    if config.use_async_batching or captured(config):
        return False
    processors = manager.logit_processor
    processors.logits_processor.append(SeededChoice.make())
    processors.tensors_required += 1
    processors._retrieve_processors_kwargs()
    processors.do_processing = True
    return True
