"""models.yaml: what it builds, and every problem reported with file, line and field."""

from __future__ import annotations

from typing import Any

import pytest

from engines.wrappers.fallback import FallbackEngine
from engines.backends.hf import HFEngine
from engines.backends.openai_pool import OpenAIPoolEngine
from engines.registry import ModelsConfigError, load_models, parse_models
from engines.backends.trtllm import TRTLLMEngine
from tests.fakes import trtllm as double

GOOD = """\
models:
  - id: llama-3.1-8b
    backend: trtllm
    model_path: /models/Llama-3.1-8B-Instruct
    tensor_parallel_size: 1
    max_batch_size: 256
    max_num_tokens: 8192
    kv_cache_free_gpu_memory_fraction: 0.9
    scheduler_policy: max_utilization
    context_length: 8192
    aliases: [llama3, llama]
    fallbacks: [llama-pool, smollm]
  - id: llama-pool
    backend: openai
    context_length: 8192
    replicas: [http://gpu-1:8000/v1, http://gpu-2:8000/v1]
    upstream_model: meta-llama/Llama-3.1-8B-Instruct
    api_key_env: POOL_KEY
    eject_after: 5
    health_path: null
  - id: smollm
    backend: hf
    max_batch_size: 8
    warmup: false
    public: false
"""


def problems(text: str, environ: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(ModelsConfigError) as info:
        parse_models(text, "models.yaml", environ=environ or {})
    return info.value.problems


def test_a_good_file_builds_models_aliases_and_fallback_chains(monkeypatch: pytest.MonkeyPatch) -> None:
    double.install(monkeypatch)
    table = parse_models(GOOD, "models.yaml", environ={"POOL_KEY": "sk-upstream"})
    served = table.build()
    assert sorted(served) == ["llama", "llama-3.1-8b", "llama-pool", "llama3"]  # smollm is not public
    llama = served["llama-3.1-8b"]
    assert isinstance(llama, FallbackEngine)
    assert served["llama3"] is llama and served["llama"] is llama
    trt, pool, hf = llama.candidates
    assert isinstance(trt, TRTLLMEngine) and isinstance(pool, OpenAIPoolEngine) and isinstance(hf, HFEngine)
    assert pool is served["llama-pool"].candidates[0]  # one engine, shared by both models
    assert (trt.max_batch_size, trt.max_num_tokens, trt.scheduler_policy, trt.kv_cache_free_gpu_memory_fraction) == (256, 8192, "max_utilization", 0.9)
    assert (pool.upstream_model, pool._api_key, pool.pool.eject_after, pool.health_path) == ("meta-llama/Llama-3.1-8B-Instruct", "sk-upstream", 5, None)
    assert [r.url for r in pool.pool.replicas] == ["http://gpu-1:8000/v1", "http://gpu-2:8000/v1"]
    assert llama.context_length == 8192 and not llama.passthrough  # an hf fallback cannot pass tools through
    assert served["llama-pool"].passthrough


def test_every_problem_names_file_line_and_field() -> None:
    text = """\
models:
  - id: a
    backend: openai
    replicas: [gpu-1:8000]
    context_length: many
    max_concurency: 4
  - id: b
    backend: trtlm
  - id: c
    backend: hf
    fallbacks: [d, c]
    max_queue: -1
    warmup: yes please
  - id: a
    backend: hf
  - backend: hf
  - id: e
    backend: openai
    context_length: 4096
    replicas: [http://x/v1]
    api_key_env: NOT_SET_ANYWHERE
    aliases: [c]
"""
    assert problems(text) == [
        "models.yaml:4: models[0].replicas: 'gpu-1:8000' is not an http(s) base URL such as http://10.0.0.7:8000/v1",
        "models.yaml:5: models[0].context_length: must be an integer, got 'many'",
        "models.yaml:6: models[0].max_concurency: unknown field (did you mean `max_concurrency`?)",
        "models.yaml:8: models[1].backend: must be one of hf, trtllm, openai, router, synthetic, got 'trtlm'",
        "models.yaml:11: models[2].fallbacks[0]: no model named 'd' in this file",
        "models.yaml:11: models[2].fallbacks[1]: a model cannot be its own fallback",
        "models.yaml:12: models[2].max_queue: must be at least 0, got -1",
        "models.yaml:13: models[2].warmup: must be true or false, got 'yes please'",
        "models.yaml:14: models[3].id: model 'a' is defined twice (first at line 2)",
        "models.yaml:16: models[4]: missing required field `id`",
        "models.yaml:21: models[5].api_key_env: environment variable NOT_SET_ANYWHERE is not set",
        "models.yaml:22: models[5].aliases[0]: 'c' is already a model id",
    ]


def test_backend_specific_required_fields_and_aliases() -> None:
    text = """\
models:
  - id: pool
    backend: openai
  - id: trt
    backend: trtllm
    model_path: /m
    aliases: [pool]
  - id: other
    backend: hf
    aliases: [shared]
  - id: another
    backend: hf
    aliases: [shared]
"""
    found = problems(text.replace("backend: trtllm", "backend: hf").replace("    model_path: /m\n", ""))
    assert found == [
        "models.yaml:2: models[0]: missing required field `context_length` for the openai backend",
        "models.yaml:2: models[0]: missing required field `replicas` for the openai backend",
        "models.yaml:6: models[1].aliases[0]: 'pool' is already a model id",
        "models.yaml:12: models[3].aliases[0]: 'shared' is already an alias of 'other'",
    ]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("models:\n  - id: a\n    backend: hf\n   bad: indent\n", "models.yaml:4: not valid YAML"),
        ("[]\n", "models.yaml:1: models: required"),
        ("models: []\n", "models.yaml:1: models: must be a non-empty list of models"),
        ("models:\n  - id: a\n    backend: hf\n    device: cpu\n    device: cuda\n", "models.yaml:5: models[0].device: given twice"),
        ("models:\n  - id: a\n    backend: hf\nmodel: x\n", "models.yaml:4: model: unknown top-level field"),
        ("models:\n  - id: a\n    backend: hf\n    public: false\n", "models.yaml:1: models: every model is `public: false`"),
        ("models:\n  - just-a-name\n", "models.yaml:2: models[0]: each model must be a mapping"),
    ],
)
def test_malformed_files(text: str, expected: str) -> None:
    found = problems(text)
    assert len(found) == 1 and found[0].startswith(expected), found


def test_load_models_reads_the_file(tmp_path: Any) -> None:
    path = tmp_path / "models.yaml"
    path.write_text("models:\n  - id: tiny\n    backend: hf\n    max_batch_size: 0\n")
    with pytest.raises(ModelsConfigError) as info:
        load_models(path)
    assert info.value.problems == [f"{path}:4: models[0].max_batch_size: must be at least 1, got 0"]
    with pytest.raises(ModelsConfigError) as missing:
        load_models(tmp_path / "absent.yaml")
    assert missing.value.problems[0].startswith(f"{tmp_path / 'absent.yaml'}:1: cannot read the models file")


def test_the_server_builds_its_engines_from_its_settings_not_the_environment(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """gateway/wiring.py:build_engines: models.yaml's api_key_env names are looked up in the
    environment load_settings() captured (settings.engines.environ), and the hf engines cache a
    converted checkpoint in settings.engines.cache_dir; os.environ as it is now plays no part."""
    from engines.backends.hf_process import HFProcessEngine
    from gateway.config import EngineSettings, Settings
    from gateway.wiring import build_engines

    double.install(monkeypatch)
    monkeypatch.setenv("POOL_KEY", "sk-from-os-environ")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-now"))
    path = tmp_path / "models.yaml"
    path.write_text(GOOD)
    engines = EngineSettings(models_file=str(path), environ={"POOL_KEY": "sk-from-settings"}, cache_dir=tmp_path / "cache")
    trt, pool, hf = build_engines(Settings(engines=engines))["llama-3.1-8b"].candidates  # type: ignore[attr-defined]
    assert pool._api_key == "sk-from-settings" and hf._cache_dir == tmp_path / "cache"
    with pytest.raises(SystemExit, match="environment variable POOL_KEY is not set"):
        build_engines(Settings(engines=EngineSettings(models_file=str(path))))  # made in code: an empty environment

    [one] = build_engines(Settings(engines=EngineSettings(cache_dir=tmp_path / "cache"))).values()  # no models file: the hf engine
    assert type(one) is HFEngine and one._cache_dir == tmp_path / "cache"
    [own_process] = build_engines(Settings(engines=EngineSettings(cache_dir=tmp_path / "cache", process=True))).values()
    assert isinstance(own_process, HFProcessEngine) and own_process._params["cache_dir"] == tmp_path / "cache"


def test_an_upstream_key_is_never_quoted_and_must_fit_a_header() -> None:
    """`api_key_env` names a variable: a key pasted there instead is refused without being printed.
    The variable's value loses its surrounding whitespace (a key file's newline); one that still
    could not be a header value is refused, again without printing it."""
    pasted = "sk-proj-" + "x9" * 20

    def pool(env_name: str) -> str:
        return f"models:\n  - id: p\n    backend: openai\n    context_length: 4096\n    replicas: [http://x/v1]\n    api_key_env: {env_name}\n"

    said = problems(pool(pasted))
    assert said == ["models.yaml:6: models[0].api_key_env: must be the name of an environment variable (letters, digits and _), "
                    "not the key itself"] and pasted not in str(said)
    for value in ("", " \n", "two words", "tab\tinside"):
        said = problems(pool("POOL_KEY"), {"POOL_KEY": value})
        assert said == ["models.yaml:6: models[0].api_key_env: environment variable POOL_KEY holds no usable key: empty, or "
                        "spaces or control characters inside it"], value
    table = parse_models(pool("POOL_KEY"), "models.yaml", environ={"POOL_KEY": f" {pasted}\r\n"})
    assert table.specs["p"].params["api_key"] == pasted
