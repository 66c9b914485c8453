#!/bin/bash
# Run a pytest selection on a machine made busy on purpose, to show that the suite does not
# depend on what it does not own:
#   - CPU: BURNERS processes spinning (default: one per core), so every test competes for CPU;
#   - mounts: a loop mounting and unmounting a tmpfs under a private directory of its own, in
#     the host's mount namespace, so the host's mount table changes under every test.
# Each run of the selection is one pytest process; the script stops starting runs after
# MAX_SECONDS, prints "passed P of N runs" and exits non-zero if any run failed. Everything it
# started (burners, mount loop, the tmpfs, its directory) is removed on exit, Ctrl-C included.
#
#   tests/stress/busy.sh [-n RUNS] [-b BURNERS] [-t MAX_SECONDS] [-l LOGDIR] [--] PYTEST-ARGS...
#   e.g. tests/stress/busy.sh -n 20 -- tests/test_resident.py -k killed_daemon
#
# The mount loop needs root (as the container tests do); without it only the CPU is loaded.
set -u

runs=1 burners=$(nproc) max_s=3600 logdir=""
while [ $# -gt 0 ]; do
    case $1 in
        -n) runs=$2; shift 2;;
        -b) burners=$2; shift 2;;
        -t) max_s=$2; shift 2;;
        -l) logdir=$2; shift 2;;
        --) shift; break;;
        -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0;;
        *) break;;
    esac
done
[ $# -gt 0 ] || { echo "busy.sh: name the tests to run (pytest arguments); -h for help" >&2; exit 2; }

here=$(cd "$(dirname "$0")/../.." && pwd)
py=${PYTHON:-$here/.venv/bin/python}
[ -x "$py" ] || { echo "busy.sh: no $py: run 'make fixtures' first (or set PYTHON)" >&2; exit 2; }
work=$(mktemp -d /tmp/nvhook-busy.XXXXXX)
[ -n "$logdir" ] || logdir=$work/logs
mkdir -p "$logdir"
pids=() run_pid=""

cleanup() {
    trap - EXIT INT TERM
    if [ -n "$run_pid" ]; then kill -INT "$run_pid" 2>/dev/null; wait "$run_pid" 2>/dev/null; fi
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
    # the loop may have been stopped between its mount and its umount
    while mountpoint -q "$work/churn" 2>/dev/null; do umount "$work/churn" || break; done
    rmdir "$work/churn" 2>/dev/null
    [ "$logdir" = "$work/logs" ] && [ "$failed" = 0 ] && rm -rf "$logdir"
    rmdir "$work" 2>/dev/null
}
failed=0
trap cleanup EXIT
trap 'exit 130' INT TERM

for _ in $(seq "$burners"); do
    python3 -c 'while 1: pass' &
    pids+=($!)
done

if [ "$(id -u)" = 0 ]; then
    mkdir "$work/churn"
    (
        trap 'exit 0' TERM
        i=0
        while :; do
            mount -t tmpfs -o size=64k "nvhook-busy-$i" "$work/churn" || exit 1
            sleep 0.05
            umount "$work/churn" || exit 1
            sleep 0.05
            i=$((i + 1))
        done
    ) &
    pids+=($!)
    churn="mounts: a tmpfs on $work/churn, every 0.1 s"
else
    churn="mounts: none (not root)"
fi
echo "busy.sh: $burners CPU burner(s) on $(nproc) core(s); $churn; up to $runs run(s) within ${max_s} s: $*"

end=$(( $(date +%s) + max_s ))
done_runs=0 passed=0
for i in $(seq "$runs"); do
    [ "$(date +%s)" -lt "$end" ] || { echo "busy.sh: time is up after $done_runs run(s)"; break; }
    log=$logdir/run-$i.log
    t0=$(date +%s)
    # in the background, so that a signal to this script is acted on at once (see cleanup)
    (cd "$here" && exec "$py" -m pytest -q -p no:cacheprovider "$@") > "$log" 2>&1 &
    run_pid=$!
    wait "$run_pid"
    rc=$?
    run_pid=""
    if [ "$rc" = 0 ]; then
        passed=$((passed + 1)); res=passed
    else
        failed=$((failed + 1)); res="FAILED (log: $log)"
    fi
    done_runs=$((done_runs + 1))
    echo "busy.sh: run $i: $res in $(( $(date +%s) - t0 )) s: $(tail -n 1 "$log")"
    [ "$res" = passed ] && rm -f "$log"
done
echo "busy.sh: passed $passed of $done_runs run(s)"
[ "$failed" = 0 ] && [ "$done_runs" -gt 0 ]
