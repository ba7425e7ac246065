#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for the Slurm tests (tests/test_slurm.py) and for trying
# `memtrain submit` by hand. Installs Debian's slurm-wlm and munge when missing (needs root and the
# Debian package registry), writes /etc/slurm/slurm.conf for this host (proctrack/linuxproc, no
# cgroups, CPUs only, requeue allowed), starts munged, slurmctld and slurmd, and waits until the node
# is idle. Idempotent: a running cluster is left as it is.
#
#   tools/slurm-local.sh          # install if needed, configure, start
#   tools/slurm-local.sh stop     # stop the daemons
set -euo pipefail

alive() {  # a live (not zombie) process of this exact name
    pgrep -x -r R,S,D "$1" >/dev/null 2>&1
}

if [ "${1:-}" = "stop" ]; then
    for daemon in slurmd slurmctld munged; do
        pkill -x "$daemon" || true
        for _ in $(seq 50); do alive "$daemon" || break; sleep 0.2; done
    done
    exit 0
fi

if [ "$(id -u)" != 0 ]; then
    echo "slurm-local: needs root (it installs packages and runs the Slurm daemons)" >&2
    exit 1
fi

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    echo "slurm-local: installing slurm-wlm and munge" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq slurm-wlm munge >/dev/null
fi

if scontrol ping 2>/dev/null | grep -q UP && sinfo -h -o %T 2>/dev/null | grep -qE "idle|mix|alloc"; then
    exit 0  # already up
fi

host=$(hostname -s)
cpus=$(nproc)
mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge
cat > /etc/slurm/slurm.conf <<CONF
# written by memtrain's tools/slurm-local.sh: one node, this host, CPUs only
ClusterName=memtrain-local
SlurmctldHost=${host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1
# a requeued job may start again after this many seconds (default 120)
AuthInfo=cred_expire=10
SlurmctldTimeout=30
SlurmdTimeout=30
KillWait=30
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
NodeName=${host} CPUs=${cpus} RealMemory=${mem} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF

mkdir -p /var/log/munge /var/lib/munge /etc/munge
chown -R munge:munge /etc/munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
if ! alive munged; then
    [ -s /etc/munge/munge.key ] || /usr/sbin/mungekey --create --force 2>/dev/null || \
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 2>/dev/null
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
    runuser -u munge -- /usr/sbin/munged
fi
alive slurmctld || /usr/sbin/slurmctld
alive slurmd || /usr/sbin/slurmd

for _ in $(seq 60); do
    if sinfo -h -o %T 2>/dev/null | grep -qE "^(idle|mix|alloc)"; then
        exit 0
    fi
    scontrol update nodename="${host}" state=resume >/dev/null 2>&1 || true
    sleep 1
done
echo "slurm-local: the node did not come up; see /var/log/slurm/slurmctld.log and slurmd.log" >&2
sinfo >&2 || true
exit 1
