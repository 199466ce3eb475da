"""Cost-aware routing: a virtual model (e.g. `auto`) that sends each request to one of several
real models by rules in models.yaml.

    - id: auto
      backend: router
      default: llama-3.1-8b                 # when no rule matches
      routes:                               # first match wins; every condition given must hold
        - model: qwen2.5-coder-7b
          code: true                        # a code fence or code-looking text in the prompt
        - model: llama-3.1-70b
          tools: true                       # the request carries tools
        - model: llama-3.1-70b
          min_prompt_tokens: 2000
        - model: smollm2-135m-instruct
          max_prompt_tokens: 200
          max_output_tokens: 256            # requested max_tokens (unset counts as unbounded)

The choice is made before the request is parsed: the body's `model` becomes the chosen id, so
everything after (permissions, prompt counting, quota, price, the response's `model`, the
ledger row) is the chosen model's, exactly as if the client had named it. When the chosen model
cannot take a request now (not loaded, unhealthy or full), the next matching rule's model is
tried, then the default; a model's own `fallbacks` still apply once it runs.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from engines.base import Engine, EngineError, EngineOutput, EngineRequest

CODE_PATTERN = re.compile(
    r"```|^\s*(def|class|import|from \S+ import|#include|function|const|let|var|public|private|package|fn|SELECT|CREATE TABLE)\b"
    r"|\b(def|function|fn)\s+\w+\s*\(|[{};]\s*$",
    re.MULTILINE,
)
RULE_FIELDS = ("model", "min_prompt_tokens", "max_prompt_tokens", "min_output_tokens", "max_output_tokens", "tools", "code")


@dataclass(frozen=True)
class Features:
    prompt_tokens: int
    max_tokens: int | None  # None: the client did not bound the output
    tools: bool
    code: bool


@dataclass(frozen=True)
class Rule:
    model: str
    min_prompt_tokens: int | None = None
    max_prompt_tokens: int | None = None
    min_output_tokens: int | None = None
    max_output_tokens: int | None = None
    tools: bool | None = None
    code: bool | None = None

    def matches(self, f: Features) -> bool:
        if self.min_prompt_tokens is not None and f.prompt_tokens < self.min_prompt_tokens:
            return False
        if self.max_prompt_tokens is not None and f.prompt_tokens > self.max_prompt_tokens:
            return False
        if self.min_output_tokens is not None and f.max_tokens is not None and f.max_tokens < self.min_output_tokens:
            return False
        if self.max_output_tokens is not None and (f.max_tokens is None or f.max_tokens > self.max_output_tokens):
            return False
        if self.tools is not None and f.tools != self.tools:
            return False
        if self.code is not None and f.code != self.code:
            return False
        return True


def check_rule(value: Any) -> str | None:
    """A problem with one `routes` entry, or None (models.yaml validation)."""
    if not isinstance(value, dict):
        return "each route must be a mapping with `model` and conditions"
    unknown = [k for k in value if k not in RULE_FIELDS]
    if unknown:
        return f"unknown route condition {unknown[0]!r} (one of {', '.join(RULE_FIELDS[1:])})"
    if not isinstance(value.get("model"), str) or not value["model"].strip():
        return "a route needs `model`: the id it sends matching requests to"
    for name in ("min_prompt_tokens", "max_prompt_tokens", "min_output_tokens", "max_output_tokens"):
        v = value.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            return f"`{name}` must be a non-negative integer"
    for name in ("tools", "code"):
        if name in value and not isinstance(value[name], bool):
            return f"`{name}` must be true or false"
    return None


class RouterEngine(Engine):
    """The virtual model in the served map. It never runs a request itself: the gateway resolves
    its id to the model `choose` picks before it parses the request."""

    passthrough = False

    def __init__(self, model_id: str, rules: list[Rule], default: str, targets: Mapping[str, Engine]) -> None:
        self.model_id = model_id
        self.rules = rules
        self.default = default
        self.targets = dict(targets)  # model id -> its served engine

    # routing -------------------------------------------------------------------------------------
    def features(self, body: dict[str, Any], kind: str) -> Features:
        text = _prompt_text(body, kind)
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
            max_tokens = None
        return Features(
            prompt_tokens=self._count(body, kind, text),
            max_tokens=max_tokens,
            tools=bool(body.get("tools") or body.get("functions")),
            code=bool(CODE_PATTERN.search(text)),
        )

    def _count(self, body: dict[str, Any], kind: str, text: str) -> int:
        encoder = self.targets.get(self.default)
        try:
            if kind == "chat" and encoder is not None and encoder.ready:
                from engines.wrappers.fallback import plain_messages

                return len(encoder.encode_chat(plain_messages(body.get("messages") or [])))
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return len(prompt)
            if encoder is not None and encoder.ready:
                return len(encoder.encode_text(text))
        except Exception:
            pass
        return max(1, len(text) // 4)  # no tokenizer at hand: a rough count

    def candidates(self, features: Features) -> list[str]:
        """Models in the order they would be tried: matching rules, then the default."""
        out = [r.model for r in self.rules if r.matches(features)]
        out.append(self.default)
        return list(dict.fromkeys(out))

    def choose(self, body: dict[str, Any], kind: str) -> str:
        order = self.candidates(self.features(body, kind))
        for name in order:
            engine = self.targets.get(name)
            if engine is not None and engine.ready and engine.healthy and engine.has_capacity():
                return name
        return order[0]  # none can take it now: the first choice answers with its own error

    # Engine --------------------------------------------------------------------------------------
    @property
    def context_length(self) -> int:  # type: ignore[override]
        return max((e.context_length for e in self.targets.values()), default=0)

    @property
    def owned_by(self) -> str:  # type: ignore[override]
        return "tollgate"

    @property
    def ready(self) -> bool:
        return any(e.ready for e in self.targets.values())

    async def start(self) -> None:
        for engine in self.targets.values():
            if not engine.ready:
                await engine.start()

    async def stop(self) -> None:
        return None  # the targets are served models; they are stopped as such

    def runners(self) -> list[Engine]:
        return []

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.targets[self.default].encode_chat(messages)

    def encode_text(self, prompt: str) -> list[int]:
        return self.targets[self.default].encode_text(prompt)

    async def stream(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        raise EngineError(f"{self.model_id} is a routing model; requests are sent to the model it chooses")
        yield  # pragma: no cover

    def cancel(self, request_id: str) -> None:
        return None

    def has_capacity(self) -> bool:
        return any(e.has_capacity() for e in self.targets.values())

    def requests_in_flight(self) -> int:
        return 0


def _prompt_text(body: dict[str, Any], kind: str) -> str:
    if kind == "chat":
        from engines.backends.openai_stream import content_text

        messages = body.get("messages")
        if not isinstance(messages, list):
            return ""
        return "\n".join(content_text(m.get("content")) for m in messages if isinstance(m, dict))
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return "\n".join(p for p in prompt if isinstance(p, str))
    return ""


def router_of(engine: Engine) -> RouterEngine | None:
    """The RouterEngine a served engine is (behind the scheduler, were it wrapped), or None."""
    unwrapped = engine.unwrapped()
    return unwrapped if isinstance(unwrapped, RouterEngine) else None
