#!/bin/bash
# A 2-node Ray cluster on one machine, for the cluster tests (`make test-cluster`) and for trying
# the Ray launcher: a head node and a worker node, each pinned to its own share of the machine's
# cores (taskset; every process Ray starts on a node inherits it).
#
#   tests/clusters/ray.sh up     # prints RAY_ADDRESS=...; the launcher and the tests read it
#   tests/clusters/ray.sh down   # stops both nodes
#
# Each node runs `ray start --block` in the background, so that it is stopped by its own pid
# (`ray stop` would stop every Ray process on the machine, other users' too). Settings:
# RAY (the ray command), AREAL_LITE_RAY_DIR (state: pids, logs, Ray's temp dir), AREAL_LITE_RAY_PORT
# (the head's port), AREAL_LITE_RAY_CPUS (the CPUs each node offers to Ray's scheduler: 2, so that
# the server-kill test's 2 servers and trainer fit on a 2-core machine).
set -euo pipefail
RAY=${RAY:-ray}
DIR=${AREAL_LITE_RAY_DIR:-/tmp/areal_lite_ray}
PORT=${AREAL_LITE_RAY_PORT:-6390}
CPUS=${AREAL_LITE_RAY_CPUS:-2}
ADDRESS=127.0.0.1:$PORT
COMMON=(--block --num-cpus="$CPUS" --num-gpus=0 --object-store-memory=100000000 --disable-usage-stats)

# Node i gets cores i*n/2 .. (i+1)*n/2-1 of the n this process may use (all of them on one core).
share() {
    local cores=($(python3 -c "import os; print(*sorted(os.sched_getaffinity(0)))"))
    local n=${#cores[@]} half=$(( ${#cores[@]} / 2 ))
    if [ "$half" -eq 0 ]; then echo "${cores[*]}" | tr ' ' ,; return; fi
    if [ "$1" -eq 0 ]; then echo "${cores[@]:0:$half}" | tr ' ' ,; else echo "${cores[@]:$half:$((n - half))}" | tr ' ' ,; fi
}

nodes_up() {
    RAY_ADDRESS=$ADDRESS "$(dirname "$(command -v "$RAY")")/python" -c \
        "import ray; ray.init(log_to_driver=False); print(sum(n['Alive'] for n in ray.nodes()))" 2>/dev/null || echo 0
}

wait_for_nodes() {
    for _ in $(seq 120); do
        [ "$(nodes_up | tail -n1)" -ge "$1" ] && return 0
        sleep 1
    done
    echo "the Ray cluster did not reach $1 nodes; see $DIR/*.log" >&2
    return 1
}

case "${1:-}" in
up)
    if [ -f "$DIR/head.pid" ] && kill -0 "$(cat "$DIR/head.pid")" 2>/dev/null; then
        echo "RAY_ADDRESS=$ADDRESS"
        exit 0
    fi
    mkdir -p "$DIR"
    taskset -c "$(share 0)" "$RAY" start --head --port="$PORT" --node-ip-address=127.0.0.1 --include-dashboard=false \
        --temp-dir="$DIR/tmp" "${COMMON[@]}" > "$DIR/head.log" 2>&1 &
    echo $! > "$DIR/head.pid"
    wait_for_nodes 1
    taskset -c "$(share 1)" "$RAY" start --address="$ADDRESS" --node-ip-address=127.0.0.1 --temp-dir="$DIR/tmp-worker" "${COMMON[@]}" > "$DIR/worker.log" 2>&1 &
    echo $! > "$DIR/worker.pid"
    wait_for_nodes 2
    echo "RAY_ADDRESS=$ADDRESS"
    ;;
down)
    for node in worker head; do
        pidfile="$DIR/$node.pid"
        [ -f "$pidfile" ] || continue
        pid=$(cat "$pidfile")
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        kill -KILL "$pid" 2>/dev/null || true
        rm -f "$pidfile"
    done
    ;;
*)
    echo "usage: $0 up|down" >&2
    exit 2
    ;;
esac
