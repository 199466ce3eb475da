"""The path of one streamed chat completion may not grow: bench/request_path.py records it (real
model behind the scheduler, Redis quotas, Postgres ledger with its journal) and counts it as
docs/architecture.md counts it. The ceilings are the counts the tree has now; the goal is 45 stops'
worth of steps, 18 crossings between packages and 6 back up into gateway/ (docs/architecture.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import PG_HOST, PG_PORT, REDIS_URL, missing, reachable, require_redis

ROOT = Path(__file__).resolve().parents[2]
CEILING = {"stops": 60, "crossings": 12, "back_up": 5}


def test_the_streamed_chat_completion_path_does_not_grow() -> None:
    if not reachable(PG_HOST, PG_PORT):
        missing(f"Postgres is not reachable at {PG_HOST}:{PG_PORT}")
    require_redis(REDIS_URL)
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "request_path.py"), "--json", "-"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout)
    path = "\n".join(got["path"])
    assert got["path"][0] == "gateway/http/hardening.py:GuardedHttpToolsProtocol.data_received", path
    assert "billing/ledger/writer.py:LedgerWriter.record" in got["path"], path  # the row is on the path it counts
    over = {k: (got[k], ceiling) for k, ceiling in CEILING.items() if got[k] > ceiling}
    assert not over, f"the request's path grew (count, ceiling): {over}\n{path}"
