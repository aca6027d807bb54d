#!/usr/bin/env bash
# A real two-"node" Slurm on this machine, for tests/test_slurm_launcher.py (and for trying the
# Slurm launcher by hand): munged, slurmctld and two slurmd (n1, n2) on 127.0.0.1, all of
# Debian's slurm-wlm, each node with CPUS cores (default 1).
#
#   bash scripts/slurm_test_cluster.sh start DIR [CPUS]   # prints: export SLURM_CONF=DIR/slurm.conf
#   bash scripts/slurm_test_cluster.sh stop DIR
#
# Needs root (slurmd runs jobs as their user; munged's key is root's). Installs slurm-wlm and
# munge with apt-get when they are missing. Ports: slurmctld 16817, slurmd 16818 / 16819.
set -euo pipefail
action="${1:?start|stop}"
dir="$(mkdir -p "${2:?DIR}" && cd "$2" && pwd)"
cpus="${3:-1}"
conf="$dir/slurm.conf"

stop_cluster() {
  for pidfile in "$dir"/slurmd-n1.pid "$dir"/slurmd-n2.pid "$dir"/slurmctld.pid "$dir"/munged.pid; do
    if [ -f "$pidfile" ]; then
      kill "$(cat "$pidfile")" 2>/dev/null || true
      rm -f "$pidfile"
    fi
  done
}

if [ "$action" = stop ]; then
  stop_cluster
  exit 0
fi
[ "$action" = start ] || { echo "usage: $0 start|stop DIR [CPUS]" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "slurm_test_cluster: needs root (slurmd, munged)" >&2; exit 1; }
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  echo "[slurm_test_cluster] installing slurm-wlm and munge (apt-get)"
  apt-get install -y -q slurm-wlm munge >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null && apt-get install -y -q slurm-wlm munge >/dev/null; }
fi
stop_cluster  # a cluster left by an earlier run in DIR
if (exec 3<>/dev/tcp/127.0.0.1/16817) 2>/dev/null; then
  echo "slurm_test_cluster: port 16817 is taken (another test Slurm? stop it with:" \
       "$0 stop ITS_DIR)" >&2
  exit 1
fi
rm -rf "$dir"/state "$dir"/spool  # a test cluster starts with no job
mkdir -p "$dir"/state "$dir"/spool "$dir"/log "$dir"/munge
host="$(hostname)"
cat >"$conf" <<EOF
ClusterName=arealtest
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=16817
SlurmdPort=16818
AuthType=auth/munge
# cred_expire: a requeued job may start again this long after (Slurm's default: 120 s)
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
SlurmUser=root
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
KillWait=10
MinJobAge=600
NodeName=n1 NodeHostname=$host NodeAddr=127.0.0.1 Port=16818 CPUs=$cpus RealMemory=8000 State=UNKNOWN
NodeName=n2 NodeHostname=$host NodeAddr=127.0.0.1 Port=16819 CPUs=$cpus RealMemory=8000 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
EOF
# munge: a key and a socket of its own under DIR (slurm.conf's AuthInfo names the socket)
key="$dir/munge/munge.key"
[ -f "$key" ] || { dd if=/dev/urandom bs=1 count=1024 of="$key" 2>/dev/null; chmod 400 "$key"; }
munged --force --key-file="$key" --socket="$dir/munge/munge.socket" \
  --pid-file="$dir/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/seed"
export SLURM_CONF="$conf"
slurmctld -f "$conf"
slurmd -f "$conf" -N n1
slurmd -f "$conf" -N n2
for _ in $(seq 1 120); do  # until both nodes are idle (a minute at most)
  if [ "$(sinfo -h -N -o '%t' 2>/dev/null | grep -c idle)" = 2 ]; then
    echo "export SLURM_CONF=$conf"
    exit 0
  fi
  sleep 0.5
done
echo "slurm_test_cluster: the nodes did not become idle; sinfo says:" >&2
sinfo -N >&2 || true
tail -n 20 "$dir"/log/*.log >&2
exit 1
