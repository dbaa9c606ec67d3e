//! Weights saved as safetensors under readable names round-trip bit for bit; a file that does
//! not match the model, or is not a safetensors file at all, is refused with what is wrong.

use std::collections::HashMap;

use candle::{DType, Device};
use poslab::{Encoder, Error, ModelConfig, NormPlacement, ParamStore, PositionalConfig};

use crate::common::*;

fn build(config: &ModelConfig, seed: u64) -> (Encoder, ParamStore) {
    let store = ParamStore::new(seed);
    let encoder = Encoder::new(config, store.var_builder(DType::F32, &Device::Cpu)).unwrap();
    (encoder, store)
}

fn metadata(config: &ModelConfig) -> HashMap<String, String> {
    HashMap::from([("config".to_string(), config.to_json())])
}

#[test]
fn save_then_load_restores_weights_and_outputs_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    for positional in all_schemes() {
        let config = tiny_config(positional, NormPlacement::Pre);
        let (saved, saved_store) = build(&config, 1);
        let path = dir
            .path()
            .join(format!("{}.safetensors", config.positional.name()));
        saved_store.save(&path, metadata(&config)).unwrap();

        // A model with other initial weights takes the file's.
        let (loaded, loaded_store) = build(&config, 2);
        let meta = loaded_store.load(&path).unwrap();
        assert_eq!(ModelConfig::from_json_str(&meta["config"]).unwrap(), config);
        for (name, var) in saved_store.vars() {
            assert_eq!(
                bits(&var),
                bits(&loaded_store.get(&name).unwrap()),
                "{name}"
            );
        }
        let (ids, mask) = padded_batch(3, 11, 40);
        let a = saved.forward_t(&ids, &mask, false).unwrap();
        let b = loaded.forward_t(&ids, &mask, false).unwrap();
        assert_eq!(
            bits(&a),
            bits(&b),
            "{}: outputs differ after a round trip",
            config.positional.name()
        );
    }
}

#[test]
fn checkpoints_use_the_reference_names() {
    let config = tiny_config(
        PositionalConfig::Learned(Default::default()),
        NormPlacement::Pre,
    );
    let (_, store) = build(&config, 0);
    let names: Vec<String> = store.vars().into_iter().map(|(n, _)| n).collect();
    for expected in [
        "tok_emb.weight",
        "pos_emb.weight",
        "layers.0.attn.q.weight",
        "layers.0.attn.q.bias",
        "layers.0.attn.k.weight",
        "layers.1.attn.o.bias",
        "layers.0.attn_norm.weight",
        "layers.1.ffn.up.weight",
        "layers.1.ffn.down.bias",
        "layers.1.ffn_norm.bias",
        "final_norm.weight",
    ] {
        assert!(
            names.iter().any(|n| n == expected),
            "{expected} missing from {names:?}"
        );
    }
    // Every fixture's weights load by name (see reference.rs); here the count matches too.
    let fx = load_encoder_fixture("encoder_learned_pre.safetensors");
    assert_eq!(fx.weights.len(), names.len());
}

#[test]
fn a_checkpoint_of_another_model_is_refused_with_every_mismatch() {
    let dir = tempfile::tempdir().unwrap();
    let learned = tiny_config(
        PositionalConfig::Learned(Default::default()),
        NormPlacement::Pre,
    );
    let path = dir.path().join("learned.safetensors");
    let (_, store) = build(&learned, 0);
    store.save(&path, metadata(&learned)).unwrap();

    // Another scheme with another token width: one unexpected, one mis-shaped tensor.
    let concat = tiny_config(
        PositionalConfig::SinusoidalConcat(poslab::positional::ConcatOptions {
            pos_dim: 6,
            base: 10_000.0,
            layout: Default::default(),
            project: false,
        }),
        NormPlacement::Pre,
    );
    let (_, other) = build(&concat, 5);
    let before = bits(&other.get("tok_emb.weight").unwrap());
    let message = other.load(&path).unwrap_err().to_string();
    for needle in [
        "learned.safetensors",
        "tensor `tok_emb.weight` has shape [40, 16] in the file but the model expects [40, 10]",
        "unexpected tensor `pos_emb.weight` [32, 16]",
        "2 problems",
    ] {
        assert!(message.contains(needle), "{message}\nlacks: {needle}");
    }
    assert_eq!(
        before,
        bits(&other.get("tok_emb.weight").unwrap()),
        "a refused load changed weights"
    );

    // A post-norm model has no final_norm: the pre-norm model finds it missing.
    let post = tiny_config(
        PositionalConfig::Learned(Default::default()),
        NormPlacement::Post,
    );
    let post_path = dir.path().join("post.safetensors");
    build(&post, 0).1.save(&post_path, metadata(&post)).unwrap();
    let message = store.load(&post_path).unwrap_err().to_string();
    assert!(
        message.contains("missing tensor `final_norm.weight` (the model expects shape [16])"),
        "{message}"
    );
}

#[test]
fn corrupt_files_are_refused_and_never_half_loaded() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config(
        PositionalConfig::Rope(Default::default()),
        NormPlacement::Pre,
    );
    let (_, store) = build(&config, 0);
    let path = dir.path().join("model.safetensors");
    store.save(&path, metadata(&config)).unwrap();
    let bytes = std::fs::read(&path).unwrap();

    let (_, target) = build(&config, 9);
    let before: Vec<Vec<u32>> = target.vars().iter().map(|(_, v)| bits(v)).collect();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("truncated", bytes[..bytes.len() - 100].to_vec()),
        ("header only", bytes[..64].to_vec()),
        ("empty", Vec::new()),
        (
            "not safetensors",
            b"this is a text file, not weights".to_vec(),
        ),
    ];
    for (what, data) in cases {
        let bad = dir
            .path()
            .join(format!("{}.safetensors", what.replace(' ', "_")));
        std::fs::write(&bad, data).unwrap();
        let err = target.load(&bad).unwrap_err();
        assert!(matches!(err, Error::Checkpoint { .. }), "{what}: {err}");
        let message = err.to_string();
        assert!(
            message.contains("not a readable safetensors file"),
            "{what}: {message}"
        );
        let after: Vec<Vec<u32>> = target.vars().iter().map(|(_, v)| bits(v)).collect();
        assert_eq!(before, after, "{what}: weights changed");
    }
    let missing = target
        .load(dir.path().join("absent.safetensors"))
        .unwrap_err();
    assert!(
        matches!(missing, Error::Io { .. }) && missing.to_string().contains("absent.safetensors")
    );
}

#[test]
fn saving_over_a_checkpoint_replaces_it_whole() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config(
        PositionalConfig::None(Default::default()),
        NormPlacement::Post,
    );
    let path = dir.path().join("model.safetensors");
    let (_, first) = build(&config, 1);
    first.save(&path, metadata(&config)).unwrap();
    let (_, second) = build(&config, 2);
    second.save(&path, metadata(&config)).unwrap();
    let (_, check) = build(&config, 3);
    check.load(&path).unwrap();
    let name = "layers.0.attn.q.weight";
    assert_eq!(
        bits(&check.get(name).unwrap()),
        bits(&second.get(name).unwrap())
    );
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != "model.safetensors")
        .collect();
    assert!(leftovers.is_empty(), "temporary files left: {leftovers:?}");
}

#[test]
fn f32_checkpoints_load_into_f64_models() {
    // The fixtures are f32; the gradient checks run them in f64. Values convert exactly.
    let fx = load_encoder_fixture("encoder_rope_half_pre.safetensors");
    let (_, store) = fx.encoder(DType::F64);
    let name = "layers.1.attn.k.bias";
    let ours = store.get(name).unwrap().to_dtype(DType::F32).unwrap();
    assert_eq!(bits(&ours), bits(&fx.weights[name]));
}
