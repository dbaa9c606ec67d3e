//! The project's own seeded generator.
//!
//! candle cannot seed its CPU random generator, so every random number poslab uses (weight
//! initialisation, dropout masks, and later data order) comes from ChaCha8 streams derived here.
//! A stream is named: `stream(seed, "layers.0.attn.q.weight")` is the same sequence whatever else
//! was drawn before it, so two models that share a parameter name and shape under the same seed
//! start with the same values, whichever positional variant they use.

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// The generator type used throughout poslab.
pub type Rng = ChaCha8Rng;

/// FNV-1a, 64 bit: a fixed, platform-independent hash for stream names (std's hasher is not
/// guaranteed stable across Rust releases).
pub fn stable_hash(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The generator for `name` under `seed`: the seed picks the key, the name picks the stream.
pub fn stream(seed: u64, name: &str) -> Rng {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(stable_hash(name.as_bytes()));
    rng
}

/// Mixes a counter (a step, an epoch) into a seed, for per-step streams that can be recreated
/// after a resume without replaying earlier steps.
pub fn derive_seed(seed: u64, label: &str, counter: u64) -> u64 {
    let mut bytes = Vec::with_capacity(16 + label.len());
    bytes.extend_from_slice(&seed.to_le_bytes());
    bytes.extend_from_slice(label.as_bytes());
    bytes.extend_from_slice(&counter.to_le_bytes());
    stable_hash(&bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::Rng as _;

    #[test]
    fn fnv1a_matches_published_vectors() {
        // Test vectors from the FNV reference (http://www.isthe.com/chongo/tech/comp/fnv/).
        assert_eq!(stable_hash(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(stable_hash(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(stable_hash(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn named_streams_are_reproducible_and_distinct() {
        let a: Vec<u32> = stream(7, "x").random_iter().take(8).collect();
        let b: Vec<u32> = stream(7, "x").random_iter().take(8).collect();
        let c: Vec<u32> = stream(7, "y").random_iter().take(8).collect();
        let d: Vec<u32> = stream(8, "x").random_iter().take(8).collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_ne!(a, d);
        assert_ne!(derive_seed(1, "dropout", 0), derive_seed(1, "dropout", 1));
    }
}
