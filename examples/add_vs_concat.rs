//! Add or concatenate? A small controlled comparison through the library API.
//!
//! cargo run --release --example add_vs_concat
//!
//! Three variants of the sinusoid (added, concatenated at the same width, concatenated and
//! projected) on a relative-position task, 2 seeds each, then the report. The full version is
//! `poslab compare configs/add_vs_concat.toml`.

use anyhow::Result;
use poslab::runs::compare::{run, RunOptions};
use poslab::runs::report::text_report;
use poslab::runs::ExperimentConfig;

const EXPERIMENT: &str = r#"
name = "add_vs_concat_example"
seeds = 2

[model]
d_model = 64
n_heads = 4
n_layers = 2
ffn_dim = 128
dropout = 0.0
attention_dropout = 0.0

[train]
budget = { steps = 250 }
lr = 2e-3

[[tasks]]
kind = "prev_token"
k = 2
lengths = [4, 16]
eval_examples = 300

[[variants]]
name = "add"
positional = { kind = "sinusoidal_add" }

[[variants]]
name = "concat"
positional = { kind = "sinusoidal_concat", pos_dim = 16 }

[[variants]]
name = "concat_project"
positional = { kind = "sinusoidal_concat", pos_dim = 16, project = true }
"#;

fn main() -> Result<()> {
    let config = ExperimentConfig::from_toml_str(EXPERIMENT)?;
    let dir = std::env::temp_dir().join("poslab-add-vs-concat-example");
    let output = run(
        &config,
        &RunOptions {
            progress: poslab::progress::Progress::for_stderr(
                false,
                poslab::progress::Progress::DEFAULT_EVERY,
            ),
            // One job per core; each then gets one thread (the cores shared out).
            jobs: poslab::nn::cores(),
            ..RunOptions::new(candle::Device::Cpu, &dir)
        },
        &|line| eprintln!("{line}"),
    )?;
    println!("{}", text_report(&output.results, &output.timings));
    std::fs::remove_dir_all(dir)?;
    Ok(())
}
