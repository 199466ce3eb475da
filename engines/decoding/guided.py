"""Guided decoding for the `hf` engine: a per-request token mask from llguidance's grammar matcher.

A request's grammar (a JSON schema for `response_format`, a tool-call grammar for `tool_choice`
`required` or a named function) becomes a matcher that knows which tokens may come next. Before
each sampling step the mask of every guided request in the batch is computed on the host and the
disallowed logits are set to -inf, so whatever the sampler picks follows the grammar; once the
grammar is complete only the end-of-sequence token is allowed, which ends the request.

transformers' continuous batching takes per-request logits processors (`per_request_processors`):
each step it asks every `ContinuousBatchingLogitsProcessor` for a tensor argument per request that
has a new token (`prepare_tensor_args`, on the host, in the order of the batch's logits) and then
applies it to the logits (`__call__`), before temperature and top-p. `TokenMask` is one of those:
its argument is a flag per row (guided or not) and it keeps the rows' bitmasks itself. The state a
mask needs is the request's own generated tokens, which the manager has appended by the time it
prepares the next step when it batches synchronously. With asynchronous batching (the default with
CUDA graphs) the next step is prepared before the previous token is known, so no mask can be
computed: the engine then refuses guided requests (`HFEngine.guided`).
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

from engines.decoding.seeded import captured

log = logging.getLogger("tollgate.engines.guided")

# JSON as models write it (`{"a": 1, "b": 2}`): one space after ',' and ':', no other whitespace. Free
# whitespace lets a small model pad with newlines until max_tokens.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """The grammar (a client's schema or tools) cannot be compiled; the message says why."""


def _llguidance() -> Any:
    import llguidance

    return llguidance


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """The grammar of JSON text matching `schema` (`{"type": "object"}` for any JSON object)."""
    LLMatcher = _llguidance().LLMatcher
    try:
        grammar = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)
    except ValueError as exc:
        raise GrammarError(str(exc)) from None
    return checked(grammar)


def lark_grammar(lark: str) -> str:
    return checked(_llguidance().LLMatcher.grammar_from_lark(lark))


def checked(grammar: str) -> str:
    """The grammar, once llguidance has compiled it without error (else GrammarError with its reason)."""
    problem = _llguidance().LLMatcher.validate_grammar(grammar, None)
    if problem and not problem.startswith("WARNING"):
        raise GrammarError(problem)
    return grammar


def styled(schema: dict[str, Any]) -> dict[str, Any]:
    """A schema embedded in a Lark grammar (`%json {...}`), carrying the JSON style with it."""
    return {**schema, "x-guidance": {**JSON_STYLE, **(schema.get("x-guidance") or {})}}


def lark_json(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps(styled(schema), ensure_ascii=False)


class Guide:
    """One request's matcher. Made in the engine's process from the grammar text; the batching thread
    feeds it the request's tokens and reads its mask."""

    __slots__ = ("grammar", "matcher", "consumed", "failed")

    def __init__(self, grammar: str) -> None:
        self.grammar = grammar
        self.matcher: Any = None
        self.consumed = 0
        self.failed: str | None = None

    def __deepcopy__(self, memo: dict[int, Any]) -> "Guide":
        # The manager deep-copies a request's processor arguments when it re-queues the request
        # (its KV cache offloaded): the re-queued request goes on with this same matcher.
        return self

    def catch_up(self, tokenizer: Any, generated: list[int]) -> None:
        """Feeds the matcher the tokens the request generated since the last step."""
        if self.matcher is None:
            self.matcher = _llguidance().LLMatcher(tokenizer, self.grammar)
            if self.matcher.is_error():
                self._fail(f"grammar: {self.matcher.get_error()}")
        new = generated[self.consumed:]
        if new and self.failed is None and not self.matcher.consume_tokens(new):
            self._fail(f"token not allowed: {self.matcher.get_error()}")
        self.consumed = len(generated)

    def _fail(self, why: str) -> None:
        self.failed = why
        log.error("guided decoding failed (%s); the request is ended", why)


class TokenMask:
    """The continuous batching logits processor (see the module docstring). Built lazily as the
    library's subclass, so that importing this module imports neither torch nor transformers."""

    @staticmethod
    def make(hf_tokenizer: Any, eos_ids: list[int], device: Any, rows: int, always: bool) -> Any:
        import numpy as np
        import torch
        from transformers.generation.continuous_batching.cb_logits_processors import ContinuousBatchingLogitsProcessor

        from llguidance.torch import fill_next_token_bitmask

        class _TokenMask(ContinuousBatchingLogitsProcessor):
            supported_kwargs: dict[str, type] = {"guide": Guide}
            ignored_kwargs: tuple[str, ...] = ()

            def __init__(self) -> None:
                self._tokenizer: Any = None
                self._lock = threading.Lock()
                self._vocab = len(hf_tokenizer)
                self._host = torch.full((rows, (self._vocab + 31) // 32), -1, dtype=torch.int32)
                self._device = self._host.to(device)
                self._shifts = torch.arange(32, dtype=torch.int32, device=device)
                self._any = always
                self._rows: list[int] = []  # this step's guided rows

            def tokenizer(self) -> Any:
                """llguidance's view of the vocabulary: ~1 s to build, so once, on the first guided request."""
                with self._lock:
                    if self._tokenizer is None:
                        import llguidance.hf

                        eos = eos_ids[0] if len(eos_ids) == 1 else eos_ids
                        self._tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=self._vocab, eos_token=eos)
                    return self._tokenizer

            def fill_defaults(self, int32_tensor: Any) -> None:
                int32_tensor.fill_(0)

            def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> Any:
                flags = [0] * len(requests_with_new_token)
                for i, future in enumerate(requests_with_new_token):
                    guide = future.state.logit_processor_kwargs.get("guide")
                    if guide is None:
                        continue
                    state = future.state
                    generated = state.generated_tokens
                    if state._true_initial_tokens:  # re-queued: what it generated before is part of its prompt now
                        generated = state.initial_tokens[state._true_initial_tokens:] + generated
                    guide.catch_up(self.tokenizer(), generated)
                    if guide.failed is None:
                        fill_next_token_bitmask(guide.matcher, self._host, i)
                    else:  # only the end of the sequence: the request ends here
                        self._host[i].zero_()
                        for eos in eos_ids:
                            self._host[i, eos // 32] |= 1 << (eos % 32)
                    flags[i] = 1
                self._rows = [i for i, flag in enumerate(flags) if flag]
                self._any = always or bool(self._rows)
                if always and self._rows:
                    self._device[: len(flags)].copy_(self._host[: len(flags)])
                return torch.tensor(flags, dtype=torch.int32)

            def __call__(self, scores: Any, tensor_arg: Any) -> Any:
                if not self._any:
                    return scores
                if not always:  # eager: only the guided rows, unpacked by numpy (~0.2 ms a row on a CPU core)
                    return self._masked_rows(scores)
                batch, width = scores.shape
                n = min(batch, rows)  # rows past the batch's requests are padding
                bits = (self._device[:n].unsqueeze(-1) >> self._shifts) & 1  # [n, words, 32]
                allowed = bits.reshape(n, -1)[:, :width].bool()
                if allowed.size(-1) < width:  # logits wider than the vocabulary: padding ids are never allowed
                    allowed = torch.cat([allowed, torch.zeros(n, width - allowed.size(-1), dtype=torch.bool, device=scores.device)], dim=-1)
                unguided = (tensor_arg[:n] == 0).unsqueeze(-1)
                head = scores[:n].masked_fill(~(allowed | unguided), float("-inf"))
                return head if n == batch else torch.cat([head, scores[n:]])

            def _masked_rows(self, scores: Any) -> Any:
                width = scores.size(-1)
                bits = np.unpackbits(self._host.numpy()[self._rows].view(np.uint8), axis=1, bitorder="little")[:, :width]
                allowed = torch.from_numpy(bits).to(device=scores.device, dtype=torch.bool)
                if allowed.size(-1) < width:  # logits wider than the vocabulary: padding ids are never allowed
                    allowed = torch.cat([allowed, allowed.new_zeros(len(self._rows), width - allowed.size(-1))], dim=-1)
                rows = torch.tensor(self._rows, device=scores.device)
                # In place: these logits are this step's own (the lm head's output), read by nothing after sampling.
                return scores.index_copy_(0, rows, scores.index_select(0, rows).masked_fill_(~allowed, float("-inf")))

        return _TokenMask()


def install(manager: Any, hf_tokenizer: Any, eos_ids: list[int], device: Any, rows: int) -> bool:
    """Puts the token mask first among the manager's per-request logits processors (before
    temperature and top-p: they must only ever see allowed tokens). Call before `manager.start()`:
    the batch processor sizes its argument tensors from the list when it is made. Returns whether
    guided decoding works with this manager (False under asynchronous batching)."""
    if manager.continuous_batching_config.use_async_batching:
        return False
    rows = max(rows, int(manager.continuous_batching_config.max_requests_per_batch or 0))
    processors = manager.logit_processor
    config = manager.continuous_batching_config
    # A captured graph or a compiled step keeps no Python branch: the mask is applied on every step there.
    always = captured(config)
    processors.logits_processor.insert(0, TokenMask.make(hf_tokenizer, eos_ids, device, rows, always))
    processors.tensors_required += 1
    processors._retrieve_processors_kwargs()
    processors.do_processing = True
    return True
