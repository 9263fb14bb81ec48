#!/usr/bin/env bash
# A single-node Slurm on this machine (slurmctld + slurmd + munge on localhost), for rehearsing
# cluster=slurm and for tests/launcher/test_slurm.py's real-submission tests. Needs root and Debian's
# packages: apt-get install -y slurm-wlm munge. Took about a minute here (slurm-wlm 22.05).
#   bash scripts/local_slurm.sh        start (idempotent)
#   bash scripts/local_slurm.sh stop   stop the daemons
set -euo pipefail
if [ "${1:-}" = stop ]; then
  for f in /run/slurmd.pid /run/slurmctld.pid; do [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null || true; done
  exit 0
fi
[ "$(id -u)" = 0 ] || { echo "run as root" >&2; exit 1; }
command -v slurmctld >/dev/null || { echo "apt-get install -y slurm-wlm munge" >&2; exit 1; }
host=$(hostname -s)
cpus=$(nproc)
mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2 ))
mkdir -p /var/run/munge /var/log/munge /var/lib/munge /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
chown -R munge:munge /var/run/munge /var/log/munge /var/lib/munge /etc/munge 2>/dev/null || true
pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=rehearsal
SlurmctldHost=$host
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmUser=root
SlurmdUser=root
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
pgrep -x slurmctld >/dev/null || /usr/sbin/slurmctld
pgrep -x slurmd >/dev/null || /usr/sbin/slurmd
for _ in $(seq 50); do scontrol ping 2>/dev/null | grep -q UP && sinfo -h -o %T | grep -qv "down\|unk" && break; sleep 0.2; done
sinfo
