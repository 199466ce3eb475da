"""What the gateway asks of an engine is declared on `Engine`: defaults for an engine that declares
nothing, and the scheduler's wrapper answering as the engine it wraps (not as the defaults)."""

from __future__ import annotations

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


def test_an_engine_that_declares_nothing_gets_the_defaults() -> None:
    plain = FakeEngine("plain")
    assert (plain.renders_tools, plain.response_cache, plain.queue_depth()) == (False, False, None)
    plain.use_classes(("gold", "standard"))  # takes the classes and sends nothing


def test_the_scheduler_declares_what_its_engine_declares() -> None:
    inner = Declaring()
    scheduled = ScheduledEngine(inner)
    assert scheduled.renders_tools is True and scheduled.response_cache is True
    scheduled.use_classes(("gold", "standard"))
    assert inner.classes == ("gold", "standard")
    assert scheduled.queue_depth() == 0  # its own queue, empty
    plain = ScheduledEngine(FakeEngine("plain"))
    assert plain.renders_tools is False and plain.response_cache is False
