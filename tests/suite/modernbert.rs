//! ModernBERT through `--model`: the tiny ModernBERT of `tests/fixtures/pretrained/` (4 layers:
//! global, local, local, global; RoPE bases 160,000 and 10,000; windows of 6) against what
//! transformers 5.23 computed with it (`reference.safetensors`): the tokenizer's ids, every
//! layer's hidden states and the last (1e-5 at real tokens), the masked-LM logits (1e-4); both
//! config forms; and loaders that ignore the window or the per-layer base missing them.

use std::path::{Path, PathBuf};

use candle::{DType, Device, IndexOp, Tensor};
use poslab::pretrained::{Folder, Pretrained};

use crate::common::{fixture_path, load_fixture, max_abs_diff, max_abs_diff_real};

fn folder() -> PathBuf {
    fixture_path("pretrained/tiny-modernbert")
}

fn texts(dir: &Path) -> Vec<String> {
    let meta = poslab::params::read_metadata(dir.join("reference.safetensors")).unwrap();
    serde_json::from_str(&meta["texts"]).unwrap()
}

/// The worst difference at real tokens of every layer's hidden states, the last hidden state
/// and the logits, asserting each within its tolerance; `what` names the loader.
fn check(model: &Pretrained, what: &str) -> [f64; 3] {
    let reference = load_fixture("pretrained/tiny-modernbert/reference.safetensors");
    let batch = model.batch(&texts(&folder()), false).unwrap();
    let ids = batch
        .ids
        .to_dtype(DType::I64)
        .unwrap()
        .to_vec2::<i64>()
        .unwrap();
    assert_eq!(
        ids,
        reference["input_ids"].to_vec2::<i64>().unwrap(),
        "{what}: ids"
    );
    let hidden = model.hidden(&batch.ids, &batch.mask).unwrap();
    let mut states = model
        .encoder
        .hidden_states(&batch.ids, &batch.mask)
        .unwrap();
    // transformers 5 records ModernBERT's last entry after the final norm: the last hidden
    // state (the reference's `hidden_states_4` equals its `last_hidden_state` bit for bit).
    *states.last_mut().unwrap() = hidden.clone();
    let mut worst_layer = 0.0f64;
    for (i, h) in states.iter().enumerate() {
        let e = max_abs_diff_real(h, &reference[&format!("hidden_states_{i}")], &batch.mask);
        assert!(e <= 1e-5, "{what}: hidden_states_{i} off by {e:e}");
        worst_layer = worst_layer.max(e);
    }
    let last = max_abs_diff_real(&hidden, &reference["last_hidden_state"], &batch.mask);
    assert!(last <= 1e-5, "{what}: last_hidden_state off by {last:e}");
    let logits = model.mlm_logits(&hidden).unwrap();
    let e = max_abs_diff_real(&logits, &reference["mlm_logits"], &batch.mask);
    assert!(e <= 1e-4, "{what}: mlm_logits off by {e:e}");
    [worst_layer, last, e]
}

#[test]
fn tiny_modernbert_matches_transformers_layer_by_layer() {
    let model = Pretrained::load(&folder(), &Device::Cpu).unwrap();
    let [layers, last, logits] = check(&model, "config.json");
    eprintln!("tiny-modernbert: layers {layers:.1e}, last {last:.1e}, logits {logits:.1e}");
    // A text alone gives the states it has in the padded batch.
    let all = texts(&folder());
    let batch = model.batch(&all, false).unwrap();
    let hidden = model.hidden(&batch.ids, &batch.mask).unwrap();
    for (k, text) in all.iter().enumerate() {
        let alone = model.batch(std::slice::from_ref(text), false).unwrap();
        let h = model.hidden(&alone.ids, &alone.mask).unwrap();
        let n = alone.lengths[0];
        let e = max_abs_diff(&h.i((0, ..n)).unwrap(), &hidden.i((k, ..n)).unwrap());
        assert!(e <= 1e-5, "text {k} alone moved by {e:e}");
    }
}

/// A copy of the folder with `config_v4.json` (the Hub checkpoints' keys) as its config.
fn v4_copy() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for f in [
        "model.safetensors",
        "tokenizer.json",
        "reference.safetensors",
    ] {
        std::fs::copy(folder().join(f), dir.path().join(f)).unwrap();
    }
    std::fs::copy(
        folder().join("config_v4.json"),
        dir.path().join("config.json"),
    )
    .unwrap();
    dir
}

#[test]
fn the_hub_checkpoints_config_keys_give_the_same_model() {
    let v4 = v4_copy();
    let a = Folder::read(&folder()).unwrap();
    let b = Folder::read(v4.path()).unwrap();
    assert_eq!(a.config, b.config);
    let model = Pretrained::load(v4.path(), &Device::Cpu).unwrap();
    check(&model, "config_v4.json");
    let plan = a.config.layers.as_ref().unwrap();
    assert_eq!(plan.local_window, Some(6));
    let bases = plan.rope_base.unwrap();
    assert_eq!(
        (bases.global, bases.local),
        (Some(160_000.0), Some(10_000.0))
    );
}

#[test]
fn a_loader_without_the_window_or_the_per_layer_base_misses_transformers() {
    let reference = load_fixture("pretrained/tiny-modernbert/reference.safetensors");
    let folder_ = Folder::read(&folder()).unwrap();
    let run = |config: &poslab::ModelConfig| {
        let params = poslab::ParamStore::new(0);
        let encoder =
            poslab::Encoder::new(config, params.var_builder(DType::F32, &Device::Cpu)).unwrap();
        // The encoder's tensors (the masked-LM head's are not built here).
        let tensors: std::collections::HashMap<String, Tensor> = folder_
            .tensors
            .iter()
            .filter(|(name, _)| !name.starts_with("mlm."))
            .map(|(n, t)| (n.clone(), t.clone()))
            .collect();
        params.assign(&tensors, &folder_.weights).unwrap();
        let ids = reference["input_ids"].to_dtype(DType::U32).unwrap();
        let mask = reference["attention_mask"].clone();
        let h = encoder.forward_t(&ids, &mask, false).unwrap();
        max_abs_diff_real(&h, &reference["last_hidden_state"], &mask)
    };
    assert!(run(&folder_.config) <= 1e-5);
    let mut no_window = folder_.config.clone();
    let plan = no_window.layers.as_mut().unwrap();
    plan.pattern = vec![poslab::LayerKind::Global];
    plan.local_window = None;
    plan.rope_base = Some(poslab::RopeBases {
        global: Some(160_000.0),
        local: None,
    });
    let e = run(&no_window);
    assert!(
        e > 1e-3,
        "ignoring the window moved the states by {e:e} only"
    );
    let mut one_base = folder_.config.clone();
    one_base.layers.as_mut().unwrap().rope_base = Some(poslab::RopeBases {
        global: Some(10_000.0),
        local: Some(10_000.0),
    });
    let e = run(&one_base);
    assert!(
        e > 1e-5,
        "one base for every layer moved the states by {e:e} only"
    );
}

#[test]
fn modernbert_configs_poslab_cannot_run_are_refused_by_key() {
    let base: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(folder().join("config_v4.json")).unwrap())
            .unwrap();
    let cases: [(&str, serde_json::Value, &str); 5] = [
        (
            "local_attention",
            serde_json::json!(5),
            "local_attention = 5",
        ),
        (
            "local_attention",
            serde_json::json!(0),
            "local_attention = 0",
        ),
        ("mlp_bias", serde_json::json!(true), "mlp_bias = true"),
        (
            "hidden_activation",
            serde_json::json!("silu"),
            "hidden_activation = `silu`",
        ),
        (
            "rope_parameters",
            serde_json::json!({"sliding_attention": {"rope_theta": 10000.0, "rope_type": "yarn"}, "full_attention": {"rope_theta": 160000.0, "rope_type": "default"}}),
            "rope_type = `yarn`",
        ),
    ];
    for (key, value, needle) in cases {
        let dir = v4_copy();
        let mut config = base.clone();
        config[key] = value;
        std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
        let e = Folder::read(dir.path())
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains(needle), "{key}: {e}");
    }
}

#[test]
fn tiny_modernbert_loads_through_a_hub_cache_layout() {
    // models--org--name/snapshots/<rev>/ and refs/main, as hf-hub lays them out, offline.
    let cache = tempfile::tempdir().unwrap();
    let repo = cache.path().join("models--poslab--tiny-modernbert");
    let snapshot = repo.join("snapshots").join("0123456789abcdef");
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), "0123456789abcdef").unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(folder().join(f), snapshot.join(f)).unwrap();
    }
    let hub = poslab::text::HubSource {
        cache_dir: cache.path().to_path_buf(),
        offline: true,
    };
    let dir = poslab::pretrained::resolve("poslab/tiny-modernbert", &hub).unwrap();
    assert!(dir.starts_with(cache.path()));
    let model = Pretrained::load(&dir, &Device::Cpu).unwrap();
    check(&model, "the hub cache");
}

#[test]
fn analyze_model_draws_the_per_layer_energy_and_rotation_split() {
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().join("a");
    let run = std::process::Command::new(env!("CARGO_BIN_EXE_poslab"))
        .args([
            "analyze",
            "--model",
            folder().to_str().unwrap(),
            "--out",
            dir.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    for needle in [
        "layer 0 (global) q:",
        "layer 1 (local, keys within 3) k:",
        "layer 3 (global): rotation",
    ] {
        assert!(stdout.contains(needle), "{needle}: {stdout}");
    }
    for file in [
        "rope_energy_layer0.png",
        "rope_energy_layer3.png",
        "rope_energy.csv",
        "rotation_terms.csv",
        "rotation_terms.png",
    ] {
        assert!(dir.join(file).is_file(), "{file}");
    }
}
