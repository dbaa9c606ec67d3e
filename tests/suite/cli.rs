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
    let missing = dir.join("missing.py");
    let (ok, _, stderr) = poslab(&["bench", "--torch", missing.to_str().unwrap()]);
    assert!(!ok && stderr.contains("no such file"), "{stderr}");
    std::fs::remove_dir_all(&dir).unwrap();
}
