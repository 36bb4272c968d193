#!/bin/bash
# A one-node Slurm cluster on this machine (Debian's slurm-wlm and munge), for the cluster tests
# (`make test-cluster`) and for trying the Slurm launcher. Run as root.
#
#   tests/clusters/slurm.sh up     # prints SLURM_CONF=...; sbatch, srun, squeue need it set
#   tests/clusters/slurm.sh down   # stops the daemons it started
#
# The configuration, state, logs and pid files live in AREAL_LITE_SLURM_DIR (default
# /tmp/areal_lite_slurm), so /etc/slurm is left alone: clients find the cluster through SLURM_CONF.
# munged is started (as user munge, with a new key when there is none) only when none answers, and
# stopped by `down` only when `up` started it. An `up` that fails stops what it started.
set -euo pipefail
DIR=${AREAL_LITE_SLURM_DIR:-/tmp/areal_lite_slurm}
CONF=$DIR/slurm.conf
export SLURM_CONF=$CONF

stop_all() {
    stop_pidfile "$DIR/slurmd.pid"
    stop_pidfile "$DIR/slurmctld.pid"
    stop_pidfile "$DIR/munged.pid"
}

stop_pidfile() {
    [ -f "$1" ] || return 0
    local pid
    pid=$(cat "$1")
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    kill -KILL "$pid" 2>/dev/null || true
    rm -f "$1"
}

case "${1:-}" in
up)
    if [ -f "$DIR/slurmctld.pid" ] && kill -0 "$(cat "$DIR/slurmctld.pid")" 2>/dev/null; then
        echo "SLURM_CONF=$CONF"
        exit 0
    fi
    mkdir -p "$DIR/state" "$DIR/slurmd"
    if ! munge -n 2> /dev/null | unmunge > /dev/null 2>&1; then
        if [ ! -s /etc/munge/munge.key ]; then
            dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
        fi
        chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
        mkdir -p /run/munge && chown munge:munge /run/munge
        rm -f /run/munge/munged.pid
        su -s /bin/sh munge -c munged
        for _ in $(seq 40); do [ -s /run/munge/munged.pid ] && break; sleep 0.25; done
        cp /run/munge/munged.pid "$DIR/munged.pid"
    fi
    host=$(hostname -s)
    mem=$(awk '/MemTotal/ {print int($2 / 1024 * 0.8)}' /proc/meminfo)
    cat > "$CONF" <<CONF
ClusterName=areallite
SlurmctldHost=$host
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SlurmUser=root
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
MpiDefault=none
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/slurmd
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
NodeName=$host CPUs=$(nproc) RealMemory=$mem State=UNKNOWN
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
    slurmctld -c
    slurmd
    for _ in $(seq 60); do
        sinfo -h -o %T 2>/dev/null | grep -q idle && break
        sleep 1
    done
    if ! sinfo -h -o %T 2> /dev/null | grep -q idle; then
        echo "the Slurm node is not idle; see $DIR/*.log" >&2
        stop_all
        exit 1
    fi
    echo "SLURM_CONF=$CONF"
    ;;
down)
    stop_all
    ;;
*)
    echo "usage: $0 up|down" >&2
    exit 2
    ;;
esac
