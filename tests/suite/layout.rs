//! The code's layout, as the README draws it: no two modules import each other, and the core
//! (the encoder, its layers and schemes) imports nothing above it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// A file's module path (`experiment::run`; `mod.rs` is its folder's module).
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        parts.pop();
    }
    parts
}

/// The code of a file without its tests and comments.
fn code(file: &Path) -> String {
    let text = std::fs::read_to_string(file).unwrap();
    let text = text.split("#[cfg(test)]").next().unwrap_or("");
    text.lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The modules each module names through `crate::` or `super::` paths (longest known prefix).
fn imports() -> BTreeMap<Vec<String>, BTreeSet<Vec<String>>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let files = crate::common::files_with_extension(&src, "rs");
    let modules: BTreeSet<Vec<String>> = files.iter().map(|f| module_of(&src, f)).collect();
    let resolve = |path: &[String]| {
        (1..=path.len())
            .rev()
            .map(|k| path[..k].to_vec())
            .find(|p| modules.contains(p))
    };
    let mut graph = BTreeMap::new();
    for file in &files {
        let module = module_of(&src, file);
        let parent: Vec<String> = module[..module.len().saturating_sub(1)].to_vec();
        let code = code(file);
        let mut named = BTreeSet::new();
        for (root, base) in [("crate::", Vec::new()), ("super::", parent.clone())] {
            for (at, _) in code.match_indices(root) {
                let before = code[..at].chars().last();
                if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                    continue;
                }
                let rest = &code[at + root.len()..];
                let mut heads: Vec<String> = Vec::new();
                if let Some(list) = rest.strip_prefix('{') {
                    let list = &list[..list.find('}').unwrap_or(list.len())];
                    heads.extend(list.split(',').map(|s| s.trim().to_string()));
                } else {
                    let end = rest
                        .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                        .unwrap_or(rest.len());
                    heads.push(rest[..end].to_string());
                }
                for head in heads {
                    let mut path = base.clone();
                    path.extend(head.split("::").filter(|s| !s.is_empty()).map(String::from));
                    if let Some(target) = resolve(&path) {
                        if target != module {
                            named.insert(target);
                        }
                    }
                }
            }
        }
        graph.insert(module, named);
    }
    graph
}

#[test]
fn no_two_modules_import_each_other() {
    let graph = imports();
    assert!(graph.len() > 100, "found {} modules", graph.len());
    let mut mutual = Vec::new();
    for (a, targets) in &graph {
        for b in targets {
            let related = a.starts_with(b) || b.starts_with(a);
            if a < b && !related && graph.get(b).is_some_and(|t| t.contains(a)) {
                mutual.push(format!("{} <-> {}", a.join("::"), b.join("::")));
            }
        }
    }
    assert!(
        mutual.is_empty(),
        "modules that import each other: {mutual:?}"
    );
    // The check sees real imports: the encoder names the positional schemes.
    let encoder = &graph[&vec!["encoder".to_string()]];
    assert!(
        encoder.contains(&vec!["positional".to_string()]),
        "{encoder:?}"
    );
}

/// The folder a module's file lies in (`nn/fused/layer.rs` and `nn/fused/mod.rs`: `nn::fused`).
fn folder_of(module: &[String], folders: &BTreeSet<Vec<String>>) -> Vec<String> {
    match folders.contains(module) {
        true => module.to_vec(),
        false => module[..module.len().saturating_sub(1)].to_vec(),
    }
}

/// The strongly connected components of more than one node of `graph` (Tarjan's algorithm).
fn cycles(graph: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>) -> Vec<Vec<String>> {
    struct Walk<'a> {
        graph: &'a BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
        index: BTreeMap<&'a Vec<String>, (usize, usize)>,
        stack: Vec<&'a Vec<String>>,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(w: &mut Walk<'a>, v: &'a Vec<String>) {
        let n = w.index.len();
        w.index.insert(v, (n, n));
        w.stack.push(v);
        for t in w.graph.get(v).into_iter().flatten() {
            let Some((t, _)) = w.graph.get_key_value(t) else {
                continue;
            };
            match w.index.get(t).copied() {
                None => {
                    visit(w, t);
                    let low = w.index[t].1.min(w.index[v].1);
                    w.index.get_mut(v).unwrap().1 = low;
                }
                Some((ti, _)) if w.stack.contains(&t) => {
                    let low = ti.min(w.index[v].1);
                    w.index.get_mut(v).unwrap().1 = low;
                }
                Some(_) => {}
            }
        }
        let (i, low) = w.index[v];
        if i == low {
            let mut component = Vec::new();
            while let Some(u) = w.stack.pop() {
                component.push(u.join("::"));
                if u == v {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort();
                w.out.push(component);
            }
        }
    }
    let mut w = Walk {
        graph,
        index: BTreeMap::new(),
        stack: Vec::new(),
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !w.index.contains_key(v) {
            visit(&mut w, v);
        }
    }
    w.out
}

#[test]
fn no_folders_import_each_other_in_a_circle() {
    // Folders as nodes, an edge where a file of one names a module of another (a folder and
    // the folders inside it are one family, as a parent module declares its children).
    let graph = imports();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let folders: BTreeSet<Vec<String>> = crate::common::files_with_extension(&src, "rs")
        .iter()
        .filter(|f| f.file_name().is_some_and(|n| n == "mod.rs"))
        .map(|f| module_of(&src, f))
        .collect();
    let mut by_folder: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    for (module, targets) in &graph {
        let from = folder_of(module, &folders);
        let entry = by_folder.entry(from.clone()).or_default();
        for t in targets {
            let to = folder_of(t, &folders);
            if !from.starts_with(&to) && !to.starts_with(&from) {
                entry.insert(to);
            }
        }
    }
    assert!(by_folder.len() > 10, "found {} folders", by_folder.len());
    let circles = cycles(&by_folder);
    assert!(
        circles.is_empty(),
        "folders that import each other in a circle: {circles:?}"
    );
    // The check finds a circle where there is one.
    let mut circle = by_folder.clone();
    let (a, b) = (vec!["runs".to_string()], vec!["render".to_string()]);
    circle.entry(a.clone()).or_default().insert(b.clone());
    circle.entry(b).or_default().insert(a);
    assert_eq!(cycles(&circle).len(), 1);
}

#[test]
fn the_kernels_are_a_leaf() {
    // The kernels take tensors, slices, shapes and their own specs: they name no module of
    // the model, no scheme, no config and nothing of the lab.
    let graph = imports();
    let mut wrong = Vec::new();
    for (module, targets) in &graph {
        if module.first().map(String::as_str) != Some("kernels") {
            continue;
        }
        for t in targets {
            if t.first().map(String::as_str) != Some("kernels") {
                wrong.push(format!("{} -> {}", module.join("::"), t.join("::")));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "the kernels name modules outside them: {wrong:?}"
    );
    let layer = &graph[&["kernels", "cpu", "layer"].map(String::from).to_vec()];
    assert!(
        layer.iter().any(|t| t[..2] == ["kernels", "spec"]),
        "{layer:?}"
    );
}

#[test]
fn the_core_imports_nothing_above_it() {
    let core = [
        "encoder",
        "model",
        "layers",
        "positional",
        "nn",
        "params",
        "config",
    ];
    let above = [
        "runs",
        "train",
        "analysis",
        "bench",
        "cli",
        "tasks",
        "text",
        "pretrained",
        "saved",
        "infer",
        "render",
        "progress",
    ];
    let mut wrong = Vec::new();
    for (module, targets) in imports() {
        if !module.first().is_some_and(|m| core.contains(&m.as_str())) {
            continue;
        }
        for t in targets {
            if t.first().is_some_and(|t| above.contains(&t.as_str())) {
                wrong.push(format!("{} -> {}", module.join("::"), t.join("::")));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "the core imports from above it: {wrong:?}"
    );
}

#[test]
fn what_is_drawn_knows_no_run_analysis_or_scheme() {
    let above = [
        "runs",
        "analysis",
        "positional",
        "bench",
        "cli",
        "tasks",
        "train",
        "nn",
    ];
    let mut wrong = Vec::new();
    let graph = imports();
    for (module, targets) in &graph {
        if module.first().map(String::as_str) != Some("render") {
            continue;
        }
        for t in targets {
            if t.first().is_some_and(|t| above.contains(&t.as_str())) {
                wrong.push(format!("{} -> {}", module.join("::"), t.join("::")));
            }
        }
    }
    assert!(wrong.is_empty(), "render imports from above it: {wrong:?}");
    // The check sees real imports: the drawing rooms name render.
    let report = &graph[&vec!["runs".to_string(), "report".to_string()]];
    assert!(report.iter().any(|t| t[0] == "render"), "{report:?}");
}

#[test]
fn only_render_calls_the_drawing_and_csv_libraries_or_holds_a_pages_script() {
    // The other rooms describe what to show (render::chart, a page's data) and render draws it.
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let calls = ["plotters::", "csv::Writer", ".js\")"];
    let mut wrong = Vec::new();
    let mut seen = BTreeSet::new();
    for file in crate::common::files_with_extension(&src, "rs") {
        let code = code(&file);
        let module = module_of(&src, &file);
        for call in calls.iter().filter(|c| code.contains(**c)) {
            match module.first().map(String::as_str) {
                Some("render") => {
                    seen.insert(*call);
                }
                _ => wrong.push(format!("{}: {call}", module.join("::"))),
            }
        }
    }
    assert!(wrong.is_empty(), "drawing outside render: {wrong:?}");
    // The check sees real calls: render makes each of them.
    assert_eq!(seen.len(), calls.len(), "{seen:?}");
}

/// Where a file matches on a positional scheme (`PositionalConfig::X(..) =>`, `if let` /
/// `let ... else`, `matches!`), as `file:line`.
fn scheme_matches(code: &str, file: &str) -> Vec<String> {
    let mut found = Vec::new();
    let lines: Vec<&str> = code.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        for (at, _) in line.match_indices("PositionalConfig::") {
            let rest = &line[at + "PositionalConfig::".len()..];
            if !rest.starts_with(|c: char| c.is_ascii_uppercase()) {
                continue;
            }
            let before = line[..at].trim_end();
            // A pattern: an arm (`X(..) =>`, `X(..) | Y(..)`), `let X(..) = ...`, `if let`,
            // `while let`, `matches!(v, X(..))`.
            let arm = {
                let mut tail = line[at..].to_string();
                for next in &lines[i + 1..lines.len().min(i + 3)] {
                    tail.push(' ');
                    tail.push_str(next);
                }
                let close = tail.find(')').map_or("", |c| &tail[c + 1..]).trim_start();
                close.starts_with("=>") || close.starts_with("| PositionalConfig::")
            };
            let binding = before.ends_with("let") || before.ends_with("matches!(");
            let in_matches = before.contains("matches!(") && before.trim_end().ends_with(',');
            if arm || binding || in_matches {
                found.push(format!("{file}:{}", i + 1));
            }
        }
    }
    found
}

#[test]
fn nothing_outside_a_schemes_file_matches_on_the_scheme() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut found = Vec::new();
    for file in crate::common::files_with_extension(&src, "rs") {
        let rel = file
            .strip_prefix(&src)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        if rel.starts_with("positional/") {
            continue;
        }
        found.extend(scheme_matches(&code(&file), &rel));
    }
    assert!(
        found.is_empty(),
        "matches on a scheme outside positional/: {found:?}"
    );
    // The check finds each form of a match, and passes a construction.
    let sample = "match p {\n    PositionalConfig::Rope(o) => 1,\n    _ => 2,\n}\n\
                  if let PositionalConfig::Fire(f) = p {}\n\
                  let PositionalConfig::T5(o) = p else { return };\n\
                  matches!(p, PositionalConfig::Fox(_))\n\
                  PositionalConfig::Cope(_) | PositionalConfig::Path(_) => {}\n\
                  let q = PositionalConfig::Alibi(NoOptions {});\n\
                  f(PositionalConfig::Rope(RopeOptions { base, ..o }))\n";
    assert_eq!(
        scheme_matches(sample, "s"),
        ["s:2", "s:5", "s:6", "s:7", "s:8", "s:8"],
        "{sample}"
    );
}

/// The dates from 2020 on in `text` (`2026-11-28`), as `line: date`.
fn dates_in(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let b = line.as_bytes();
        for i in 0..b.len().saturating_sub(9) {
            let digits = |r: std::ops::Range<usize>| r.into_iter().all(|k| b[k].is_ascii_digit());
            let is_date = b[i..].len() >= 10
                && digits(i..i + 4)
                && b[i + 4] == b'-'
                && digits(i + 5..i + 7)
                && b[i + 7] == b'-'
                && digits(i + 8..i + 10)
                // Years from 2020 (a measurement's), not an epoch's (1970-01-01).
                && b[i] == b'2'
                && b[i + 1] == b'0'
                && b[i + 2] >= b'2'
                && (i == 0 || !b[i - 1].is_ascii_digit());
            if is_date {
                found.push(format!("{}: {}", n + 1, &line[i..i + 10]));
            }
        }
    }
    found
}

#[test]
fn the_code_holds_no_dated_measurements() {
    // Code says what is; the book says what was measured, and when (performance.md's
    // "Measurements behind the code's choices").
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut problems = Vec::new();
    for file in crate::common::files_with_extension(&src, "rs") {
        let text = std::fs::read_to_string(&file).unwrap();
        for d in dates_in(&text) {
            problems.push(format!("{}:{d}", file.display()));
        }
    }
    assert!(
        problems.is_empty(),
        "dates in the code:\n{}",
        problems.join("\n")
    );
    assert_eq!(
        dates_in("// measured 2026-11-28 (one thread)\nlet x = 12345678901;"),
        ["1: 2026-11-28"]
    );
}
