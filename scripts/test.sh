#!/usr/bin/env bash
# `make test`'s pytest, in two parts:
#   1. every test not marked `solo`, in TOLLGATE_TEST_WORKERS processes (default 2; 0: in this one), each
#      taking whole files, the longest first (tests/conftest.py:LONGEST_FIRST);
#   2. the tests marked `solo` (they hold wall-clock times to bounds: TTFTs, queue waits, the soak's
#      calibrated load) and schemathesis' generated tests, one after the other, nothing else running.
# Two workers on two cores: in fresh-clone CI runs three took as long (the whole suite 1,077 s of pytest,
# two: 1,079 s) and made tests fail beside them. Arguments go to both parts (a path, -k, -x); a part they
# select nothing of passes.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WORKERS=${TOLLGATE_TEST_WORKERS:-2}

part() {
    "$PY" -m pytest -q --durations=10 "$@"
    local rc=$?
    [ "$rc" = 5 ] && rc=0  # no test selected
    return "$rc"
}

parallel=(-m "not solo")
[ "$WORKERS" != 0 ] && parallel+=(-n "$WORKERS" --dist loadfile --no-loadscope-reorder)
part "${parallel[@]}" "$@"; first=$?
# The workers' sessions drop their databases in processes of their own (tests/drop_databases.py): each
# DROP waits for a checkpoint, which the tests that run alone must not share the machine with.
waited=0
while pgrep -f 'tests[.]drop_databases' >/dev/null && [ "$waited" -lt 600 ]; do
    [ "$waited" = 0 ] && echo "test.sh: waiting for the parallel part's databases to be dropped"
    sleep 0.2; waited=$((waited + 1))
done
part -m solo "$@"; second=$?
[ "$first" = 0 ] && [ "$second" = 0 ]
