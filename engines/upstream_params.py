"""Which of a client's body fields an `openai` pool forwards upstream: its `params:` in models.yaml.

    params: {policy: pass}                           # the default: every field, as the client sent it
    params: {policy: pass, drop: [user]}             # every field but these
    params: {policy: drop, upstream: trtllm-serve}   # only the fields trtllm-serve's request models declare
    params: {policy: drop, upstream: vllm, accept: [my_ext], drop: [cache_salt]}
    params: {policy: drop, accept: [messages, max_tokens, temperature, ...]}   # a list of your own

`policy: drop` forwards a field only if the upstream accepts it: the built-in list of `upstream`
(the fields of its ChatCompletionRequest / CompletionRequest, read from its source, below) plus
`accept`, minus `drop`. trtllm-serve's request models forbid unknown fields (pydantic
`extra="forbid"`), so one field it does not know turns the whole request into a 400; vLLM's
allow them (it logs and ignores them), so its list only keeps bodies clean.

What the gateway itself needs is always forwarded: `model`, `messages` / `prompt`, `stream`,
`stream_options` (whose inner fields are filtered too, with a built-in list). Fields that bound
what a request is billed (`max_tokens`, `max_completion_tokens`) are never dropped silently: a
policy may not list them in `drop`, and a request carrying one the upstream does not accept is
refused (400) instead of running unbounded. Every dropped field is logged at debug and counted
(`ParamPolicy.dropped`).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("tollgate.engines.openai")

POLICIES = ("pass", "drop")

# --- facts: field names of the upstreams' request models (names only) ----------------------------
# trtllm-serve: NVIDIA/TensorRT-LLM tensorrt_llm/serve/openai_protocol.py at commit
# 1f064c467a211b4168555ca06bb9b801c64eae20 (the commit tests/contracts/trtllm_contract.json was
# read from); classes ChatCompletionRequest, CompletionRequest and StreamOptions, all
# `extra="forbid"`. `max_tokens` is ChatCompletionRequest.max_completion_tokens's validation_alias
# (populate_by_name=True: both names are accepted).
TRTLLM_SERVE_COMMIT = "1f064c467a211b4168555ca06bb9b801c64eae20"
TRTLLM_SERVE = {
    "chat": (
        "messages", "prompt_token_ids", "prompt_token_ids_b64", "model", "frequency_penalty", "logit_bias",
        "logprobs", "top_logprobs", "max_completion_tokens", "max_tokens", "n", "presence_penalty",
        "response_format", "seed", "stop", "stream", "stream_options", "temperature", "top_p", "tools",
        "tool_choice", "user", "reasoning_effort", "thinking_token_budget", "prompt_ignore_length",
        "best_of", "use_beam_search", "top_k", "top_p_min", "min_p", "repetition_penalty",
        "length_penalty", "early_stopping", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
        "min_tokens", "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
        "lora_request", "echo", "add_generation_prompt", "add_special_tokens", "documents",
        "chat_template", "chat_template_kwargs", "media_io_kwargs", "disaggregated_params",
        "conversation_params", "cache_salt", "priority", "agent_hierarchy", "mm_processor_kwargs",
    ),
    "text": (
        "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens",
        "n", "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature",
        "top_p", "user", "lora_request", "prompt_ignore_length", "use_beam_search", "top_k", "top_p_min",
        "min_p", "repetition_penalty", "length_penalty", "early_stopping", "stop_token_ids",
        "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
        "spaces_between_special_tokens", "truncate_prompt_tokens", "return_context_logits", "detokenize",
        "thinking_token_budget", "add_special_tokens", "response_format", "disaggregated_params",
        "priority", "conversation_params",
    ),
    "stream_options": ("include_usage", "continuous_usage_stats"),
}

# vLLM: vllm-project/vllm vllm/entrypoints/openai/protocol.py at commit
# ec3b890c14b00f6670515d9df8d503b5270e95ca; classes ChatCompletionRequest, CompletionRequest and
# StreamOptions (`extra="allow"`: unknown fields are logged and ignored there, not refused).
VLLM_COMMIT = "ec3b890c14b00f6670515d9df8d503b5270e95ca"
VLLM = {
    "chat": (
        "messages", "model", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "max_tokens",
        "max_completion_tokens", "n", "presence_penalty", "response_format", "seed", "stop", "stream",
        "stream_options", "temperature", "top_p", "tools", "tool_choice", "reasoning_effort",
        "include_reasoning", "parallel_tool_calls", "user", "use_beam_search", "top_k", "min_p",
        "repetition_penalty", "length_penalty", "stop_token_ids", "include_stop_str_in_output",
        "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
        "truncate_prompt_tokens", "prompt_logprobs", "allowed_token_ids", "bad_words", "echo",
        "add_generation_prompt", "continue_final_message", "add_special_tokens", "documents",
        "chat_template", "chat_template_kwargs", "mm_processor_kwargs", "structured_outputs", "priority",
        "request_id", "logits_processors", "return_tokens_as_token_ids", "return_token_ids", "cache_salt",
        "kv_transfer_params", "vllm_xargs",
    ),
    "text": (
        "model", "prompt", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
        "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p",
        "user", "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty",
        "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
        "spaces_between_special_tokens", "truncate_prompt_tokens", "allowed_token_ids", "prompt_logprobs",
        "prompt_embeds", "add_special_tokens", "response_format", "structured_outputs", "priority",
        "request_id", "logits_processors", "return_tokens_as_token_ids", "return_token_ids", "cache_salt",
        "kv_transfer_params", "vllm_xargs",
    ),
    "stream_options": ("include_usage", "continuous_usage_stats"),
}

UPSTREAMS: dict[str, dict[str, tuple[str, ...]]] = {"trtllm-serve": TRTLLM_SERVE, "vllm": VLLM}
UPSTREAM_COMMITS = {"trtllm-serve": ("NVIDIA/TensorRT-LLM", TRTLLM_SERVE_COMMIT), "vllm": ("vllm-project/vllm", VLLM_COMMIT)}

# Always forwarded (the gateway sets or needs them), so never in `drop`.
NEEDED = frozenset({"model", "messages", "prompt", "stream", "stream_options"})
# Bound what a request is billed: never dropped silently.
BILLING = frozenset({"max_tokens", "max_completion_tokens"})
KEYS = ("policy", "upstream", "accept", "drop")
_MAX_NAMES_COUNTED = 256  # distinct dropped names counted one by one; the rest count as "(other)"


def check_params(value: Any) -> str | None:
    """models.yaml's `params:` of an `openai` pool: a problem, or None."""
    if not isinstance(value, dict):
        return f"must be a mapping such as {{policy: drop, upstream: trtllm-serve}}, got {type(value).__name__}"
    unknown = [k for k in value if k not in KEYS]
    if unknown:
        return f"unknown key {unknown[0]!r} (known: {', '.join(KEYS)})"
    policy = value.get("policy", "pass")
    if policy not in POLICIES:
        return f"policy must be one of {', '.join(POLICIES)}, got {policy!r}"
    for key in ("accept", "drop"):
        names = value.get(key)
        if names is not None and (not isinstance(names, list) or not all(isinstance(n, str) and n.strip() for n in names)):
            return f"{key} must be a list of field names"
    upstream = value.get("upstream")
    if upstream is not None and upstream not in UPSTREAMS:
        return f"upstream must be one of {', '.join(UPSTREAMS)}, got {upstream!r}"
    if policy == "pass" and (upstream is not None or value.get("accept") is not None):
        return "upstream and accept apply only with policy: drop (policy: pass forwards every field)"
    if policy == "drop" and upstream is None and not value.get("accept"):
        return "policy: drop needs upstream (trtllm-serve, vllm) or an accept list"
    refused = sorted(set(value.get("drop") or ()) & (NEEDED | BILLING))
    if refused:
        why = "bounds what the request is billed" if refused[0] in BILLING else "is needed by the gateway"
        return f"drop may not list {refused[0]!r}: it {why}"
    return None


class ParamRefused(Exception):
    """The client sent a field that bounds billing and the upstream does not accept."""

    def __init__(self, name: str, upstream: str) -> None:
        super().__init__(f"`{name}` is not accepted by this model's upstream ({upstream}); it bounds what the "
                         "request is billed, so it is not dropped")
        self.name = name


@dataclass
class ParamPolicy:
    """A pool's policy, built from models.yaml's `params:` (validated by `check_params`)."""

    policy: str = "pass"
    upstream: str | None = None
    accept: tuple[str, ...] = ()
    drop: tuple[str, ...] = ()
    dropped: Counter[str] = field(default_factory=Counter)  # field name -> requests it was dropped from
    requests_with_drops: int = 0

    @classmethod
    def from_config(cls, value: dict[str, Any] | None) -> "ParamPolicy":
        value = value or {}
        problem = check_params(value)
        if problem:
            raise ValueError(f"params: {problem}")
        return cls(
            policy=value.get("policy", "pass"), upstream=value.get("upstream"),
            accept=tuple(value.get("accept") or ()), drop=tuple(value.get("drop") or ()),
        )

    def __post_init__(self) -> None:
        builtin = UPSTREAMS.get(self.upstream or "", {})
        self._accepted: dict[str, frozenset[str]] | None = None
        if self.policy == "drop":
            self._accepted = {
                kind: (frozenset(builtin.get(kind, ())) | frozenset(self.accept) | NEEDED) - frozenset(self.drop)
                for kind in ("chat", "text")
            }
        self._stream_options = frozenset(builtin["stream_options"]) if "stream_options" in builtin else None
        self._drop = frozenset(self.drop)

    @property
    def filters(self) -> bool:
        return self.policy == "drop" or bool(self.drop)

    def apply(self, body: dict[str, Any], chat: bool) -> list[str]:
        """Removes from `body` (in place) what this upstream must not get; returns the names removed."""
        if not self.filters:
            return []
        accepted = self._accepted["chat" if chat else "text"] if self._accepted is not None else None
        removed = [k for k in body if (k in self._drop) or (accepted is not None and k not in accepted)]
        for name in removed:
            if name in BILLING and body[name] is not None:
                raise ParamRefused(name, self.upstream or "its accept list")
        for name in removed:
            del body[name]
        options = body.get("stream_options")
        if self._stream_options is not None and isinstance(options, dict):
            inner = [k for k in options if k not in self._stream_options]
            if inner:
                body["stream_options"] = {k: v for k, v in options.items() if k in self._stream_options}
                removed += [f"stream_options.{k}" for k in inner]
        if removed:
            self.requests_with_drops += 1
            for name in removed:
                self.dropped[name if name in self.dropped or len(self.dropped) < _MAX_NAMES_COUNTED else "(other)"] += 1
        return removed
