"""What the hf engine needs of transformers: the floor pyproject.toml sets is one that takes every
argument engines/backends/hf.py passes to ContinuousBatchingConfig (transformers 5.17 has no `page_size`:
the GPU host that had it failed at start)."""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

from engines.backends.hf import HFEngine

ROOT = Path(__file__).resolve().parents[3]
# ContinuousBatchingConfig's dataclass fields as released (read with `ast` from each wheel's
# transformers/generation/configuration_utils.py). A kwarg the engine passes must be in the floor's set.
FIELDS_5_17 = {
    "allow_block_sharing", "block_size", "cpu_group_timeout", "cpu_offload_space", "cpu_offload_space_safety_threshold",
    "decode_compile_config", "default_compile_level", "disable_nccl_graph_mixing", "drop_unsupported_processors",
    "kv_padding_interval_size", "max_batch_tokens", "max_blocks_per_request", "max_cached_graphs", "max_memory_percent",
    "max_queue_size", "max_requests_per_batch", "num_blocks", "per_request_processors", "q_padding_interval_size",
    "return_logprobs", "safety_margin", "scheduler_type", "seed", "use_async_batching", "use_cuda_graph",
    "use_default_compile_configs", "varlen_compile_config",
}
FIELDS_5_18 = FIELDS_5_17 | {"page_size"}
FIELDS_AT = {(5, 17): FIELDS_5_17, (5, 18): FIELDS_5_18}


def floor() -> tuple[int, int]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    spec = next(d for d in deps if re.match(r"transformers\b", d))
    major, minor = re.search(r">=\s*(\d+)\.(\d+)", spec).groups()  # type: ignore[union-attr]
    return int(major), int(minor)


def passed_kwargs(engine: HFEngine, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The kwargs `_make_manager` gives ContinuousBatchingConfig (the manager itself is not built)."""
    import transformers.generation.configuration_utils as cu

    seen: dict[str, Any] = {}

    class Recorder(cu.ContinuousBatchingConfig):  # type: ignore[misc,valid-type]
        def __init__(self, **kwargs: Any) -> None:
            seen.update(kwargs)
            super().__init__(**kwargs)

    class Model:
        generation_config = type("G", (), {"eos_token_id": 2})()
        device = "cpu"

        def init_continuous_batching(self, **kwargs: Any) -> None:
            return None

    monkeypatch.setattr(cu, "ContinuousBatchingConfig", Recorder)
    import engines.decoding.guided
    import engines.decoding.seeded

    monkeypatch.setattr(engines.decoding.guided, "install", lambda *args, **kwargs: False)  # no manager is built here to install on
    monkeypatch.setattr(engines.decoding.seeded, "install", lambda *args, **kwargs: False)
    engine._model, engine._tokenizer = Model(), type("T", (), {"eos_token_id": 2, "pad_token_id": 2})()
    engine._make_manager()
    return seen


def test_the_transformers_floor_takes_every_argument_the_engine_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    kwargs = passed_kwargs(HFEngine(model_id="probe", device="cuda"), monkeypatch)  # cuda: every knob is passed
    assert "page_size" in kwargs and "use_cuda_graph" in kwargs
    low = floor()
    assert low in FIELDS_AT, f"pyproject's transformers floor {low} has no recorded field list here"
    missing = set(kwargs) - FIELDS_AT[low]
    assert not missing, f"transformers {low[0]}.{low[1]} (the floor) has no ContinuousBatchingConfig field {sorted(missing)}"
    assert set(kwargs) - FIELDS_5_17, "5.17 would take these arguments: the floor could be lower"


def test_the_installed_transformers_is_at_or_above_the_floor() -> None:
    installed = tuple(int(x) for x in version("transformers").split(".")[:2])
    assert installed >= floor()
