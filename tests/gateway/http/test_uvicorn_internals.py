"""gateway/http/hardening.py subclasses uvicorn's httptools protocol and gateway/http/drain.py its Server:
internals, not API. This fails on a uvicorn outside the range pyproject.toml pins, or on one whose
internals that code relies on have moved (a callback renamed, an attribute gone)."""

from __future__ import annotations

import inspect
import re
import tomllib
from importlib.metadata import version
from pathlib import Path

import uvicorn
import uvicorn.server
from packaging.requirements import Requirement
from uvicorn.protocols.http import httptools_impl
from uvicorn.protocols.http.flow_control import FlowControl

from gateway.http.drain import DrainingServer
from gateway.http.hardening import GuardedHttpToolsProtocol

ROOT = Path(__file__).resolve().parents[3]


def pinned(name: str) -> Requirement:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(r for r in map(Requirement, deps) if r.name == name)


def test_the_installed_uvicorn_and_httptools_are_in_the_pinned_range() -> None:
    for name in ("uvicorn", "httptools"):
        requirement = pinned(name)
        assert requirement.specifier.contains(version(name)), f"{name} {version(name)} is outside {requirement}"
    assert any(spec.operator == "<" for spec in pinned("uvicorn").specifier), "the range must stop before a uvicorn nobody read"


def test_the_protocol_callbacks_hardening_overrides_exist_with_their_signatures() -> None:
    base = httptools_impl.HttpToolsProtocol
    for name, params in {
        "connection_made": ["self", "transport"], "connection_lost": ["self", "exc"], "data_received": ["self", "data"],
        "on_message_begin": ["self"], "on_url": ["self", "url"], "on_header": ["self", "name", "value"],
        "on_headers_complete": ["self"], "on_message_complete": ["self"],
    }.items():
        assert name in GuardedHttpToolsProtocol.__dict__, f"hardening no longer overrides {name}: update this list"
        assert list(inspect.signature(getattr(base, name)).parameters) == params, name


def test_the_attributes_hardening_reads_are_set_by_uvicorn() -> None:
    source = inspect.getsource(httptools_impl.HttpToolsProtocol)
    for attribute in ("self.cycle", "self.scope", "self.transport", "self.loop", "self.flow", "self.pipeline", "self.app"):
        assert f"{attribute} =" in source or f"{attribute}:" in source, attribute
    cycle = inspect.getsource(httptools_impl.RequestResponseCycle)
    for attribute in ("self.response_complete", "self.response_started", "self.scope"):
        assert f"{attribute} =" in cycle, attribute
    assert callable(FlowControl.resume_reading)
    assert {408, 431} <= set(httptools_impl.STATUS_LINE) and httptools_impl.STATUS_LINE[408].startswith(b"HTTP/1.1 408")


def test_the_server_hook_drain_overrides_exists() -> None:
    # Read from the installed source: at run time another test's server may have wrapped the method.
    assert re.search(r"def handle_exit\(self, sig: int, frame", Path(uvicorn.server.__file__).read_text())
    assert "handle_exit" in DrainingServer.__dict__
    config = inspect.signature(uvicorn.Config).parameters
    assert {"http", "loop", "log_config", "access_log", "proxy_headers"} <= set(config)
    assert {"factory", "workers"} <= set(inspect.signature(uvicorn.run).parameters)


def test_a_signal_before_the_app_has_started_stops_it_as_uvicorn_does() -> None:
    """The drain needs the app's services; before the lifespan has made them (a model loading), a
    SIGINT or SIGTERM is uvicorn's own stop. The review: a SIGINT then raised AttributeError in the
    loop and the server went on to serve."""
    import signal
    import types

    import uvicorn

    from gateway.http.drain import Drain
    from gateway.services import Services

    for sig in (signal.SIGINT, signal.SIGTERM):
        app = types.SimpleNamespace(state=Services(), draining=False)  # what the lifespan has not filled in yet
        server = DrainingServer(uvicorn.Config(app))
        server.drain = Drain(app, 30.0, lambda: None)
        server.handle_exit(sig, None)
        assert server.should_exit and not server.drain.hurried and not server.drain.active, sig
