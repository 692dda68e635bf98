#!/usr/bin/env bash
# A one-machine SLURM cluster (munged + slurmctld + slurmd on this host) for CI and for trying the sbatch
# launch path on a laptop. Needs root and Debian's `slurm-wlm` and `munge` packages (`install` gets them).
#
#   recipes/slurm/localhost.sh install   # apt-get install slurm-wlm munge (quiet; skipped when present)
#   recipes/slurm/localhost.sh up        # write /etc/slurm/slurm.conf, start the three daemons, wait until idle
#   recipes/slurm/localhost.sh down      # stop the daemons this script started
#   recipes/slurm/localhost.sh status    # sinfo
#
# The config is cgroup-free (proctrack/linuxproc, task/none, no accounting), so it also runs in containers
# without systemd or a writable cgroup tree. It refuses to overwrite a slurm.conf it did not write.
set -euo pipefail
CONF=/etc/slurm/slurm.conf
MARK="# written by k3lit recipes/slurm/localhost.sh"
STATE=/var/spool/k3lit-slurm
HOST=$(hostname -s)

install() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
        && command -v sbatch >/dev/null; then
        return 0
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
}

write_conf() {
    if [[ -f $CONF ]] && ! grep -qxF "$MARK" "$CONF"; then
        echo "localhost.sh: $CONF exists and was not written by this script; not touching it" >&2
        exit 1
    fi
    local cpus mem
    cpus=$(nproc)
    mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 512 ))
    mkdir -p /etc/slurm "$STATE/ctld" "$STATE/d" /var/log/slurm
    cat > "$CONF" <<CONFEOF
$MARK
ClusterName=k3lit-localhost
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
KillWait=5
MinJobAge=600
InactiveLimit=0
SlurmdParameters=config_overrides
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONFEOF
}

up() {
    install
    write_conf
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
    [[ -s /etc/munge/munge.key ]] || { dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null;
                                       chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key; }
    if ! munge -n >/dev/null 2>&1; then
        runuser -u munge -- /usr/sbin/munged
    fi
    pgrep -xf "/usr/sbin/slurmctld.*" >/dev/null || /usr/sbin/slurmctld -f "$CONF"
    pgrep -xf "/usr/sbin/slurmd.*" >/dev/null || /usr/sbin/slurmd -f "$CONF"
    for _ in $(seq 60); do
        if sinfo -h -o %T 2>/dev/null | grep -qE "^(idle|mixed|allocated)"; then
            sinfo
            return 0
        fi
        sleep 1
    done
    echo "localhost.sh: the node did not become idle; logs:" >&2
    tail -n 20 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log >&2 || true
    sinfo -R >&2 || true
    exit 1
}

down() {
    local f pid
    for f in "$STATE/slurmd.pid" "$STATE/slurmctld.pid"; do
        if [[ -f $f ]] && pid=$(cat "$f") && kill -0 "$pid" 2>/dev/null; then
            kill "$pid"
            for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        fi
    done
    if [[ -f /run/munge/munged.pid ]] && pid=$(cat /run/munge/munged.pid) && kill -0 "$pid" 2>/dev/null; then
        kill "$pid"
        for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    fi
}

case "${1:-}" in
    install) install ;;
    up) up ;;
    down) down ;;
    status) sinfo ;;
    *) echo "usage: $0 install|up|down|status" >&2; exit 2 ;;
esac
