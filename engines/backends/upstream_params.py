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

Under either policy, fields that reach past what the gateway counted and reserved (`INTERNAL`:
token ids or embeddings instead of the counted prompt, another request's KV state, an adapter
path, server-side code or ids) are refused with a 400 naming the field, unless the model's
`params.allow` lists it. So are chat template variables (`chat_template_kwargs`) that carry text
into the prompt rather than switch the template (`documents`, `tools`, lists, objects, long
strings), unless `allow` lists `chat_template_kwargs`. A client's `priority` is never forwarded: with `params.priority` set, the
account's scheduling class is sent in the upstream's own terms instead (`upstream_priority`).

    params: {policy: pass, allow: [prompt_token_ids]}        # a trusted caller's token-id prompts
    params: {policy: drop, upstream: vllm, priority: by_class}  # classes as vLLM priorities
    params: {policy: pass, priority: {interactive: 1.0, batch: 0.2}}  # or each class's value
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("tollgate.engines.openai")

POLICIES = ("pass", "drop")

# --- facts: field names of the upstreams' request models (names only) ----------------------------
# trtllm-serve: NVIDIA/TensorRT-LLM tensorrt_llm/serve/openai_protocol.py as stored at commit
# 0076e9390e1ed11515f149eec356f5a03f4a00d8 (main's layout: it imports tensorrt_llm.sampling_params,
# not executor/params/); classes ChatCompletionRequest, CompletionRequest and StreamOptions, all
# `extra="forbid"`. `max_tokens` is ChatCompletionRequest.max_completion_tokens's validation_alias
# (populate_by_name=True: both names are accepted). `priority`: a float in [0, 1], higher first.
TRTLLM_SERVE_COMMIT = "0076e9390e1ed11515f149eec356f5a03f4a00d8"
TRTLLM_SERVE = {
    "chat": (
        "messages", "prompt_token_ids", "prompt_token_ids_b64", "model", "frequency_penalty", "logit_bias",
        "logprobs", "top_logprobs", "max_completion_tokens", "max_tokens", "n", "presence_penalty",
        "response_format", "seed", "stop", "stream", "stream_options", "temperature", "top_p", "tools",
        "tool_choice", "parallel_tool_calls", "user", "reasoning_effort", "thinking", "thinking_token_budget",
        "prompt_ignore_length", "best_of", "use_beam_search", "top_k", "top_p_min", "min_p", "repetition_penalty",
        "length_penalty", "early_stopping", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
        "min_tokens", "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
        "lora_request", "echo", "add_generation_prompt", "add_special_tokens", "documents",
        "chat_template", "chat_template_kwargs", "injected_chat_template_kwargs", "media_io_kwargs",
        "disaggregated_params", "conversation_params", "cache_salt", "priority", "agent_hierarchy",
        "mm_processor_kwargs",
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

# vLLM: vllm-project/vllm at commit 002032ee2b18e1f7bd924ec47b62504ba3866063, where the protocol is
# split: vllm/entrypoints/openai/chat_completion/protocol.py (ChatCompletionRequest) and
# completion/protocol.py (CompletionRequest); StreamOptions in vllm/entrypoints/generate/base/protocol.py
# (`extra="allow"`: unknown fields are logged and ignored there, not refused). `priority`: an
# integer, lower first, 0 unless the server runs with --scheduling-policy priority.
VLLM_COMMIT = "002032ee2b18e1f7bd924ec47b62504ba3866063"
VLLM = {
    "chat": (
        "messages", "model", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "max_tokens",
        "max_completion_tokens", "n", "presence_penalty", "response_format", "seed", "stop", "stream",
        "stream_options", "temperature", "top_p", "tools", "tool_choice", "reasoning_effort",
        "thinking_token_budget", "include_reasoning", "parallel_tool_calls", "user", "use_beam_search", "top_k",
        "min_p", "repetition_penalty", "watermarking", "length_penalty", "stop_token_ids",
        "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
        "spaces_between_special_tokens", "truncate_prompt_tokens", "truncation_side", "prompt_logprobs",
        "logprob_token_ids", "allowed_token_ids", "bad_words", "echo", "add_generation_prompt",
        "continue_final_message", "add_special_tokens", "documents", "chat_template", "chat_template_kwargs",
        "media_io_kwargs", "mm_processor_kwargs", "structured_outputs", "priority", "request_id", "session_id",
        "return_tokens_as_token_ids", "return_token_ids", "routed_experts_prompt_start", "return_token_offsets",
        "return_prompt_text", "return_mm_kwargs", "cache_salt", "kv_transfer_params", "ec_transfer_params",
        "vllm_xargs", "repetition_detection", "stream_interval",
    ),
    "text": (
        "model", "prompt", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
        "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p",
        "user", "use_beam_search", "top_k", "min_p", "repetition_penalty", "watermarking", "length_penalty",
        "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
        "spaces_between_special_tokens", "truncate_prompt_tokens", "truncation_side", "allowed_token_ids",
        "prompt_logprobs", "logprob_token_ids", "bad_words", "prompt_embeds", "add_special_tokens",
        "response_format", "structured_outputs", "priority", "request_id", "session_id",
        "return_tokens_as_token_ids", "return_token_ids", "routed_experts_prompt_start", "return_token_offsets",
        "return_mm_kwargs", "cache_salt", "kv_transfer_params", "ec_transfer_params", "vllm_xargs",
        "repetition_detection", "thinking_token_budget", "stream_interval",
    ),
    "stream_options": ("include_usage", "continuous_usage_stats"),
}

UPSTREAMS: dict[str, dict[str, tuple[str, ...]]] = {"trtllm-serve": TRTLLM_SERVE, "vllm": VLLM}

# Fields no tenant may set (400 unless `allow` lists them): each lets a request reach past what the
# gateway counted, reserved and checked against the context, or into the server itself. Read from
# trtllm-serve's openai_protocol.py and vLLM's protocol modules at the commits above.
INTERNAL: dict[str, str] = {
    "prompt_token_ids": "a prompt of token ids in place of the messages the gateway counted (trtllm-serve: "
                        "disaggregated serving's generation step)",
    "prompt_token_ids_b64": "the same token-id prompt, base64-encoded (trtllm-serve)",
    "prompt_embeds": "prompt embeddings in place of the prompt the gateway counted (vLLM), loaded by the server",
    "disaggregated_params": "another request's prefilled KV cache and its usage (trtllm-serve: ctx_request_id, "
                            "opaque_state, ctx_usage)",
    "kv_transfer_params": "KV blocks pulled from a remote engine instead of a counted prefill (vLLM)",
    "ec_transfer_params": "encoder outputs pulled from a remote engine (vLLM encoder-cache disaggregation)",
    "lora_request": "a LoRA adapter loaded from a server path (trtllm-serve LoRARequest.lora_path)",
    "logits_processors": "server-side logits processor classes by qualified name (vLLM)",
    "vllm_xargs": "arguments for server-side extensions (vLLM)",
    "request_id": "the engine's own request id, which aborts and routing go by (vLLM)",
    "agent_hierarchy": "scheduling input the gateway owns (trtllm-serve SchedulingParams)",
    "injected_chat_template_kwargs": "server-populated (trtllm-serve): exempts template kwargs from its checks",
    "chat_template": "a Jinja template of the caller's: the prompt it renders is not the one the gateway counted",
    "documents": "text the chat template adds to the prompt, which the gateway does not count",
    "mm_processor_kwargs": "media processing sizes (vLLM: max_pixels, frames per video) that set what a media part "
                           "costs upstream, past the per-part bound the gateway reserved (tokens_per_non_text_part)",
    "media_io_kwargs": "media loading options (vLLM: video frames read) that change what a media part costs upstream",
}
# Fields that multiply the sequences generated past the `n` the gateway reserved for (chat).
MULTIPLIERS = ("best_of",)
# The chat template's variables (vLLM and trtllm-serve): the upstream renders them into the prompt,
# which the gateway counted without them. Switches (`enable_thinking: false`, `reasoning_effort:
# "low"`) change a few tokens the template itself holds; text of the caller's (HF's `documents`,
# `tools`, a long string, a list or an object) is prompt the gateway did not count or reserve.
TEMPLATE_VARIABLES = "chat_template_kwargs"
TEMPLATE_TEXT = ("documents", "tools", "messages", "conversation", "chat_template")
TEMPLATE_SWITCH_CHARS = 64
# The scheduling priority, in each upstream's terms (read from their protocol and engine sources):
# trtllm-serve a float in [0, 1], higher first (0.5 when unset, honoured with
# scheduler_config.waiting_queue_policy=priority); vLLM an integer, lower first (0 when unset; any
# other value is a 400 unless the server runs with --scheduling-policy priority).
PRIORITY_SCALES = {"trtllm-serve": "float", "vllm": "int"}
UPSTREAM_COMMITS = {"trtllm-serve": ("NVIDIA/TensorRT-LLM", TRTLLM_SERVE_COMMIT), "vllm": ("vllm-project/vllm", VLLM_COMMIT)}

# Always forwarded (the gateway sets or needs them), so never in `drop`.
NEEDED = frozenset({"model", "messages", "prompt", "stream", "stream_options"})
# Bound what a request is billed: never dropped silently.
BILLING = frozenset({"max_tokens", "max_completion_tokens"})
KEYS = ("policy", "upstream", "accept", "drop", "allow", "priority")
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
    if policy == "pass" and value.get("accept") is not None:
        return "accept applies only with policy: drop (policy: pass forwards every field)"
    if policy == "pass" and upstream is not None and value.get("priority") is None:
        return "upstream applies only with policy: drop or a priority (policy: pass forwards every field)"
    allow = value.get("allow")
    if allow is not None:
        if not isinstance(allow, list) or not all(isinstance(n, str) for n in allow):
            return "allow must be a list of field names"
        refusable = [*INTERNAL, *MULTIPLIERS, TEMPLATE_VARIABLES]
        unknown_allow = [n for n in allow if n not in refusable]
        if unknown_allow:
            return f"allow lists {unknown_allow[0]!r}, which is not refused (refused: {', '.join(refusable)})"
    problem = _check_priority(value.get("priority"), upstream)
    if problem:
        return problem
    if policy == "drop" and upstream is None and not value.get("accept"):
        return "policy: drop needs upstream (trtllm-serve, vllm) or an accept list"
    refused = sorted(set(value.get("drop") or ()) & (NEEDED | BILLING))
    if refused:
        why = "bounds what the request is billed" if refused[0] in BILLING else "is needed by the gateway"
        return f"drop may not list {refused[0]!r}: it {why}"
    return None


def _check_priority(value: Any, upstream: str | None) -> str | None:
    if value is None:
        return None
    if value == "by_class":
        if upstream not in PRIORITY_SCALES:
            return "priority: by_class needs upstream (trtllm-serve, vllm): the priority's scale is the upstream's"
        return None
    if not isinstance(value, dict) or not value:
        return "priority must be by_class or a mapping of scheduling class to the upstream's priority value"
    for name, v in value.items():
        if type(v) not in (int, float):
            return f"priority of class {name!r} must be a number, got {v!r}"
        if upstream == "trtllm-serve" and not 0.0 <= v <= 1.0:
            return f"priority of class {name!r}: trtllm-serve takes 0.0 to 1.0 (higher first), got {v!r}"
        if upstream == "vllm" and type(v) is not int:
            return f"priority of class {name!r}: vLLM takes an integer (lower first), got {v!r}"
    return None


class ParamRefused(Exception):
    """The client sent a field that bounds billing and the upstream does not accept, or one no
    tenant may set (INTERNAL)."""

    def __init__(self, name: str, upstream: str, reason: str | None = None) -> None:
        if reason is not None:
            message = f"`{name}` may not be set on this model: {reason}"
        else:
            message = (f"`{name}` is not accepted by this model's upstream ({upstream}); it bounds what the "
                       "request is billed, so it is not dropped")
        super().__init__(message)
        self.name = name


@dataclass
class ParamPolicy:
    """A pool's policy, built from models.yaml's `params:` (validated by `check_params`)."""

    policy: str = "pass"
    upstream: str | None = None
    accept: tuple[str, ...] = ()
    drop: tuple[str, ...] = ()
    allow: tuple[str, ...] = ()
    priority: str | dict[str, float] | None = None
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
            allow=tuple(value.get("allow") or ()), priority=value.get("priority"),
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
        self._drop = frozenset(self.drop) | {"priority"}  # a tenant's own priority never goes through
        self._refused = {k: v for k, v in INTERNAL.items() if k not in self.allow}
        self._multipliers = tuple(m for m in MULTIPLIERS if m not in self.allow)
        self._template_text = TEMPLATE_VARIABLES not in self.allow
        self._classes: tuple[str, ...] = ()

    def use_classes(self, names: tuple[str, ...]) -> None:
        """The gateway's scheduling classes, highest first (for `priority: by_class`)."""
        self._classes = tuple(names)

    def upstream_priority(self, klass: str | None) -> float | int | None:
        """The priority to send for a request of this scheduling class (None: the top class), or None
        to send none. by_class: the classes spread over the upstream's scale, the top class first
        (trtllm-serve 1.0 down to 0.0; vLLM 0, 1, 2, ...); a class this gateway does not know ranks last."""
        if self.priority is None:
            return None
        if isinstance(self.priority, dict):
            if klass is None:
                klass = self._classes[0] if self._classes else None
            if klass in self.priority:
                return self.priority[klass]
            return None
        if len(self._classes) < 2:
            return None  # one class: every request is equal, the upstream's default says so
        rank = self._classes.index(klass) if klass in self._classes else (0 if klass is None else len(self._classes) - 1)
        if PRIORITY_SCALES[self.upstream or ""] == "int":
            return rank
        return round(1.0 - rank / (len(self._classes) - 1), 6)

    def refuse(self, body: dict[str, Any], chat: bool) -> None:
        """Raises ParamRefused for a field no tenant may set (INTERNAL, or a chat sequence multiplier
        the gateway did not reserve for), whatever the policy."""
        for name in body:
            reason = self._refused.get(name)
            if reason is not None and body[name] is not None:
                raise ParamRefused(name, self.upstream or "", reason)
        if self._template_text and body.get(TEMPLATE_VARIABLES) is not None:
            _refuse_template_text(body[TEMPLATE_VARIABLES], self.upstream or "")
        if chat:
            for name in self._multipliers:
                value = body.get(name)
                if value is not None and value != 1:
                    raise ParamRefused(name, self.upstream or "", "more sequences than the n the request is reserved and "
                                       "billed for; use n")

    def bound(self, body: dict[str, Any], chat: bool, max_tokens: int) -> None:
        """Sets the completion bound the gateway reserved for (`max_tokens`: the client's own, or less
        where the context leaves less room) in `body`: every bound field the client sent, else the
        first of max_tokens / max_completion_tokens this upstream accepts (none: an accept list
        that names neither says the upstream takes no bound, and none is sent). Without it an
        upstream generates to its own context (a chat without max_tokens; a prompt the upstream
        truncated, `truncate_prompt_tokens`, leaves it more room than the gateway reserved)."""
        sent = [name for name in BILLING if body.get(name) is not None]
        if not sent:
            accepted = self._accepted["chat" if chat else "text"] if self._accepted is not None else None
            sent = [n for n in ("max_tokens", "max_completion_tokens") if accepted is None or n in accepted][:1]
        for name in sent:
            body[name] = max_tokens

    def apply(self, body: dict[str, Any], chat: bool) -> list[str]:
        """Removes from `body` (in place) what this upstream must not get; returns the names removed.
        Raises ParamRefused for a field no tenant may set."""
        self.refuse(body, chat)
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


def _refuse_template_text(variables: Any, upstream: str) -> None:
    """Raises ParamRefused for chat template variables that carry text into the prompt (TEMPLATE_TEXT)."""
    if not isinstance(variables, dict):
        raise ParamRefused(TEMPLATE_VARIABLES, upstream, "must be an object of the chat template's variables")
    for name, value in variables.items():
        text = (name in TEMPLATE_TEXT or isinstance(value, (dict, list))
                or (isinstance(value, str) and len(value) > TEMPLATE_SWITCH_CHARS))
        if text and value is not None:
            raise ParamRefused(f"{TEMPLATE_VARIABLES}.{name}", upstream,
                               "text the chat template adds to the prompt, which the gateway does not count "
                               f"(a template variable may be a switch: a boolean, a number or at most "
                               f"{TEMPLATE_SWITCH_CHARS} characters)")
