"""bench/relay.py's pooled report and its directory variants. No load is generated here: `--pool`
is fed saved runs whose ratios are known, and a directory variant is checked to be used as it is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.overhead import snapshot

ROOT = Path(__file__).resolve().parents[2]
TWO = "wt+TOLLGATE_WORKERS=2"


def _round(tok_s: float) -> dict[str, Any]:
    return {"tok_s": tok_s, "cpu_ms_per_1k": 10.0, "tokens_per_event": 5.0, "streams": 100, "errors": 0,
            "gateway_busy": 1.0, "engine_busy": 0.5, "driver_busy": 0.1}


def _saved(path: Path, rounds: dict[str, list[float]], cells: tuple[int, ...] = (256,)) -> Path:
    runs = {f"{c}|{v}": [_round(t) for t in tok] for c in cells for v, tok in rounds.items()}
    path.write_text(json.dumps({"variants": list(rounds), "cells": list(cells), "runs": runs}))
    return path


def _pool(*files: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "bench" / "relay.py"), "--pool", *map(str, files)],
                          capture_output=True, text=True, cwd=ROOT)


def test_pooled_rounds_are_paired_within_their_own_run(tmp_path: Path) -> None:
    # Run a: 2 workers x3.0 in its first round, x0.9 in its second. Run b: x1.0.
    a = _saved(tmp_path / "a.json", {"wt": [100_000, 200_000], TWO: [300_000, 180_000]})
    b = _saved(tmp_path / "b.json", {"wt": [150_000], TWO: [150_000]})
    done = _pool(a, b)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "2 runs, 3 rounds per variant and cell" in out
    line = next(x for x in out.splitlines() if x.strip().startswith(f"{TWO} / wt"))
    # medians over the pooled rounds: 150,000 and 180,000 -> x1.200; per-round ratios 3.0, 0.9, 1.0 -> paired
    # 1.000 (rounds paired across runs or out of order would give other ratios)
    assert "tok/s x1.200 (paired 1.000 [0.900-3.000])" in line, out
    # per process: two workers' median tok/s halved
    assert any(x.startswith(TWO) and x.split()[2] == "90000" for x in out.splitlines()), out


def test_pool_reports_only_what_every_run_has(tmp_path: Path) -> None:
    a = _saved(tmp_path / "a.json", {"wt": [100_000], "wt+": [100_000], TWO: [180_000]}, cells=(64, 256))
    b = _saved(tmp_path / "b.json", {"wt": [100_000], TWO: [190_000]}, cells=(256,))
    out = _pool(a, b).stdout
    assert "== 256 streams ==" in out and "== 64 streams ==" not in out
    assert "wt+ / wt" not in out and f"{TWO} / wt" in out


def test_pool_refuses_runs_with_nothing_in_common(tmp_path: Path) -> None:
    a = _saved(tmp_path / "a.json", {"wt": [100_000], TWO: [180_000]}, cells=(64,))
    b = _saved(tmp_path / "b.json", {"wt": [100_000], TWO: [180_000]}, cells=(256,))
    done = _pool(a, b)
    assert done.returncode != 0 and "no variant and cell in common" in done.stderr


def test_a_directory_variant_is_that_tree_as_it_is(tmp_path: Path) -> None:
    (tmp_path / "gateway").mkdir()
    with snapshot(str(tmp_path)) as tree:
        assert tree == tmp_path.resolve()
    assert (tmp_path / "gateway").is_dir()  # used, not copied or removed


def test_pool_refuses_runs_set_against_another_first_variant(tmp_path: Path) -> None:
    a = _saved(tmp_path / "a.json", {"wt": [100_000], TWO: [180_000]})
    b = _saved(tmp_path / "b.json", {TWO: [180_000], "wt": [100_000]})  # the same gateways, the ratios the other way
    done = _pool(a, b)
    assert done.returncode != 0 and "same first variant" in done.stderr
