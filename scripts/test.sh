#!/usr/bin/env bash
# `make test`'s pytest, in two parts:
#   1. every test not marked `solo`, in TOLLGATE_TEST_WORKERS processes (default 3; 0: in this one), each
#      taking whole files, the longest first (tests/conftest.py:LONGEST_FIRST);
#   2. the tests marked `solo` (they hold wall-clock times to bounds: TTFTs, queue waits, the soak's
#      calibrated load), one after the other, with nothing else running.
# Three workers on two cores: much of the suite waits on processes, Postgres and Redis (measured: the whole
# suite in 1,259 s with two workers, 1,047 s with three, ~1,600 s in one process). Arguments go to both parts
# (a path, -k, -x); a part they select nothing of passes.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WORKERS=${TOLLGATE_TEST_WORKERS:-3}

part() {
    "$PY" -m pytest -q --durations=10 "$@"
    local rc=$?
    [ "$rc" = 5 ] && rc=0  # no test selected
    return "$rc"
}

parallel=(-m "not solo")
[ "$WORKERS" != 0 ] && parallel+=(-n "$WORKERS" --dist loadfile --no-loadscope-reorder)
part "${parallel[@]}" "$@"; first=$?
part -m solo "$@"; second=$?
[ "$first" = 0 ] && [ "$second" = 0 ]
