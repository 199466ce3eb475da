"""What the gateway asks of an engine is declared on `Engine`: defaults for an engine that declares
nothing, and the scheduler's wrapper answering as the engine it wraps (not as the defaults)."""

from __future__ import annotations

from typing import Any

import pytest

from engines.wrappers.fallback import FallbackEngine
from engines.wrappers.router import RouterEngine, router_of
from engines.wrappers.scheduler import ScheduledEngine
from tests.fakes.engine import FakeEngine


class Declaring(FakeEngine):
    renders_tools = True  # type: ignore[assignment]

    def __init__(self) -> None:
        super().__init__("declaring")
        self.response_cache = True
        self.classes: tuple[str, ...] | None = None

    def use_classes(self, names: tuple[str, ...]) -> None:
        self.classes = names

    def encode_with_tools(self, messages: list[dict[str, Any]], tools: list[Any]) -> list[int]:
        return self.encode_chat(messages) + [len(tools)]

    def tool_encoder(self) -> Any:
        return self.encode_with_tools


def test_an_engine_that_declares_nothing_gets_the_defaults() -> None:
    plain = FakeEngine("plain")
    assert (plain.renders_tools, plain.response_cache, plain.queue_depth()) == (False, False, None)
    assert plain.tool_encoder() is None and plain.unwrapped() is plain
    plain.use_classes(("gold", "standard"))  # takes the classes and sends nothing


def test_the_scheduler_declares_what_its_engine_declares() -> None:
    inner = Declaring()
    scheduled = ScheduledEngine(inner)
    assert scheduled.renders_tools is True and scheduled.response_cache is True
    scheduled.use_classes(("gold", "standard"))
    assert inner.classes == ("gold", "standard")
    assert scheduled.queue_depth() == 0  # its own queue, empty
    assert scheduled.tool_encoder() == inner.encode_with_tools and scheduled.unwrapped() is inner
    plain = ScheduledEngine(FakeEngine("plain"))
    assert plain.renders_tools is False and plain.response_cache is False
    assert plain.tool_encoder() is None


def test_the_scheduler_forwards_only_what_engine_declares() -> None:
    inner = Declaring()
    inner.special = "a backend's own"  # type: ignore[attr-defined]
    scheduled = ScheduledEngine(inner)
    assert not hasattr(scheduled, "special")
    with pytest.raises(AttributeError):
        scheduled.special  # type: ignore[attr-defined]  # noqa: B018  # the backend's attribute, not the wrapper's
    assert scheduled.unwrapped().special == "a backend's own"  # type: ignore[attr-defined]
    assert ScheduledEngine(scheduled).unwrapped() is inner  # through every scheduler in front of it


def test_a_chain_counts_tools_with_its_encoder() -> None:
    tools, plain = Declaring(), FakeEngine("plain")
    chain = FallbackEngine("chain", [ScheduledEngine(tools), plain])
    assert chain.tool_encoder() == tools.encode_with_tools  # the encoder: the first loaded, through its scheduler
    assert FallbackEngine("plain-first", [plain, tools]).tool_encoder() is None
    assert chain.unwrapped() is chain  # a chain is a model of its own, not a wrapper of one engine


def test_the_renderer_is_the_engine_that_encodes_and_checks() -> None:
    """The gateway encodes a prompt and has its fields judged by `engine.renderer`: an engine is its
    own; the scheduler names its engine's (through every scheduler in front of it), a chain is its own
    (it encodes with its encoder and checks every candidate)."""
    plain = FakeEngine("plain")
    assert plain.renderer is plain
    assert ScheduledEngine(plain).renderer is plain and ScheduledEngine(ScheduledEngine(plain)).renderer is plain
    chain = FallbackEngine("chain", [ScheduledEngine(plain), FakeEngine("backup")])
    assert chain.renderer is chain and ScheduledEngine(chain).renderer is chain


def test_router_of_sees_a_routing_model_through_the_scheduler() -> None:
    auto = RouterEngine("auto", [], "plain", {"plain": FakeEngine("plain")})
    assert router_of(auto) is auto and router_of(ScheduledEngine(auto)) is auto
    assert router_of(ScheduledEngine(FakeEngine("plain"))) is None and router_of(FakeEngine("plain")) is None


def test_the_engines_that_run_a_models_requests() -> None:
    plain, backup = FakeEngine("plain"), FakeEngine("backup")
    chain = FallbackEngine("chain", [plain, backup])
    auto = RouterEngine("auto", [], "chain", {"chain": chain})
    assert plain.runners() == [plain] and chain.runners() == [plain, backup]
    assert auto.runners() == []  # the models it picks run their own requests, served as themselves


def test_a_routing_model_in_the_served_map_passes_the_start_with_several_workers() -> None:
    # Before runners() the start probed `candidates`, which on a router is a method: TypeError.
    from engines.backends.hf_process import HFProcessEngine
    from gateway.serving.engine_hosts import connect_hosted
    from gateway.wiring import share_replicas

    hosted = HFProcessEngine.__new__(HFProcessEngine)  # only its model_id and connect_to are used here
    hosted.model_id, hosted.connect_to = "hosted", None
    served = {"auto": RouterEngine("auto", [], "hosted", {}), "hosted": FallbackEngine("hosted", [hosted])}
    share_replicas(served, 2)
    connect_hosted(served, {"hosted": "/run/tollgate/hosted.sock"})
    assert hosted.connect_to == "/run/tollgate/hosted.sock"
