//! Pretrained BERT-family encoders against transformers: the tiny BERT and RoBERTa folders of
//! `tests/fixtures/pretrained/` (as `save_pretrained` writes them) and what transformers 5.23
//! computed with them (`reference.safetensors`): the tokenizer's ids, the last hidden states
//! (1e-5 at real tokens), the masked-LM logits (1e-4) and the mean-pooled vectors (1e-5); and
//! the folders poslab must refuse, with the fix named.

use std::path::{Path, PathBuf};

use candle::{DType, Device, IndexOp, Tensor};
use poslab::pretrained::{mean_pool, Pretrained};

use crate::common::{fixture_path, load_fixture, max_abs_diff, max_abs_diff_real};

fn folder(name: &str) -> PathBuf {
    fixture_path(&format!("pretrained/{name}"))
}

fn reference_texts(dir: &Path) -> Vec<String> {
    let meta = poslab::params::read_metadata(dir.join("reference.safetensors")).unwrap();
    serde_json::from_str(&meta["texts"]).unwrap()
}

fn matches_transformers(name: &str) {
    let dir = folder(name);
    let reference = load_fixture(&format!("pretrained/{name}/reference.safetensors"));
    let model = Pretrained::load(&dir, &Device::Cpu).unwrap();
    let texts = reference_texts(&dir);
    let batch = model.batch(&texts, false).unwrap();
    // The folder's tokenizer gives transformers' ids, padded at the end the same way.
    let ids = batch
        .ids
        .to_dtype(DType::I64)
        .unwrap()
        .to_vec2::<i64>()
        .unwrap();
    assert_eq!(
        ids,
        reference["input_ids"].to_vec2::<i64>().unwrap(),
        "{name}"
    );
    let mask = batch
        .mask
        .to_dtype(DType::I64)
        .unwrap()
        .to_vec2::<i64>()
        .unwrap();
    assert_eq!(mask, reference["attention_mask"].to_vec2::<i64>().unwrap());

    let hidden = model.hidden(&batch.ids, &batch.mask).unwrap();
    let e = max_abs_diff_real(&hidden, &reference["last_hidden_state"], &batch.mask);
    eprintln!("{name}: last_hidden_state worst {e:.2e}");
    assert!(e <= 1e-5, "{name}: last_hidden_state off by {e}");

    let logits = model.mlm_logits(&hidden).unwrap();
    let e = max_abs_diff_real(&logits, &reference["mlm_logits"], &batch.mask);
    eprintln!("{name}: mlm_logits worst {e:.2e}");
    assert!(e <= 1e-4, "{name}: mlm_logits off by {e}");

    for (key, normalize) in [("mean_pooled", false), ("mean_pooled_normalized", true)] {
        let pooled = mean_pool(&hidden, &batch.mask, normalize).unwrap();
        let e = max_abs_diff(&pooled, &reference[key]);
        eprintln!("{name}: {key} worst {e:.2e}");
        assert!(e <= 1e-5, "{name}: {key} off by {e}");
    }
    // A text alone gives what it gives in the padded batch (padding changes nothing).
    let alone = model.batch(&texts[..1], false).unwrap();
    let h1 = model.hidden(&alone.ids, &alone.mask).unwrap();
    let n = alone.lengths[0];
    let e = max_abs_diff(&h1.i((0, ..n)).unwrap(), &hidden.i((0, ..n)).unwrap());
    assert!(e <= 1e-5, "{name}: padding moved the first text by {e}");
}

#[test]
fn tiny_bert_matches_transformers() {
    matches_transformers("tiny-bert");
}

#[test]
fn tiny_roberta_matches_transformers() {
    matches_transformers("tiny-roberta");
}

#[test]
fn tiny_distilbert_matches_transformers() {
    // DistilBERT's own config names (dim, n_layers, hidden_dim, activation, ...), no token
    // types, its own tensor names and masked-LM head.
    matches_transformers("tiny-distilbert");
    let model = Pretrained::load(&folder("tiny-distilbert"), &Device::Cpu).unwrap();
    let c = model.encoder.config();
    assert_eq!(
        (
            c.d_model,
            c.n_layers,
            c.n_heads,
            c.ffn_dim,
            c.embeddings.token_types
        ),
        (32, 2, 4, 37, 0)
    );
    assert_eq!((c.dropout, c.attention_dropout), (0.1, 0.1));
}

#[test]
fn roberta_positions_start_after_the_padding_index() {
    let model = Pretrained::load(&folder("tiny-roberta"), &Device::Cpu).unwrap();
    // The encoder moves positions 0..t to padding_idx + 1 = 2 onwards.
    assert_eq!(model.encoder.config().embeddings.first_position, 2);
    let mask = Tensor::new(&[[1f32, 1., 1., 0.], [1., 1., 1., 1.]], &Device::Cpu).unwrap();
    assert_eq!(model.positions(&mask).unwrap().as_range(), Some(0));
    // The table has 66 rows: 64 tokens at positions 2..=65.
    assert_eq!(model.max_tokens(), 64);
    let bert = Pretrained::load(&folder("tiny-bert"), &Device::Cpu).unwrap();
    assert_eq!(bert.encoder.config().embeddings.first_position, 0);
    assert_eq!(bert.max_tokens(), 64);
    // A text's hidden states do not depend on the padding beside it (padded tokens are never
    // read), and 64 tokens fit where 65 are refused.
    let short = vec!["the cat sat".to_string()];
    let both = vec![
        "the cat sat".to_string(),
        "the big red fox ran over the lazy dog".into(),
    ];
    let alone = model.batch(&short, false).unwrap();
    let padded = model.batch(&both, false).unwrap();
    let h1 = model.hidden(&alone.ids, &alone.mask).unwrap().i(0).unwrap();
    let t = alone.lengths[0];
    let h2 = model
        .hidden(&padded.ids, &padded.mask)
        .unwrap()
        .i((0, ..t))
        .unwrap();
    let diff = (h1 - h2)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(diff < 1e-5, "padding moved a real token by {diff}");
    let fits = vec!["the ".repeat(62)];
    assert_eq!(model.batch(&fits, false).unwrap().lengths, vec![64]);
    let e = model
        .batch(&[format!("{} the", fits[0])], false)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("65 tokens") && e.contains("at most 64") && e.contains("--truncate"),
        "{e}"
    );
}

/// A copy of a fixture folder to break.
fn copy_of(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(folder(name)).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.path().join(path.file_name().unwrap())).unwrap();
    }
    dir
}

fn load_error(dir: &Path) -> String {
    match Pretrained::load(dir, &Device::Cpu) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn folders_poslab_cannot_load_are_refused_with_the_fix() {
    // An unsupported model type: the message lists what is supported.
    let dir = copy_of("tiny-bert");
    let config = std::fs::read_to_string(dir.path().join("config.json")).unwrap();
    std::fs::write(
        dir.path().join("config.json"),
        config.replace("\"model_type\": \"bert\"", "\"model_type\": \"gpt2\""),
    )
    .unwrap();
    let e = load_error(dir.path());
    assert!(
        e.contains("`gpt2` is not supported") && e.contains("roberta"),
        "{e}"
    );

    // No weights.
    let dir = copy_of("tiny-bert");
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    let e = load_error(dir.path());
    assert!(
        e.contains("no model.safetensors") && e.contains("save_pretrained"),
        "{e}"
    );

    // Weights of another shape than the config says: every mismatch named.
    let dir = copy_of("tiny-bert");
    std::fs::write(
        dir.path().join("config.json"),
        config.replace("\"intermediate_size\": 37", "\"intermediate_size\": 40"),
    )
    .unwrap();
    let e = load_error(dir.path());
    assert!(
        e.contains("layers.0.ffn.up.weight") && e.contains("[37, 32]") && e.contains("[40, 32]"),
        "{e}"
    );

    // Weights of another architecture: the BERT file under a RoBERTa config.
    let dir = copy_of("tiny-bert");
    let roberta = std::fs::read_to_string(folder("tiny-roberta").join("config.json")).unwrap();
    std::fs::write(dir.path().join("config.json"), roberta).unwrap();
    let e = load_error(dir.path());
    assert!(
        e.contains("unexpected tensor `cls.predictions.bias`"),
        "{e}"
    );

    // Relative position embeddings are another scheme.
    let dir = copy_of("tiny-bert");
    std::fs::write(
        dir.path().join("config.json"),
        config.replace(
            "\"model_type\": \"bert\"",
            "\"model_type\": \"bert\", \"position_embedding_type\": \"relative_key\"",
        ),
    )
    .unwrap();
    let e = load_error(dir.path());
    assert!(e.contains("relative_key") && e.contains("absolute"), "{e}");

    // A text past the position table, without truncation: refused; with it: cut, keeping
    // the closing [SEP].
    let model = Pretrained::load(&folder("tiny-bert"), &Device::Cpu).unwrap();
    let long = vec!["the cat sat on the mat ".repeat(20)];
    let e = model.batch(&long, false).err().unwrap().to_string();
    assert!(e.contains("at most 64") && e.contains("--truncate"), "{e}");
    let cut = model.batch(&long, true).unwrap();
    assert_eq!(cut.lengths, [64]);
    let ids = cut.ids.to_vec2::<u32>().unwrap();
    let sep = model.tokenizer.token_to_id("[SEP]").unwrap();
    assert_eq!(ids[0][63], sep);
    model.hidden(&cut.ids, &cut.mask).unwrap();
}

/// The real sentence-transformers/all-MiniLM-L6-v2, when `POSLAB_MINILM` names its folder (see
/// the book's chapter on pretrained encoders for the commands that fetch it): for every text of
/// `pretrained/minilm_reference.json`, the same token ids, and an embedding (mean over real
/// tokens, unit norm) at cosine 0.99999 or more to sentence-transformers'.
#[test]
fn real_minilm_matches_sentence_transformers() {
    let Some(dir) = std::env::var_os("POSLAB_MINILM") else {
        eprintln!(
            "skipped: set POSLAB_MINILM to an all-MiniLM-L6-v2 folder to run this test \
             (the book, book/src/guide/pretrained.md: \"A real encoder: all-MiniLM-L6-v2\")"
        );
        return;
    };
    let model = Pretrained::load(Path::new(&dir), &Device::Cpu).unwrap();
    let text = std::fs::read_to_string(fixture_path("pretrained/minilm_reference.json")).unwrap();
    let reference: serde_json::Value = serde_json::from_str(&text).unwrap();
    let items = reference["items"].as_array().unwrap();
    let texts: Vec<String> = items
        .iter()
        .map(|i| i["text"].as_str().unwrap().to_string())
        .collect();
    let batch = model.batch(&texts, false).unwrap();
    let hidden = model.hidden(&batch.ids, &batch.mask).unwrap();
    let pooled = mean_pool(&hidden, &batch.mask, true)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    let ids = batch.ids.to_vec2::<u32>().unwrap();
    let mut worst_cosine = f64::INFINITY;
    for (i, item) in items.iter().enumerate() {
        let expected: Vec<u32> = item["input_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(ids[i][..batch.lengths[i]], expected[..], "text {i}");
        let r: Vec<f64> = item["embedding"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        let ours: Vec<f64> = pooled[i].iter().map(|&v| v as f64).collect();
        let dot: f64 = ours.iter().zip(&r).map(|(a, b)| a * b).sum();
        let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
        let cosine = dot / (norm(&ours) * norm(&r));
        worst_cosine = worst_cosine.min(cosine);
        assert!(cosine >= 0.99999, "text {i}: cosine {cosine}");
    }
    eprintln!(
        "all-MiniLM-L6-v2: worst cosine {worst_cosine:.9} (1 - cosine = {:.1e}) over {} texts",
        1.0 - worst_cosine,
        items.len()
    );
}

fn poslab(args: &[&str], envs: &[(&str, &Path)]) -> (bool, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_poslab"))
        .args(args)
        .envs(envs.iter().copied())
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The vectors of `embed`'s JSON lines.
fn vectors(stdout: &str) -> Vec<Vec<f32>> {
    stdout
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["embedding"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect()
        })
        .collect()
}

#[test]
fn embed_model_gives_transformers_vectors_from_a_folder_and_from_the_hub_cache() {
    for name in ["tiny-bert", "tiny-roberta"] {
        let dir = folder(name);
        let texts = reference_texts(&dir);
        let reference = load_fixture(&format!("pretrained/{name}/reference.safetensors"));
        let expected = reference["mean_pooled_normalized"]
            .to_vec2::<f32>()
            .unwrap();
        let mut args = vec!["embed", "--model", dir.to_str().unwrap(), "--normalize"];
        args.extend(texts.iter().map(String::as_str));
        let (ok, out, err) = poslab(&args, &[]);
        assert!(ok, "{err}");
        let got = vectors(&out);
        assert_eq!(got.len(), texts.len());
        for (g, e) in got.iter().zip(&expected) {
            let worst = g
                .iter()
                .zip(e)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(worst <= 1e-5, "{name}: {worst}");
        }
    }
    // The same folder as a Hub id, from a cache laid out as the Hub client writes it, offline.
    let cache = tempfile::tempdir().unwrap();
    let repo = poslab::text::RepoRef::parse("poslab-tests/tiny-bert").unwrap();
    for file in ["config.json", "tokenizer.json", "model.safetensors"] {
        let bytes = std::fs::read(folder("tiny-bert").join(file)).unwrap();
        poslab::text::hub::place_in_cache(cache.path(), &repo, &"ab".repeat(20), file, &bytes)
            .unwrap();
    }
    let env = [("HF_HUB_CACHE", cache.path())];
    let by_id = poslab(
        &["embed", "--model", "poslab-tests/tiny-bert", "the cat sat"],
        &env,
    );
    let dir = folder("tiny-bert");
    let by_dir = poslab(
        &["embed", "--model", dir.to_str().unwrap(), "the cat sat"],
        &env,
    );
    assert!(by_id.0 && by_dir.0, "{}", by_id.2);
    assert_eq!(by_id.1, by_dir.1);
    // A repo the cache lacks, offline: the error says where it looked and how to fix it.
    let (ok, _, err) = poslab(&["embed", "--model", "poslab-tests/absent", "x"], &env);
    assert!(
        !ok && err.contains("HF_HUB_OFFLINE") && err.contains("no folder"),
        "{err}"
    );
}

#[test]
fn embed_refuses_what_it_cannot_do_with_the_fix() {
    let dir = folder("tiny-bert");
    let dir = dir.to_str().unwrap();
    // A Hugging Face folder given as a poslab run (users used to get "missing field `format`").
    let (ok, _, err) = poslab(&["embed", "--run", dir, "x"], &[]);
    assert!(
        !ok && err.contains("Hugging Face model folder") && err.contains("--model"),
        "{err}"
    );
    // A text past the position table, and the same with --truncate.
    let long = "the cat sat on the mat ".repeat(20);
    let (ok, _, err) = poslab(&["embed", "--model", dir, &long], &[]);
    assert!(!ok && err.contains("--truncate"), "{err}");
    let (ok, out, err) = poslab(&["embed", "--model", dir, "--truncate", &long], &[]);
    assert!(ok && vectors(&out).len() == 1, "{err}");
    // Pretrained-only options on a poslab model.
    let (ok, _, err) = poslab(&["embed", "--run", "somewhere", "--normalize", "x"], &[]);
    assert!(!ok && err.contains("--model"), "{err}");
    // CLS pooling reads the first token: unit vectors with --normalize.
    let (ok, out, err) = poslab(
        &[
            "embed",
            "--model",
            dir,
            "--pooling",
            "cls",
            "--normalize",
            "a cat",
        ],
        &[],
    );
    assert!(ok, "{err}");
    let v = &vectors(&out)[0];
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    assert!((norm - 1.0).abs() < 1e-5, "{norm}");
}

#[test]
fn predict_model_fills_masks_from_the_checked_logits() {
    let model = Pretrained::load(&folder("tiny-bert"), &Device::Cpu).unwrap();
    let text = "the cat [MASK] on the mat".to_string();
    let out = model
        .fill_masks(std::slice::from_ref(&text), 36, false)
        .unwrap();
    let poslab::infer::Prediction::Fills { masks } = &out[0].value else {
        panic!("not fills")
    };
    assert_eq!(masks.len(), 1);
    assert_eq!(masks[0].word, 2);
    // The probabilities are the softmax of the masked-LM logits (checked against transformers
    // above) at the mask, specials left out, in descending order.
    let batch = model.batch(std::slice::from_ref(&text), false).unwrap();
    let logits = model
        .mlm_logits(&model.hidden(&batch.ids, &batch.mask).unwrap())
        .unwrap()
        .i((0, 3))
        .unwrap();
    let probs = candle_nn::ops::softmax(&logits, 0)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let fills = &masks[0].fills;
    assert!(fills
        .windows(2)
        .all(|w| w[0].probability >= w[1].probability));
    for f in fills {
        let id = model.tokenizer.token_to_id(&f.label).unwrap() as usize;
        assert!(
            (f.probability - f64::from(probs[id])).abs() < 1e-6,
            "{}",
            f.label
        );
        assert!(!["[PAD]", "[CLS]", "[SEP]", "[MASK]", "[UNK]"].contains(&f.label.as_str()));
    }
    // A text without a mask, and a model without a head, are refused.
    let e = model
        .fill_masks(&["the cat".into()], 5, false)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("no [MASK] token"), "{e}");
    // Through the CLI, with RoBERTa's <mask>.
    let dir = folder("tiny-roberta");
    let (ok, out, err) = poslab(
        &[
            "predict",
            "--model",
            dir.to_str().unwrap(),
            "--top-k",
            "3",
            "--json",
            "the cat <mask> on the mat",
        ],
        &[],
    );
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["masks"][0]["fills"].as_array().unwrap().len(), 3);
}

#[test]
fn inspect_model_describes_the_mapped_encoder() {
    let dir = folder("tiny-roberta");
    let (ok, out, err) = poslab(&["inspect", "--model", dir.to_str().unwrap()], &[]);
    assert!(ok, "{err}");
    for expected in [
        "a `roberta` model",
        "positions: from 2 (padding_idx + 1), padded tokens at 1",
        "at most 64 tokens",
        "masked-LM head: yes",
        "shape: 2 layers, d_model 32, 4 heads of 8, FFN 37, post-norm, vocab 36, max_len 66",
        "embeddings: 1 token types (type 0 added to every token), then a LayerNorm",
        "* learned",
    ] {
        assert!(out.contains(expected), "{expected:?} not in\n{out}");
    }
    // The count is the file's, less the key biases the encoder does not need.
    let model = Pretrained::load(&dir, &Device::Cpu).unwrap();
    let in_file: usize = candle::safetensors::load(dir.join("model.safetensors"), &Device::Cpu)
        .unwrap()
        .values()
        .map(|t| t.elem_count())
        .sum();
    assert_eq!(model.params.num_params(), in_file - 2 * 32);
    assert!(
        out.contains(&format!("parameters: {} loaded", in_file - 2 * 32)),
        "{out}"
    );
}

#[test]
fn analyze_model_measures_the_rows_real_tokens_read() {
    let out_dir = tempfile::tempdir().unwrap();
    let dir = folder("tiny-roberta");
    let out = out_dir.path().join("a");
    let (ok, stdout, err) = poslab(
        &[
            "analyze",
            "--model",
            dir.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ],
        &[],
    );
    assert!(ok, "{err}");
    assert!(
        stdout.contains("rows from 2") && stdout.contains("64 positions from 0, 32 wide"),
        "{stdout}"
    );
    // table.csv holds rows 2..66 of the file's table, as stored.
    let csv = std::fs::read_to_string(out.join("table.csv")).unwrap();
    let rows: Vec<Vec<f64>> = csv
        .lines()
        .skip(1)
        .map(|l| l.split(',').skip(1).map(|v| v.parse().unwrap()).collect())
        .collect();
    assert_eq!((rows.len(), rows[0].len()), (64, 32));
    let file = candle::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let table = file["roberta.embeddings.position_embeddings.weight"]
        .to_vec2::<f32>()
        .unwrap();
    for (r, row) in rows.iter().enumerate() {
        for (c, v) in row.iter().enumerate() {
            assert!(
                (v - f64::from(table[r + 2][c])).abs() < 1e-6,
                "row {r} col {c}"
            );
        }
    }
    for f in [
        "distance_cosine.png",
        "offsets.csv",
        "summary.json",
        "norms.png",
        "pca.png",
        "attention_terms.csv",
        "attention_terms.png",
    ] {
        assert!(out.join(f).is_file(), "{f}");
    }
    // Wang & Chen's order probe, and the first layer's logits split on real text (the default:
    // the shipped reviews), rebuilt to f32 rounding.
    assert!(
        stdout.contains("order probe (is j after i?") && stdout.contains("512 pairs, 5-fold"),
        "{stdout}"
    );
    assert!(
        stdout.contains("on 64 texts of examples/data/reviews.tsv") && stdout.contains("layer 0:"),
        "{stdout}"
    );
    let terms = std::fs::read_to_string(out.join("attention_terms.csv")).unwrap();
    assert_eq!(
        terms.lines().count(),
        1 + 4 * 4,
        "a header and 4 terms of layer 0's 4 heads"
    );
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    let order = &summary["order_probe"];
    assert_eq!(order["pairs"], 512);
    let accuracy = order["accuracy"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&accuracy), "{order}");
    // rows.csv: each row's norm (of the rows real tokens read) and its principal coordinates.
    let geometry = std::fs::read_to_string(out.join("rows.csv")).unwrap();
    let mut lines = geometry.lines();
    assert_eq!(lines.next(), Some("position,norm,pc1,pc2,pc3"));
    for (r, line) in lines.enumerate() {
        let norm: f64 = line.split(',').nth(1).unwrap().parse().unwrap();
        let expected = table[r + 2]
            .iter()
            .map(|v| f64::from(*v).powi(2))
            .sum::<f64>()
            .sqrt();
        assert!((norm - expected).abs() < 1e-5, "row {r}: {norm} {expected}");
    }
    assert!(stdout.contains("row norms:") && stdout.contains("principal components of the rows"));
}
