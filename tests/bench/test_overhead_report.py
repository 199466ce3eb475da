"""bench/overhead.py reports like for like (issue 19, "Benchmark honesty"): LiteLLM runs with as
many worker processes as Tollgate and ratios are printed only between same-worker runs; p99 is
absolute (worst round beside the median), never Tollgate's minus a noisy direct's; the added p50
is paired by round, with its worst round; LiteLLM's version is pinned in the install and recorded.
No load is generated here: the summaries are fed measured-looking rounds."""

from __future__ import annotations

import contextlib
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from bench import overhead

CONNS = [1, 64]


def _round(rps: float, p50: float, p99: float, cpu: bool = False) -> dict[str, Any]:
    r = {"rps": rps, "p50_ms": p50, "p99_ms": p99, "requests": int(rps * 5), "ok": int(rps * 5), "non2xx": 0,
         "socket_errors": 0, "generator": "wrk"}
    if cpu:
        r["cpu_us_per_request"] = 600.0
    return r


def _runs() -> dict[str, Any]:
    """Three rounds per cell. Direct's p99 is noisy in round 2 (9 ms); Tollgate's worst p99 is 4 ms."""
    direct = [_round(17000, 0.06, 1.5), _round(17000, 0.06, 9.0), _round(17000, 0.05, 1.6)]
    tollgate = [_round(1200, 0.76, 2.5, True), _round(1100, 1.30, 4.0, True), _round(1190, 0.75, 2.4, True)]
    litellm = [_round(100, 10.0, 15.0), _round(50, 10.5, 400.0), _round(98, 10.1, 16.0)]
    cells = {"direct": direct, "tollgate": tollgate, "litellm": litellm}
    return {t: {m: {c: [dict(r) for r in rs] for c in CONNS} for m in overhead.MODES} for t, rs in cells.items()}  # keyed as main() keys them


def _settings(tollgate_workers: int, litellm_workers: int | None, version: str | None = "1.2.3") -> dict[str, Any]:
    return {"rounds": 3, "seconds": 5, "connections": CONNS, "generator": "wrk", "cpus": 2, "python": "3.11",
            "tollgate_source": "working tree", "tollgate_workers": tollgate_workers, "litellm_workers": litellm_workers,
            "litellm_version": version, "machine": "test"}


def _printed(summary: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    overhead.print_table(summary, list(overhead.TARGETS), CONNS)
    return capsys.readouterr().out


def _summary(settings: dict[str, Any]) -> dict[str, Any]:
    runs = _runs()
    summary = overhead.summarize(runs, list(overhead.TARGETS), CONNS, settings)
    summary.setdefault("settings", settings)  # what main() does with it
    summary["runs"] = runs
    return summary


def test_ratios_against_litellm_only_between_runs_with_the_same_worker_count(capsys: pytest.CaptureFixture[str]) -> None:
    mixed = _summary(_settings(tollgate_workers=2, litellm_workers=1))
    assert "ratios_tollgate_over_litellm" not in mixed
    out = _printed(mixed, capsys)
    assert "no Tollgate/LiteLLM ratios: LiteLLM ran with 1 worker process(es), Tollgate with 2" in out
    assert "req/s x" not in out

    same = _summary(_settings(tollgate_workers=2, litellm_workers=2))
    ratios = same["ratios_tollgate_over_litellm"]["nonstream"]["64"]
    assert ratios["rps"] == pytest.approx(1190 / 98)  # medians
    assert ratios["rps_worst_round"] == pytest.approx(12.0)  # rounds: 1200/100, 1100/50, 1190/98: the worse is round 1
    assert "both with 2 worker process(es)" in _printed(same, capsys)


def test_p99_is_absolute_with_its_worst_round_and_never_a_difference(capsys: pytest.CaptureFixture[str]) -> None:
    summary = _summary(_settings(1, 1))
    tg = summary["medians"]["tollgate"]["nonstream"]["1"]
    assert "added_p99_ms" not in tg  # 2.5 - 1.6 median difference: what a noisy direct made of it
    assert tg["p99_ms"] == 2.5 and tg["p99_worst_ms"] == 4.0
    assert summary["medians"]["direct"]["nonstream"]["1"]["p99_worst_ms"] == 9.0
    out = _printed(summary, capsys)
    assert "+p99" not in out and "worst p99" in out
    # The c=1 line: both absolute p99s (worst round of each) beside the added p50, and a bound that one
    # noisy direct round cannot shrink: Tollgate's worst p99 minus direct's best.
    line = next(x for x in out.splitlines() if x.startswith("Tollgate at c=1"))
    assert "p99 Tollgate 4.00 ms, direct 9.00 ms" in line
    assert "worst p99 minus direct's best 2.50 ms" in line


def test_added_p50_is_paired_by_round_and_its_worst_round_judges_the_target(capsys: pytest.CaptureFixture[str]) -> None:
    summary = _summary(_settings(1, 1))
    tg = summary["medians"]["tollgate"]["nonstream"]["1"]
    assert tg["added_p50_ms"] == pytest.approx(0.70)  # rounds: 0.70, 1.24, 0.70
    assert tg["added_p50_worst_ms"] == pytest.approx(1.24)
    line = next(x for x in _printed(summary, capsys).splitlines() if x.startswith("Tollgate at c=1"))
    assert "added p50 0.70 ms, worst round 1.24 ms" in line and "judged on the worst round: FAIL" in line


def test_litellm_runs_with_as_many_workers_as_tollgate(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    started: list[list[str]] = []

    @contextlib.contextmanager
    def process(args: list[str], env: dict[str, str], log: Path) -> Any:
        started.append(args)
        yield None

    monkeypatch.setattr(overhead, "ensure_litellm", lambda: tmp_path / "litellm")
    monkeypatch.setattr(overhead, "process", process)
    monkeypatch.setattr(overhead, "wait_http", lambda *a, **k: None)
    with overhead.litellm_proxy("http://127.0.0.1:1/v1", workers=3):
        pass
    [args] = started
    assert args[args.index("--num_workers") + 1] == "3"


def test_litellm_is_installed_at_the_pinned_version_and_a_different_one_is_replaced(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    venv = tmp_path / "venv-litellm"
    (venv / "bin").mkdir(parents=True)
    for name in ("python", "pip", "litellm"):
        (venv / "bin" / name).touch()
    installed = {"version": "0.9.0"}
    commands: list[list[str]] = []

    def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        commands.append(list(cmd))
        if cmd[-1].startswith("litellm[proxy]"):
            installed["version"] = cmd[-1].split("==", 1)[1]
        out = installed["version"] + "\n" if "importlib.metadata" in " ".join(cmd) else ""
        return subprocess.CompletedProcess(cmd, 0, out, "")

    monkeypatch.setattr(overhead, "LITELLM_VENV", venv)
    monkeypatch.setattr(overhead.subprocess, "run", run)
    assert overhead.ensure_litellm() == venv / "bin" / "litellm"
    pins = [c[-1] for c in commands if "install" in c]
    assert pins == [f"litellm[proxy]=={overhead.LITELLM_VERSION}"]  # an exact pin, never a bare `litellm[proxy]`
    assert overhead.installed_litellm_version() == overhead.LITELLM_VERSION
    commands.clear()
    overhead.ensure_litellm()  # already at the pin: nothing installed
    assert not any("install" in c for c in commands)


def test_a_recorded_run_is_reported_as_this_bench_reports_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recorded = {"settings": {k: v for k, v in _settings(2, None).items() if not k.startswith("litellm")}, "runs": _runs(),
                "ledger": None}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(recorded))
    summary = overhead.report_from_json(path)
    out = capsys.readouterr().out
    # Runs recorded before the JSON said how many LiteLLM workers ran had one: no ratios for two Tollgate workers.
    assert summary["settings"]["litellm_workers"] == 1 and "ratios_tollgate_over_litellm" not in summary
    assert "LiteLLM (version not recorded) with 1" in out and "no Tollgate/LiteLLM ratios" in out
