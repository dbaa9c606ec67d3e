#!/usr/bin/env bash
# Issue 17's runs on a GPU machine (the device tool's `run`), from the repository root, with
# gpu/ carried (made here by scripts/gpu/prepare.sh). Each stage writes one file to $OUT (at
# most 8 files come back); GPU time is short, so give one call the stages that fit 10 minutes:
#
#   scripts/gpu/session.sh info tests compare       # GPU tests; compare f32 and bf16
#   scripts/gpu/session.sh bench-ref bench-large    # bench vs PyTorch, both shapes, f32 + bf16
#
# Stages:
#   info         nvidia-smi, torch, the libraries the binary resolves        -> info.txt
#   tests        tests/suite/cuda.rs: fixtures f32/bf16/f16, gradients vs the CPU, training
#                                                                             -> tests.txt
#   suite        every integration test with the cuda build (CLI defaults pick the GPU)
#                                                                             -> suite.txt
#   compare      `compare --device cuda` on the default config, f32 then bf16
#                                     -> compare-f32.tar.gz, compare-bf16.tar.gz (run folders)
#   bench-ref    bench at the reference shape, f32 and bf16, beside PyTorch  -> bench-ref.txt
#   bench-large  width 768, 12 heads, 12 layers, FFN 3072, batch 32 x 512    -> bench-large.txt
# ROUNDS (default 2) sets the interleaved poslab/PyTorch rounds; JOBS the compare's --jobs.
set -uo pipefail
OUT=${OUT:-/tmp/poslab-gpu-out}
mkdir -p "$OUT"
ROOT=$(pwd)
P=$ROOT/gpu/poslab
ROUNDS=${ROUNDS:-2}
# CUDA 13's cuBLAS, cuRAND, NVRTC and runtime from the wheels beside PyTorch; the driver's
# libcuda.so.1 from the system.
LIB=$(python3 -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu13", "lib"))')
export LD_LIBRARY_PATH=$LIB:${LD_LIBRARY_PATH:-}
# The test binary reads tests/fixtures under the folder it was built in: point that here.
BUILT=$(cat "$ROOT/gpu/manifest-dir")
if [ ! -e "$BUILT" ]; then mkdir -p "$(dirname "$BUILT")" && ln -s "$ROOT" "$BUILT"; fi

# The binaries travel compressed (scripts/gpu/prepare.sh): unpack them once.
for bin in poslab suite; do
  if [ ! -x "gpu/$bin" ]; then
    python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
      "gpu/$bin.xz" "gpu/$bin" && chmod +x "gpu/$bin" || { echo "cannot unpack gpu/$bin.xz"; exit 1; }
  fi
done

stamp() { echo "== $* ($(date +%T))"; }
bench() { # bench FILE [bench args...]: f32 then bf16, the same shape, beside PyTorch
  local file=$1; shift
  for dtype in f32 bf16; do
    stamp "bench $* --dtype $dtype"
    "$P" bench --device cuda --dtype "$dtype" --rounds "$ROUNDS" \
      --torch --python python3 "$@"
    stamp "bench, every poslab variant, $* --dtype $dtype"
    "$P" bench --device cuda --dtype "$dtype" "$@"
  done 2>&1 | tee -a "$OUT/$file"
}

for stage in "$@"; do
  case $stage in
    info)
      { stamp info; cat gpu/commit; nvidia-smi
        python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))'
        ldd "$P" | grep -E 'cuda|cublas|curand|nvrtc|not found'
        "$P" --version; } 2>&1 | tee "$OUT/info.txt" ;;
    tests)
      { stamp tests; time gpu/suite cuda:: --test-threads=1 --nocapture; } 2>&1 | tee "$OUT/tests.txt" ;;
    suite)
      { stamp suite; time gpu/suite; } 2>&1 | tee "$OUT/suite.txt" ;;
    compare)
      for dtype in f32 bf16; do
        stamp "compare $dtype"
        ( time "$P" compare --device cuda --dtype "$dtype" --quiet ${JOBS:+--jobs $JOBS} \
            --out "/tmp/compare-$dtype" --overwrite ) 2>&1 | tail -40
        tar -czf "$OUT/compare-$dtype.tar.gz" -C /tmp "compare-$dtype"
      done ;;
    bench-ref)
      bench bench-ref.txt ;;
    bench-large)
      bench bench-large.txt --d-model 768 --heads 12 --layers 12 --ffn 3072 --batch 32 --seq 512 \
        --warmup 2 --forward-reps 5 --train-reps 5 ;;
    *) echo "unknown stage $stage (info tests suite compare bench-ref bench-large)"; exit 2 ;;
  esac
done
