#!/usr/bin/env bash
# The test suite on a slow day: one core taken by a busy loop at nice 0 beside it, as a
# shared machine or CI runner gives it (docs/slow-day.md). Arguments go to pytest; none:
# the README's test command. RAYTRAINER_SLOWDAY_HOGS: how many busy loops (default 1).
#   bash tests/slowday.sh                      # the whole suite, two sessions
#   bash tests/slowday.sh -q tests/test_elastic.py
set -u
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
if [ -x .venv/bin/python ] && [ "$PYTHON" = python ]; then
    # The project's venv, as the README's command has it, activated: tests run `ray` and
    # `raytrainer` as a user does, from PATH.
    PYTHON=.venv/bin/python
    export VIRTUAL_ENV="$PWD/.venv" PATH="$PWD/.venv/bin:$PATH"
fi
hogs=()
for _ in $(seq "${RAYTRAINER_SLOWDAY_HOGS:-1}"); do
    nice -n 0 bash -c 'while :; do :; done' &
    hogs+=($!)
done
trap 'kill "${hogs[@]}" 2>/dev/null' EXIT INT TERM
echo "slow day: ${#hogs[@]} busy loop(s) at nice 0 (pids ${hogs[*]}), load $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null)" >&2
if [ $# -eq 0 ]; then
    set -- -q -n 2 --dist loadfile
fi
start=$(date +%s)
"$PYTHON" -m pytest "$@"
rc=$?
echo "slow day: pytest exited $rc after $(( $(date +%s) - start )) s, load $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null)" >&2
exit $rc
