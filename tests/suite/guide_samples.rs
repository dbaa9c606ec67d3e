//! The guide's sample outputs stay true: every command the guide shows with its output is run,
//! and its output must match the page's, line for line, up to numbers (times, rates and
//! timestamps vary with the machine; every number is read as `#`) and the width of the spaces
//! between columns.
//!
//! A sample is a ```` ```sh ```` block of one `poslab` command followed by a ```` ```text ````
//! block (its output), or a ```` ```text ```` block of `$ command` lines, each followed by its
//! output. A page line `...` stands for any number of lines. A sample the test cannot run (it
//! needs the network, a GPU, a cluster, or minutes) says so in a comment on the line before it,
//! `<!-- sample not run: why -->`; every other one runs.
//!
//! The samples run in order, page after page as the book's summary lists the guide, in one
//! scratch folder holding the project's `configs/` and `examples/`, with `-q` dropped from
//! nothing and progress lines (`… elapsed`) left out of the comparison. A run folder a command
//! names by its timestamp (`runs/train-reviews-20261121-125048`) is the one an earlier sample
//! made under that name, and `/tmp/` is the scratch folder's own.

use std::path::{Path, PathBuf};

/// One fenced block of a page: its language, its lines (the fence's indentation removed), the
/// line its fence opens on (0-based), and whether only blank lines separate it from the block
/// before it.
struct Block {
    lang: String,
    lines: Vec<String>,
    start: usize,
    follows: bool,
}

fn blocks(text: &str) -> Vec<Block> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out: Vec<Block> = Vec::new();
    let mut last_end: Option<usize> = None;
    let mut i = 0;
    while i < lines.len() {
        let trimmed = lines[i].trim_start();
        if let Some(lang) = trimmed.strip_prefix("```") {
            let indent = lines[i].len() - trimmed.len();
            let start = i;
            let mut body = Vec::new();
            i += 1;
            while i < lines.len() && !lines[i].trim_start().starts_with("```") {
                body.push(lines[i].get(indent..).unwrap_or("").to_string());
                i += 1;
            }
            let follows = last_end
                .is_some_and(|end| lines[end + 1..start].iter().all(|l| l.trim().is_empty()));
            out.push(Block {
                lang: lang.trim().to_string(),
                lines: body,
                start,
                follows,
            });
            last_end = Some(i);
        }
        i += 1;
    }
    out
}

/// `line` without a trailing ` # comment` (outside quotes).
fn without_comment(line: &str) -> &str {
    let mut quote = None;
    let bytes = line.as_bytes();
    for (i, &b) in bytes.iter().enumerate() {
        match (quote, b) {
            (None, b'"' | b'\'') => quote = Some(b),
            (Some(q), _) if q == b => quote = None,
            (None, b'#') if i > 0 && bytes[i - 1] == b' ' => return line[..i].trim_end(),
            _ => {}
        }
    }
    line.trim_end()
}

/// A sample: where it is, and its steps (a command and the output the page shows for it).
struct Sample {
    page: String,
    line: usize,
    steps: Vec<(String, Vec<String>)>,
    not_run: Option<String>,
}

fn samples(page: &str, text: &str) -> Vec<Sample> {
    let lines: Vec<&str> = text.lines().collect();
    // The comment on the line before `start`, blank lines skipped.
    let note = |start: usize| -> Option<String> {
        let before = lines[..start].iter().rev().find(|l| !l.trim().is_empty())?;
        let why = before.trim().strip_prefix("<!-- sample not run:")?;
        Some(why.trim_end_matches("-->").trim().to_string())
    };
    let found = blocks(text);
    let mut out = Vec::new();
    for (i, b) in found.iter().enumerate() {
        let shell = matches!(b.lang.as_str(), "sh" | "bash");
        if shell
            && found
                .get(i + 1)
                .is_some_and(|t| t.lang == "text" && t.follows)
        {
            // One logical command (continuation lines joined) that runs poslab.
            let joined = b
                .lines
                .iter()
                .map(|l| without_comment(l))
                .filter(|l| !l.is_empty())
                .collect::<Vec<_>>()
                .join("\n")
                .replace("\\\n", " ");
            let commands: Vec<&str> = joined.lines().collect();
            if let [command] = commands[..] {
                if command.starts_with("poslab ") {
                    out.push(Sample {
                        page: page.into(),
                        line: b.start + 1,
                        steps: vec![(command.to_string(), found[i + 1].lines.clone())],
                        not_run: note(b.start),
                    });
                }
            }
        } else if b.lang == "text" && b.lines.first().is_some_and(|l| l.starts_with("$ ")) {
            let mut steps: Vec<(String, Vec<String>)> = Vec::new();
            for l in &b.lines {
                match l.strip_prefix("$ ") {
                    Some(command) => steps.push((without_comment(command).to_string(), Vec::new())),
                    None => steps.last_mut().expect("a first command").1.push(l.clone()),
                }
            }
            out.push(Sample {
                page: page.into(),
                line: b.start + 1,
                steps,
                not_run: note(b.start),
            });
        }
    }
    out
}

/// A line as compared: each number `#`, each run of spaces one space, no trailing space.
fn canonical(line: &str) -> String {
    let mut out = String::new();
    let chars: Vec<char> = line.trim_end().chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_ascii_digit() {
            let digit_at = |k: usize| chars.get(k).is_some_and(char::is_ascii_digit);
            while i < chars.len() {
                if chars[i].is_ascii_digit() {
                    i += 1;
                } else if matches!(chars[i], '.' | ',' | 'e') && digit_at(i + 1) {
                    i += 2;
                } else if chars[i] == 'e' && chars.get(i + 1) == Some(&'-') && digit_at(i + 2) {
                    i += 3;
                } else {
                    break;
                }
            }
            out.push('#');
            continue;
        }
        if c == ' ' || c == '\t' {
            while i < chars.len() && (chars[i] == ' ' || chars[i] == '\t') {
                i += 1;
            }
            out.push(' ');
            continue;
        }
        out.push(c);
        i += 1;
    }
    out
}

/// Whether `got` is `want` line for line (canonical), a `...` line of `want` standing for any
/// number of lines of `got`.
fn matches(want: &[String], got: &[String]) -> bool {
    match want.split_first() {
        None => got.is_empty(),
        Some((w, rest)) if w.trim() == "..." || w.trim() == "…" => {
            (0..=got.len()).any(|k| matches(rest, &got[k..]))
        }
        Some((w, rest)) => got
            .split_first()
            .is_some_and(|(g, more)| canonical(w) == canonical(g) && matches(rest, more)),
    }
}

/// `command` as it runs in `work`: a run folder named by its timestamp is the newest one of that
/// name there, and `/tmp/` is `work/tmp/`.
fn localize(command: &str, work: &Path) -> String {
    let mut out = Vec::new();
    for word in command.split(' ') {
        // `runs/NAME-YYYYMMDD-HHMMSS[/...]`: the folder an earlier sample made of NAME.
        let dated = word.find("runs/").and_then(|at| {
            let rest = &word[at + 5..];
            let folder = rest.split('/').next()?;
            let cut = folder.len().checked_sub(16)?;
            let (name, stamp) = folder.split_at(cut);
            let digits = |s: &str| s.chars().all(|c| c.is_ascii_digit());
            let ok = stamp.len() == 16
                && stamp.starts_with('-')
                && digits(&stamp[1..9])
                && &stamp[9..10] == "-"
                && digits(&stamp[10..]);
            ok.then(|| (at + 5, folder.len(), format!("{name}-")))
        });
        match dated {
            Some((start, len, prefix)) => {
                let mut found: Vec<String> = std::fs::read_dir(work.join("runs"))
                    .into_iter()
                    .flatten()
                    .flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.starts_with(&prefix))
                    .collect();
                found.sort();
                let folder = found
                    .pop()
                    .unwrap_or_else(|| panic!("no earlier sample made {word}"));
                out.push(format!(
                    "{}{folder}{}",
                    &word[..start],
                    &word[start + len..]
                ));
            }
            None => out.push(word.replace("/tmp/", &format!("{}/tmp/", work.display()))),
        }
    }
    out.join(" ")
}

/// Runs `command` in `work` (poslab first on the PATH), standard error into standard output,
/// as the page's lines: progress lines left out, the scratch folder's `/tmp/` written back.
fn run(command: &str, work: &Path) -> Vec<String> {
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_poslab"));
    let path = format!(
        "{}:{}",
        bin.parent().unwrap().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("{{ {command}\n}} 2>&1"))
        .current_dir(work)
        .env("PATH", path)
        .env("HF_HUB_OFFLINE", "1")
        .env_remove("POSLAB_KERNELS")
        .env_remove("POSLAB_MAX_MEMORY")
        .env_remove("POSLAB_MAX_PARAMS")
        .env_remove("RAYON_NUM_THREADS")
        .output()
        .unwrap();
    let tmp = format!("{}/tmp/", work.display());
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.contains(" elapsed"))
        .map(|l| l.replace(&tmp, "/tmp/"))
        .collect()
}

/// The guide's pages, in the book's order.
fn guide_pages() -> Vec<PathBuf> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("book/src");
    let summary = std::fs::read_to_string(src.join("SUMMARY.md")).unwrap();
    summary
        .lines()
        .filter_map(|l| l.split_once("](guide/"))
        .map(|(_, rest)| src.join("guide").join(rest.trim_end_matches(')')))
        .collect()
}

#[test]
fn the_guides_sample_outputs_are_what_the_commands_print() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let scratch = tempfile::tempdir().unwrap();
    let work = scratch.path();
    std::fs::create_dir(work.join("tmp")).unwrap();
    for folder in ["configs", "examples"] {
        std::os::unix::fs::symlink(root.join(folder), work.join(folder)).unwrap();
    }
    let mut ran = 0;
    let mut failures = Vec::new();
    for page in guide_pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        let name = page.strip_prefix(root).unwrap().display().to_string();
        for sample in samples(&name, &text) {
            if sample.not_run.is_some() {
                continue;
            }
            for (command, want) in &sample.steps {
                let got = run(&localize(command, work), work);
                if !matches(want, &got) {
                    failures.push(format!(
                        "{}:{}: `{command}` printed\n{}\n-- where the page shows --\n{}",
                        sample.page,
                        sample.line,
                        got.join("\n"),
                        want.join("\n")
                    ));
                }
                ran += 1;
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    assert!(ran >= 6, "only {ran} sample commands ran");
}

/// Every sample the test passes over says why, and the parser finds both forms of sample.
#[test]
fn a_sample_not_run_says_why_and_both_forms_are_found() {
    let page = "```sh\nposlab inspect a.toml   # a comment\n```\n\n```text\na.toml: valid 12 x\n```\n\n\
                <!-- sample not run: it downloads a model -->\n```text\n$ poslab predict --model x\n\
                y\n...\n$ cmp a b && echo identical\nidentical\n```\n\n```sh\nposlab a\nposlab b\n```\n\n\
                ```text\nnot a sample: two commands\n```\n";
    let found = samples("p.md", page);
    assert_eq!(found.len(), 2);
    assert_eq!(found[0].steps[0].0, "poslab inspect a.toml");
    assert_eq!(found[0].not_run, None);
    assert_eq!(found[1].not_run.as_deref(), Some("it downloads a model"));
    assert_eq!(found[1].steps.len(), 2);
    assert!(matches(
        &["a.toml: valid 3.5 x".into()],
        &["a.toml:  valid 12 x".into()]
    ));
    assert!(!matches(&["a: 1".into()], &["a: 1".into(), "b".into()]));
    assert!(matches(
        &["a".into(), "...".into(), "z".into()],
        &["a".into(), "b".into(), "c".into(), "z".into()]
    ));
    assert_eq!(
        canonical("x 1,024 and 6.3e-5, 20261121-125048"),
        "x # and #, #-#"
    );
    for page in guide_pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        for sample in samples("", &text) {
            if let Some(why) = sample.not_run {
                assert!(
                    why.len() > 10,
                    "{}:{}: say why",
                    page.display(),
                    sample.line
                );
            }
        }
    }
}
