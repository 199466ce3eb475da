"""bench/overhead_floor.py, one short round: the floor server answers through the same Redis,
upstream and ledger as Tollgate, every answer it gave has its completed ledger row, and the
comparison writes its report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(400)
@pytest.mark.solo  # its load generator's connection was closed unanswered once with other tests running beside it
def test_the_floor_server_does_the_work_and_the_comparison_runs(tmp_path: Path) -> None:
    out = tmp_path / "floor.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "overhead_floor.py"), "--rounds", "1", "--seconds", "1", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=360,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    ledger = report["floor_ledger"]
    assert ledger["pass"] and ledger["ok_2xx"] > 0 and ledger["rows"] >= ledger["ok_2xx"]
    for name in ("floor", "tollgate"):
        (result,) = report["rounds"][name]
        assert result["ok"] > 0 and result["non2xx"] == 0 and result["cpu_us"] > 0
    assert "Tollgate CPU per request / floor" in run.stdout
