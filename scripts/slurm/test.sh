#!/usr/bin/env bash
# The shipped Slurm recipe (examples/cluster/length_suite.sbatch) on a real Slurm: a one-node
# cluster of Debian's slurm-wlm and munge, started here, private to this script (its own munge
# key and socket, its own ports and folders), and stopped at the end by the PIDs it started.
#
#   sudo scripts/slurm/test.sh        # root: it installs the packages where missing and runs
#                                     # the daemons; needs target/release/poslab (POSLAB=...)
#
# It submits the recipe on a tiny length-suite config (3 shards of 8 cells, and the merge),
# makes shard 1 fail, checks that Slurm cancels the merge instead of leaving it pending, that
# `status` names the shard, re-runs it with `rerun 1`, and compares the merged results.json
# with an unsharded run's, byte for byte. .ci/run runs it (about a minute, apt-get included).
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$(pwd)
POSLAB=$(realpath "${POSLAB:-target/release/poslab}")
[[ -x "$POSLAB" ]] || { echo "no $POSLAB: cargo build --release first" >&2; exit 1; }
[[ $(id -u) == 0 ]] || { echo "scripts/slurm/test.sh runs Slurm's daemons: run it as root" >&2; exit 1; }

say() { echo "== slurm test [$(date +%T)]: $*"; }

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
    || ! command -v munged >/dev/null || ! command -v sbatch >/dev/null; then
    say "installing slurm-wlm and munge"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        slurm-wlm munge >/dev/null
fi
say "$(slurmctld -V), munge $(munged --version 2>&1 | head -1 | awk '{print $2}')"

work=$(mktemp -d /tmp/poslab-slurm.XXXXXX)
chmod 755 "$work"
pids=()
cleanup() {
    local status=$?
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
    if ((status != 0)); then
        echo "== slurm test FAILED; logs:" >&2
        for f in "$work"/log/* "$work"/runs/logs/*; do
            [[ -f "$f" ]] && { echo "--- $f" >&2; tail -n 30 "$f" >&2; }
        done
    fi
    rm -rf "$work"
    exit "$status"
}
trap cleanup EXIT

# munge: a key and a socket of this test's own, the daemon as the munge user.
mkdir -p "$work/munge" "$work/log" "$work/state" "$work/spool"
chown munge:munge "$work/munge"
chmod 700 "$work/munge"
runuser -u munge -- mungekey --create --keyfile "$work/munge/munge.key"
chmod 755 "$work/munge"
socket="$work/munge/munge.socket"
runuser -u munge -- munged --foreground --socket "$socket" --key-file "$work/munge/munge.key" \
    --pid-file "$work/munge/munged.pid" --log-file "$work/munge/munged.log" \
    --seed-file "$work/munge/munged.seed" >"$work/log/munged.out" 2>&1 &
pids+=($!)
for _ in $(seq 50); do [[ -S "$socket" ]] && break; sleep 0.1; done
[[ -S "$socket" ]] || { echo "munged did not start" >&2; exit 1; }

# Slurm: one node, this machine, as slurmd -C describes it.
chown slurm:slurm "$work/state" "$work/log"
node=$(slurmd -C | head -1)
host=$(hostname -s)
cat >"$work/slurm.conf" <<EOF
ClusterName=poslabtest
SlurmctldHost=$host(127.0.0.1)
SlurmUser=slurm
SlurmctldPort=16817
SlurmdPort=16818
AuthType=auth/munge
AuthInfo=socket=$socket
CredType=cred/munge
StateSaveLocation=$work/state
SlurmdSpoolDir=$work/spool
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd.pid
SlurmctldLogFile=$work/log/slurmctld.log
SlurmdLogFile=$work/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$work/log/jobcomp.txt
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SchedulerType=sched/backfill
$node NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=test Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF="$work/slurm.conf"
slurmctld -D -f "$SLURM_CONF" >"$work/log/slurmctld.out" 2>&1 &
pids+=($!)
slurmd -D -f "$SLURM_CONF" >"$work/log/slurmd.out" 2>&1 &
pids+=($!)
for _ in $(seq 100); do
    state=$(sinfo -h -o %T 2>/dev/null || true)
    [[ "$state" == idle ]] && break
    sleep 0.2
done
[[ "$state" == idle ]] || { echo "the node is not idle ($state)" >&2; exit 1; }
say "one node up: $node"

# A tiny suite: 2 tasks x 2 variants x 2 seeds = 8 cells, in 3 shards.
cp tests/fixtures/tiny_suite.toml "$work/tiny.toml"
"$POSLAB" compare "$work/tiny.toml" --out "$work/whole" --quiet --jobs 1 >/dev/null 2>&1

# Shard 1 cannot start: its folder holds a file poslab did not write.
runs="$work/runs"
mkdir -p "$runs/shard-1"
echo "not poslab's" >"$runs/shard-1/report.md"

wait_idle() {
    for _ in $(seq 600); do
        [[ -z "$(squeue -h 2>/dev/null)" ]] && return 0
        sleep 0.5
    done
    echo "jobs still queued after 5 minutes:" >&2
    squeue >&2
    return 1
}
# JobState of job $1 from the job-completion log.
job_state() {
    grep -E "JobId=$1 " "$work/log/jobcomp.txt" | tail -1 | sed -E 's/.*JobState=([A-Z_]+).*/\1/'
}

cd /tmp # paths are made absolute at submit: the jobs run from anywhere
out=$(RUNS=$runs SHARDS=3 CONFIG=$work/tiny.toml POSLAB=$POSLAB CPUS=1 MEM=500M TIME=10:00 \
    bash "$repo/examples/cluster/length_suite.sbatch" submit)
echo "$out"
array=$(echo "$out" | sed -E 's/.* as job ([0-9]+),.*/\1/')
merge=$(echo "$out" | sed -E 's/.*merge as job ([0-9]+) .*/\1/')
wait_idle
sleep 1
for k in 0 1 2; do
    say "shard $k: $(grep -E "ArrayJobId=$array ArrayTaskId=$k " "$work/log/jobcomp.txt" \
        | grep -o 'JobState=[A-Z_]*' | tail -1)"
done
[[ -f "$runs/shard-0/results.json" && -f "$runs/shard-2/results.json" ]] \
    || { echo "shards 0 and 2 did not finish" >&2; exit 1; }
[[ ! -f "$runs/shard-1/results.json" ]] || { echo "shard 1 should have failed" >&2; exit 1; }
grep -q "which no poslab run recorded writing there" "$runs/logs/shard-1.out" \
    || { echo "shard 1's log does not say why it failed" >&2; exit 1; }
merge_state=$(scontrol show job "$merge" 2>/dev/null | grep -o 'JobState=[A-Z_]*' || true)
merge_state=${merge_state:-$(job_state "$merge")}
say "first merge: ${merge_state:-gone} (its dependency failed)"
[[ "$merge_state" != *PENDING* ]] || { echo "the merge is left pending" >&2; exit 1; }
[[ ! -d "$runs/merged" ]] || { echo "a merge ran without shard 1" >&2; exit 1; }

status=$(RUNS=$runs bash "$repo/examples/cluster/length_suite.sbatch" status)
echo "$status"
grep -q "^shard 1/3: " <<<"$status" && grep -q "not done: 1 " <<<"$status" \
    || { echo "status does not name shard 1" >&2; exit 1; }
# A merge by hand now fails, naming the shard.
if RUNS=$runs bash "$repo/examples/cluster/length_suite.sbatch" merge 2>"$work/merge.err"; then
    echo "a merge without shard 1 succeeded" >&2
    exit 1
fi
grep -q "shard 1 (.*/shard-1)" "$work/merge.err" || { cat "$work/merge.err" >&2; exit 1; }
say "merge without shard 1 refused: $(tail -1 "$work/merge.err")"

# The cause removed, shard 1 again, then the merge.
rm "$runs/shard-1/report.md"
RUNS=$runs bash "$repo/examples/cluster/length_suite.sbatch" rerun 1
wait_idle
sleep 1
[[ -f "$runs/merged/results.json" ]] || { echo "the merge after the re-run did not finish" >&2; exit 1; }
grep -q -- "--shard 1/3" "$runs/logs/shard-1.out" \
    || grep -q "shard 1/3" "$runs/logs/shard-1.out" \
    || { echo "the re-run did not run shard 1/3" >&2; exit 1; }
cmp "$work/whole/results.json" "$runs/merged/results.json" \
    || { echo "the merged results differ from the unsharded run" >&2; exit 1; }
say "re-run shard 1/3, merged: results.json equals the unsharded run's, byte for byte"

# Preemption: a shard requeued while it runs (scontrol requeue kills it and queues it again)
# continues from the cells it had finished, and ends as an uninterrupted run.
sed -e 's/steps = 4 }/steps = 1500 }/' -e 's/eval_every = 4$/eval_every = 1500/' \
    -e 's/name = "tiny_suite"/name = "requeue_suite"/' "$work/tiny.toml" >"$work/long.toml"
grep -q "steps = 1500" "$work/long.toml" || { echo "the long config was not made" >&2; exit 1; }
"$POSLAB" compare "$work/long.toml" --out "$work/whole-long" --quiet --jobs 1 >/dev/null 2>&1
requeue="$work/requeue"
out=$(RUNS=$requeue SHARDS=1 CONFIG=$work/long.toml POSLAB=$POSLAB CPUS=1 MEM=500M TIME=10:00 \
    bash "$repo/examples/cluster/length_suite.sbatch" submit)
array=$(echo "$out" | sed -E 's/.* as job ([0-9]+),.*/\1/')
for _ in $(seq 600); do
    done_cells=$( (find "$requeue/shard-0/cells" -name 'seed*.json' 2>/dev/null || true) | wc -l)
    ((done_cells >= 2)) && break
    sleep 0.2
done
((done_cells >= 2 && done_cells < 8)) || { echo "no running shard to requeue ($done_cells cells)" >&2; exit 1; }
scontrol requeue "${array}_0"
# Slurm holds a requeued job back for a while (its BeginTime); start it now.
sleep 1
scontrol update JobId="${array}_0" StartTime=now 2>/dev/null || true
say "requeued the running shard with $done_cells of 8 cells done"
wait_idle
sleep 1
grep -q "resuming $requeue/shard-0: [2-7] of 8 cells were done before" "$requeue/logs/shard-0.out" \
    || { echo "the requeued shard did not continue its cells" >&2; exit 1; }
cmp "$work/whole-long/results.json" "$requeue/merged/results.json" \
    || { echo "the requeued shard's results differ from the unsharded run" >&2; exit 1; }
say "$(grep -m1 resuming "$requeue/logs/shard-0.out")"
say "requeued shard merged: results.json equals the unsharded run's, byte for byte"
say "passed"
