#!/usr/bin/env bash
# Builds poslab's `cuda` feature here (no GPU needed) and stages what a GPU machine needs in
# gpu/ (ignored by git), for scripts/gpu/session.sh there. Issue 17; see the book's "CUDA and mixed precision" (book/src/guide/cuda.md).
#
#   scripts/gpu/prepare.sh            # about 21 min the first time (nvcc compiles candle's
#                                     # kernels into target-cuda/), a few minutes after that
#   BASES="d406ad5 f32d7f8" scripts/gpu/prepare.sh
#                                     # also poslab at each of those commits, as
#                                     # gpu/poslab-<commit>.xz (about 3 min and 10 MiB each), for
#                                     # session.sh's `ab` stages: before and after, side by side
#                                     # on one GPU
#
# It builds a snapshot of HEAD (git archive) so that editing the working tree meanwhile cannot
# race the build; commit first. Stages: gpu/poslab.xz, gpu/suite.xz (the integration-test
# binary), both stripped and compressed (the PyTorch model `bench --torch` runs is built into
# poslab); gpu/manifest-dir (the snapshot's path, which the test binary has compiled in, for its
# fixtures). Then carry `gpu` in the device tool's run.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SHARED=${POSLAB_SHARED:-$ROOT/../shared}
SRC=/tmp/poslab-cuda-src
rm -rf "$SRC" && mkdir -p "$SRC"
git -C "$ROOT" archive HEAD | tar -x -C "$SRC"
# git archive dates every file at its commit; cargo, which shares one build of poslab between
# snapshot folders, would take an older commit's files for fresh against a newer build. Date
# them now, so that each snapshot compiles.
find "$SRC" -type f -exec touch {} +
CARGO_TARGET_DIR=$ROOT/target-cuda "$SHARED/cuda/build-cuda.sh" "$SRC" --bins --tests
# The device path's kernels compile with NVRTC here (no GPU needed): a kernel that does not
# compile fails now, not on the GPU's time. The test binary links libcuda, which the build
# stubs (the stub answers no call: the GPU tests then skip).
WHEELS=${CUDA_WHEELS:-$HOME/.cache/poslab-cuda13}/nvidia/cu13/lib
ln -sf libcuda.so "$WHEELS/stubs/libcuda.so.1"
SUITE_BUILT=$(ls -t "$ROOT"/target-cuda/release/deps/suite-* | grep -v '\.d$' | head -1)
LD_LIBRARY_PATH=$WHEELS:$WHEELS/stubs "$SUITE_BUILT" cuda::device_path_kernels_compile_with_nvrtc
OUT=$ROOT/gpu
rm -rf "$OUT" && mkdir -p "$OUT"
cp "$ROOT/target-cuda/release/poslab" "$OUT/poslab"
# The newest integration-test executable (cargo names it suite-<hash>).
SUITE=$(ls -t "$ROOT"/target-cuda/release/deps/suite-* | grep -v '\.d$' | head -1)
cp "$SUITE" "$OUT/suite"
strip "$OUT/poslab" "$OUT/suite"
STAGED=$(sha256sum < "$OUT/poslab" | cut -c1-64)
# About 66 MiB each stripped (candle's kernels are in them), 10 MiB each in xz: the device tool
# carries 64 MiB with the tree. session.sh unpacks them (Python's lzma, no xz needed there).
xz -9 -T2 "$OUT/poslab" "$OUT/suite"
echo "$SRC" > "$OUT/manifest-dir"
git -C "$ROOT" rev-parse HEAD > "$OUT/commit"
# Earlier commits' poslab, each from its own snapshot folder, built in target-cuda/ (sharing
# the dependencies' build, candle's kernels). Each build leaves its binary in release/: copy it
# now, and check that it differs from the others staged.
for base in ${BASES:-}; do
  short=$(git -C "$ROOT" rev-parse --short=7 "$base^{commit}")
  BSRC=/tmp/poslab-cuda-base-$short
  rm -rf "$BSRC" && mkdir -p "$BSRC"
  git -C "$ROOT" archive "$short" | tar -x -C "$BSRC"
  find "$BSRC" -type f -exec touch {} +
  CARGO_TARGET_DIR=$ROOT/target-cuda "$SHARED/cuda/build-cuda.sh" "$BSRC" --bin poslab
  cp "$ROOT/target-cuda/release/poslab" "$OUT/poslab-$short"
  strip "$OUT/poslab-$short"
  sum=$(sha256sum < "$OUT/poslab-$short" | cut -c1-64)
  if grep -q "$sum" <<< "$STAGED"; then
    echo "error: poslab at $short is the same binary as one staged before: a build was skipped" >&2
    exit 1
  fi
  STAGED="$STAGED $sum"
  xz -9 -T2 "$OUT/poslab-$short"
done
du -sh "$OUT"/*
total=$(du -sb "$OUT" | cut -f1)
if [ "$total" -gt $((48 * 1024 * 1024)) ]; then
  echo "warning: gpu/ holds $((total / 1024 / 1024)) MiB; the device tool carries 64 MiB with the tree"
fi
