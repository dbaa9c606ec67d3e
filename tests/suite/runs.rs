//! Runs that survive scale: a `compare` killed at any moment and started again ends with the
//! `results.json` of a run that never stopped, byte for byte; one writer per run folder;
//! `--overwrite` removes only what poslab wrote; `report` refuses bad or missing data; lengths
//! are tested as their columns say; progress reaches logs; experiments are checked before they
//! run.

use std::io::BufRead as _;
use std::os::unix::process::ExitStatusExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use poslab::runs::ExperimentConfig;

/// 2 tasks (sentence labels with the shuffle test; a length-suite task scored by length) x 2
/// variants (rope re-scored under YaRN: a row of its own) x 2 seeds = 8 cells, each a fraction
/// of a second. Cells in run order: word_order seed 0 rope (0), none (1), seed 1 rope (2), none
/// (3); reverse_string likewise (4..7).
const RUN: &str = r#"
name = "survive"
seeds = 2
[model]
d_model = 16
n_heads = 2
n_layers = 1
ffn_dim = 32
[train]
budget = { steps = 30 }
batch_size = 16
eval_every = 10
[eval]
rope_scaling = [{ kind = "yarn", factor = 2 }]
[[tasks]]
kind = "word_order"
lengths = [5, 8]
train_examples = 200
eval_examples = 40
[[tasks]]
kind = "reverse_string"
lengths = [1, 6]
test_lengths = [[7, 9]]
train_examples = 64
eval_examples = 12
[[variants]]
name = "rope"
positional = { kind = "rope" }
[[variants]]
name = "none"
positional = { kind = "none" }
"#;

fn command(dir: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_poslab"));
    c.args(args)
        .current_dir(dir)
        .env("RAYON_NUM_THREADS", "1")
        .stdin(Stdio::null());
    c
}

fn poslab(dir: &Path, args: &[&str]) -> Output {
    command(dir, args).output().unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// `poslab compare run.toml --out OUT -q --jobs 1 EXTRA...` in `dir`.
fn compare(dir: &Path, out: &str, extra: &[&str]) -> Output {
    let mut args = vec!["compare", "run.toml", "--out", out, "-q"];
    if !extra.contains(&"--jobs") {
        args.extend(["--jobs", "1"]);
    }
    args.extend_from_slice(extra);
    poslab(dir, &args)
}

/// The command `inspect` (its output `text`) gives to continue an unfinished run.
fn continue_command(text: &str) -> &str {
    let hint = text
        .lines()
        .find_map(|l| l.strip_prefix("unfinished: continue it with "))
        .unwrap_or_else(|| panic!("{text}"));
    hint.split(" (the same").next().unwrap()
}

fn assert_ok(out: &Output, what: &str) {
    assert!(out.status.success(), "{what}: {}", stderr(out));
}

fn read(path: impl AsRef<Path>) -> Vec<u8> {
    std::fs::read(path.as_ref()).unwrap_or_else(|e| panic!("{}: {e}", path.as_ref().display()))
}

/// Every file under `dir` whose name marks it a temporary of an atomic write.
fn temporaries(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if e.file_name().to_string_lossy().contains(".tmp") {
                found.push(p);
            }
        }
    }
    found
}

/// A folder with run.toml and the uninterrupted run's results.json.
fn setup() -> (tempfile::TempDir, Vec<u8>) {
    let root = tempfile::tempdir().unwrap();
    std::fs::write(root.path().join("run.toml"), RUN).unwrap();
    assert_ok(&compare(root.path(), "whole", &[]), "the uninterrupted run");
    let whole = read(root.path().join("whole/results.json"));
    (root, whole)
}

/// The device and threads each cell's timing record names (`cpu (1 job x 2 threads)`).
fn timing_devices(run: &Path) -> Vec<String> {
    let timing: serde_json::Value = serde_json::from_slice(&read(run.join("timing.json"))).unwrap();
    timing
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["device"].as_str().unwrap().to_string())
        .collect()
}

/// Each job's threads come from `--threads`, else `RAYON_NUM_THREADS` when set, else the cores
/// shared out among the jobs; the timing records say which ran, and the results are the same
/// bytes whatever it was.
#[test]
fn threads_per_job_show_in_the_timing_and_change_no_result() {
    let (root, whole) = setup();
    let d = root.path();
    // setup's run: one job, RAYON_NUM_THREADS=1 (command's environment).
    let all = |run: &str, label: &str| {
        let devices = timing_devices(&d.join(run));
        assert_eq!(devices.len(), 8, "{run}");
        assert!(
            devices.iter().all(|l| l == &format!("cpu ({label})")),
            "{run}: {devices:?}"
        );
    };
    all("whole", "1 job x 1 thread");
    // --threads wins over the variable.
    assert_ok(
        &compare(d, "t3", &["--jobs", "2", "--threads", "3"]),
        "--threads 3",
    );
    assert!(read(d.join("t3/results.json")) == whole);
    all("t3", "2 jobs x 3 threads");
    // Neither: the cores shared out (one job gets them all).
    let out = command(
        d,
        &["compare", "run.toml", "--out", "cores", "-q", "--jobs", "1"],
    )
    .env_remove("RAYON_NUM_THREADS")
    .output()
    .unwrap();
    assert_ok(&out, "no --threads, no RAYON_NUM_THREADS");
    assert!(read(d.join("cores/results.json")) == whole);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    all(
        "cores",
        &format!(
            "1 job x {cores} thread{}",
            if cores == 1 { "" } else { "s" }
        ),
    );
}

#[test]
fn a_compare_killed_anywhere_resumes_to_the_uninterrupted_results() {
    let (root, whole) = setup();
    let d = root.path();
    // During a cell's training, after its model is saved, with its record half written,
    // between cells, after the last cell, and while the report is written.
    let points = [
        "cell-1-step-17",
        "cell-1-saved",
        "cell-1-record",
        "cell-1-done",
        "cell-7-done",
        "report",
    ];
    for (n, point) in points.iter().enumerate() {
        let out = format!("killed-{n}");
        let killed = compare(d, &out, &["--kill-at", point]);
        assert_eq!(
            killed.status.signal(),
            Some(9),
            "{point}: {}",
            stderr(&killed)
        );
        assert!(!d.join(&out).join("results.json").exists(), "{point}");
        if *point == "cell-1-record" {
            // A torn record never replaces the file: it sits in a temporary, the cell unfinished.
            let torn = temporaries(&d.join(&out).join("cells/word_order/none"));
            assert_eq!(torn.len(), 1, "{point}: {torn:?}");
            assert!(!d
                .join(&out)
                .join("cells/word_order/none/seed0.json")
                .exists());
        }
        // The same command again (with another number of jobs: it changes nothing) continues.
        let resumed = compare(d, &out, &["--jobs", "2"]);
        assert_ok(&resumed, point);
        let done_before = match *point {
            "cell-1-step-17" | "cell-1-saved" | "cell-1-record" => 1,
            "cell-1-done" => 2,
            _ => 8,
        };
        assert!(
            stderr(&resumed).contains(&format!(
                "{done_before} of 8 cells were done before, {} to run",
                8 - done_before
            )),
            "{point}: {}",
            stderr(&resumed)
        );
        assert!(
            read(d.join(&out).join("results.json")) == whole,
            "{point}: the resumed results.json differs from the uninterrupted run's"
        );
        assert_eq!(temporaries(&d.join(&out)), Vec::<PathBuf>::new(), "{point}");
    }
}

#[test]
fn kill_nine_at_random_moments_until_done_gives_the_same_bytes() {
    let (root, whole) = setup();
    let d = root.path();
    // Kills from outside, at moments nothing in the program chose, as a preempting scheduler
    // sends them; each start continues from what the last one finished.
    let delays = [90u64, 260, 140, 420, 60, 330, 200, 510, 120, 290];
    let (mut kills, mut finished) = (0, false);
    for i in 0..60 {
        let mut child: Child = command(d, &["compare", "run.toml", "--out", "k", "-q"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(delays[i % delays.len()]));
        if let Some(status) = child.try_wait().unwrap() {
            assert!(status.success(), "run {i} failed: {status}");
            finished = true;
            break;
        }
        child.kill().unwrap();
        child.wait().unwrap();
        kills += 1;
    }
    if !finished {
        assert_ok(&compare(d, "k", &[]), "the last start");
    }
    assert!(kills >= 1, "no run was killed");
    assert!(
        read(d.join("k/results.json")) == whole,
        "after {kills} kills the results differ"
    );
}

#[test]
fn a_resume_keeps_its_config_its_cells_and_its_shard() {
    let (root, whole) = setup();
    let d = root.path();
    let killed = compare(d, "r", &["--kill-at", "cell-2-done"]);
    assert_eq!(killed.status.signal(), Some(9));
    // Another config into the folder: refused, naming the first difference.
    std::fs::write(
        d.join("other.toml"),
        RUN.replace("steps = 30", "steps = 31"),
    )
    .unwrap();
    let out = poslab(d, &["compare", "other.toml", "--out", "r", "-q"]);
    let e = stderr(&out);
    assert!(
        !out.status.success()
            && e.contains("of another experiment config")
            && e.contains("train.budget.steps: 30 vs 31"),
        "{e}"
    );
    // Even with --overwrite: one folder holds one experiment.
    let out = poslab(
        d,
        &["compare", "other.toml", "--out", "r", "-q", "--overwrite"],
    );
    assert!(!out.status.success() && stderr(&out).contains("never replaces another experiment"));
    // Other cells of the same experiment: refused, saying what each is.
    let out = compare(d, "r", &["--seed", "0"]);
    let e = stderr(&out);
    assert!(
        !out.status.success()
            && e.contains(
                "already holds a compare run (every cell, 8 cells, on cpu with the layer kernels)"
            )
            && e.contains(
                "this is a compare run (--seed 0, 4 cells, on cpu with the layer kernels)"
            ),
        "{e}"
    );
    assert_eq!(
        e.lines().count(),
        2,
        "a header line and one error line: {e}"
    );
    // The same cells with other kernels, which agree to within rounding, not bit for bit:
    // refused, saying which each computes with.
    let out = compare(d, "r", &["--kernels", "reference"]);
    let e = stderr(&out);
    assert!(
        !out.status.success()
            && e.contains("(every cell, 8 cells, on cpu with the layer kernels)")
            && e.contains("(every cell, 8 cells, on cpu with the reference kernels)"),
        "{e}"
    );
    // A folder from before the kernels were recorded resumes with them.
    let manifest = d.join("r/run.json");
    let mut m: serde_json::Value = serde_json::from_slice(&read(&manifest)).unwrap();
    assert_eq!(m["kernels"], "layer");
    m.as_object_mut().unwrap().remove("kernels");
    std::fs::write(&manifest, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
    // `inspect` says where the run stands and how to continue it; that command finishes it.
    let out = poslab(d, &["inspect", "r"]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(text.contains("cells: 3 of 8 done"), "{text}");
    let hint = continue_command(&text);
    let args: Vec<&str> = hint.split_whitespace().skip(1).collect();
    assert_eq!(args[0], "compare", "{hint}");
    assert_ok(&poslab(d, &args), hint);
    assert!(read(d.join("r/results.json")) == whole);

    // A shard, killed and requeued, continues its own cells.
    let shard = poslab(
        d,
        &[
            "compare",
            "run.toml",
            "--shard",
            "1/3",
            "--out",
            "s1",
            "-q",
            "--jobs",
            "1",
            "--kill-at",
            "cell-1-done",
        ],
    );
    assert_eq!(shard.status.signal(), Some(9), "{}", stderr(&shard));
    let again = poslab(
        d,
        &["compare", "run.toml", "--shard", "1/3", "--out", "s1", "-q"],
    );
    assert_ok(&again, "the requeued shard");
    assert!(
        stderr(&again).contains("2 of 3 cells were done before"),
        "{}",
        stderr(&again)
    );
    let whole_shard = poslab(
        d,
        &[
            "compare", "run.toml", "--shard", "1/3", "--out", "s1w", "-q",
        ],
    );
    assert_ok(&whole_shard, "the uninterrupted shard");
    assert!(read(d.join("s1/results.json")) == read(d.join("s1w/results.json")));
    // The shard is refused as shard 2/3's folder.
    let out = poslab(
        d,
        &["compare", "run.toml", "--shard", "2/3", "--out", "s1", "-q"],
    );
    assert!(
        stderr(&out).contains("(shard 1/3, 3 cells, on cpu with the layer kernels)"),
        "{}",
        stderr(&out)
    );
    // A run begun with other kernels is continued with them.
    let killed = compare(
        d,
        "k",
        &["--kernels", "reference", "--kill-at", "cell-1-done"],
    );
    assert_eq!(killed.status.signal(), Some(9));
    let text = String::from_utf8_lossy(&poslab(d, &["inspect", "k"]).stdout).into_owned();
    let hint = continue_command(&text);
    assert!(hint.ends_with("--kernels reference"), "{hint}");
    let args: Vec<&str> = hint.split_whitespace().skip(1).collect();
    let again = poslab(d, &args);
    assert_ok(&again, hint);
    assert!(
        stderr(&again).contains("2 of 8 cells were done before"),
        "{}",
        stderr(&again)
    );
}

#[test]
fn one_writer_per_run_folder() {
    let root = tempfile::tempdir().unwrap();
    let d = root.path();
    // A run long enough to be caught running: 1 task x 2 variants x 1 seed, 3000 steps each.
    let slow = RUN
        .replace("steps = 30", "steps = 3000")
        .replace("seeds = 2", "seeds = 1");
    let slow = &slow[..slow.find("[[tasks]]\nkind = \"reverse_string\"").unwrap()];
    let slow = format!("{slow}[[variants]]\nname = \"rope\"\npositional = {{ kind = \"rope\" }}\n[[variants]]\nname = \"none\"\npositional = {{ kind = \"none\" }}\n");
    std::fs::write(d.join("run.toml"), &slow).unwrap();
    let mut first = command(
        d,
        &["compare", "run.toml", "--out", "busy", "-q", "--jobs", "1"],
    )
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    let started = Instant::now();
    while !d.join("busy/config.toml").exists() {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the first run never started"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let pid = first.id();
    let second = compare(d, "busy", &[]);
    let e = stderr(&second);
    assert!(
        !second.status.success()
            && e.contains("busy is being written by another poslab process right now")
            && e.contains(&format!("pid {pid} (poslab compare)")),
        "{e}"
    );
    // Nor is a folder merged while it is written.
    let report = poslab(d, &["report", "busy", "--out", "merged"]);
    assert!(
        !report.status.success() && stderr(&report).contains("is being written by"),
        "{}",
        stderr(&report)
    );
    assert!(first.wait().unwrap().success(), "the first run failed");
    // The first run's results are whole: those of the same run alone.
    assert_ok(&compare(d, "alone", &[]), "the run alone");
    assert!(read(d.join("busy/results.json")) == read(d.join("alone/results.json")));
}

#[test]
fn overwrite_removes_only_what_poslab_wrote() {
    let (root, whole) = setup();
    let d = root.path();
    // A folder a user also keeps their own things in.
    let mine = d.join("mine");
    let theirs = [
        "models/all-MiniLM-L6-v2/model.safetensors",
        "plots/my_figure.png",
        "notes.txt",
    ];
    for f in theirs {
        let p = mine.join(f);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, "the user's").unwrap();
    }
    assert_ok(&compare(d, "mine", &[]), "a run beside the user's files");
    // One more user file, inside a model folder poslab made.
    std::fs::write(
        mine.join("models/word_order/rope/seed0/NOTES"),
        "the user's",
    )
    .unwrap();
    let again = compare(d, "mine", &["--overwrite"]);
    assert_ok(&again, "--overwrite");
    assert!(!stderr(&again).contains("resuming"), "{}", stderr(&again));
    for f in theirs.iter().chain(&["models/word_order/rope/seed0/NOTES"]) {
        assert_eq!(read(mine.join(f)), b"the user's", "{f}");
    }
    assert!(read(mine.join("results.json")) == whole);

    // A file of the user's where poslab would write: refused, untouched, nothing written.
    let other = d.join("other");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(other.join("report.md"), "the user's report").unwrap();
    let out = compare(d, "other", &[]);
    let e = stderr(&out);
    assert!(
        !out.status.success()
            && e.contains("holds report.md, which no poslab run recorded writing there"),
        "{e}"
    );
    assert_eq!(read(other.join("report.md")), b"the user's report");
    assert!(!other.join("run.json").exists() && !other.join("cells").exists());
    let out = compare(d, "other", &["--overwrite"]);
    assert!(
        !out.status.success(),
        "--overwrite does not take a user's file either"
    );
    assert_eq!(read(other.join("report.md")), b"the user's report");
}

/// A finished run's results.json, config.toml and run.json copied into `name`, results.json
/// changed by `edit`.
fn edited(d: &Path, name: &str, edit: impl FnOnce(&mut serde_json::Value)) -> PathBuf {
    let dir = d.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.toml", "run.json", "timing.json"] {
        std::fs::copy(d.join("whole").join(f), dir.join(f)).unwrap();
    }
    let mut json: serde_json::Value =
        serde_json::from_slice(&read(d.join("whole/results.json"))).unwrap();
    edit(&mut json);
    std::fs::write(
        dir.join("results.json"),
        serde_json::to_vec_pretty(&json).unwrap(),
    )
    .unwrap();
    dir
}

/// An edit of a finished run's results.json.
type Edit = Box<dyn FnOnce(&mut serde_json::Value)>;

/// Each `(name, edit, expected)`: the finished run's results edited into folder `name`, which
/// `report` refuses (exit 1) in one line naming the file and holding every `expected`,
/// writing nothing.
fn refused_edits(d: &Path, cases: Vec<(&str, Edit, &[&str])>) {
    for (name, edit, expected) in cases {
        edited(d, name, edit);
        let out = poslab(d, &["report", name, "--out", &format!("{name}-merged")]);
        let e = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{name}: {e}");
        let file = format!("{name}/results.json");
        assert!(
            e.contains(&file) && expected.iter().all(|x| e.contains(x)) && e.lines().count() == 1,
            "{name}: {e}"
        );
        assert!(
            !d.join(format!("{name}-merged")).exists(),
            "{name}: nothing written"
        );
    }
}

#[test]
fn a_report_merges_parts_computed_alike_and_refuses_parts_computed_otherwise() {
    let (root, whole) = setup();
    let d = root.path();
    let manifest = |run: &str| -> serde_json::Value {
        serde_json::from_slice(&read(d.join(run).join("run.json"))).unwrap()
    };
    assert_ok(&compare(d, "s0", &["--seed", "0"]), "seed 0");
    let reference = ["--seed", "1", "--kernels", "reference"];
    assert_ok(&compare(d, "s1", &reference), "seed 1, reference kernels");
    // Kernels agree to within rounding, not bit for bit: the merge would not be the run.
    let out = poslab(d, &["report", "s0", "s1", "--out", "mixed"]);
    let e = stderr(&out);
    assert!(
        !out.status.success()
            && e.contains("s0 computed its cells with the layer kernels and s1 with the reference")
            && e.contains("Rerun the cells of s1 into a new folder with --kernels layer"),
        "{e}"
    );
    assert!(!d.join("mixed").exists());
    // Computed alike: the merge is the whole run, and its manifest says how it was computed.
    assert_ok(&compare(d, "s1-layer", &["--seed", "1"]), "seed 1");
    assert_ok(
        &poslab(d, &["report", "s0", "s1-layer", "--out", "m"]),
        "report",
    );
    assert!(read(d.join("m/results.json")) == whole);
    let merged = manifest("m");
    assert_eq!(
        (&merged["device"], &merged["kernels"]),
        (&"cpu".into(), &"layer".into())
    );
    // A part from before kernels were recorded joins any, and the report claims none.
    let mut old = manifest("s1");
    old.as_object_mut().unwrap().remove("kernels");
    std::fs::write(
        d.join("s1/run.json"),
        serde_json::to_vec_pretty(&old).unwrap(),
    )
    .unwrap();
    assert_ok(
        &poslab(d, &["report", "s0", "s1", "--out", "o"]),
        "old part",
    );
    let merged = manifest("o");
    assert_eq!(merged["device"], "cpu");
    assert!(merged.get("kernels").is_none(), "{merged}");
}

#[test]
fn report_refuses_what_a_results_file_should_not_hold() {
    let (root, _) = setup();
    let d = root.path();
    let cell = |j: &mut serde_json::Value, i: usize| j["cells"][i].clone();
    let cases: Vec<(&str, Edit, &[&str])> = vec![
        (
            "duplicated",
            Box::new(move |j| {
                let c = cell(j, 0);
                j["cells"].as_array_mut().unwrap().push(c);
            }),
            &["cell word_order/rope/seed0 appears twice"],
        ),
        (
            "unknown_task",
            Box::new(|j| j["cells"][0]["task"] = "ghost".into()),
            &[
                "cell ghost/rope/seed0",
                "task `ghost` is not in the experiment's config",
            ],
        ),
        (
            "unknown_variant",
            Box::new(|j| j["cells"][0]["variant"] = "alibi".into()),
            &[
                "cell word_order/alibi/seed0",
                "variant `alibi` is not in the experiment's config",
            ],
        ),
        (
            "unknown_seed",
            Box::new(|j| j["cells"][0]["seed"] = 7.into()),
            &[
                "cell word_order/rope/seed7",
                "seed 7 is not among the experiment's seeds [0, 1]",
            ],
        ),
        (
            "out_of_range",
            Box::new(|j| {
                j["cells"][1]["evaluations"][0]["outcome"]["scored"]["accuracy"] = 5.0.into()
            }),
            &[
                "cell word_order/rope/seed1",
                "test `1x`: accuracy 5 is outside 0..1",
            ],
        ),
        (
            "empty",
            Box::new(|j| j["cells"] = serde_json::json!([])),
            &["holds no cells (an empty list)"],
        ),
        // One example's outcome flipped: the outcomes no longer give the cell's accuracy.
        (
            "flipped_example",
            Box::new(|j| {
                let examples = &mut j["cells"][1]["evaluations"][0]["examples"];
                let right = examples["right"].as_str().unwrap().to_string();
                // The first byte (the first example's varint, 0 or 1) is the first base64
                // character's 6 bits (0: `A`) and the top 2 of the second's: `A` for 0, `Q`
                // for 1 (the second byte, 0 or 1, leaves its other 4 bits 0).
                let flipped = match &right[1..2] {
                    "A" => format!("{}Q{}", &right[..1], &right[2..]),
                    _ => format!("{}A{}", &right[..1], &right[2..]),
                };
                examples["right"] = flipped.into();
            }),
            &[
                "cell word_order/rope/seed1",
                "test `1x`: accuracy",
                "but its example outcomes give",
            ],
        ),
        (
            "damaged_examples",
            Box::new(|j| j["cells"][1]["evaluations"][0]["examples"]["right"] = "%%".into()),
            &[
                "cell word_order/rope/seed1",
                "its example outcomes are damaged: right outputs: not base64",
            ],
        ),
        (
            "untested_length",
            Box::new(|j| {
                let cells = j["cells"].as_array_mut().unwrap();
                let c = cells
                    .iter_mut()
                    .find(|c| c["task"] == "reverse_string")
                    .unwrap();
                let e = &mut c["evaluations"][1]["outcome"]["scored"];
                assert_eq!(e["by_length"][2]["length"], 9);
                e["by_length"].as_array_mut().unwrap().pop();
            }),
            &["cell reverse_string/rope/seed0", "test `7-9`"],
        ),
    ];
    refused_edits(d, cases);
    // An unfinished run: refused, saying how to finish it; with --allow-partial its finished
    // cells are merged and the report says it is partial (exit status 3).
    let killed = compare(d, "unfinished", &["--kill-at", "cell-2-done"]);
    assert_eq!(killed.status.signal(), Some(9));
    let out = poslab(d, &["report", "unfinished", "--out", "m1"]);
    let e = stderr(&out);
    assert!(
        e.contains("unfinished is an unfinished run (every cell: 3 of 8 cells done)")
            && e.contains("--allow-partial"),
        "{e}"
    );
    let out = poslab(
        d,
        &["report", "unfinished", "--out", "m2", "--allow-partial"],
    );
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("partial: 3 of 8 cells"),
        "{}",
        stderr(&out)
    );
}

/// Copies `what` (a file or folder, relative to a run folder) from run `from` to run `to`.
fn copy_into(from: &Path, to: &Path, what: &str) {
    let (src, dst) = (from.join(what), to.join(what));
    if src.is_dir() {
        std::fs::create_dir_all(&dst).unwrap();
        for e in std::fs::read_dir(&src).unwrap().flatten() {
            copy_into(
                from,
                to,
                &format!("{what}/{}", e.file_name().to_string_lossy()),
            );
        }
    } else {
        std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
        std::fs::copy(&src, &dst).unwrap();
    }
}

/// Every cell carries the fingerprint of the config that made it: a cell of another config
/// (another learning rate), in `cells/` or spliced into `results.json`, is refused by merges and
/// run again by resumes; a summary that disagrees with its cells (an edited loss) is refused;
/// and damaged records are reported as damage, naming the file, not as absence.
#[test]
fn a_cell_carries_the_fingerprint_of_the_config_that_made_it() {
    let (root, whole) = setup();
    let d = root.path();
    std::fs::write(
        d.join("other.toml"),
        RUN.replace("batch_size = 16", "batch_size = 16\nlr = 5e-3"),
    )
    .unwrap();
    let other = poslab(
        d,
        &[
            "compare",
            "other.toml",
            "--out",
            "other",
            "-q",
            "--jobs",
            "1",
        ],
    );
    assert_ok(&other, "the other config's run");
    let foreign = "cells/word_order/none/seed1.json";
    let foreign_model = "models/word_order/none/seed1";

    // Resume: the foreign cell, placed where the killed run has not yet been, is run again.
    let killed = compare(d, "r", &["--kill-at", "cell-2-done"]);
    assert_eq!(killed.status.signal(), Some(9));
    copy_into(&d.join("other"), &d.join("r"), foreign);
    copy_into(&d.join("other"), &d.join("r"), foreign_model);
    // Before it is resumed, a partial report calls it what it is.
    let out = poslab(d, &["report", "r", "--out", "rm", "--allow-partial"]);
    let e = stderr(&out);
    assert!(
        out.status.code() == Some(1)
            && e.contains("unusable cell records")
            && e.contains(foreign)
            && e.contains("made by another config")
            && !e.contains("missing"),
        "{e}"
    );
    let resumed = compare(d, "r", &[]);
    assert_ok(&resumed, "the resume");
    let e = stderr(&resumed);
    assert!(
        e.contains("cell word_order/none/seed1: runs again")
            && e.contains("made by another config")
            && e.contains("3 of 8 cells were done before, 5 to run"),
        "{e}"
    );
    assert!(
        read(d.join("r/results.json")) == whole,
        "the resumed results.json differs from the uninterrupted run's"
    );

    // A partial report: a truncated record, and a record copied over another cell's, are
    // damage, named by file.
    let killed = compare(d, "p", &["--kill-at", "cell-2-done"]);
    assert_eq!(killed.status.signal(), Some(9));
    let first = d.join("p/cells/word_order/rope/seed0.json");
    let text = read(&first);
    std::fs::write(&first, &text[..text.len() / 2]).unwrap();
    let out = poslab(d, &["report", "p", "--out", "pm", "--allow-partial"]);
    let e = stderr(&out);
    assert!(
        out.status.code() == Some(1)
            && e.contains("cells/word_order/rope/seed0.json: unreadable")
            && !e.contains("missing"),
        "{e}"
    );
    std::fs::copy(d.join("p/cells/word_order/none/seed0.json"), &first).unwrap();
    let out = poslab(d, &["report", "p", "--out", "pm", "--allow-partial"]);
    let e = stderr(&out);
    assert!(
        out.status.code() == Some(1)
            && e.contains("cells/word_order/rope/seed0.json: holds cell word_order/none/seed0")
            && !d.join("pm").exists(),
        "{e}"
    );

    // Merges: a foreign cell spliced into results.json, and an edited loss or score.
    let theirs: serde_json::Value =
        serde_json::from_slice(&read(d.join("other/results.json"))).unwrap();
    let spliced = theirs["cells"][0].clone();
    assert_eq!(spliced["task"], "word_order");
    let cases: Vec<(&str, Edit, &[&str])> = vec![
        (
            "spliced",
            Box::new(move |j| j["cells"][0] = spliced),
            &["cell word_order/rope/seed0", "made by another config"],
        ),
        (
            "no_fingerprint",
            Box::new(|j| {
                j["cells"][0]
                    .as_object_mut()
                    .unwrap()
                    .remove("config_sha256");
            }),
            &["cell word_order/rope/seed0", "fingerprint `none`"],
        ),
        (
            "edited_loss",
            Box::new(|j| {
                j["cells"][1]["evaluations"][0]["outcome"]["scored"]["loss"] = 0.001.into()
            }),
            &[
                "its summary of word_order/rope disagrees with its cells",
                "1x",
            ],
        ),
        (
            "edited_train_loss",
            Box::new(|j| j["cells"][2]["final_train_loss"] = 0.001.into()),
            &["disagrees with its cells", "train loss"],
        ),
        (
            "edited_score",
            Box::new(|j| {
                j["cells"][1]["evaluations"][0]["outcome"]["scored"]["accuracy"] = 0.999.into()
            }),
            &[
                "cell word_order/rope/seed1",
                "accuracy 0.999",
                "example outcomes",
            ],
        ),
    ];
    refused_edits(d, cases);
    // The untouched results merge (the checks refuse only what is wrong).
    edited(d, "untouched", |_| {});
    assert_ok(
        &poslab(d, &["report", "untouched", "--out", "untouched-merged"]),
        "the untouched results",
    );
}

#[test]
fn test_ranges_are_tested_at_every_length_their_columns_name() {
    let err =
        ExperimentConfig::from_toml_str(&RUN.replace("eval_examples = 12", "eval_examples = 2"))
            .unwrap_err()
            .to_string();
    assert!(
        err.contains("task `reverse_string`: eval_examples = 2 cannot test every length of the range 1-6 (6 lengths")
            && err.contains("at least 6"),
        "{err}"
    );
    let err = ExperimentConfig::from_toml_str(
        &RUN.replace("test_lengths = [[7, 9]]", "test_lengths = [[11, 100]]")
            .replace("eval_examples = 12", "eval_examples = 3"),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("range 11-100 (90 lengths") && err.contains("at least 90"),
        "{err}"
    );

    // Every column of a run says the lengths its results hold.
    let (root, whole) = setup();
    let results: poslab::runs::results::Results = serde_json::from_slice(&whole).unwrap();
    let md = std::fs::read_to_string(root.path().join("whole/report.md")).unwrap();
    let config = ExperimentConfig::from_toml_str(RUN).unwrap();
    for (task, spec) in results.tasks.iter().zip(&config.tasks) {
        let data = spec.generate().unwrap();
        for (test, set) in task.tests.iter().zip(&data.tests) {
            let [a, b] = test.lengths;
            assert_eq!([a, b], set.tested_lengths(), "{}", test.name);
            // With the test set's size, which is its examples'.
            assert_eq!(test.examples, set.examples.len(), "{}", test.name);
            let n = set.examples.len();
            let header = match test.factor {
                Some(_) => format!("{} (len {a}-{b}, n={n})", test.name),
                None => format!("len {a}-{b}, n={n}"),
            };
            assert!(md.contains(&header), "{header}");
            for c in results.cells.iter().filter(|c| c.task == task.name) {
                if let Some(poslab::runs::results::Outcome::Scored { by_length, .. }) =
                    c.evaluation(&test.name)
                {
                    if test.factor.is_none() {
                        let lengths: Vec<usize> = by_length.iter().map(|s| s.length).collect();
                        assert_eq!(lengths, (a..=b).collect::<Vec<_>>(), "{}", test.name);
                    }
                }
            }
        }
    }
}

#[test]
fn progress_reaches_a_log_before_the_run_ends() {
    let root = tempfile::tempdir().unwrap();
    let d = root.path();
    std::fs::write(
        d.join("train.toml"),
        "name = \"logged\"\n[model]\nd_model = 16\nn_heads = 2\nn_layers = 1\nffn_dim = 32\n\
         [positional]\nkind = \"rope\"\n[train]\nbudget = { steps = 20000 }\n\
         [task]\nkind = \"word_order\"\nlengths = [5, 8]\ntrain_examples = 200\neval_examples = 40\n",
    )
    .unwrap();
    std::fs::write(
        d.join("run.toml"),
        RUN.replace("steps = 30", "steps = 20000"),
    )
    .unwrap();
    let wanted = [
        (
            vec![
                "train",
                "--config",
                "train.toml",
                "--out",
                "t",
                "--log-every",
                "0.1",
            ],
            "logged: step ",
        ),
        (
            vec![
                "compare",
                "run.toml",
                "--out",
                "c",
                "--jobs",
                "1",
                "--log-every",
                "0.1",
            ],
            "compare: 0/8 cells done; word_order/rope/seed0 step ",
        ),
    ];
    for (args, prefix) in wanted {
        // Standard error is a pipe, not a terminal: plain lines, no bars.
        let mut child = command(d, &args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
        let line = lines
            .by_ref()
            .map_while(|l| l.ok())
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no progress line {prefix:?}"));
        // The run is still going (it has steps to go): the line came before its end.
        assert!(child.try_wait().unwrap().is_none(), "{line}");
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(
            line.contains("/20000") && line.contains(" loss ") && line.contains(" elapsed"),
            "{line}"
        );
    }
    let bad = poslab(d, &["train", "--config", "train.toml", "--log-every", "0"]);
    assert!(stderr(&bad).contains("--log-every 0"), "{}", stderr(&bad));
}

#[test]
fn an_experiment_is_checked_and_costed_before_it_runs() {
    let root = tempfile::tempdir().unwrap();
    let d = root.path();
    std::fs::write(d.join("run.toml"), RUN).unwrap();
    let out = poslab(d, &["compare", "run.toml", "--dry-run", "--shard", "1/3"]);
    assert_ok(&out, "dry run");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        text.contains("2 tasks x 2 variants x 2 seeds = 8 cells; shard 1/3 holds 3 of them"),
        "{text}"
    );
    // Shard 1 of 3: cells 1, 4 and 7 in run order.
    let cells: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("/seed"))
        .map(|l| l.split_whitespace().next().unwrap())
        .collect();
    assert_eq!(
        cells,
        [
            "word_order/none/seed0",
            "reverse_string/rope/seed0",
            "reverse_string/none/seed1"
        ]
    );
    assert!(text.contains("total: 3 cells"), "{text}");
    assert!(!d.join("runs").exists(), "a dry run writes nothing");
    // One of a kind is counted in the singular.
    std::fs::write(d.join("one.toml"), RUN.replace("seeds = 2", "seeds = 1")).unwrap();
    let out = poslab(d, &["compare", "one.toml", "--dry-run"]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        text.contains("2 tasks x 2 variants x 1 seed = 4 cells"),
        "{text}"
    );
    // What only the data can show (randomized positions fewer than the inputs' tokens) is
    // found before anything runs.
    std::fs::write(
        d.join("bad.toml"),
        RUN.replace(
            "name = \"none\"\n",
            "name = \"none\"\nrandom_positions = 4\n",
        ),
    )
    .unwrap();
    let out = poslab(d, &["compare", "bad.toml", "--dry-run"]);
    assert!(
        !out.status.success() && stderr(&out).contains("random_positions = 4"),
        "{}",
        stderr(&out)
    );
    // inspect tells an experiment config from a train config and a model config.
    let out = poslab(d, &["inspect", "run.toml"]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        text.contains("a valid experiment config (for poslab compare), `survive`: 2 tasks x 2 variants x 2 seeds = 8 cells")
            && text.contains("--dry-run"),
        "{text}"
    );
    let train = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/train_reviews.toml");
    let out = poslab(d, &["inspect", train.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        text.contains("a valid train config (for poslab train)"),
        "{text}"
    );
}

/// The dry run looks at `--out` exactly as the run does: a folder of another config is refused
/// with the run's words; a finished run or shard has 0 cells to run; a killed run lists only the
/// cells still to run, and a foreign record among them is named; a folder that does not exist is
/// not made.
#[test]
fn a_dry_run_looks_at_its_folder_as_the_run_does() {
    let (root, _) = setup();
    let d = root.path();
    let cells_listed = |text: &str| -> Vec<String> {
        text.lines()
            .filter(|l| l.contains("/seed") && !l.starts_with("note"))
            .map(|l| l.split_whitespace().next().unwrap().to_string())
            .collect()
    };
    // A finished run, and a finished shard: nothing to run.
    let out = poslab(d, &["compare", "run.toml", "--dry-run", "--out", "whole"]);
    assert_ok(&out, "the finished run's dry run");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        text.contains("--out whole: holds this run, which continues: 8 of 8 cells done, 0 to run")
            && text.contains("total: 0 cells")
            && cells_listed(&text).is_empty(),
        "{text}"
    );
    let shard = ["compare", "run.toml", "--shard", "1/3", "--out", "s1", "-q"];
    assert_ok(&poslab(d, &shard), "the shard");
    let out = poslab(
        d,
        &[
            "compare",
            "run.toml",
            "--shard",
            "1/3",
            "--out",
            "s1",
            "--dry-run",
        ],
    );
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(text.contains("3 of 3 cells done, 0 to run"), "{text}");
    // Another config into the finished run's folder: the run's refusal, word for word.
    std::fs::write(
        d.join("other.toml"),
        RUN.replace("steps = 30", "steps = 31"),
    )
    .unwrap();
    let dry = poslab(d, &["compare", "other.toml", "--out", "whole", "--dry-run"]);
    let real = poslab(d, &["compare", "other.toml", "--out", "whole", "-q"]);
    assert!(
        !dry.status.success() && stderr(&dry).contains("of another experiment config"),
        "{}",
        stderr(&dry)
    );
    let last = |o: &Output| stderr(o).lines().last().unwrap_or("").to_string();
    assert_eq!(last(&dry), last(&real));
    // Other cells of the same config: refused as the run refuses them.
    let dry = poslab(
        d,
        &[
            "compare",
            "run.toml",
            "--out",
            "s1",
            "--dry-run",
            "--shard",
            "2/3",
        ],
    );
    assert!(
        !dry.status.success()
            && stderr(&dry).contains("(shard 1/3, 3 cells, on cpu with the layer kernels)"),
        "{}",
        stderr(&dry)
    );
    // A killed run: the cells still to run, and a foreign record named as the run names it.
    let killed = compare(d, "r", &["--kill-at", "cell-2-done"]);
    assert_eq!(killed.status.signal(), Some(9));
    let foreign = RUN.replace("batch_size = 16", "batch_size = 16\nlr = 5e-3");
    std::fs::write(d.join("foreign.toml"), foreign).unwrap();
    let f = poslab(
        d,
        &["compare", "foreign.toml", "--out", "f", "-q", "--seed", "0"],
    );
    assert_ok(&f, "the foreign run");
    let record = "cells/word_order/rope/seed0.json";
    std::fs::copy(d.join("f").join(record), d.join("r").join(record)).unwrap();
    let out = poslab(d, &["compare", "run.toml", "--out", "r", "--dry-run"]);
    assert_ok(&out, "the killed run's dry run");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        text.contains("holds this run, which continues: 2 of 8 cells done, 6 to run")
            && text.contains("note: cell word_order/rope/seed0: runs again")
            && text.contains("made by another config"),
        "{text}"
    );
    assert_eq!(cells_listed(&text).len(), 6, "{text}");
    assert!(!cells_listed(&text).contains(&"word_order/none/seed0".to_string()));
    // A folder not made yet is not made by a dry run.
    let out = poslab(d, &["compare", "run.toml", "--out", "new/run", "--dry-run"]);
    assert_ok(&out, "a new folder's dry run");
    assert!(String::from_utf8_lossy(&out.stdout).contains("--out new/run: a new folder"));
    assert!(!d.join("new").exists());
}

/// A dry run costs a sample of each generated task, one task at a time (the length suite's
/// shard 0/110 went from 6 min 20 s and 13.5 GB to about 30 s and 0.2 GB on 2 cores): the
/// same parameters and steps as from every example, and costs within 5%.
#[test]
fn a_dry_run_costs_a_sample_within_a_few_percent_of_every_example() {
    let config = ExperimentConfig::from_toml_str(
        r#"
name = "sampled"
seeds = 1
[model]
d_model = 16
n_heads = 2
n_layers = 1
ffn_dim = 32
[train]
budget = { steps = 100 }
batch_size = 32
[[tasks]]
kind = "reverse_string"
lengths = [1, 40]
test_lengths = [[41, 100], [101, 200]]
train_examples = 40000
eval_examples = 3000
[[tasks]]
kind = "binary_addition"
lengths = [1, 40]
test_lengths = [[41, 100]]
train_examples = 20000
eval_examples = 1500
[[variants]]
name = "learned"
positional = { kind = "learned" }
[[variants]]
name = "rope"
positional = { kind = "rope" }
"#,
    )
    .unwrap();
    let selection = poslab::runs::Selection::default();
    let limits = poslab::limits::Limits::default();
    let compute = poslab::nn::Compute {
        device: &poslab::candle::Device::Cpu,
        backend: Default::default(),
    };
    let sampled =
        poslab::runs::estimate::estimate(&config, &selection, 1, &limits, compute).unwrap();
    let whole =
        poslab::runs::estimate::estimate_from(&config, &selection, 1, None, &limits, compute)
            .unwrap();
    assert_eq!(sampled.sampled, ["reverse_string", "binary_addition"]);
    assert!(whole.sampled.is_empty());
    assert_eq!(sampled.cells.len(), 4);
    for (s, w) in sampled.cells.iter().zip(&whole.cells) {
        assert_eq!((&s.name, s.params, s.steps), (&w.name, w.params, w.steps));
        for (what, a, b) in [
            ("tokens/step", s.tokens_per_step, w.tokens_per_step),
            ("train", s.train_flop, w.train_flop),
            ("test", s.eval_flop, w.eval_flop),
        ] {
            assert!((a / b - 1.0).abs() < 0.05, "{}: {what} {a} vs {b}", s.name);
        }
    }
}

/// A cell that diverges stops the run with advice that works: training is deterministic, so
/// "run it again" would stop at the same step. The config changed, the folder (no cell finished)
/// is started over with --overwrite, and ends as a fresh folder of the fixed config does.
#[test]
fn a_run_stopped_by_divergence_is_started_over_with_the_fixed_config() {
    let (root, whole) = setup();
    let d = root.path();
    let diverging = RUN.replace(
        "eval_every = 10",
        "eval_every = 10\nlr = 1e30\nwarmup = 0.0\ngrad_clip = 0.0",
    );
    std::fs::write(d.join("bad.toml"), &diverging).unwrap();
    let out = poslab(
        d,
        &["compare", "bad.toml", "--out", "r", "-q", "--jobs", "1"],
    );
    let e = stderr(&out);
    assert!(!out.status.success(), "{e}");
    assert_eq!(
        e.matches("the loss became").count(),
        1,
        "the cause once: {e}"
    );
    assert!(
        e.contains("no cell finished, of 8")
            && e.contains("stops here again")
            && e.contains("--overwrite to start r over")
            && !e.contains("run the same command again"),
        "{e}"
    );
    // The fixed config: refused without --overwrite, saying that it would start the folder over.
    let out = compare(d, "r", &[]);
    let e = stderr(&out);
    assert!(
        !out.status.success()
            && e.contains("of another experiment config")
            && e.contains("it has no finished cell, so --overwrite starts it over"),
        "{e}"
    );
    assert_ok(
        &compare(d, "r", &["--overwrite"]),
        "the fixed config, --overwrite",
    );
    assert_eq!(read(d.join("r/results.json")), whole);
    assert!(temporaries(&d.join("r")).is_empty());
}

/// A compare folder given where a model is wanted says where its models are; the same folder
/// twice to `report` is refused by name instead of as a cell found twice.
#[test]
fn run_folders_given_for_models_or_twice_say_so() {
    let (root, _) = setup();
    let d = root.path();
    for args in [
        &["predict", "--run", "whole", "a text"][..],
        &["embed", "--run", "whole", "a text"],
        &["analyze", "--run", "whole"],
    ] {
        let out = poslab(d, args);
        let e = stderr(&out);
        assert!(
            !out.status.success()
                && e.contains("a `poslab compare` run folder, not a model")
                && e.contains("whole/models/<task>/<variant>/seed<N>"),
            "{args:?}: {e}"
        );
    }
    let out = poslab(d, &["report", "whole", "./whole", "--out", "merged"]);
    let e = stderr(&out);
    assert!(
        !out.status.success() && e.contains("whole and ./whole are the same folder"),
        "{e}"
    );
    assert!(!d.join("merged").exists());
    // `train --resume` of a compare folder says which command continues it.
    let out = poslab(d, &["train", "--resume", "whole"]);
    let e = stderr(&out);
    assert!(
        !out.status.success()
            && e.contains("holds a `poslab compare` run, not a `poslab train` one"),
        "{e}"
    );
}

/// A config given to the other command, and a file where a run folder must go, are named with
/// the fix, not as an unknown field or "File exists".
#[test]
fn configs_and_folders_in_the_wrong_place_say_where_they_go() {
    let root = tempfile::tempdir().unwrap();
    let d = root.path();
    std::fs::write(d.join("run.toml"), RUN).unwrap();
    let train = "name = \"t\"\n[model]\nd_model = 16\nn_heads = 2\nn_layers = 1\nffn_dim = 32\n\
                 [positional]\nkind = \"rope\"\n[train]\nbudget = { steps = 5 }\n\
                 [task]\nkind = \"word_order\"\nlengths = [5, 8]\ntrain_examples = 50\neval_examples = 10\n";
    std::fs::write(d.join("train.toml"), train).unwrap();
    for (args, says) in [
        (
            &["train", "--config", "run.toml"][..],
            "run it with `poslab compare run.toml`",
        ),
        (
            &["compare", "train.toml", "--dry-run"],
            "run it with `poslab train --config train.toml`",
        ),
    ] {
        let out = poslab(d, args);
        let e = stderr(&out);
        assert!(!out.status.success() && e.contains(says), "{args:?}: {e}");
    }
    std::fs::write(d.join("afile"), "").unwrap();
    for args in [
        &["train", "--config", "train.toml", "--out", "afile"][..],
        &["compare", "run.toml", "--out", "afile", "-q"],
        &["analyze", "rope", "--out", "afile"],
        &["analyze", "rope", "--out", "afile/sub"],
    ] {
        let out = poslab(d, args);
        let e = stderr(&out);
        assert!(
            !out.status.success() && e.contains("afile is a file, not a folder"),
            "{args:?}: {e}"
        );
    }
    assert_eq!(std::fs::read(d.join("afile")).unwrap(), b"");
}

/// Jobs at once share the activation limit in training: a config whose training batches fit the
/// limit with one job is refused with two (which would hold two such batches), saying so, and
/// fits twice the limit.
#[test]
fn jobs_at_once_share_the_memory_limit() {
    let root = tempfile::tempdir().unwrap();
    let d = root.path();
    // Batches of 64 in training and tests one text at a time, so that the training batches are
    // what the limit binds (not the tests, nor the generated words).
    let run = RUN
        .replace("batch_size = 16", "batch_size = 64")
        .replace("[eval]\n", "[eval]\nbatch_size = 1\n");
    std::fs::write(d.join("run.toml"), run).unwrap();
    let dry = |limit: u64, jobs: &str| {
        command(d, &["compare", "run.toml", "--dry-run", "--jobs", jobs])
            .env("POSLAB_MAX_MEMORY", limit.to_string())
            .output()
            .unwrap()
    };
    // The least limit one job fits, by bisection.
    let (mut lo, mut hi) = (1u64, 1u64 << 32);
    assert!(dry(hi, "1").status.success(), "{}", stderr(&dry(hi, "1")));
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if dry(mid, "1").status.success() {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    let out = dry(lo, "2");
    let e = stderr(&out);
    assert!(
        !out.status.success()
            && e.contains("training: a batch of 64 x")
            && e.contains("(2 jobs at once: 2 such batches)")
            && e.contains("run fewer jobs at once (--jobs)"),
        "{e}"
    );
    assert!(dry(2 * lo, "2").status.success());
    assert!(!dry(2 * lo - 1, "2").status.success());
}

/// Ctrl-C (SIGINT) during a run without `--out` ends it with exit status 130, saying how many
/// cells are kept where and the command that continues; that same command then continues the
/// run in its folder (no second folder) and ends with the `results.json` of a run that never
/// stopped. A finished run is not continued: the command once more starts a new folder.
#[test]
fn ctrl_c_says_how_to_continue_and_the_same_command_continues_in_the_same_folder() {
    let (root, whole) = setup();
    let d = root.path();
    let run = |extra: &[&str]| {
        let mut args = vec!["compare", "run.toml", "-q", "--jobs", "1"];
        args.extend_from_slice(extra);
        poslab(d, &args)
    };
    let folders = || -> Vec<PathBuf> {
        let mut found: Vec<PathBuf> = std::fs::read_dir(d.join("runs"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        found.sort();
        found
    };
    let stopped = run(&["--kill-at", "int:cell-2-done"]);
    let said = stderr(&stopped);
    assert_eq!(stopped.status.code(), Some(130), "{said}");
    let [folder] = folders().try_into().unwrap();
    let name = folder.strip_prefix(d).unwrap().display().to_string();
    assert!(
        said.contains(&format!("3 of 8 cells are done and kept in {name}.")),
        "{said}"
    );
    assert!(
        said.contains("The same command continues there:\n  poslab compare run.toml -q --jobs 1\n"),
        "{said}"
    );
    assert!(!folder.join("results.json").exists());
    let again = run(&[]);
    assert_ok(&again, "the same command again");
    assert!(
        stderr(&again).contains(&format!(
            "continuing the unfinished run in {name} (3 of 8 cells done)"
        )),
        "{}",
        stderr(&again)
    );
    assert_eq!(folders(), vec![folder.clone()], "no second folder");
    assert_eq!(read(folder.join("results.json")), whole);
    assert_ok(&run(&[]), "a third time");
    assert_eq!(folders().len(), 2, "a finished run is not continued");
}

/// A run whose start fails (its TSV missing, or holding only a header) leaves no folder
/// behind for `inspect` to call unfinished: `compare` and `train` into their default folders.
#[test]
fn a_failed_start_leaves_no_folder_behind() {
    let root = tempfile::tempdir().unwrap();
    let d = root.path();
    let configs = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
    std::fs::create_dir_all(d.join("configs")).unwrap();
    for name in ["compare_reviews.toml", "train_reviews.toml"] {
        std::fs::copy(configs.join(name), d.join("configs").join(name)).unwrap();
    }
    std::fs::create_dir_all(d.join("examples/data")).unwrap();
    let runs =
        || -> usize { std::fs::read_dir(d.join("runs")).map_or(0, |entries| entries.count()) };
    // The command fails, saying why, and leaves no folder.
    let fails = |args: &[&str], why: &str| {
        let out = poslab(d, args);
        assert!(!out.status.success(), "{args:?}");
        assert!(stderr(&out).contains(why), "{}", stderr(&out));
        assert_eq!(runs(), 0, "{args:?} left a folder");
    };
    fails(
        &["compare", "configs/compare_reviews.toml", "-q"],
        "reviews.tsv",
    );
    std::fs::write(d.join("examples/data/reviews.tsv"), "text\tlabel\n").unwrap();
    fails(
        &["train", "--config", "configs/train_reviews.toml", "-q"],
        "no examples",
    );
}

/// Words a test set has and the training texts do not (here capitals: word_level keeps "Dog"
/// apart from "dog") are counted split by split where a run starts, with the fix; lowercasing
/// then leaves nothing to report.
#[test]
fn a_run_counts_its_unknown_words_and_names_lowercasing() {
    let root = tempfile::tempdir().unwrap();
    let d = root.path();
    let mut train = String::from("text\tlabel\n");
    for _ in 0..30 {
        train.push_str("the dog barks\tpositive\nthe cat sleeps\tnegative\n");
    }
    std::fs::write(d.join("train.tsv"), train).unwrap();
    std::fs::write(
        d.join("test.tsv"),
        "text\tlabel\nThe Dog barks\tpositive\nthe cat sleeps\tnegative\n",
    )
    .unwrap();
    let config = |lowercase: bool| {
        format!(
            "name = \"unk\"\n[model]\nd_model = 16\nn_heads = 2\nn_layers = 1\nffn_dim = 32\n\
             [positional]\nkind = \"rope\"\n[train]\nbudget = {{ steps = 2 }}\nbatch_size = 8\n\
             [task]\nkind = \"classify\"\nname = \"toy\"\ntrain = \"train.tsv\"\ntest = \"test.tsv\"\n\
             valid_fraction = 0.1\ntokenizer = {{ kind = \"word_level\", lowercase = {lowercase} }}\n"
        )
    };
    std::fs::write(d.join("cased.toml"), config(false)).unwrap();
    std::fs::write(d.join("lower.toml"), config(true)).unwrap();
    let cased = poslab(d, &["train", "--config", "cased.toml", "-q"]);
    assert_ok(&cased, "cased");
    let said = stderr(&cased);
    assert!(said.contains("0 of 162 training tokens (0.0%)"), "{said}");
    assert!(said.contains("2 of 6 test `1x` tokens (33.3%)"), "{said}");
    assert!(said.contains("lowercase = true"), "{said}");
    let lower = poslab(d, &["train", "--config", "lower.toml", "-q"]);
    assert_ok(&lower, "lowercased");
    assert!(!stderr(&lower).contains("[UNK]"), "{}", stderr(&lower));
}

#[test]
fn a_run_of_some_variants_names_the_rows_it_lacks_in_one_line() {
    let root = tempfile::tempdir().unwrap();
    let d = root.path();
    std::fs::write(d.join("run.toml"), RUN).unwrap();
    // Each row is compared with the first, `rope`, which this run does not train: its four
    // comparisons (two a task, one with its re-scoring) have no verdict, said in one line.
    assert_ok(&compare(d, "v", &["--variant", "none"]), "a run of `none`");
    let md = String::from_utf8(read(d.join("v/report.md"))).unwrap();
    let html = String::from_utf8(read(d.join("v/report.html"))).unwrap();
    let needle = "- no verdict in 4 comparisons: these results hold no cell of `rope`, \
                  `rope + yarn x2`; run those cells";
    assert!(md.contains(needle), "{needle}\n{md}");
    assert!(
        html.contains("no verdict in 4 comparisons: these results hold no cell of rope, rope"),
        "{html}"
    );
    // Not a line (or a "not compared" entry) for each comparison.
    for text in [&md, &html] {
        assert!(!text.contains("in these results"), "{text}");
    }
    // With both rows, the verdict lines as before.
    assert_ok(
        &compare(
            d,
            "t",
            &[
                "--variant",
                "none",
                "--variant",
                "rope",
                "--task",
                "word_order",
            ],
        ),
        "a run of one task",
    );
    let md = String::from_utf8(read(d.join("t/report.md"))).unwrap();
    assert!(md.contains("**word_order**, `none` − `rope`"), "{md}");
    assert!(!md.contains("- no verdict"), "{md}");
}

/// A config's relative data paths are relative to its own folder, whatever the working
/// directory: a compare's dry run and a train run read them from anywhere, a train run resumes
/// from another folder, and a path written from the working directory is refused with where it
/// was looked for and the path to write instead.
#[test]
fn relative_data_paths_follow_the_config_file() {
    let root = tempfile::tempdir().unwrap();
    let d = root.path();
    for sub in ["configs", "data", "elsewhere"] {
        std::fs::create_dir_all(d.join(sub)).unwrap();
    }
    let mut tsv = String::from("text\tlabel\n");
    for _ in 0..30 {
        tsv.push_str("the dog barks\tpositive\nthe cat sleeps\tnegative\n");
    }
    std::fs::write(d.join("data/reviews.tsv"), tsv).unwrap();
    let task = |path: &str| {
        format!("kind = \"classify\"\nname = \"toy\"\ntrain = \"{path}\"\nvalid_fraction = 0.2\n")
    };
    let shape = "d_model = 16\nn_heads = 2\nn_layers = 1\nffn_dim = 32\n";
    let experiment = |path: &str| {
        format!(
            "name = \"paths\"\nseeds = 1\n[model]\n{shape}[train]\nbudget = {{ steps = 2 }}\n\
             batch_size = 8\n[[tasks]]\n{}[[variants]]\nname = \"rope\"\n\
             positional = {{ kind = \"rope\" }}\n",
            task(path)
        )
    };
    std::fs::write(
        d.join("configs/good.toml"),
        experiment("../data/reviews.tsv"),
    )
    .unwrap();
    std::fs::write(d.join("configs/bad.toml"), experiment("data/reviews.tsv")).unwrap();
    std::fs::write(
        d.join("configs/train.toml"),
        format!(
            "name = \"paths\"\ncheckpoint_every = 2\n[model]\n{shape}[positional]\nkind = \"rope\"\n\
             [train]\nbudget = {{ steps = 4 }}\nbatch_size = 8\n[task]\n{}",
            task("../data/reviews.tsv")
        ),
    )
    .unwrap();
    // From the project's folder and from a folder beside it.
    for (cwd, config) in [
        (d.to_path_buf(), "configs/good.toml"),
        (d.join("elsewhere"), "../configs/good.toml"),
    ] {
        let out = poslab(&cwd, &["compare", config, "--dry-run"]);
        assert_ok(&out, &format!("dry run of {config} from {}", cwd.display()));
    }
    // Written from the working directory: refused, naming where it looked and the fix.
    let out = poslab(d, &["compare", "configs/bad.toml", "--dry-run"]);
    assert!(!out.status.success());
    let said = stderr(&out);
    let looked = d
        .canonicalize()
        .unwrap()
        .join("configs")
        .join("data/reviews.tsv");
    for part in [
        format!("no such file at {}", looked.display()),
        "relative to the config file's folder".into(),
        "train = \"../data/reviews.tsv\"".into(),
    ] {
        assert!(said.contains(&part), "{part:?} not in: {said}");
    }
    // A train run started from one folder and resumed from another reads the same file.
    let out = poslab(
        d,
        &[
            "train",
            "--config",
            "configs/train.toml",
            "--out",
            "run",
            "--stop-after",
            "2",
            "-q",
        ],
    );
    assert_ok(&out, "a train run's start");
    let out = poslab(&d.join("elsewhere"), &["train", "--resume", "../run", "-q"]);
    assert_ok(&out, "its resume from another folder");
    assert!(d.join("run/metrics.json").is_file());
    // The run folder keeps the path as written.
    let kept = std::fs::read_to_string(d.join("run/train.toml")).unwrap();
    assert!(kept.contains("train = \"../data/reviews.tsv\""), "{kept}");
}

/// A `train` and a `compare` of the same name, each into its default folder, are told apart by
/// the folders' first word; the default experiment, named `compare`, does not repeat it.
#[test]
fn run_folders_begin_with_their_command() {
    let root = tempfile::tempdir().unwrap();
    let d = root.path();
    std::fs::write(
        d.join("one.toml"),
        "name = \"survive\"\n[model]\nd_model = 16\nn_heads = 2\nn_layers = 1\nffn_dim = 32\n\
         [positional]\nkind = \"rope\"\n[train]\nbudget = { steps = 2 }\nbatch_size = 8\n\
         [task]\nkind = \"word_order\"\nlengths = [5, 8]\ntrain_examples = 64\neval_examples = 16\n",
    )
    .unwrap();
    std::fs::write(d.join("run.toml"), RUN.replace("steps = 30", "steps = 2")).unwrap();
    assert_ok(
        &poslab(d, &["train", "--config", "one.toml", "-q"]),
        "train",
    );
    assert_ok(
        &poslab(
            d,
            &[
                "compare",
                "run.toml",
                "-q",
                "--jobs",
                "1",
                "--variant",
                "rope",
            ],
        ),
        "compare",
    );
    let name = |prefix: &str| {
        std::fs::read_dir(d.join("runs"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(prefix))
            .count()
    };
    assert_eq!((name("train-survive-2"), name("compare-survive-2")), (1, 1));
    assert_eq!(
        poslab::io::run_dir_prefix("compare", "compare"),
        "compare-",
        "the default experiment's folder"
    );
}
