#!/usr/bin/env bash
# Issue 17's runs on a GPU machine (the device tool's `run`), from the repository root, with
# gpu/ carried (made here by scripts/gpu/prepare.sh). Each stage writes one file to $OUT (at
# most 8 files come back) and runs its commands under a time limit, so one call can be given
# the stages in order of need and still come back with what finished:
#
#   scripts/gpu/session.sh info tests bench-ref bench-large        # first call
#   scripts/gpu/session.sh compare variants kernels                # second, on the warm machine
#
# The first run (2026-11-26, H100, 15 minutes of device time) took: unpacking and info 5 s,
# tests 24 s, bench-ref about 70 s a dtype for one round, compare 4.3 s a cell (45 cells), the
# variants 30 s a dtype. Fire the second call as soon as the first returns: the machine stays
# warm 30 s. The second run (2026-11-26, evening, `ROUNDS=1`, `info tests bench-large kernels
# bench-ref` in one call of 437 s, the start 34 s): tests 23 s, bench-large 105 and 90 s
# (f32, bf16), kernels 80 s (its reference-kernel large run cut at 70 s), bench-ref 60 s a
# dtype; then `parts` (bf16) 20 s and `profile` 28 s a dtype.
#
# Stages:
#   info         nvidia-smi, torch, the libraries the binary resolves        -> info.txt
#   tests        tests/suite/cuda.rs: fixtures f32/bf16/f16, gradients vs the CPU, training
#                                                                             -> tests.txt
#   suite        every integration test with the cuda build (CLI defaults pick the GPU)
#                                                                             -> suite.txt
#   compare      `compare --device cuda` on the default config, f32 then bf16
#                                     -> compare-f32.tar.gz, compare-bf16.tar.gz (run folders)
#   bench-ref    bench at the reference shape beside PyTorch, f32 and bf16    -> bench-ref.txt
#   bench-large  width 768, 12 heads, 12 layers, FFN 3072, batch 32 x 512, the same
#                                                                             -> bench-large.txt
#   variants     every poslab variant at both shapes, f32 and bf16, one process per shape
#                                                                             -> variants.txt
#   kernels      --kernels reference against the default (one CUDA kernel per op), both shapes
#                                                                             -> kernels.txt
#   parts        the large shape's step in parts, sin_add, f32 and bf16       -> parts.txt
#   profile      ncu: each kernel's GPU time in one large-shape training step (batch 8), f32 and
#                bf16, summed by kernel name              -> profile-f32.csv, profile-bf16.csv
#   profile-torch  the same for PyTorch's step (benches/torch_at_shape.py)
#                                                   -> profile-torch-f32.csv, profile-torch-bf16.csv
#   launches     bench --launches (issue 46): device operations and peak memory of one training
#                step at the large shape, batch 2 and 32, f32 and bf16          -> launches.txt
#   small        the default compare's model: a step's wall time on the GPU and the CPU, and its
#                kernels' GPU time (ncu)                      -> small.txt, profile-small.csv
#   ab           earlier commits' poslab (prepare.sh's BASES) and this one's in turn: training at
#                the compare's and the reference shape                         -> ab.txt
#   ab-large     the same at the large shape (batch 32 x 512), f32 and bf16, sin_add
#                                                                            -> ab-large.txt
#   ab-compare   the default compare (f32) with each, timed; each one's results.json
#                                                         -> ab-compare.txt, ab-compare.tar.gz
#   shards       the default compare (f32) as 2, then 4 shard processes at once on the one GPU,
#                merged by `poslab report`: wall time, and the results against one process's
#                                                                               -> shards.txt
#
# Built since, not yet run on a GPU (2026-12-08, issue 75): the fused attention's CUDA kernels
# (gpu/flash/flash.cu, a second NVRTC program) and their test, `tests` runs
# cuda::gpu_fused_attention_matches_its_twin; a CUDA stream does not fuse until it passes (then
# answer true in CudaStream's `fuses_attention`, gpu/mod.rs's default, rebuild with prepare.sh,
# and run `launches bench-large`). Attention dropout on the device path is drawn from a seed
# (one `dropout_mask` kernel a layer on CUDA, where the host drew b h t^2 values and copied
# them): cuda::gpu_gradients_... compares it with the CPU drawing the same.
# Built before, not yet run on a GPU (2026-12-07, issue 75): the layers as one node on the device
# path (a stack of every layer packed in one variable; on the twin sin_add 540 -> 419 launches a
# step at the large shape, batch 2, and 140 -> 129 at the compare's), AdamW's lower bounds in
# its launch (KERPLE 1,018 -> 731), the fused attention on the twin only (its CUDA kernel is not
# written: layers take the softmax path on a GPU). The CUDA kernels changed: adamw's table is 7
# values a variable (the bound). Next: `info tests launches small compare shards` (the compare
# against 2 CPU cores, the target half), then `bench-large` with LARGE_ROUNDS=1.
# Built since, not yet run on a GPU (2026-11-29): the task head and its loss as one node on the
# device path (99 fewer launches a step at every shape, on the twin; the compare's step predicted
# 2.5 -> 1.6-1.9 ms), the GPU opened with cudarc's per-tensor events off (four driver calls
# a tensor; predicted 0.15-0.7 ms less a compare step), and the final LayerNorm as one node
# (26 fewer launches a step at every shape: 186 -> 160 at the compare's; the lookup's shape
# itself, 4 more: 156), and one product
# through cublasGemmEx rather than as a batch of one (cutlass's SIMT align1 kernels took 20 of
# the 56 ms of products in the last f32 profile; the batched call suspected). Next: here,
# `BASES="f32d7f8 4d0bdcd" scripts/gpu/prepare.sh` (before the events and the norm node; before
# one product going through cublasGemmEx), then on the GPU `info tests ab ab-compare shards`
# (about 6 minutes), then on the warm machine `ab-large bench-large` with LARGE_ROUNDS=1 and
# AB_ROUNDS=1 (about 4.5), then `profile-torch variants` if time is left. Two bases at most:
# the tree (12 MiB) and gpu/ must stay under the 64 MiB the device tool carries.
# Issue 46's second GPU session (2026-11-28, morning; 15 minutes of device time, two calls):
# `info tests variants small profile` in 106 s of command (T5 and FIRE near sin_add, measured),
# then at 1166cc4 `info tests small profile compare` plus the compare with JOBS=2 in 164 s;
# each call cost about 6 minutes of device time with its start and release. Next (at the head,
# with the token embedding's kernel and the softmax chosen by dtype, built but not yet run on
# a GPU): `info tests profile profile-torch bench-large` with LARGE_ROUNDS=1, then `variants
# compare` with COMPARE_DTYPES=f32 if time is left; about 8 minutes in all.
# Issue 46's first GPU session (2026-11-28, the device path): `info tests launches bench-large
# compare` with COMPARE_DTYPES=f32 in 324 s (the start about 30 s; tests 29 s, launches 20 s,
# bench-large 114 and 90 s, compare 59 s), then `bench-ref` with ROUNDS=1 and the compare with
# JOBS=4 in 234 s, then `variants` in 64 s. Next: `info tests variants small profile` (T5's and
# FIRE's biases from their offsets, predicted near sin_add; the small model's step; where the
# large step's backward loses to PyTorch's, the token embedding's index_add suspected), then
# `bench-large kernels` and `compare` in bf16 on the warm machine.
# Issue 46's first GPU session (the device path, each encoder layer on cuBLAS and poslab's NVRTC
# kernels, Kernels::Layer, the default on CUDA): `info tests bench-large launches`, then
# `kernels bench-ref compare` on the warm machine. `tests` runs the device path through every
# fixture and gradient check beside the Ops and Reference paths; `kernels` compares the three.
# Environment: ROUNDS (default 2) interleaved poslab/PyTorch rounds at the reference shape,
# LARGE_ROUNDS (default 1) at the large one; COMPARE_DTYPES, PARTS_DTYPES, PROFILE_DTYPES (default
# "f32 bf16") the dtypes of those stages; JOBS the compare's --jobs (default 1: on an H100 four
# jobs on the one GPU were 2.5x slower in all than one, 2026-11-26); LIMIT_<STAGE>
# (seconds) caps each command of a stage (defaults below); a command cut off says so.
set -uo pipefail
OUT=${OUT:-/tmp/poslab-gpu-out}
mkdir -p "$OUT"
ROOT=$(pwd)
P=$ROOT/gpu/poslab
ROUNDS=${ROUNDS:-2}
LARGE_ROUNDS=${LARGE_ROUNDS:-1}
JOBS=${JOBS:-1}
# CUDA 13's cuBLAS, cuRAND, NVRTC and runtime from the wheels beside PyTorch; the driver's
# libcuda.so.1 from the system.
LIB=$(python3 -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu13", "lib"))')
export LD_LIBRARY_PATH=$LIB:${LD_LIBRARY_PATH:-}
# The test binary reads tests/fixtures under the folder it was built in: point that here.
BUILT=$(cat "$ROOT/gpu/manifest-dir")
if [ ! -e "$BUILT" ]; then mkdir -p "$(dirname "$BUILT")" && ln -s "$ROOT" "$BUILT"; fi

# The binaries travel compressed (scripts/gpu/prepare.sh): unpack them once. poslab-<commit>
# are earlier commits' (prepare.sh's BASES), for the `ab` stages.
BASES=()
for xz in gpu/poslab-*.xz; do
  [ -e "$xz" ] && BASES+=("$(basename "$xz" .xz)")
done
for bin in poslab suite "${BASES[@]}"; do
  if [ ! -x "gpu/$bin" ]; then
    python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
      "gpu/$bin.xz" "gpu/$bin" && chmod +x "gpu/$bin" || { echo "cannot unpack gpu/$bin.xz"; exit 1; }
  fi
done

stamp() { echo "== $* ($(date +%T))"; }
# limited SECONDS CMD...: runs CMD, killed (with its children) after SECONDS; says so.
limited() {
  local s=$1; shift
  timeout -k 5 "$s" "$@"
  local rc=$?
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then echo "!! cut off after ${s}s: $*"; fi
  return $rc
}
LARGE=(--d-model 768 --heads 12 --layers 12 --ffn 3072 --batch 32 --seq 512)
# The default compare's model: width 64, 4 heads, 2 layers, FFN 128, batch 32 x 16.
SMALL=(--d-model 64 --heads 4 --layers 2 --ffn 128 --batch 32 --seq 16 --vocab 64)
torch_bench() { # torch_bench FILE LIMIT ROUNDS [bench args...]: f32 then bf16, beside PyTorch
  local file=$1 limit=$2 rounds=$3; shift 3
  for dtype in f32 bf16; do
    stamp "bench $* --dtype $dtype --rounds $rounds --torch"
    limited "$limit" "$P" bench --device cuda --dtype "$dtype" --rounds "$rounds" \
      --torch --python python3 "$@"
  done 2>&1 | tee -a "$OUT/$file"
}

for stage in "$@"; do
  case $stage in
    info)
      { stamp info; cat gpu/commit; nvidia-smi
        python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))'
        ldd "$P" | grep -E 'cuda|cublas|curand|nvrtc|not found'
        "$P" --version; } 2>&1 | tee "$OUT/info.txt" ;;
    tests)
      { stamp tests; time limited "${LIMIT_TESTS:-240}" gpu/suite cuda:: --test-threads=1 --nocapture; } \
        2>&1 | tee "$OUT/tests.txt" ;;
    suite)
      { stamp suite; time limited "${LIMIT_SUITE:-600}" gpu/suite; } 2>&1 | tee "$OUT/suite.txt" ;;
    compare)
      for dtype in ${COMPARE_DTYPES:-f32 bf16}; do
        stamp "compare $dtype --jobs $JOBS"
        ( time limited "${LIMIT_COMPARE:-300}" "$P" compare --device cuda --dtype "$dtype" --quiet \
            --jobs "$JOBS" --out "/tmp/compare-$dtype" --overwrite ) 2>&1 | tail -40
        tar -czf "$OUT/compare-$dtype.tar.gz" -C /tmp "compare-$dtype"
      done ;;
    bench-ref)
      torch_bench bench-ref.txt "${LIMIT_BENCH_REF:-120}" "$ROUNDS" ;;
    bench-large)
      torch_bench bench-large.txt "${LIMIT_BENCH_LARGE:-150}" "$LARGE_ROUNDS" "${LARGE[@]}" \
        --warmup 2 --forward-reps 5 --train-reps 5 ;;
    variants)
      for dtype in f32 bf16; do
        stamp "bench, every variant, reference shape, --dtype $dtype"
        limited "${LIMIT_VARIANTS:-60}" "$P" bench --device cuda --dtype "$dtype" --in-process
        stamp "bench, every variant, large shape, --dtype $dtype"
        limited "${LIMIT_VARIANTS:-60}" "$P" bench --device cuda --dtype "$dtype" --in-process \
          "${LARGE[@]}" --warmup 1 --forward-reps 3 --train-reps 3
      done 2>&1 | tee -a "$OUT/variants.txt" ;;
    kernels)
      for shape in ref large; do
        args=(); [ $shape = large ] && args=("${LARGE[@]}" --warmup 1 --forward-reps 3 --train-reps 3)
        for kernels in reference ops layer; do
          stamp "bench --kernels $kernels, $shape shape, sin_add and rope"
          limited "${LIMIT_KERNELS:-45}" "$P" bench --device cuda --kernels "$kernels" \
            --variants sin_add,rope --in-process "${args[@]}"
        done
      done 2>&1 | tee -a "$OUT/kernels.txt" ;;
    parts)
      # The large shape's step in parts (forward with the loss / backward / optimizer), sin_add.
      for dtype in ${PARTS_DTYPES:-f32 bf16}; do
        stamp "bench parts, large shape, sin_add, --dtype $dtype"
        limited "${LIMIT_PARTS:-45}" "$P" bench --device cuda --dtype "$dtype" --variants sin_add \
          --in-process "${LARGE[@]}" --warmup 1 --forward-reps 3 --train-reps 3
      done 2>&1 | tee -a "$OUT/parts.txt" ;;
    profile)
      # Nsight Compute: every kernel's GPU time in one training step at the large shape with
      # batch 8 (the other dimensions as bench-large), summed by kernel name (per-kernel summary).
      NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      for dtype in ${PROFILE_DTYPES:-f32 bf16}; do
        stamp "ncu, one training step, large shape at batch 8, sin_add, --dtype $dtype" | tee -a "$OUT/profile.txt"
        limited "${LIMIT_PROFILE:-120}" "$NCU" --metrics gpu__time_duration.sum --clock-control none \
          --cache-control none --print-summary per-kernel --csv \
          "$P" bench --device cuda --dtype "$dtype" --variants sin_add --in-process \
          "${LARGE[@]:0:8}" --batch 8 --seq 512 --warmup 0 --forward-reps 0 --train-reps 1 \
          > "$OUT/profile-$dtype.csv" 2>&1
        tail -5 "$OUT/profile-$dtype.csv"
      done 2>&1 | tee -a "$OUT/profile.txt" ;;
    profile-torch)
      # PyTorch's side of `profile`: the same step (sin_add, large shape at batch 8, one training
      # step and no forward-only pass) of benches/torch_at_shape.py, every kernel's GPU time.
      NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      for dtype in ${PROFILE_DTYPES:-f32 bf16}; do
        stamp "ncu, PyTorch, one training step, large shape at batch 8, sin_add, --dtype $dtype" | tee -a "$OUT/profile.txt"
        limited "${LIMIT_PROFILE:-120}" "$NCU" --metrics gpu__time_duration.sum --clock-control none \
          --cache-control none --print-summary per-kernel --csv \
          python3 benches/torch_at_shape.py sin_add --device cuda --dtype "$dtype" --vocab 8192 \
          --d-model 768 --heads 12 --layers 12 --ffn 3072 --batch 8 --seq 512 --warm 0 \
          --fwd-iters 0 --train-iters 1 > "$OUT/profile-torch-$dtype.csv" 2>&1
        tail -5 "$OUT/profile-torch-$dtype.csv"
      done 2>&1 | tee -a "$OUT/profile.txt" ;;
    launches)
      # Issue 46: what one training step asks of the GPU through the device path (kernel
      # launches, cuBLAS calls, copies; an upper bound of candle's) and its peak pool memory,
      # at the large shape with batch 2 (the CPU twin's figures are for the same shape) and 32,
      # f32 and bf16.
      for dtype in f32 bf16; do
        for b in 2 32; do
          stamp "bench --launches, large shape at batch $b, --dtype $dtype"
          limited "${LIMIT_LAUNCHES:-60}" "$P" bench --device cuda --dtype "$dtype" --launches \
            --variants sin_add,rope,alibi,fox "${LARGE[@]:0:8}" --batch "$b" --seq 512
        done
      done 2>&1 | tee -a "$OUT/launches.txt" ;;
    small)
      # Issue 46, item 6: the default compare's model (width 64, 4 heads, 2 layers, FFN 128,
      # batch 32 x 16): a training step's wall time on the GPU and on this machine's CPU cores,
      # then the GPU time of its kernels (ncu, one step, summed by kernel). A step whose kernels
      # take far less than its wall time is bound by the host: launches and candle's per-op cost.
      NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      { for device in cuda cpu; do
          stamp "bench, the default compare's shape, --device $device"
          limited "${LIMIT_SMALL:-60}" "$P" bench --device "$device" --in-process \
            --variants sin_add,rope "${SMALL[@]}" --warmup 20 --forward-reps 50 --train-reps 200
        done
        stamp "ncu, one training step at the default compare's shape, sin_add"
        limited "${LIMIT_SMALL:-60}" "$NCU" --metrics gpu__time_duration.sum --clock-control none \
          --cache-control none --print-summary per-kernel --csv \
          "$P" bench --device cuda --variants sin_add --in-process "${SMALL[@]}" \
          --warmup 0 --forward-reps 0 --train-reps 1 > "$OUT/profile-small.csv" 2>&1
        tail -3 "$OUT/profile-small.csv"; } 2>&1 | tee -a "$OUT/small.txt" ;;
    ab)
      # Before and after, side by side on one GPU: the earlier commits' poslab (prepare.sh's
      # BASES) and this commit's, in turn, AB_ROUNDS times (default 2), training at the default
      # compare's shape (bound by the host) and at the reference shape, sin_add and rope.
      [ ${#BASES[@]} -gt 0 ] || echo "no earlier poslab in gpu/: run prepare.sh with BASES"
      for r in $(seq "${AB_ROUNDS:-2}"); do
        for bin in "${BASES[@]}" poslab; do
          stamp "ab round $r: $bin ($( [ "$bin" = poslab ] && cat gpu/commit || echo base)), the compare's shape"
          limited "${LIMIT_AB:-60}" "gpu/$bin" bench --device cuda --in-process \
            --variants sin_add,rope "${SMALL[@]}" --warmup 20 --forward-reps 20 --train-reps 200
          stamp "ab round $r: $bin, the reference shape"
          limited "${LIMIT_AB:-60}" "gpu/$bin" bench --device cuda --in-process \
            --variants sin_add,rope --warmup 2 --forward-reps 5 --train-reps 10
        done
      done 2>&1 | tee -a "$OUT/ab.txt" ;;
    ab-large)
      # The earlier commits' poslab and this one's in turn at the large shape (batch 32 x 512),
      # training, f32 then bf16, sin_add, AB_ROUNDS times (default 2): where cuBLAS's choice of
      # kernels shows.
      for r in $(seq "${AB_ROUNDS:-2}"); do
        for dtype in f32 bf16; do
          for bin in "${BASES[@]}" poslab; do
            stamp "ab-large round $r: $bin, --dtype $dtype"
            limited "${LIMIT_AB:-60}" "gpu/$bin" bench --device cuda --dtype "$dtype" \
              --in-process --variants sin_add "${LARGE[@]}" --warmup 1 --forward-reps 2 \
              --train-reps 4
          done
        done
      done 2>&1 | tee -a "$OUT/ab-large.txt" ;;
    ab-compare)
      # The default compare (f32, one job) with each earlier poslab and this commit's, in turn:
      # the whole run's wall time, its results kept to check they agree.
      for bin in "${BASES[@]}" poslab; do
        stamp "ab-compare: $bin, compare --device cuda --dtype f32"
        ( time limited "${LIMIT_COMPARE:-300}" "gpu/$bin" compare --device cuda --dtype f32 \
            --quiet --out "/tmp/ab-compare-$bin" --overwrite ) 2>&1 | tail -4
        mkdir -p /tmp/ab-results && cp "/tmp/ab-compare-$bin/results.json" \
          "/tmp/ab-results/$bin-results.json" 2>/dev/null
      done 2>&1 | tee -a "$OUT/ab-compare.txt"
      tar -czf "$OUT/ab-compare.tar.gz" -C /tmp ab-results ;;
    shards)
      # Issue 46, item 6: many cells at once on one GPU as processes. The default compare (f32)
      # split into N shards (SHARDS, default "2 4"), the N processes at once on the one GPU,
      # then merged by `poslab report`: the wall time of all N, against one process (`compare`
      # or `ab-compare`), and whether the merged results.json equals one process's.
      for n in ${SHARDS:-2 4}; do
        dir=/tmp/shards-$n
        rm -rf "$dir" && mkdir -p "$dir"
        stamp "shards: the default compare as $n processes at once on one GPU"
        start=$(date +%s.%N)
        for k in $(seq 0 $((n - 1))); do
          limited "${LIMIT_COMPARE:-300}" "$P" compare --device cuda --dtype f32 --quiet \
            --shard "$k/$n" --out "$dir/part$k" > "$dir/log$k.txt" 2>&1 &
        done
        wait
        echo "all $n shards: $(python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$start" "$(date +%s.%N)") s of wall time"
        tail -n 2 "$dir"/log*.txt
        "$P" report "$dir"/part* --out "$dir/merged" > "$dir/report.txt" 2>&1; tail -n 3 "$dir/report.txt"
        for one in /tmp/compare-f32 /tmp/ab-compare-poslab; do
          [ -e "$one/results.json" ] && { cmp -s "$one/results.json" "$dir/merged/results.json" \
            && echo "merged results.json equals $one's" || echo "merged results.json differs from $one's"; }
        done
      done 2>&1 | tee -a "$OUT/shards.txt" ;;
    *) echo "unknown stage $stage (info tests suite compare bench-ref bench-large variants kernels parts profile profile-torch launches small ab ab-large ab-compare shards)"; exit 2 ;;
  esac
done
