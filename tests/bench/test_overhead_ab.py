"""bench/overhead_ab.py's report (issue 23's speed check): each variant's CPU per request against the
first as the ratio of medians and as the median of per-round ratios; `--pool` reports the rounds of
several saved runs together; the first variant named twice (`REV`, `REV+`) is the noise floor and
the others are also set against those two's mean, round by round. No load is generated here: the
report is fed rounds whose ratios are known."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench import overhead_ab

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = ["old", "old+", "new"]


def _round(cpu: float) -> dict[str, Any]:
    return {"rps": 1000.0, "p50_ms": 1.0, "p99_ms": 2.0, "requests": 4000, "ok": 4000, "non2xx": 0, "cpu_us_per_request": cpu}


def _saved(path: Path, old: list[float], old2: list[float], new: list[float]) -> Path:
    runs = {}
    for cell in ("nonstream c=1", "stream c=64"):
        for spec, cpus in zip(VARIANTS, (old, old2, new)):
            runs[f"{cell}|{spec}"] = [_round(c) for c in cpus]
    path.write_text(json.dumps({"variants": VARIANTS, "together": True, "runs": runs}))
    return path


def _line(out: str, cell: str, spec: str, against: bool = False) -> str:
    for line in out.splitlines():
        if line.startswith(cell) and line[len(cell):].split()[0] == spec and ("against the mean" in line) == against:
            return line
    raise AssertionError(f"no line for {cell} {spec} in:\n{out}")


def test_pooled_rounds_paired_ratios_and_the_controls_mean(tmp_path: Path) -> None:
    # Run 1: old drifts (100, 200); new costs 1.1x old in each round. Run 2: new costs 1.3x old.
    a = _saved(tmp_path / "a.json", [100, 200], [100, 200], [110, 220])
    b = _saved(tmp_path / "b.json", [100, 100], [120, 120], [130, 130])
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "overhead_ab.py"), "--pool", str(a), str(b)],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert "4 rounds pooled from 2 runs" in out
    new = _line(out, "nonstream c=1", "new")
    # medians over the 4 pooled rounds: old 100 (100, 200, 100, 100), new 130 (110, 220, 130, 130) -> x 1.300;
    # the per-round ratios 1.1, 1.1, 1.3, 1.3 -> paired x 1.200
    assert "cpu    130 us/req" in new and "cpu x 1.300" in new and "paired x 1.200 [1.100-1.300]" in new
    noise = _line(out, "nonstream c=1", "old+")
    assert "paired x 1.100 [1.000-1.200]" in noise  # 1.0, 1.0, 1.2, 1.2
    # against the mean of old and old+: 1.1, 1.1, 130/110, 130/110 -> median (1.1 + 1.1818) / 2
    assert "cpu paired x 1.141" in _line(out, "stream c=64", "new", against=True)


def test_no_controls_mean_without_a_repeated_first_variant(capsys: Any) -> None:
    runs = {f"stream c=1|{spec}": [_round(c)] for spec, c in (("old", 100.0), ("new", 103.0))}
    overhead_ab.report(["old", "new"], [(True, 1)], runs, "1 round")
    out = capsys.readouterr().out
    assert "paired x 1.030" in out and "against the mean" not in out


def test_pool_takes_the_same_variants_in_another_order(tmp_path: Path) -> None:
    a = _saved(tmp_path / "a.json", [100], [100], [110])
    b = _saved(tmp_path / "b.json", [100], [100], [130])
    reordered = json.loads(b.read_text())
    reordered["variants"] = ["old", "new", "old+"]  # the new one in the middle: same gateways, another place
    b.write_text(json.dumps(reordered))
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "overhead_ab.py"), "--pool", str(a), str(b)],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert "paired x 1.200 [1.100-1.300]" in _line(out, "nonstream c=1", "new")


def test_pool_refuses_runs_of_other_variants(tmp_path: Path) -> None:
    a = _saved(tmp_path / "a.json", [100], [100], [100])
    for variants in (["x", "y"], ["new", "old", "old+"]):  # other gateways; the same ones against another first
        b = tmp_path / "b.json"
        b.write_text(json.dumps({"variants": variants, "runs": {}}))
        done = subprocess.run([sys.executable, str(ROOT / "bench" / "overhead_ab.py"), "--pool", str(a), str(b)],
                              capture_output=True, text=True, cwd=ROOT)
        assert done.returncode != 0 and "different variants" in done.stderr
