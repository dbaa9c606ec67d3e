#!/bin/sh
# A shard pod of the length suite's Kubernetes Job (shards.yaml): trains shard
# $JOB_COMPLETION_INDEX of $SHARDS into $RUNS/shard-K. A pod that is retried (a failure, an
# evicted node) continues from the cells the folder already holds; a folder of another
# experiment or another shard count is refused, so a reused volume never mixes two runs.
set -eu
: "${SHARDS:?SHARDS: the number of shards, the Job's completions}"
: "${JOB_COMPLETION_INDEX:?runs as a pod of an Indexed Job (JOB_COMPLETION_INDEX)}"
CONFIG=${CONFIG:-/poslab/configs/length_suite.toml}
RUNS=${RUNS:-/runs/length_suite}
POSLAB=${POSLAB:-poslab}
K=$JOB_COMPLETION_INDEX
if [ "$K" -ge "$SHARDS" ]; then
    echo "shard.sh: index $K is not a shard of $SHARDS: completions and SHARDS must be equal" >&2
    exit 1
fi
exec "$POSLAB" compare "$CONFIG" --shard "$K/$SHARDS" --out "$RUNS/shard-$K" \
    ${JOBS:+--jobs "$JOBS"}
