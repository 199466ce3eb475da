#!/bin/sh
# Waits for the database, applies migrations, then runs the tollgate command (default: serve).
set -eu
tries=0
until tollgate migrate; do
    tries=$((tries + 1))
    if [ "$tries" -ge 30 ]; then
        echo "tollgate: database still unreachable after $tries tries" >&2
        exit 1
    fi
    echo "tollgate: waiting for the database ($tries)" >&2
    sleep 2
done
exec tollgate "$@"
