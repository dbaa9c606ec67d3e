//! The binary as a user meets it: output into a closed pipe, and a broken one.

use std::os::fd::{FromRawFd, OwnedFd};
use std::process::{Command, Stdio};

/// Runs `poslab args` with standard output a pipe whose reading end is already closed: the
/// first write fails with a broken pipe. Returns the exit code and standard error.
fn into_closed_pipe(args: &[&str]) -> (Option<i32>, String) {
    let mut fds = [0i32; 2];
    // SAFETY: pipe writes two new descriptors into the array.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: both descriptors were just created and are owned here alone.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    drop(read);
    let out = Command::new(env!("CARGO_BIN_EXE_poslab"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stdout(Stdio::from(write))
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_closed_pipe_ends_the_program_quietly() {
    for args in [
        vec!["inspect", "configs/encoder.toml"],
        vec![
            "analyze",
            "alibi",
            "--positions",
            "8",
            "--out",
            "/tmp/poslab-closed-pipe-test",
        ],
        vec!["--help"],
    ] {
        let (code, stderr) = into_closed_pipe(&args);
        if args[0] == "--help" {
            // clap prints help itself; it must not panic either.
            assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
            continue;
        }
        assert_eq!(code, Some(0), "{args:?}: {stderr}");
        assert!(
            !stderr.contains("panicked") && !stderr.contains("Broken pipe"),
            "{args:?}: {stderr}"
        );
    }
    let _ = std::fs::remove_dir_all("/tmp/poslab-closed-pipe-test");
}

/// A tiny experiment and a tiny training run, for the tests that need a real run.
const TINY_COMPARE: &str = "name = \"tiny\"\nseeds = 2\n[model]\nd_model = 16\nn_heads = 2\n\
    n_layers = 1\nffn_dim = 32\n[train]\nbudget = { steps = 20 }\nbatch_size = 16\n\
    [[tasks]]\nkind = \"prev_token\"\nlengths = [4, 8]\ntrain_examples = 100\n\
    eval_examples = 40\n[[variants]]\nname = \"none\"\npositional = { kind = \"none\" }\n\
    [[variants]]\nname = \"rope\"\npositional = { kind = \"rope\" }\n";
const TINY_TRAIN: &str = "name = \"tt\"\n[model]\nd_model = 16\nn_heads = 2\nn_layers = 1\n\
    ffn_dim = 32\n[positional]\nkind = \"rope\"\n[train]\nbudget = { steps = 20 }\n\
    batch_size = 16\n[task]\nkind = \"prev_token\"\nlengths = [4, 8]\n\
    train_examples = 100\neval_examples = 40\n";

#[test]
fn compare_and_train_finish_their_runs_when_their_output_pipes_close() {
    // `poslab compare 2>&1 | head -n 1`, or a `tee` that dies: standard output and standard
    // error both pipes whose reading ends are closed before the first line. The run goes on to
    // its end (its results are in its folder), and the exit status is success, not a panic.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("c.toml"), TINY_COMPARE).unwrap();
    std::fs::write(dir.path().join("t.toml"), TINY_TRAIN).unwrap();
    let runs: [(&[&str], &str); 2] = [
        (&["compare", "c.toml", "--out", "c"], "c/results.json"),
        (
            &["train", "--config", "t.toml", "--out", "t"],
            "t/model.safetensors",
        ),
    ];
    for (args, product) in runs {
        let mut child = Command::new(env!("CARGO_BIN_EXE_poslab"))
            .args(args)
            .current_dir(dir.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take());
        drop(child.stderr.take());
        let status = child.wait().unwrap();
        assert_eq!(status.code(), Some(0), "{args:?}");
        assert!(dir.path().join(product).is_file(), "{args:?}: no {product}");
    }
}

#[test]
fn run_files_get_the_mode_an_ordinary_create_gives() {
    // Under umask 002 an ordinary create gives 0664: every file of a compare's run folder (its
    // reports, records, models and plots, all written atomically) is readable by the group and
    // others, not 0600 as a temporary file is made.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("c.toml"), TINY_COMPARE).unwrap();
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "umask 002 && exec '{}' compare c.toml --out run --quiet",
            env!("CARGO_BIN_EXE_poslab")
        ))
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    use std::os::unix::fs::PermissionsExt as _;
    let mut files = Vec::new();
    let mut stack = vec![dir.path().join("run")];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let path = e.path();
            if path.is_dir() {
                stack.push(path);
            } else {
                files.push(path);
            }
        }
    }
    assert!(files.len() > 20, "{files:?}");
    for f in &files {
        let mode = std::fs::metadata(f).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o664, "{}: {mode:o}", f.display());
    }
}

#[test]
fn every_command_that_reads_a_model_holds_it_and_its_text_to_the_limits() {
    // predict, embed and analyze read POSLAB_MAX_MEMORY and POSLAB_MAX_PARAMS as train and
    // compare do: a model past the parameter limit is refused before it is built, and text
    // whose batch would pass the memory limit is refused before it is computed, naming the
    // limit (analyze --run read any text at any size).
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("t.toml"), TINY_TRAIN).unwrap();
    let run = |args: &[&str], envs: &[(&str, &str)]| {
        let out = Command::new(env!("CARGO_BIN_EXE_poslab"))
            .args(args)
            .envs(envs.iter().copied())
            .current_dir(dir.path())
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, err) = run(&["train", "--config", "t.toml", "--out", "m", "-q"], &[]);
    assert!(ok, "{err}");
    let lines: String = (0..4).map(|_| "a b c d ".repeat(50) + "\n").collect();
    std::fs::write(dir.path().join("long.txt"), &lines).unwrap();
    let long_line = "a b c d ".repeat(500);
    let memory = [("POSLAB_MAX_MEMORY", "1M")];
    let (ok, err) = run(
        &["analyze", "--run", "m", "--text", "long.txt", "--out", "a"],
        &memory,
    );
    assert!(
        !ok && err.contains("analyze: 4 texts of up to") && err.contains("limit of 1.0 MiB"),
        "{err}"
    );
    for command in ["predict", "embed"] {
        let (ok, err) = run(&[command, "--run", "m", &long_line], &memory);
        assert!(
            !ok && err.contains("fits the memory limit (POSLAB_MAX_MEMORY)"),
            "{command}: {err}"
        );
        let (ok, err) = run(
            &[command, "--run", "m", "a b"],
            &[("POSLAB_MAX_PARAMS", "100")],
        );
        assert!(
            !ok && err.contains("more than the limit of 100"),
            "{command}: {err}"
        );
        // Within the limits, the same text is read.
        let (ok, err) = run(&[command, "--run", "m", &long_line], &[]);
        assert!(ok, "{command}: {err}");
    }
    let (ok, err) = run(
        &["analyze", "--run", "m", "--out", "b"],
        &[("POSLAB_MAX_PARAMS", "100")],
    );
    assert!(!ok && err.contains("more than the limit of 100"), "{err}");
}

#[test]
fn bench_launches_holds_the_path_it_runs_to_the_memory_limit() {
    // On the CPU, --launches runs the device path's twin, whose CoPE holds its composition's
    // attention tables: the limit is checked for those, not for the fused kernels' fewer
    // (at 256 MiB the step took 0.70 GiB).
    let out = Command::new(env!("CARGO_BIN_EXE_poslab"))
        .args([
            "bench",
            "--launches",
            "--device",
            "cpu",
            "--variants",
            "cope",
            "--seq",
            "256",
            "--batch",
            "2",
        ])
        .env("POSLAB_MAX_MEMORY", "256M")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("more than the limit of 256.0 MiB"),
        "{err}"
    );
}

#[test]
fn a_full_device_is_one_line_of_error() {
    // /dev/full refuses every write with "no space left on device".
    let Ok(full) = std::fs::OpenOptions::new().write(true).open("/dev/full") else {
        eprintln!("skipped: no /dev/full on this system");
        return;
    };
    let out = Command::new(env!("CARGO_BIN_EXE_poslab"))
        .args(["inspect", "configs/encoder.toml"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stdout(Stdio::from(full))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.starts_with("error: writing the output:") && stderr.lines().count() == 1,
        "{stderr}"
    );
}

fn poslab(args: &[&str]) -> (bool, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_poslab"))
        .args(args)
        .current_dir(std::env::temp_dir())
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn rough_edges_a_new_user_meets() {
    // `inspect` with no argument reads its embedded default, from any folder.
    let (ok, stdout, stderr) = poslab(&["inspect"]);
    assert!(
        ok && stdout.starts_with("configs/encoder.toml (embedded default): valid"),
        "{stderr}"
    );
    // `--stop-after 0` would train a step before stopping: refused.
    let (ok, _, stderr) = poslab(&["train", "--config", "x.toml", "--stop-after", "0"]);
    assert!(!ok && stderr.contains("--stop-after 0"), "{stderr}");
    // A reference row past the positions analysed is refused, not clamped.
    let (ok, _, stderr) = poslab(&[
        "analyze",
        "sinusoidal",
        "--positions",
        "16",
        "--reference",
        "40",
    ]);
    assert!(
        !ok && stderr.contains("--reference 40 is not among the 16 positions"),
        "{stderr}"
    );
    // Every option of `embed` says what it does.
    let (_, help, _) = poslab(&["embed", "--help"]);
    for option in ["--input", "--truncate", "--rope-scaling"] {
        let line = help
            .lines()
            .find(|l| l.trim_start().starts_with(option))
            .unwrap();
        let described = line.trim().len() > option.len() + 20
            || help
                .lines()
                .skip_while(|l| !l.trim_start().starts_with(option))
                .nth(1)
                .is_some_and(|l| !l.trim().is_empty() && !l.trim_start().starts_with('-'));
        assert!(described, "{option} has no description:\n{help}");
    }
}

#[test]
fn bench_measures_the_matmul_peak_beside_the_step_and_the_share_of_it() {
    // The peak is measured in the same run, on the same threads, and each variant's training
    // rate is printed as a share of it: a rate above the peak or a missing peak is a bug.
    let tiny = [
        "bench",
        "--vocab",
        "64",
        "--d-model",
        "16",
        "--heads",
        "2",
        "--layers",
        "1",
        "--ffn",
        "32",
        "--batch",
        "2",
        "--seq",
        "8",
        "--warmup",
        "0",
        "--forward-reps",
        "1",
        "--train-reps",
        "2",
        "--threads",
        "1",
        "--in-process",
        "--variants",
        "sin_add",
    ];
    let (ok, out, err) = poslab(&[&tiny[..], &["--json"]].concat());
    assert!(ok, "{err}");
    let doc: serde_json::Value = serde_json::from_str(&out).unwrap();
    let record = &doc["results"][0];
    let peak = record["matmul_peak_gflops"]
        .as_f64()
        .expect("a measured peak");
    let rate = record["train"]["gflops"].as_f64().unwrap();
    assert!(peak.is_finite() && peak > 0.1, "peak {peak} GFLOP/s");
    assert!(
        rate > 0.0 && rate < peak,
        "training {rate} GFLOP/s against a peak of {peak}"
    );
    let (ok, table, err) = poslab(&tiny);
    assert!(ok, "{err}");
    let share = table
        .lines()
        .skip_while(|l| !l.contains("share of the f32 matmul peak"))
        .nth(1)
        .unwrap_or_else(|| panic!("no share table:\n{table}"));
    assert!(
        share.contains("sin_add") && share.contains("GFLOP/s") && share.ends_with('%'),
        "{share}"
    );
    // Interleaved rounds (child processes) print it too, from each variant's fastest round.
    let rounds: Vec<&str> = tiny
        .iter()
        .copied()
        .filter(|a| *a != "--in-process")
        .map(|a| if a == "sin_add" { "sin_add,alibi" } else { a })
        .chain(["--rounds", "2"])
        .collect();
    let (ok, table, err) = poslab(&rounds);
    assert!(ok, "{err}");
    let shares: Vec<&str> = table
        .lines()
        .skip_while(|l| !l.contains("share of the f32 matmul peak"))
        .skip(1)
        .take(2)
        .collect();
    assert!(
        shares.len() == 2
            && shares[0].contains("sin_add")
            && shares[1].contains("alibi")
            && shares.iter().all(|l| l.ends_with('%')),
        "no share table for the rounds:\n{table}"
    );
}

/// An executable shell script at `path`.
fn write_executable(path: &std::path::Path, body: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, body).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// A stand-in for Python (these tests have no torch) in `dir`: it checks that it was handed the
/// built-in script (poslab's own PyTorch model), logs its arguments to `log`, answers the probe
/// with `variants` (JSON strings, comma-separated) and runs `body` (shell) for anything else.
fn fake_built_in_python(
    dir: &std::path::Path,
    log: &std::path::Path,
    variants: &str,
    body: &str,
) -> std::path::PathBuf {
    let python = dir.join("python");
    write_executable(
        &python,
        &format!(
            r#"#!/bin/sh
grep -q "poslab's bench encoder in PyTorch" "$1" || {{ echo "not the built-in script: $1" >&2; exit 3; }}
echo "$@" >> {log}
if [ "$2" = "--probe" ]; then echo '{{"torch": "9.9-fake", "variants": [{variants}]}}'; exit 0; fi
{body}
"#,
            log = log.display()
        ),
    );
    python
}

#[test]
fn bench_torch_with_no_path_runs_the_built_in_pytorch_model_at_the_benchs_shape() {
    // A stand-in for Python (these tests have no torch): it checks that it was handed the
    // built-in script (poslab's own PyTorch model), answers its probe with three variants, and
    // reports fixed throughputs, logging its arguments.
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("args.log");
    let python = fake_built_in_python(
        dir.path(),
        &log,
        r#""sin_add", "alibi", "none""#,
        r#"echo '{"variant": "'$2'", "fwd_tokens_per_s_median": 1000.0, "train_tokens_per_s_median": 500.0, "train_part_medians_ms": {"fwd": 1.0, "bwd": 2.0, "opt": 0.5}, "peak_rss_train_phase_mib": 100.0, "fwd_foreign_cores": 0.0, "train_foreign_cores": 0.0}'"#,
    );
    let python = python.to_str().unwrap();
    let shape: Vec<&str> = "--vocab 50 --d-model 16 --heads 2 --layers 1 --ffn 32 --batch 2 \
        --seq 8 --threads 1 --warmup 0 --forward-reps 1 --train-reps 1 --rounds 1"
        .split_whitespace()
        .collect();
    let mut args = vec!["bench", "--torch", "--python", python, "--json"];
    args.extend_from_slice(&shape);
    let (ok, stdout, stderr) = poslab(&args);
    assert!(ok, "{stderr}");
    let doc: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(doc["torch"], "9.9-fake", "{stdout}");
    // The script's variants but none, where the shape allows them: sin_concat is not asked for.
    let ratios = doc["ratios"].as_array().unwrap();
    let names: Vec<&str> = ratios
        .iter()
        .map(|r| r["variant"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["sin_add", "alibi"], "{stdout}");
    for r in ratios {
        assert_eq!(r["torch_train"], 500.0, "{r}");
        let ratio = r["train_ratio"].as_f64().unwrap();
        let poslab_train = r["poslab_train"].as_f64().unwrap();
        assert!(
            ratio > 0.0 && (ratio - poslab_train / 500.0).abs() < 1e-9,
            "{r}"
        );
    }
    // The shape, threads and reps went to the script; its temporary file is gone.
    let calls = std::fs::read_to_string(&log).unwrap();
    let runs: Vec<&str> = calls.lines().filter(|l| !l.contains("--probe")).collect();
    assert_eq!(runs.len(), 2, "{calls}");
    for run in &runs {
        for flags in [
            "--d-model 16",
            "--heads 2",
            "--seq 8",
            "--threads 1",
            "--device cpu",
        ] {
            assert!(run.contains(flags), "{flags}: {run}");
        }
    }
    let script = runs[0].split(' ').next().unwrap();
    assert!(
        !std::path::Path::new(script).exists(),
        "{script} left behind"
    );
    // A variant the script does not run is refused before anything is measured.
    let mut args = vec!["bench", "--torch", "--python", python, "--variants", "rope"];
    args.extend_from_slice(&shape);
    let (ok, _, stderr) = poslab(&args);
    assert!(
        !ok && stderr.contains("has no `rope` variant; it runs sin_add, alibi, none")
            && !stderr.contains("poslab bench on"),
        "{stderr}"
    );
}

#[test]
fn bench_products_sets_each_product_of_the_step_beside_pytorchs() {
    // A stand-in for Python: the built-in script's probe, then `--products` answered with 100
    // GFLOP/s for every product but the square one (200), logging its arguments.
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("args.log");
    let names = [
        "qkv.output",
        "qkv.input_gradient",
        "qkv.weight_gradient",
        "attn_out.output",
        "attn_out.input_gradient",
        "attn_out.weight_gradient",
        "ffn_up.output",
        "ffn_up.input_gradient",
        "ffn_up.weight_gradient",
        "ffn_down.output",
        "ffn_down.input_gradient",
        "ffn_down.weight_gradient",
        "attention.scores",
        "attention.outputs",
        "attention.probs_gradient",
        "attention.values_gradient",
        "attention.queries_gradient",
        "attention.keys_gradient",
    ];
    let rates: Vec<String> = names.iter().map(|n| format!("\"{n}\": 100.0")).collect();
    let python = fake_built_in_python(
        dir.path(),
        &log,
        r#""sin_add""#,
        &format!(
            r#"[ "$2" = "--products" ] || {{ echo "not --products: $2" >&2; exit 4; }}
echo '{{"torch": "9.9-fake", "products": {{"square": 200.0, {}}}}}'"#,
            rates.join(", ")
        ),
    );
    let python = python.to_str().unwrap();
    // 16 x 8 rows, width 16, FFN 32, 3 layers.
    let shape: Vec<&str> = "--vocab 50 --d-model 16 --heads 2 --layers 3 --ffn 32 --batch 16 \
        --seq 8 --threads 1 --warmup 0 --train-reps 2 --rounds 2"
        .split_whitespace()
        .collect();
    let mut args = vec![
        "bench",
        "--products",
        "--torch",
        "--python",
        python,
        "--json",
    ];
    args.extend_from_slice(&shape);
    let (ok, stdout, stderr) = poslab(&args);
    assert!(ok, "{stderr}");
    let doc: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(doc["torch"], "9.9-fake", "{stdout}");
    assert_eq!(doc["rows"], 128, "{stdout}");
    let products = doc["products"].as_array().unwrap();
    let got: Vec<&str> = products
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(got[0], "square");
    assert_eq!(got[1..], names, "{stdout}");
    let mut flop = 0.0;
    for p in products {
        let poslab = p["poslab"].as_array().unwrap();
        assert_eq!(poslab.len(), 2, "a rate per round: {p}");
        assert!(
            poslab.iter().all(|r| r.as_f64().is_some_and(|r| r > 0.0)),
            "{p}"
        );
        let torch: Vec<f64> = p["torch"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r.as_f64().unwrap())
            .collect();
        let dims = [&p["m"], &p["n"], &p["k"]].map(|v| v.as_f64().unwrap());
        if p["name"] == "square" {
            assert_eq!(
                (torch.as_slice(), p["per_step"].as_u64()),
                (&[200.0, 200.0][..], Some(0))
            );
            assert_eq!(dims, [1024.0; 3]);
            continue;
        }
        assert_eq!(
            (torch.as_slice(), p["per_step"].as_u64()),
            (&[100.0, 100.0][..], Some(3))
        );
        let count = p["count"].as_f64().unwrap();
        if p["name"].as_str().unwrap().starts_with("attention.") {
            // 16 x 2 (batch, head) products of 8 tokens by heads 8 wide.
            assert_eq!((dims, count), ([8.0; 3], 32.0), "{p}");
        } else {
            // Every product of a linear layer in or out of width 16 (FFN 32, q k v 48) over
            // the 128 rows.
            assert!(
                dims.contains(&128.0) && dims.contains(&16.0) && count == 1.0,
                "{p}"
            );
        }
        flop += 3.0 * 2.0 * dims.iter().product::<f64>() * count;
    }
    // PyTorch's step time: every product's FLOPs at 100 GFLOP/s.
    let torch_ms = doc["step_ms"]["torch"].as_f64().unwrap();
    assert!((torch_ms - flop / 100e9 * 1e3).abs() < 1e-12, "{stdout}");
    assert!(doc["step_ms"]["poslab"].as_f64().unwrap() > 0.0, "{stdout}");
    // The shape and threads went to the script, once per round.
    let calls = std::fs::read_to_string(&log).unwrap();
    let runs: Vec<&str> = calls.lines().filter(|l| l.contains("--products")).collect();
    assert_eq!(runs.len(), 2, "{calls}");
    for flags in [
        "--batch 16",
        "--seq 8",
        "--d-model 16",
        "--ffn 32",
        "--threads 1",
    ] {
        assert!(runs.iter().all(|r| r.contains(flags)), "{flags}: {calls}");
    }
    // The table: each product's ratio, and the step at both sides' rates.
    let mut args = vec!["bench", "--products", "--torch", "--python", python];
    args.extend_from_slice(&shape);
    let (ok, stdout, stderr) = poslab(&args);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("ffn_down.weight_gradient")
            && stdout.contains("the step's products at these rates: poslab")
            && stdout.contains("PyTorch"),
        "{stdout}"
    );
    // What it cannot measure is refused before anything runs.
    for (extra, why) in [
        (vec!["--dtype", "bf16"], "it times f32 products"),
        (vec!["--variants", "rope"], "drop --variants"),
    ] {
        let mut args = vec!["bench", "--products"];
        args.extend_from_slice(&shape);
        args.extend(extra);
        let (ok, _, stderr) = poslab(&args);
        assert!(
            !ok && stderr.contains(why) && !stderr.contains("round 1"),
            "{stderr}"
        );
    }
    // A Python whose script reports no rate for a product: named, and failed.
    let partial = dir.path().join("partial");
    write_executable(
        &partial,
        r#"#!/bin/sh
if [ "$2" = "--probe" ]; then echo '{"torch": "9.9-fake", "variants": ["sin_add"]}'; exit 0; fi
echo '{"torch": "9.9-fake", "products": {"square": 200.0}}'
"#,
    );
    let mut args = vec!["bench", "--products", "--torch", "--python"];
    args.push(partial.to_str().unwrap());
    args.extend_from_slice(&shape);
    let (ok, _, stderr) = poslab(&args);
    assert!(
        !ok && stderr.contains("reported no rate for `qkv.output`"),
        "{stderr}"
    );
}

#[test]
fn bench_torch_without_torch_says_so_before_measuring_anything() {
    // A real Python whose `import torch` fails (a stand-in package first on its path), so the
    // built-in script's own check speaks: torch is named, with the fix.
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("torch")).unwrap();
    std::fs::write(
        dir.path().join("torch/__init__.py"),
        "raise ImportError('no torch in this test')\n",
    )
    .unwrap();
    let python = dir.path().join("python");
    write_executable(
        &python,
        &format!(
            "#!/bin/sh\nPYTHONPATH={} exec python3 \"$@\"\n",
            dir.path().display()
        ),
    );
    let (ok, _, stderr) = poslab(&[
        "bench",
        "--torch",
        "--python",
        python.to_str().unwrap(),
        "--variants",
        "sin_add",
    ]);
    assert!(
        !ok && stderr.contains("cannot import torch (no torch in this test)")
            && stderr.contains("pip install torch")
            && stderr.contains("--python")
            && !stderr.contains("poslab bench on"),
        "{stderr}"
    );
    // A Python that is not there.
    let missing = dir.path().join("no-such-python");
    let (ok, _, stderr) = poslab(&["bench", "--torch", "--python", missing.to_str().unwrap()]);
    assert!(!ok && stderr.contains("cannot run it"), "{stderr}");
}

#[test]
fn bench_refuses_pytorch_ratios_of_different_work() {
    // A fixed-shape PyTorch script (like shared/bench/torch_reference.py: no --d-model) beside
    // a bench at another shape or dtype would compare different work: refused before anything
    // runs, naming the script that takes the shape.
    let dir = std::env::temp_dir().join(format!("poslab-bench-torch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let fixed = dir.join("fixed_reference.py");
    std::fs::write(&fixed, "import sys\nprint('{}')\n").unwrap();
    let fixed = fixed.to_str().unwrap();
    for extra in [&["--d-model", "64"][..], &["--dtype", "bf16"][..]] {
        let mut args = vec!["bench", "--torch", fixed, "--variants", "sin_add"];
        args.extend_from_slice(extra);
        let (ok, _, stderr) = poslab(&args);
        assert!(
            !ok && stderr.contains("would compare different work")
                && stderr.contains("benches/torch_at_shape.py")
                && !stderr.contains("poslab bench on"),
            "{extra:?}: {stderr}"
        );
    }
    // It has no --products mode either, even at its own shape: refused before poslab's
    // products are timed.
    let (ok, _, stderr) = poslab(&["bench", "--products", "--torch", fixed]);
    assert!(
        !ok && stderr.contains("has no --products mode") && !stderr.contains("round 1"),
        "{stderr}"
    );
    let missing = dir.join("missing.py");
    let (ok, _, stderr) = poslab(&["bench", "--torch", missing.to_str().unwrap()]);
    assert!(!ok && stderr.contains("no such file"), "{stderr}");
    std::fs::remove_dir_all(&dir).unwrap();
}
