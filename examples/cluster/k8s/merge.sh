#!/bin/sh
# The merge pod of the length suite (merge.yaml): waits until every shard 0..SHARDS-1 has
# finished (its results.json), at most MERGE_WAIT seconds, then merges them into $RUNS/merged.
# With ALLOW_PARTIAL=1 it merges what there is once the wait is over (the report then says
# "partial: N of M cells"; poslab's exit status 3 counts as done).
# It is the only pod that merges (a Job of one pod; `poslab report` also locks the folder),
# it reads exactly SHARDS shard folders whatever else the volume holds, and --overwrite
# replaces only a merge of this same experiment (the config's SHA-256 is in run.json).
set -eu
: "${SHARDS:?SHARDS: the number of shards, the shard Job's completions}"
CONFIG=${CONFIG:-/poslab/configs/length_suite.toml}
RUNS=${RUNS:-/runs/length_suite}
POSLAB=${POSLAB:-poslab}
MERGE_WAIT=${MERGE_WAIT:-172800}
POLL=${POLL:-60}
waited=0
while :; do
    missing=""
    k=0
    while [ "$k" -lt "$SHARDS" ]; do
        [ -f "$RUNS/shard-$k/results.json" ] || missing="$missing $k"
        k=$((k + 1))
    done
    [ -n "$missing" ] || break
    if [ "$waited" -ge "$MERGE_WAIT" ]; then
        [ -n "${ALLOW_PARTIAL:-}" ] && break
        echo "merge.sh: after ${waited}s, shard(s)$missing of $SHARDS have not finished in $RUNS;" \
            "see the failed indexes with: kubectl get job poslab-length-suite -o" \
            "jsonpath='{.status.failedIndexes}'; or merge what there is with ALLOW_PARTIAL=1" >&2
        exit 1
    fi
    sleep "$POLL"
    waited=$((waited + POLL))
done
shards=""
k=0
while [ "$k" -lt "$SHARDS" ]; do
    # A partial merge takes the shards that started (an unfinished one gives its cells).
    if [ -z "${ALLOW_PARTIAL:-}" ] || [ -f "$RUNS/shard-$k/run.json" ]; then
        shards="$shards $RUNS/shard-$k"
    fi
    k=$((k + 1))
done
if [ -z "${ALLOW_PARTIAL:-}" ]; then
    # shellcheck disable=SC2086
    exec "$POSLAB" report $shards --out "$RUNS/merged" --overwrite
fi
status=0
# shellcheck disable=SC2086
"$POSLAB" report $shards --out "$RUNS/merged" --overwrite --allow-partial || status=$?
if [ "$status" -eq 3 ]; then
    echo "merge.sh: a partial merge, as asked (ALLOW_PARTIAL=1)" >&2
    status=0
fi
exit "$status"
