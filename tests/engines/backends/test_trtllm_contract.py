"""The `trtllm` backend and its test double against TensorRT-LLM's API as read from NVIDIA's source
(tests/contracts/trtllm_contract.json, written by scripts/trtllm_contract.py from a pinned commit).

- everything Tollgate passes to TensorRT-LLM (LLM kwargs, SamplingParams fields, KvCacheConfig and
  SchedulerConfig fields, generate_async kwargs) and every attribute it reads from its results and
  modules exists in the contract;
- the double's signatures, fields, defaults, members and exports equal the contract's;
- the double behaves as the source reads (stops, detokenization, queue drops, errors, defaults).
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import enum
import inspect
import json
import time
from pathlib import Path
from typing import Any

import pytest

from engines.base import EngineRequest, SamplingParams as TollgateSampling
from engines.backends.trtllm import TRTLLMEngine
from tests.fakes import trtllm as double

ROOT = Path(__file__).resolve().parents[3]
CONTRACT = json.loads((ROOT / "tests/contracts/trtllm_contract.json").read_text())
CLASSES = CONTRACT["classes"]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def fields_of(name: str, *, public: bool = True) -> dict[str, dict[str, Any]]:
    return {f["name"]: f for f in CLASSES[name]["fields"] if not (public and f["name"].startswith("_")) and f.get("init", True)}


def default_matches(spec: dict[str, Any], value: Any, factory: Any) -> bool:
    if "default" in spec:
        return value == spec["default"] and type(value) is not enum.Enum
    if "default_expr" in spec:  # an enum member such as CapacitySchedulerPolicy.GUARANTEED_NO_EVICT
        return isinstance(value, enum.Enum) and spec["default_expr"] == f"{type(value).__name__}.{value.name}"
    if "default_factory" in spec:
        return factory is not dataclasses.MISSING
    return False


def double_fields(cls: type) -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(cls) if not f.name.startswith("_") and f.init}


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> Any:
    return double.install(monkeypatch)


def test_the_contract_is_stamped_with_its_commit() -> None:
    source = CONTRACT["source"]
    assert source["repository"] == "NVIDIA/TensorRT-LLM"
    assert len(source["commit"]) == 40 and all(c in "0123456789abcdef" for c in source["commit"])
    # The contract's commit keeps sampling params under executor/params, an unmerged branch; main has
    # tensorrt_llm/sampling_params.py (the generator finds either place). What Tollgate relies on was
    # re-read on main's files, each stamped with the commit it was stored at, and vLLM's likewise.
    assert source["files"]["sampling"] == "tensorrt_llm/executor/params/sampling.py"
    assert "ast only" in CONTRACT["generated_by"]
    checked = CONTRACT["checked_against"]
    for repo in ("NVIDIA/TensorRT-LLM", "vllm-project/vllm"):
        assert checked[repo] and all(len(c) == 40 and all(x in "0123456789abcdef" for x in c) for c in checked[repo].values()), repo
    assert "tensorrt_llm/sampling_params.py" in checked["NVIDIA/TensorRT-LLM"]


def test_the_trtllm_extra_is_bounded_to_the_versions_the_contract_and_double_describe() -> None:
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["trtllm"]
    assert extra == [f"tensorrt-llm{double.VERSIONS}"]
    assert "<" in double.VERSIONS and ">=" in double.VERSIONS  # bounded on both sides


# the double equals the contract -----------------------------------------------------------------------
@pytest.mark.parametrize("name, cls", [
    ("SamplingParams", double.SamplingParams),
    ("GuidedDecodingParams", double.GuidedDecodingParams),
    ("CompletionOutput", double.CompletionOutput),
    ("KvCacheConfig", double.KvCacheConfig),
    ("SchedulerConfig", double.SchedulerConfig),
])
def test_double_fields_and_defaults_equal_the_contract(name: str, cls: type) -> None:
    real = fields_of(name)
    mine = double_fields(cls)
    assert sorted(mine) == sorted(real), f"{name}: fields differ: only double {set(mine) - set(real)}, only real {set(real) - set(mine)}"
    for field_name, spec in real.items():
        f = mine[field_name]
        if spec.get("required"):
            assert f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING, field_name
        else:
            assert default_matches(spec, f.default, f.default_factory), f"{name}.{field_name}: {f.default!r} vs {spec}"


def test_sampling_params_keyword_only_and_max_tokens_default_32() -> None:
    assert fields_of("SamplingParams")["max_tokens"]["default"] == 32 == double.SamplingParams().max_tokens
    with pytest.raises(TypeError):
        double.SamplingParams(5)  # type: ignore[misc]  # kw_only, as the real dataclass


def test_completion_output_properties_and_result_surface() -> None:
    assert set(CLASSES["CompletionOutput"]["properties"]) == {
        n for n, v in vars(double.CompletionOutput).items() if isinstance(v, property)}
    real = CLASSES["RequestOutput"]
    surface = set(real["properties"]) | set(real["public_methods"]) | set(real["instance_attributes"])
    mine = {n for n in dir(double.RequestOutput) if not n.startswith("_") or n in ("__aiter__", "__anext__")}
    mine |= {"cached_tokens", "sampling_params", "id"}  # set in the double's __init__, as in the real one's
    assert mine <= surface, mine - surface


@pytest.mark.parametrize("name, cls", [
    ("CapacitySchedulerPolicy", double.CapacitySchedulerPolicy),
    ("ContextChunkingPolicy", double.ContextChunkingPolicy),
    ("WaitingQueuePolicy", double.WaitingQueuePolicy),
    ("LogprobMode", double.LogprobMode),
])
def test_double_enums_equal_the_contract(name: str, cls: type[enum.Enum]) -> None:
    assert {m.name: m.value for m in cls} == CLASSES[name]["members"]


@pytest.mark.parametrize("qualname, fn", [("LLM.__init__", double.LLM.__init__), ("LLM.generate_async", double.LLM.generate_async)])
def test_double_signatures_equal_the_contract(qualname: str, fn: Any) -> None:
    kinds = {"positional_or_keyword": inspect.Parameter.POSITIONAL_OR_KEYWORD, "keyword_only": inspect.Parameter.KEYWORD_ONLY,
             "var_keyword": inspect.Parameter.VAR_KEYWORD, "var_positional": inspect.Parameter.VAR_POSITIONAL}
    mine = [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]
    real = CONTRACT["signatures"][qualname]
    assert [p.name for p in mine] == [p["name"] for p in real]
    for p, spec in zip(mine, real):
        assert p.kind == kinds[spec["kind"]], p.name
        if "default" in spec:
            assert p.default == spec["default"], p.name
        elif "default_expr" in spec:
            assert spec["default_expr"] == "DEFAULT_REQUEST_PRIORITY" and p.default == double.DEFAULT_REQUEST_PRIORITY
        elif p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
            assert p.default is inspect.Parameter.empty, p.name


def test_double_exports_only_what_the_real_modules_export() -> None:
    top, llmapi = double.modules()
    exports = CONTRACT["exports"]
    real_top = set(exports["tensorrt_llm"]["bound"])
    assert {n for n in vars(top) if not n.startswith("_") and n != "llmapi"} <= real_top
    assert "KvCacheConfig" in exports["tensorrt_llm"]["listed_but_unbound"]  # in __all__, never imported: use llmapi's
    assert {n for n in vars(llmapi) if not n.startswith("_")} <= set(exports["tensorrt_llm.llmapi"]["all"])


async def test_double_llm_rejects_the_kwargs_the_real_one_rejects(api: Any) -> None:
    with pytest.raises(ValueError, match=r"not supported by the PyTorch backend: \['max_batch_sise'\]"):
        double.LLM("/m", max_batch_size=8, max_batch_sise=8)
    with pytest.raises(ValueError, match="build_config"):  # a TensorRT-engine-backend argument, gone from LLM
        double.LLM("/m", build_config=object())
    every = {f["name"]: None for f in CLASSES["TorchLlmArgs"]["fields"] if f["name"] != "model"}
    llm = double.LLM("/m", **every)  # every TorchLlmArgs field is accepted
    assert llm.args.max_batch_size == 2048 and llm.args.max_num_tokens == 8192  # None normalized to the defaults
    llm = double.LLM("/m", _mpi_session=None, backend="pytorch", dtype="bfloat16")
    assert llm.args.dtype == "bfloat16" and llm.args.enable_chunked_prefill is False and llm.args.max_seq_len is None
    assert {f["name"]: f.get("default") for f in CLASSES["TorchLlmArgs"]["fields"]
            if f["name"] in ("max_batch_size", "max_num_tokens", "enable_chunked_prefill")} == {
        "max_batch_size": 2048, "max_num_tokens": 8192, "enable_chunked_prefill": False}


# Tollgate uses only what exists --------------------------------------------------------------------------
class Recorder:
    """Records the keyword arguments Tollgate passes to the double's constructors and calls, and the
    attributes it reads from results and outputs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, api: Any) -> None:
        self.kwargs: dict[str, set[str]] = {}
        self.reads: dict[str, set[str]] = {"RequestOutput": set(), "CompletionOutput": set(), "LLM": set()}
        for module in (api, api.llmapi):
            for name in ("SamplingParams", "KvCacheConfig", "SchedulerConfig", "GuidedDecodingParams", "LLM"):
                if hasattr(module, name):
                    monkeypatch.setattr(module, name, self._recording(name, getattr(double, name)))
        original = double.LLM.generate_async

        def generate_async(llm: Any, *args: Any, **kwargs: Any) -> Any:
            self.kwargs.setdefault("generate_async", set()).update(kwargs)
            assert len(args) <= 1, "only the prompt goes positionally"
            return original(llm, *args, **kwargs)

        monkeypatch.setattr(double.LLM, "generate_async", generate_async)
        for cls_name in ("RequestOutput", "CompletionOutput"):
            cls = getattr(double, cls_name)
            base_get = cls.__getattribute__
            seen = self.reads[cls_name]

            def getattribute(obj: Any, name: str, _base: Any = base_get, _seen: set[str] = seen) -> Any:
                if not name.startswith("_") or name in ("__aiter__", "__anext__"):
                    _seen.add(name)
                return _base(obj, name)

            monkeypatch.setattr(cls, "__getattribute__", getattribute)

    def _recording(self, name: str, cls: Any) -> Any:
        def make(*args: Any, **kwargs: Any) -> Any:
            self.kwargs.setdefault(name, set()).update(kwargs)
            return cls(*args, **kwargs)

        make.__name__ = name
        return make


def tollgate_reads_from_modules() -> set[str]:
    """Names engines/backends/trtllm.py takes from the tensorrt_llm / tensorrt_llm.llmapi modules (`api.X`,
    `self._api.X`, `llmapi.X`), found in its source."""
    tree = ast.parse((ROOT / "engines/backends/trtllm.py").read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("api", "llmapi") or isinstance(base, ast.Attribute) and base.attr == "_api":
                names.add(node.attr)
    return names - {"llmapi"}


def test_every_module_name_tollgate_uses_is_exported() -> None:
    used = tollgate_reads_from_modules()
    assert {"LLM", "SamplingParams", "KvCacheConfig", "SchedulerConfig", "CapacitySchedulerPolicy"} <= used
    exports = CONTRACT["exports"]
    top = set(exports["tensorrt_llm"]["bound"])
    llmapi = set(exports["tensorrt_llm.llmapi"]["all"])
    assert used <= top | llmapi
    source = (ROOT / "engines/backends/trtllm.py").read_text()
    for name in used - top:  # taken from llmapi, never from the top-level package
        assert f"llmapi.{name}" in source and f"api.{name}" not in source.replace(f"llmapi.{name}", ""), name


def engine_request(engine: TRTLLMEngine, **extra: Any) -> EngineRequest:
    return EngineRequest(
        request_id=f"c{time.monotonic_ns()}", max_tokens=40,
        sampling=TollgateSampling(temperature=0.7, top_p=0.9, seed=3, stop=(" Paris.",)),
        prompt_token_ids=engine.encode_chat(QUESTION), extra={"messages": QUESTION, **extra} if extra else None,
    )


async def test_everything_tollgate_passes_and_reads_exists_in_the_contract(api: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    rec = Recorder(monkeypatch, api)
    engine = TRTLLMEngine(
        model_id="llama", model_path=str(tmp_path), context_length=4096, tensor_parallel_size=1, max_batch_size=8,
        max_num_tokens=4096, kv_cache_free_gpu_memory_fraction=0.8, scheduler_policy="max_utilization",
        llm_options={"cuda_graph_config": None}, api=api,
    )
    await engine.start()
    for extra in ({},):
        req = engine_request(engine, **extra)
        async for _ in engine.stream(req):
            pass
    cancelled = engine_request(engine)
    stream = engine.stream(cancelled)
    await anext(stream)
    engine.cancel(cancelled.request_id)
    async for _ in stream:
        pass
    await engine.stop()

    llm_args = {f["name"] for f in CLASSES["TorchLlmArgs"]["fields"]} | {p["name"] for p in CONTRACT["signatures"]["LLM.__init__"]}
    assert rec.kwargs["LLM"] <= llm_args, rec.kwargs["LLM"] - llm_args
    assert {"model", "tensor_parallel_size", "max_batch_size", "max_seq_len", "max_num_tokens", "kv_cache_config", "scheduler_config"} <= rec.kwargs["LLM"]
    for name in ("SamplingParams", "KvCacheConfig", "SchedulerConfig"):
        assert rec.kwargs[name] <= set(fields_of(name)), (name, rec.kwargs[name] - set(fields_of(name)))
    assert rec.kwargs["generate_async"] <= {p["name"] for p in CONTRACT["signatures"]["LLM.generate_async"]}
    result_surface = set(CLASSES["RequestOutput"]["properties"]) | set(CLASSES["RequestOutput"]["public_methods"]) | set(CLASSES["RequestOutput"]["instance_attributes"])
    assert rec.reads["RequestOutput"] and rec.reads["RequestOutput"] <= result_surface, rec.reads["RequestOutput"] - result_surface
    output_surface = set(fields_of("CompletionOutput")) | set(CLASSES["CompletionOutput"]["properties"])
    assert rec.reads["CompletionOutput"] and rec.reads["CompletionOutput"] <= output_surface, rec.reads["CompletionOutput"] - output_surface
    # Attributes of the LLM object itself: args (set by BaseLLM.__init__), tokenizer (a property), shutdown.
    llm_surface = set(CLASSES["LLM"]["properties"]) | set(CLASSES["LLM"]["public_methods"]) | set(CLASSES["LLM"]["instance_attributes"])
    assert {"args", "tokenizer", "generate_async", "shutdown"} <= llm_surface
    torch_fields = {f["name"] for f in CLASSES["TorchLlmArgs"]["fields"]}
    assert {"max_seq_len", "max_num_tokens", "enable_chunked_prefill", "max_batch_size"} <= torch_fields  # read from llm.args


# the double behaves as the source reads ----------------------------------------------------------------
async def steps_of(result: Any) -> list[tuple[str, list[int], str, str | None]]:
    out = []
    async for r in result:
        c = r.outputs[0]
        out.append((c.text_diff, list(c.token_ids_diff), c.text, c.finish_reason))
    return out


async def test_double_detokenizes_incrementally_and_trims_only_ids_on_token_stops(api: Any) -> None:
    llm = double.LLM("/m")
    steps = await steps_of(llm.generate_async([1, 2], double.SamplingParams(max_tokens=100, stop=[" capital of"]), streaming=True))
    texts = [s[2] for s in steps]
    assert all(a == b[: len(a)] for a, b in zip(texts, texts[1:]))  # the text never shrinks
    final = llm.requests[-1].outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == " capital of"
    assert final.text.endswith(" capital")  # the head of the stop string stays in the text
    assert llm.tokenizer.decode(final.token_ids) == final.text[: -len(" capital")]  # the ids are trimmed
    assert steps[-1][1] == [] and steps[-1][0] == ""


async def test_double_text_level_stop_cuts_text_and_leaves_the_executor_running(api: Any) -> None:
    llm = double.LLM("/m")
    llm.hold.clear()
    result = llm.generate_async([1], double.SamplingParams(max_tokens=100, stop="Paris"), streaming=True)
    llm.hold.set()
    await steps_of(result)
    c = result.outputs[0]
    assert c.text.endswith("France is ") and c.finish_reason == "stop" and c.stop_reason == "Paris" and result.finished
    assert not result._task.done()  # the executor generates on: only the result ended
    result.abort()
    await asyncio.wait_for(result._task, 2)


async def test_double_stop_token_ids_and_include_stop_str(api: Any) -> None:
    llm = double.LLM("/m")
    end = llm.tokenizer.encode(" end.")[0]
    await steps_of(llm.generate_async([1], double.SamplingParams(max_tokens=100, stop_token_ids=[end]), streaming=True))
    c = llm.requests[-1].outputs[0]
    assert (c.finish_reason, c.stop_reason) == ("stop", end) and end not in c.token_ids
    await steps_of(llm.generate_async([1], double.SamplingParams(max_tokens=100, stop=[" Paris."], include_stop_str_in_output=True), streaming=True))
    c = llm.requests[-1].outputs[0]
    assert c.text.endswith(" Paris.") and c.token_ids[-1] == llm.tokenizer.encode(" Paris.")[0]


async def test_double_drops_a_queued_abort_without_output_and_cancels_a_running_one(api: Any) -> None:
    llm = double.LLM("/m", max_batch_size=1)
    llm.hold.clear()
    running = llm.generate_async([1], double.SamplingParams(max_tokens=5), streaming=True)
    queued = llm.generate_async([1], double.SamplingParams(max_tokens=5), streaming=True)
    for _ in range(1000):
        if llm.waiting:
            break
        await asyncio.sleep(0)
    queued.abort()
    await asyncio.wait_for(queued._task, 2)
    assert llm.dropped == [queued.request_id] and queued._responses.empty() and not queued.finished
    running.abort()
    llm.hold.set()
    await steps_of(running)
    assert running.outputs[0].finish_reason == "cancelled"


async def test_double_errors_are_injectable_and_real_shaped(api: Any) -> None:
    llm = double.LLM("/m", max_num_tokens=3)
    with pytest.raises(double.RequestError, match=r"should not exceed max_num_tokens \(3\)"):
        llm.generate_async([1, 2, 3, 4])
    assert issubclass(double.RequestError, RuntimeError)
    double.LLM.fail_next = double.RequestError("injected")
    with pytest.raises(double.RequestError, match="injected"):
        llm.generate_async([1])
    result = llm.generate_async([1], double.SamplingParams(max_tokens=50), streaming=True)
    llm.die()
    with pytest.raises(double.EngineDeadError):
        await steps_of(result)
    with pytest.raises(double.EngineDeadError):  # sticky, as the real result's terminal error
        await result.aresult()
    with pytest.raises(RuntimeError, match="LLM is shutting down"):
        llm.generate_async([1])


def test_double_sampling_params_validate_as_the_real_ones() -> None:
    assert double.SamplingParams(n=2, temperature=0.8).best_of == 2
    with pytest.raises(ValueError, match="Greedy decoding"):
        double.SamplingParams(n=2, temperature=0.0)
    with pytest.raises(ValueError, match="best_of"):
        double.SamplingParams(n=3, best_of=2, temperature=1.0)
    assert double.SamplingParams(logprobs=True).logprobs == 0
    with pytest.raises(ValueError):
        double.SamplingParams(logprobs=101)
    with pytest.raises(ValueError, match="Only one guide"):
        double.SamplingParams(guided_decoding=double.GuidedDecodingParams(json_object=True, regex="x"))
