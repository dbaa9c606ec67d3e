#!/usr/bin/env bash
# The CPU time of two cold release builds, side by side: the whole lab (`poslab`, as
# `cargo install` builds it) and a program that depends on poslab-core alone (the encoder with
# its default feature, the kernels). Each in a fresh target folder; the registry's sources must
# be here already (`cargo fetch`). Prints user + system seconds of each, and their ratio.
#
#   scripts/build-time.sh          # about 15 minutes of wall time on 2 cores
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/core-user/src"
cat > "$WORK/core-user/Cargo.toml" <<TOML
[package]
name = "core-user"
version = "0.1.0"
edition = "2021"

[dependencies]
poslab-core = { path = "$ROOT/crates/poslab-core" }

[workspace]
TOML
cat > "$WORK/core-user/src/main.rs" <<'RS'
use poslab_core::candle::{Device, Tensor};
use poslab_core::{Encoder, ModelConfig};

fn main() -> poslab_core::Result<()> {
    let device = Device::Cpu;
    let config = ModelConfig::default().with_vocab_size(16);
    let (encoder, _) = Encoder::seeded(&config, 0, &device)?;
    let ids = Tensor::new(&[[1u32, 2, 3]], &device)?;
    let mask = Tensor::new(&[[1u32, 1, 1]], &device)?;
    println!("{:?}", encoder.forward_t(&ids, &mask, false)?.dims());
    Ok(())
}
RS
cp "$ROOT/Cargo.lock" "$WORK/core-user/Cargo.lock"
(
  cd "$WORK/core-user"
  /usr/bin/env time -f "%U %S %e" -o "$WORK/core.time" \
    cargo build --release --offline --target-dir "$WORK/t-core" > "$WORK/core.log" 2>&1
)
(
  cd "$ROOT"
  /usr/bin/env time -f "%U %S %e" -o "$WORK/lab.time" \
    cargo build --release --offline --locked -p poslab --bin poslab --target-dir "$WORK/t-lab" \
    > "$WORK/lab.log" 2>&1
)
read -r cu cs ce < "$WORK/core.time"
read -r lu ls le < "$WORK/lab.time"
python3 - "$cu" "$cs" "$ce" "$lu" "$ls" "$le" <<'PY'
import sys
cu, cs, ce, lu, ls, le = map(float, sys.argv[1:])
core, lab = cu + cs, lu + ls
print(f"poslab-core alone (with its kernels): {core:.0f} CPU-s ({ce:.0f} s wall)")
print(f"the whole poslab:                     {lab:.0f} CPU-s ({le:.0f} s wall)")
print(f"ratio: {core / lab:.2f}")
PY
