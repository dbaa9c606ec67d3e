//! The book (`book/`, mdBook) and the README hold together: every page is in the summary, every
//! link between them resolves (files, pages and anchors, as mdBook makes them), the command-line
//! reference is the binary's own help, and the environment page names every variable poslab
//! reads. CI also builds the book with a pinned mdbook (`.ci/run`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn src() -> PathBuf {
    root().join("book/src")
}

/// A heading's anchor as mdBook makes it: letters, digits, `-` and `_` kept (lower case),
/// whitespace turned into `-`, everything else dropped; the text as rendered (code spans and
/// links by their text).
fn slug(heading: &str) -> String {
    let text = rendered_text(heading.trim_start_matches('#').trim());
    text.chars()
        .filter_map(|c| {
            if c.is_alphanumeric() || c == '_' || c == '-' {
                Some(c.to_lowercase().next().unwrap_or(c))
            } else if c.is_whitespace() {
                Some('-')
            } else {
                None
            }
        })
        .collect()
}

/// Markdown inline text as it reads: `[text](url)` becomes `text`, backticks go.
fn rendered_text(s: &str) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find("](") {
        let Some(close) = rest[i..].find(')') else {
            break;
        };
        out.push_str(&rest[..i]);
        rest = &rest[i + close + 1..];
    }
    out.push_str(rest);
    out.replace(['`', '['], "")
}

/// Each line of `text` outside fenced code blocks, with its number (from 1).
fn prose_lines(text: &str) -> Vec<(usize, &str)> {
    let mut fenced = false;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            out.push((i + 1, line));
        }
    }
    out
}

/// The anchors of a page's headings, with mdBook's `-1`, `-2` for repeated ones.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    for (_, line) in prose_lines(text) {
        if line.starts_with('#') && line.trim_start_matches('#').starts_with(' ') {
            let id = slug(line);
            let n = seen.entry(id.clone()).or_insert(0);
            out.insert(if *n == 0 {
                id.clone()
            } else {
                format!("{id}-{n}")
            });
            *n += 1;
        }
    }
    out
}

/// The link targets of a line (`[text](target)` and `![alt](target)`), code spans left out.
fn link_targets(line: &str) -> Vec<String> {
    let mut prose = String::new();
    for (i, part) in line.split('`').enumerate() {
        if i % 2 == 0 {
            prose.push_str(part);
        } else {
            prose.push_str(&" ".repeat(part.len()));
        }
    }
    let mut out = Vec::new();
    let mut rest = prose.as_str();
    while let Some(i) = rest.find("](") {
        let after = &rest[i + 2..];
        let end = after.find(')').unwrap_or(after.len());
        let target = after[..end].split_whitespace().next().unwrap_or("");
        out.push(target.to_string());
        rest = &after[end..];
    }
    out
}

/// `path` without `.` and `..` components (no file system access).
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

/// The pages `SUMMARY.md` lists, relative to `book/src`.
fn summary_pages(summary: &str) -> Vec<String> {
    prose_lines(summary)
        .into_iter()
        .flat_map(|(_, l)| link_targets(l))
        .collect()
}

/// What is wrong with the links of the page `page` (a path under `base`), whose text is
/// `text`: a file that does not exist, a page the book does not render (not in `pages`), an
/// anchor the page does not have, or a file outside `inside` (which a rendered book cannot
/// reach).
fn broken_links(
    page: &Path,
    text: &str,
    base: &Path,
    inside: &Path,
    pages: &BTreeSet<PathBuf>,
) -> Vec<String> {
    let mut problems = Vec::new();
    for (n, line) in prose_lines(text) {
        for target in link_targets(line) {
            if target.is_empty()
                || target.starts_with("http://")
                || target.starts_with("https://")
                || target.starts_with("mailto:")
            {
                continue;
            }
            let (file, anchor) = match target.split_once('#') {
                Some((f, a)) => (f, Some(a)),
                None => (target.as_str(), None),
            };
            let here = format!("{}:{n}: `{target}`", page.display());
            let resolved = if file.is_empty() {
                page.to_path_buf()
            } else {
                normalize(&page.parent().unwrap_or(Path::new("")).join(file))
            };
            if !resolved.starts_with(inside) {
                problems.push(format!("{here} points outside {}", inside.display()));
                continue;
            }
            let on_disk = base.join(&resolved);
            if !on_disk.exists() {
                problems.push(format!("{here}: no such file"));
                continue;
            }
            let is_page = resolved.extension().is_some_and(|e| e == "md");
            if is_page && !pages.contains(&resolved) {
                problems.push(format!(
                    "{here}: the page is not in SUMMARY.md (mdBook would not render it)"
                ));
            }
            if let Some(anchor) = anchor {
                let target_text = std::fs::read_to_string(&on_disk).unwrap_or_default();
                if !is_page || !anchors(&target_text).contains(anchor) {
                    problems.push(format!("{here}: no heading with that anchor"));
                }
            }
        }
    }
    problems
}

fn book_pages() -> BTreeSet<PathBuf> {
    let summary = std::fs::read_to_string(src().join("SUMMARY.md")).unwrap();
    summary_pages(&summary)
        .into_iter()
        .map(|p| PathBuf::from("book/src").join(p))
        .collect()
}

#[test]
fn every_page_of_the_book_is_in_its_summary_and_every_link_resolves() {
    let pages = book_pages();
    let files = crate::common::files_with_extension(&src(), "md");
    let root = root();
    let mut problems = Vec::new();
    for file in &files {
        let rel = file.strip_prefix(&root).unwrap().to_path_buf();
        if rel != Path::new("book/src/SUMMARY.md") && !pages.contains(&rel) {
            problems.push(format!("{}: not listed in SUMMARY.md", rel.display()));
        }
    }
    for page in &pages {
        let text = std::fs::read_to_string(root.join(page))
            .unwrap_or_else(|e| panic!("SUMMARY.md lists {}: {e}", page.display()));
        problems.extend(broken_links(
            page,
            &text,
            &root,
            Path::new("book/src"),
            &pages,
        ));
    }
    // The README links into the book, and to files of the repository.
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    problems.extend(broken_links(
        Path::new("README.md"),
        &readme,
        &root,
        Path::new(""),
        &pages,
    ));
    assert!(pages.len() >= 40, "SUMMARY.md lists {} pages", pages.len());
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_link_check_finds_a_missing_page_a_missing_anchor_and_a_page_left_out() {
    let root = root();
    let pages = book_pages();
    let page = Path::new("book/src/guide/compare.md");
    let text = "See [the folder](#the-run-folder), [report](report.md#no-such-heading), \
                [gone](nowhere.md), [layout](../developing/layout.md), `[code](not-a-link.md)`\n\
                and [outside](../../Cargo.toml), [raw](../gpu/2026-11-28/info.txt).\n\
                ```\n[fenced](missing.md)\n```\n";
    let found = broken_links(page, text, &root, Path::new("book/src"), &pages);
    let said = found.join("\n");
    assert_eq!(found.len(), 3, "{said}");
    assert!(said.contains("report.md#no-such-heading") && said.contains("no heading"));
    assert!(said.contains("nowhere.md") && said.contains("no such file"));
    assert!(said.contains("Cargo.toml") && said.contains("outside"));
    // A page on disk that the summary leaves out is refused as unrendered.
    let fewer: BTreeSet<PathBuf> = pages
        .iter()
        .filter(|p| !p.ends_with("layout.md"))
        .cloned()
        .collect();
    let found = broken_links(page, text, &root, Path::new("book/src"), &fewer);
    assert!(found.iter().any(|p| p.contains("not in SUMMARY.md")));
    // Anchors as mdBook makes them, repeats numbered.
    let a = anchors("# The `poslab compare` run: a [link](x.md)!\n## Same\n## Same\n");
    assert_eq!(
        a.into_iter().collect::<Vec<_>>(),
        ["same", "same-1", "the-poslab-compare-run-a-link"]
    );
}

/// The command-line reference: `poslab --help` and every subcommand's, as the binary prints
/// them at 100 columns.
fn cli_reference() -> String {
    let help = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_poslab"))
            .args(args)
            .arg("--help")
            .env("COLUMNS", "100")
            .output()
            .unwrap();
        assert!(out.status.success(), "poslab {args:?} --help failed");
        String::from_utf8(out.stdout).unwrap()
    };
    let top = help(&[]);
    let commands: Vec<String> = top
        .split("Commands:\n")
        .nth(1)
        .unwrap()
        .lines()
        .take_while(|l| !l.is_empty())
        .filter(|l| l.starts_with("  ") && !l.starts_with("   "))
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .filter(|c| c != "help")
        .collect();
    let mut page = String::from(
        "# Command line\n\n\
         Every command's help as the `poslab` binary prints it (`poslab <command> --help`). This \
         page is generated from the binary's clap definitions and a test holds it to them, so it \
         cannot drift: after changing a command, regenerate it with \
         `POSLAB_BLESS_BOOK=1 cargo test --release book::`.\n\n",
    );
    page.push_str(&format!("## poslab\n\n```text\n{}```\n", top));
    for c in &commands {
        page.push_str(&format!("\n## poslab {c}\n\n```text\n{}```\n", help(&[c])));
    }
    page
}

#[test]
fn the_cli_reference_is_the_binarys_own_help() {
    let path = src().join("reference/cli.md");
    let generated = cli_reference();
    assert!(generated.contains("## poslab compare") && generated.contains("## poslab inspect"));
    if std::env::var("POSLAB_BLESS_BOOK").as_deref() == Ok("1") {
        std::fs::write(&path, &generated).unwrap();
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "book/src/reference/cli.md differs from the binary's help: regenerate it with \
         `POSLAB_BLESS_BOOK=1 cargo test --release book::`"
    );
}

#[test]
fn the_environment_page_names_every_variable_poslab_reads() {
    let page = std::fs::read_to_string(src().join("reference/environment.md")).unwrap();
    // Only the command line reads the environment: it names every variable it reads when it
    // meets a POSLAB_ name it does not.
    let out = Command::new(env!("CARGO_BIN_EXE_poslab"))
        .arg("inspect")
        .env("POSLAB_NOT_A_VARIABLE", "1")
        .output()
        .unwrap();
    let (code, err) = (out.status.code(), String::from_utf8_lossy(&out.stderr));
    let read = err
        .split("(poslab reads ")
        .nth(1)
        .and_then(|rest| rest.split(')').next())
        .unwrap_or_else(|| panic!("no list of variables in {err}"));
    let names: Vec<&str> = read.split(", ").collect();
    assert!(code == Some(0) && names.len() >= 8, "{err}");
    let missing: Vec<&&str> = names
        .iter()
        .filter(|name| !page.contains(&format!("`{name}`")))
        .collect();
    assert!(missing.is_empty(), "environment.md lacks {missing:?}");
}

/// Every place a doc counts all the schemes (`all twelve schemes`, `fifteen positional
/// schemes`, `one of twelve`) or lists all of them by name (a line that says it names every
/// scheme: the overview, "every scheme", "all schemes"), against the catalog: the README, the
/// project's DEVELOPERS.md, every page of the book and the crate's front page. A count of some
/// (`five schemes`) or a list of an experiment's variants is not checked. Returns the places
/// that disagree.
fn scheme_drift(texts: &[(String, String)]) -> Vec<String> {
    let names = poslab::PositionalConfig::names();
    let count = names.len();
    // A count in words (the tasks' own number words) or digits, below a hundred.
    let number = |w: &str| {
        (0..100)
            .find(|&n| poslab::tasks::sorted::number_word(n) == w)
            .or_else(|| w.parse::<usize>().ok().filter(|n| *n < 100))
    };
    let mut problems = Vec::new();
    for (file, text) in texts {
        for (n, line) in text.lines().enumerate() {
            let lower = line.to_lowercase();
            let words: Vec<&str> = lower
                .split(|c: char| !c.is_alphanumeric())
                .filter(|w| !w.is_empty())
                .collect();
            let mut counts = Vec::new();
            for (i, w) in words.iter().enumerate() {
                let Some(said) = number(w) else { continue };
                let at = |k: usize| words.get(i + k).copied();
                let before = i.checked_sub(1).and_then(|j| words.get(j)).copied();
                let total = (at(1) == Some("positional") && at(2) == Some("schemes"))
                    || (at(1) == Some("schemes") && at(2) == Some("in"))
                    || (before == Some("all")
                        && (at(1) == Some("schemes")
                            || (at(1) == Some("positional") && at(2) == Some("schemes"))))
                    || (before == Some("of")
                        && i >= 2
                        && words[i - 2] == "one"
                        && lower.contains("scheme"));
                if total {
                    counts.push(said);
                }
            }
            for said in counts.into_iter().filter(|&s| s != count) {
                problems.push(format!(
                    "{file}:{}: says {said} schemes in all; the catalog has {count}",
                    n + 1
                ));
            }
            let claims_all = ["overview", "every scheme", "all schemes", "all the schemes"]
                .iter()
                .any(|p| lower.contains(p));
            let listed: Vec<&str> = names
                .iter()
                .copied()
                .filter(|name| {
                    line.split(|c: char| !(c.is_alphanumeric() || c == '_'))
                        .any(|w| w == *name)
                })
                .collect();
            if claims_all && listed.len() >= 5 && listed.len() < count {
                let missing: Vec<&str> = names
                    .iter()
                    .copied()
                    .filter(|name| !listed.contains(name))
                    .collect();
                problems.push(format!(
                    "{file}:{}: lists {} schemes as all of them, but not {}",
                    n + 1,
                    listed.len(),
                    missing.join(", ")
                ));
            }
        }
    }
    problems
}

#[test]
fn the_docs_count_and_list_the_schemes_the_catalog_has() {
    let root = root();
    let mut texts: Vec<(String, String)> = [
        "README.md",
        "DEVELOPERS.md",
        "src/lib.rs",
        "crates/poslab-core/src/lib.rs",
        "crates/poslab-kernels/src/lib.rs",
    ]
    .iter()
    .map(|f| {
        (
            f.to_string(),
            std::fs::read_to_string(root.join(f)).unwrap(),
        )
    })
    .collect();
    for page in book_pages() {
        let text = std::fs::read_to_string(root.join(&page)).unwrap();
        texts.push((page.display().to_string(), text));
    }
    let problems = scheme_drift(&texts);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    // The check finds a wrong count and a short list.
    let planted = vec![(
        "planted.md".to_string(),
        "all twelve schemes; five schemes are trained\n[overview](x.md): none, sinusoidal_add, \
         rope, alibi, t5, fox\n"
            .to_string(),
    )];
    assert_eq!(
        scheme_drift(&planted).len(),
        2,
        "{:?}",
        scheme_drift(&planted)
    );
}

#[test]
fn the_library_pages_task_example_is_the_doc_test_of_task_spec() {
    // The guide's example of a built-in task from code is `TaskSpec::from_toml_str`'s doc test
    // (which cargo test compiles and runs), less its hidden lines.
    let code = |text: &str, fence: &str, start: &str| -> Vec<String> {
        let lines: Vec<&str> = text.lines().collect();
        let at = lines
            .iter()
            .position(|l| l.trim_start().trim_start_matches(fence).trim() == start)
            .unwrap_or_else(|| panic!("no `{start}`"));
        lines[at..]
            .iter()
            .map(|l| match fence {
                "" => l.trim_end(),
                _ => {
                    let l = l.trim_start().trim_start_matches(fence).trim_end();
                    l.strip_prefix(' ').unwrap_or(l)
                }
            })
            .map(String::from)
            .take_while(|l| l != "```")
            .filter(|l| !l.starts_with("# "))
            .collect()
    };
    let start = "use poslab::data::{make_batch, Dataset, Framing};";
    let source = std::fs::read_to_string(root().join("src/tasks/mod.rs")).unwrap();
    let page = std::fs::read_to_string(src().join("guide/library.md")).unwrap();
    let doc = code(&source, "///", start);
    assert!(doc.len() > 15, "{doc:?}");
    assert_eq!(code(&page, "", start), doc);
}
