"""models.yaml: the public model ids, each with its backend, parameters, aliases and fallbacks.

    models:
      - id: llama-3.1-8b              # what clients send as `model`
        backend: trtllm               # hf | trtllm | openai
        model_path: /models/Llama-3.1-8B-Instruct
        aliases: [llama3]
        fallbacks: [llama-pool, smollm2-135m-instruct]   # tried in order when it is down or full

Every problem is reported with the file, the line and the field (`models.yaml:7: models[0].backend:
...`), all at once, before anything loads. `load_models()` returns the served map: every public id
and alias -> a `FallbackEngine` over the model's own engine and its fallbacks' engines.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from engines.base import Engine
from engines.wrappers.fallback import FallbackEngine, SharedLifecycle

BACKENDS = ("hf", "trtllm", "openai", "router", "synthetic")
Check = Callable[[Any], str | None]  # returns a problem, or None


class ModelsConfigError(Exception):
    """models.yaml is unusable; `problems` are "file:line: field: what is wrong" lines."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


# field checks -----------------------------------------------------------------------------------
def _int(minimum: int) -> Check:
    def check(v: Any) -> str | None:
        if isinstance(v, bool) or not isinstance(v, int):
            return f"must be an integer, got {_show(v)}"
        return None if v >= minimum else f"must be at least {minimum}, got {v}"

    return check


def _number(minimum: float, maximum: float | None = None, *, above: bool = False) -> Check:
    def check(v: Any) -> str | None:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return f"must be a number, got {_show(v)}"
        if (above and v <= minimum) or v < minimum or (maximum is not None and v > maximum):
            low = f"above {minimum:g}" if above else f"at least {minimum:g}"
            return f"must be {low}" + (f" and at most {maximum:g}" if maximum is not None else "") + f", got {v}"
        return None

    return check


def _str(v: Any) -> str | None:
    return None if isinstance(v, str) and v.strip() else f"must be a non-empty string, got {_show(v)}"


def _optional_str(v: Any) -> str | None:
    return None if v is None else _str(v)


def _bool(v: Any) -> str | None:
    return None if isinstance(v, bool) else f"must be true or false, got {_show(v)}"


def _mapping(v: Any) -> str | None:
    return None if isinstance(v, dict) else f"must be a mapping, got {_show(v)}"


def _names(v: Any) -> str | None:
    if not isinstance(v, list) or not all(isinstance(x, str) and x.strip() for x in v):
        return f"must be a list of names, got {_show(v)}"
    return None if len(set(v)) == len(v) else "lists a name twice"


def upstream_key(value: str) -> str | None:
    """An upstream key as read from the environment: its surrounding whitespace dropped (a key read
    from a file ends in a newline), None when what is left could not be sent in a header."""
    key = value.strip()
    return key if key and all(" " < c < "\x7f" for c in key) else None


def _urls(v: Any) -> str | None:
    if not isinstance(v, list) or not v:
        return f"must be a non-empty list of base URLs, got {_show(v)}"
    for url in v:
        if not isinstance(url, str) or not re.match(r"^https?://[^/\s]+", url):
            return f"{_show(url)} is not an http(s) base URL such as http://10.0.0.7:8000/v1"
    return None if len(set(v)) == len(v) else "lists a replica twice"


def _routes(v: Any) -> str | None:
    from engines.wrappers.router import check_rule

    if not isinstance(v, list) or not v:
        return f"must be a non-empty list of routes, got {_show(v)}"
    for i, rule in enumerate(v):
        problem = check_rule(rule)
        if problem:
            return f"route {i}: {problem}"
    return None


def _params(v: Any) -> str | None:
    from engines.backends.upstream_params import check_params

    return check_params(v)


def _one_of(*choices: str) -> Check:
    return lambda v: None if v in choices else f"must be one of {', '.join(choices)}, got {_show(v)}"


def _show(v: Any) -> str:
    return repr(v) if not isinstance(v, (dict, list)) else type(v).__name__


@dataclass(frozen=True)
class Field:
    check: Check
    required: bool = False


COMMON = {
    "id": Field(_str, required=True),
    "backend": Field(_one_of(*BACKENDS), required=True),
    "aliases": Field(_names),
    "fallbacks": Field(_names),
    "context_length": Field(_int(16)),
    "public": Field(_bool),
    "cache": Field(_bool),  # the response cache answers this model's deterministic requests
}
BACKEND_FIELDS: dict[str, dict[str, Field]] = {
    "hf": {
        "model_path": Field(_str),
        "device": Field(_str),
        "max_batch_size": Field(_int(1)),
        "max_queue": Field(_int(0)),
        "kv_cache_tokens": Field(_int(1)),
        "max_batch_tokens": Field(_int(1)),
        "cuda_graphs": Field(_bool),
        "warmup": Field(_bool),
        "process": Field(_bool),  # the model in a process of its own (default: on for cuda devices)
        "gather_ms": Field(_int(0)),  # the engine process: how long a burst after idle is gathered (engines/backends/hf_process.py)
        "tool_parser": Field(_one_of("hermes", "llama3_json")),  # default hermes (engines/decoding/structured.py)
    },
    "trtllm": {
        "model_path": Field(_str, required=True),
        "tensor_parallel_size": Field(_int(1)),
        "max_batch_size": Field(_int(1)),
        "max_num_tokens": Field(_int(1)),
        "kv_cache_free_gpu_memory_fraction": Field(_number(0.0, 1.0, above=True)),
        "scheduler_policy": Field(_one_of("guaranteed_no_evict", "max_utilization")),
        "max_queue": Field(_int(0)),
        "llm_options": Field(_mapping),
        "tool_parser": Field(_one_of("hermes", "llama3_json")),
        "output_timeout": Field(_number(0.0, above=True)),  # s without output from any request: the executor is gone
    },
    "synthetic": {  # benchmarks only: token ids at a set rate, no model (engines/backends/synthetic.py)
        "step_ms": Field(_number(0.0, above=True)),
        "tokens_per_step": Field(_int(1)),
        "max_batch_size": Field(_int(1)),
        "max_queue": Field(_int(0)),
        "tokenizer": Field(_str),  # a folder holding the embedded model's tokenizer files (default: read from its package)
    },
    "router": {
        "routes": Field(_routes, required=True),
        "default": Field(_str, required=True),
    },
    "openai": {
        "replicas": Field(_urls, required=True),
        "context_length": Field(_int(16), required=True),
        "upstream_model": Field(_str),
        "api_key_env": Field(_str),
        "tokenizer": Field(_str),
        "max_concurrency": Field(_int(1)),
        "retries": Field(_int(0)),
        "connect_timeout": Field(_number(0.0, above=True)),
        "first_token_timeout": Field(_number(0.0, above=True)),
        "idle_timeout": Field(_number(0.0, above=True)),
        "health_path": Field(_optional_str),
        "health_interval": Field(_number(0.0, above=True)),
        "health_timeout": Field(_number(0.0, above=True)),
        "eject_after": Field(_int(1)),
        "cooldown": Field(_number(0.0)),
        "max_connections": Field(_int(1)),
        "params": Field(_params),  # which client fields go upstream: engines/backends/upstream_params.py
        # tokens counted (context check, reservation) for each content part that is not text (an image,
        # audio, a file, a video); unset: such parts are refused (engines/backends/openai_pool.py check_parts)
        "tokens_per_non_text_part": Field(_int(1)),
    },
}


# reading with line numbers ----------------------------------------------------------------------
class _Lines:
    """Line numbers of every key and value in the document, by path."""

    def __init__(self, node: yaml.Node | None, problems: list[str], where: str) -> None:
        self.values: dict[tuple[Any, ...], int] = {}
        self.keys: dict[tuple[Any, ...], int] = {}
        if node is not None:
            self._walk(node, (), problems, where)

    def _walk(self, node: yaml.Node, path: tuple[Any, ...], problems: list[str], where: str) -> None:
        self.values[path] = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            seen: set[Any] = set()
            for key_node, value_node in node.value:
                key = key_node.value
                if key in seen:
                    problems.append(f"{where}:{key_node.start_mark.line + 1}: {_dotted(path + (key,))}: given twice")
                seen.add(key)
                self.keys[path + (key,)] = key_node.start_mark.line + 1
                self._walk(value_node, path + (key,), problems, where)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._walk(item, path + (i,), problems, where)

    def of(self, path: tuple[Any, ...], key: bool = False) -> int:
        table = self.keys if key else self.values
        while path and path not in table:
            path = path[:-1]
        return table.get(path, self.values.get((), 1))


def _dotted(path: tuple[Any, ...]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else ("." if out else "") + str(part)
    return out or "(document)"


@dataclass
class ModelSpec:
    id: str
    backend: str
    params: dict[str, Any]
    aliases: list[str] = field(default_factory=list)
    fallbacks: list[str] = field(default_factory=list)
    context_length: int | None = None
    public: bool = True
    cache: bool = False
    line: int = 1


@dataclass
class ModelTable:
    """What a models file describes, validated."""

    path: Path
    specs: dict[str, ModelSpec]
    aliases: dict[str, str]  # alias -> model id

    def build(self, *, trtllm_api: Any = None, cache_dir: Path | None = None) -> dict[str, Engine]:
        """The served map: every public id and alias -> its model (same object for an alias).
        `cache_dir`: where hf models cache a converted checkpoint (`Settings.engines.cache_dir`)."""
        engines = {
            mid: build_engine(spec, trtllm_api=trtllm_api, cache_dir=cache_dir) for mid, spec in self.specs.items() if spec.backend != "router"
        }
        lifecycle = SharedLifecycle()
        served: dict[str, Engine] = {}
        chains: dict[str, Engine] = {}
        for mid, spec in self.specs.items():
            if spec.backend == "router":
                continue
            candidates = [engines[mid]] + [engines[f] for f in spec.fallbacks]
            chains[mid] = FallbackEngine(mid, candidates, context_length=spec.context_length, lifecycle=lifecycle)
            chains[mid].response_cache = spec.cache
            if spec.public:
                served[mid] = chains[mid]
        for mid, spec in self.specs.items():
            if spec.backend == "router" and spec.public:
                from engines.wrappers.router import Rule, RouterEngine

                rules = [Rule(**{**r, "model": self.aliases.get(r["model"], r["model"])}) for r in spec.params["routes"]]
                default = self.aliases.get(spec.params["default"], spec.params["default"])
                names = {default, *(r.model for r in rules)}
                served[mid] = RouterEngine(mid, rules, default, {n: chains[n] for n in names})
        for alias, mid in self.aliases.items():
            if mid in served:
                served[alias] = served[mid]
        return served


def parse_models(text: str, where: str, *, environ: Mapping[str, str] | None = None, trtllm_check: bool = True) -> ModelTable:
    """Validates a models file's text; raises ModelsConfigError listing every problem. `environ`:
    where `api_key_env` names are looked up (the server passes the environment it started with,
    `Settings.engines.environ`); none given, no variable is set. This module never reads os.environ."""
    problems: list[str] = []
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else 1
        raise ModelsConfigError([f"{where}:{line}: not valid YAML: {getattr(exc, 'problem', None) or exc}"]) from None
    lines = _Lines(node, problems, where)

    def problem(path: tuple[Any, ...], message: str, *, key: bool = False) -> None:
        problems.append(f"{where}:{lines.of(path, key)}: {_dotted(path)}: {message}")

    if not isinstance(data, dict) or "models" not in data:
        raise ModelsConfigError([f"{where}:1: models: required: the file must be a mapping with a `models:` list"])
    for key in data:
        if key != "models":
            problem((key,), "unknown top-level field (only `models` is allowed)", key=True)
    entries = data["models"]
    if not isinstance(entries, list) or not entries:
        problem(("models",), "must be a non-empty list of models")
        raise ModelsConfigError(problems)

    specs: dict[str, ModelSpec] = {}
    for i, entry in enumerate(entries):
        spec = _parse_entry(entry, ("models", i), problem, environ or {}, trtllm_check)
        if spec is not None and spec.id not in specs:
            spec.line = lines.of(("models", i))
            specs[spec.id] = spec
    aliases = _check_names(specs, entries, problem, lambda i: lines.of(("models", i)))
    if problems:
        raise ModelsConfigError(sorted(problems, key=lambda p: int(p[len(where) + 1 :].split(":", 1)[0])))
    return ModelTable(Path(where), specs, aliases)


def _parse_entry(
    entry: Any, path: tuple[Any, ...], problem: Callable[..., None], environ: Mapping[str, str], trtllm_check: bool
) -> ModelSpec | None:
    if not isinstance(entry, dict):
        problem(path, f"each model must be a mapping with id and backend, got {_show(entry)}")
        return None
    backend = entry.get("backend")
    fields = {**COMMON, **BACKEND_FIELDS.get(backend, {})} if backend in BACKENDS else dict(COMMON)
    ok = True
    for name, spec_field in fields.items():
        if name not in entry:
            if spec_field.required:
                what = f" for the {backend} backend" if name in BACKEND_FIELDS.get(backend, {}) else ""
                problem(path, f"missing required field `{name}`{what}")
                ok = False
            continue
        issue = spec_field.check(entry[name])
        if issue:
            problem(path + (name,), issue)
            ok = False
    if backend in BACKENDS:
        for name in entry:
            if name not in fields:
                close = difflib.get_close_matches(str(name), list(fields), n=1)
                hint = f" (did you mean `{close[0]}`?)" if close else f" for the {backend} backend"
                problem(path + (name,), f"unknown field{hint}", key=True)
                ok = False
    if backend == "trtllm" and trtllm_check:
        from engines.backends.trtllm import TensorRTLLMMissing, require_tensorrt_llm

        try:
            require_tensorrt_llm()
        except TensorRTLLMMissing as exc:
            problem(path + ("backend",), str(exc))
            ok = False
    bound, context = entry.get("tokens_per_non_text_part"), entry.get("context_length")
    if backend == "openai" and _int(1)(bound) is None and _int(16)(context) is None and bound > context:
        problem(path + ("tokens_per_non_text_part",), f"must be at most context_length ({context}), got {bound}")
        ok = False
    key_env = entry.get("api_key_env") if backend == "openai" else None
    if isinstance(key_env, str):
        # Never quoted unless it is a variable's name: a key pasted here by mistake is not printed.
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key_env):
            problem(path + ("api_key_env",), "must be the name of an environment variable (letters, digits and _), not the key itself")
            ok = False
        elif key_env not in environ:
            problem(path + ("api_key_env",), f"environment variable {key_env} is not set")
            ok = False
        elif not upstream_key(environ[key_env]):
            problem(path + ("api_key_env",), f"environment variable {key_env} holds no usable key: empty, or spaces or control "
                                             "characters inside it")
            ok = False
    if not ok:
        return None
    params = {k: v for k, v in entry.items() if k not in COMMON}
    if backend == "openai":
        params["context_length"] = entry["context_length"]
        key_env = params.pop("api_key_env", None)
        params["api_key"] = upstream_key(environ[key_env]) if key_env else None
    return ModelSpec(
        id=entry["id"],
        backend=backend,
        params=params,
        aliases=list(entry.get("aliases") or []),
        fallbacks=list(entry.get("fallbacks") or []),
        context_length=entry.get("context_length"),
        public=entry.get("public", True),
        cache=entry.get("cache", False),
    )


def _listed(value: Any) -> list[str]:
    return list(value) if value and _names(value) is None else []


def _check_names(
    specs: dict[str, ModelSpec], entries: list[Any], problem: Callable[..., None], line_of: Callable[[int], int]
) -> dict[str, str]:
    """Ids, aliases and fallbacks across the whole file. Invalid entries' names count too, so
    one mistake is reported once."""
    named = [(i, e) for i, e in enumerate(entries) if isinstance(e, dict) and isinstance(e.get("id"), str)]
    first: dict[str, int] = {}
    for i, entry in named:
        if entry["id"] in first:
            problem(("models", i, "id"), f"model {entry['id']!r} is defined twice (first at line {line_of(first[entry['id']])})")
        else:
            first[entry["id"]] = i
    aliases: dict[str, str] = {}
    for i, entry in named:
        for j, alias in enumerate(_listed(entry.get("aliases"))):
            if alias in first:
                problem(("models", i, "aliases", j), f"{alias!r} is already a model id")
            elif alias in aliases:
                problem(("models", i, "aliases", j), f"{alias!r} is already an alias of {aliases[alias]!r}")
            else:
                aliases[alias] = entry["id"]
    for i, entry in named:
        resolved = []
        for j, name in enumerate(_listed(entry.get("fallbacks"))):
            target = aliases.get(name, name)
            if target == entry["id"]:
                problem(("models", i, "fallbacks", j), "a model cannot be its own fallback")
            elif target not in first:
                close = difflib.get_close_matches(name, sorted(set(first) | set(aliases)), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                problem(("models", i, "fallbacks", j), f"no model named {name!r} in this file{hint}")
            else:
                resolved.append(target)
        spec = specs.get(entry["id"])
        if spec is not None and first[entry["id"]] == i:
            spec.fallbacks = resolved
    _check_routes(specs, entries, problem, aliases)
    if specs and not any(s.public for s in specs.values()):
        problem(("models",), "every model is `public: false`; nothing would be served", key=True)
    return aliases


def _check_routes(specs: dict[str, ModelSpec], entries: list[Any], problem: Callable[..., None], aliases: dict[str, str]) -> None:
    """A router's targets are real models of this file; nothing falls back to a router."""
    index = {e["id"]: i for i, e in enumerate(entries) if isinstance(e, dict) and isinstance(e.get("id"), str)}
    for mid, spec in specs.items():
        i = index[mid]
        if spec.backend != "router":
            for j, name in enumerate(spec.fallbacks):
                if specs.get(name) is not None and specs[name].backend == "router":
                    problem(("models", i, "fallbacks", j), f"{name!r} is a router, not a model that can serve")
            continue
        targets = [("default",), *(("routes", k, "model") for k in range(len(spec.params["routes"])))]
        names = [spec.params["default"], *(r["model"] for r in spec.params["routes"])]
        for path, name in zip(targets, names):
            target = aliases.get(name, name)
            if target not in specs:
                close = difflib.get_close_matches(name, sorted(set(specs) | set(aliases)), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                problem(("models", i, *path), f"no model named {name!r} in this file{hint}")
            elif specs[target].backend == "router":
                problem(("models", i, *path), f"{name!r} is a router; a route names a real model")
        if spec.fallbacks:
            problem(("models", i, "fallbacks"), "a router has no fallbacks of its own; its routes' models keep theirs")


def build_engine(spec: ModelSpec, *, trtllm_api: Any = None, cache_dir: Path | None = None) -> Engine:
    """One backend engine for a spec (nothing loads until `start()`); `cache_dir`: the hf engine's
    converted checkpoints (None: its default)."""
    params = dict(spec.params)
    if spec.backend == "hf":
        from engines.backends.hf import HFEngine
        from engines.backends.hf_process import HFProcessEngine

        separate = params.pop("process", None)
        if separate is None:  # like TOLLGATE_ENGINE_PROCESS=auto: its own process on a GPU
            separate = str(params.get("device", "cpu")).startswith("cuda")
        params["cache_dir"] = cache_dir
        if not separate:
            params.pop("gather_ms", None)  # only the engine process gathers a burst
            return HFEngine(model_id=spec.id, **params)
        return HFProcessEngine(model_id=spec.id, **params)
    if spec.backend == "synthetic":
        from engines.backends.synthetic import SyntheticEngine

        return SyntheticEngine(model_id=spec.id, cache_dir=cache_dir, **({"context_length": spec.context_length} if spec.context_length else {}), **params)
    if spec.backend == "trtllm":
        from engines.backends.trtllm import TRTLLMEngine

        return TRTLLMEngine(model_id=spec.id, context_length=spec.context_length, api=trtllm_api, **params)
    from engines.backends.openai_pool import OpenAIPoolEngine

    return OpenAIPoolEngine(model_id=spec.id, **params)


def load_models(path: str | Path, *, environ: Mapping[str, str] | None = None) -> ModelTable:
    """Reads and validates a models file (TOLLGATE_MODELS / --models); `environ` as parse_models takes it."""
    where = str(path)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ModelsConfigError([f"{where}:1: cannot read the models file: {exc.strerror or exc}"]) from None
    return parse_models(text, where, environ=environ)
