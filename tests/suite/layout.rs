//! The code's layout, as the README draws it: three crates (the lab, its core and the kernels),
//! no two modules and no circle of folders importing each other in any of them, the core
//! depending on nothing of the lab's, and the kernels on nothing of poslab's.

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

/// The workspace's crates: the lab, its core and the kernels, each with its `src` folder.
fn crates() -> [(&'static str, std::path::PathBuf); 3] {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    [
        ("poslab", root.join("src")),
        ("poslab-core", root.join("crates/poslab-core/src")),
        ("poslab-kernels", root.join("crates/poslab-kernels/src")),
    ]
}

/// Every Rust file of every crate.
fn all_sources() -> Vec<std::path::PathBuf> {
    crates()
        .into_iter()
        .flat_map(|(_, src)| crate::common::files_with_extension(&src, "rs"))
        .collect()
}

/// The lab's modules and what each names ([`imports_of`]).
fn imports() -> BTreeMap<Vec<String>, BTreeSet<Vec<String>>> {
    imports_of(&crates()[0].1)
}

/// The modules each module of the crate at `src` names through `crate::` or `super::` paths
/// (longest known prefix).
fn imports_of(src: &Path) -> BTreeMap<Vec<String>, BTreeSet<Vec<String>>> {
    let files = crate::common::files_with_extension(src, "rs");
    let modules: BTreeSet<Vec<String>> = files.iter().map(|f| module_of(src, f)).collect();
    let resolve = |path: &[String]| {
        (1..=path.len())
            .rev()
            .map(|k| path[..k].to_vec())
            .find(|p| modules.contains(p))
    };
    let mut graph = BTreeMap::new();
    for file in &files {
        let module = module_of(src, file);
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
    let mut mutual = Vec::new();
    for (name, src) in crates() {
        let graph = imports_of(&src);
        assert!(graph.len() > 10, "{name}: found {} modules", graph.len());
        for (a, targets) in &graph {
            for b in targets {
                let related = a.starts_with(b) || b.starts_with(a);
                if a < b && !related && graph.get(b).is_some_and(|t| t.contains(a)) {
                    mutual.push(format!("{name}: {} <-> {}", a.join("::"), b.join("::")));
                }
            }
        }
    }
    assert!(
        mutual.is_empty(),
        "modules that import each other: {mutual:?}"
    );
    // The check sees real imports: the encoder names the positional schemes.
    let graph = imports_of(&crates()[1].1);
    let encoder = &graph[&vec!["encoder".to_string()]];
    assert!(
        encoder.contains(&vec!["positional".to_string()]),
        "{encoder:?}"
    );
}

/// The folder a module's file lies in (`cpu/layer.rs` and `cpu/mod.rs`: `cpu`).
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
    // the folders inside it are one family, as a parent module declares its children), in each
    // crate.
    let by_folder = |src: &Path| {
        let folders: BTreeSet<Vec<String>> = crate::common::files_with_extension(src, "rs")
            .iter()
            .filter(|f| f.file_name().is_some_and(|n| n == "mod.rs"))
            .map(|f| module_of(src, f))
            .collect();
        let mut by_folder: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
        for (module, targets) in &imports_of(src) {
            let from = folder_of(module, &folders);
            let entry = by_folder.entry(from.clone()).or_default();
            for t in targets {
                let to = folder_of(t, &folders);
                if !from.starts_with(&to) && !to.starts_with(&from) {
                    entry.insert(to);
                }
            }
        }
        by_folder
    };
    let mut circles = Vec::new();
    for (name, src) in crates() {
        let graph = by_folder(&src);
        assert!(graph.len() > 2, "{name}: found {} folders", graph.len());
        circles.extend(cycles(&graph).into_iter().map(|c| format!("{name}: {c:?}")));
    }
    assert!(
        circles.is_empty(),
        "folders that import each other in a circle: {circles:?}"
    );
    // The check finds a circle where there is one.
    let mut circle = by_folder(&crates()[0].1);
    let (a, b) = (vec!["runs".to_string()], vec!["render".to_string()]);
    circle.entry(a.clone()).or_default().insert(b.clone());
    circle.entry(b).or_default().insert(a);
    assert_eq!(cycles(&circle).len(), 1);
}

/// The packages `package` depends on, by the names its `Cargo.toml` gives them, in `table`
/// (`dependencies` or `dev-dependencies`).
fn dependencies(package: &str, table: &str) -> BTreeSet<String> {
    let path = match package {
        "poslab" => "Cargo.toml".to_string(),
        other => format!("crates/{other}/Cargo.toml"),
    };
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    let manifest: toml::Table = std::fs::read_to_string(path).unwrap().parse().unwrap();
    let named = |(name, spec): (&String, &toml::Value)| {
        let package = spec.get("package").and_then(toml::Value::as_str);
        package.unwrap_or(name).to_string()
    };
    match manifest.get(table).and_then(toml::Value::as_table) {
        Some(deps) => deps.iter().map(named).collect(),
        None => BTreeSet::new(),
    }
}

/// Every package `package` builds, from Cargo.lock: its dependencies and theirs (a workspace
/// package's dev-dependencies left out).
fn builds(package: &str) -> BTreeSet<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.lock");
    let lock: toml::Table = std::fs::read_to_string(path).unwrap().parse().unwrap();
    let mut deps: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for p in lock["package"].as_array().unwrap() {
        let names = p.get("dependencies").and_then(toml::Value::as_array);
        let names = names.into_iter().flatten().filter_map(toml::Value::as_str);
        let names = names.map(|d| d.split(' ').next().unwrap_or(d).to_string());
        let name = p["name"].as_str().unwrap().to_string();
        deps.entry(name).or_default().extend(names);
    }
    // Cargo.lock lists a workspace package's dev-dependencies with its own.
    let (normal, dev) = match package.starts_with("poslab") {
        true => (
            dependencies(package, "dependencies"),
            dependencies(package, "dev-dependencies"),
        ),
        false => (BTreeSet::new(), BTreeSet::new()),
    };
    let first = deps[package].iter();
    let mut todo: Vec<String> = first
        .filter(|d| normal.contains(*d) || !dev.contains(*d))
        .cloned()
        .collect();
    let mut seen = BTreeSet::new();
    while let Some(d) = todo.pop() {
        if seen.insert(d.clone()) {
            todo.extend(deps.get(&d).into_iter().flatten().cloned());
        }
    }
    seen
}

#[test]
fn the_kernels_depend_on_nothing_of_poslabs() {
    // The kernels take tensors, slices, shapes and their own specs: no module of the model, no
    // scheme, no config and nothing of the lab; candle and numeric crates only.
    let deps = dependencies("poslab-kernels", "dependencies");
    let poslab: Vec<_> = deps.iter().filter(|d| d.starts_with("poslab")).collect();
    assert!(poslab.is_empty(), "the kernels depend on {poslab:?}");
    assert!(
        deps.contains("candle-core") && deps.contains("gemm"),
        "{deps:?}"
    );
    // Inside, the shared specs are a leaf the CPU kernels read.
    let graph = imports_of(&crates()[2].1);
    let layer = &graph[&["cpu", "layer"].map(String::from).to_vec()];
    assert!(layer.iter().any(|t| t[..1] == ["spec"]), "{layer:?}");
}

#[test]
fn the_core_builds_none_of_the_labs_dependencies() {
    // A program that wants the encoder depends on poslab-core and builds none of the lab's
    // crates (tokenizers comes with candle-core itself, which depends on it on every target
    // but wasm).
    let lab_only = [
        "plotters",
        "tokenizers",
        "hf-hub",
        "clap",
        "nalgebra",
        "csv",
        "indicatif",
        "png",
        "dejavu",
        "fs4",
    ];
    let direct = dependencies("poslab-core", "dependencies");
    let named: Vec<_> = lab_only.iter().filter(|d| direct.contains(**d)).collect();
    assert!(named.is_empty(), "poslab-core depends on {named:?}");
    assert!(!direct.contains("poslab"), "{direct:?}");
    let built = builds("poslab-core");
    let lab: Vec<_> = lab_only
        .iter()
        .filter(|d| built.contains(**d) && **d != "tokenizers")
        .collect();
    assert!(lab.is_empty(), "poslab-core builds {lab:?}");
    assert!(builds("candle-core").contains("tokenizers"));
    // The check sees the lab's: the lab builds every one.
    let all = builds("poslab");
    let missing: Vec<_> = lab_only.iter().filter(|d| !all.contains(**d)).collect();
    assert!(missing.is_empty(), "the lab builds none of {missing:?}?");
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
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut found = Vec::new();
    for file in all_sources() {
        let rel = file
            .strip_prefix(root)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        if rel.starts_with("crates/poslab-core/src/positional/") {
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
    let mut problems = Vec::new();
    for file in all_sources() {
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

/// Each function of `code` longer than `max` lines, as `name: lines` (from its `fn` line to its
/// closing brace).
fn long_functions(code: &str, max: usize) -> Vec<String> {
    let lines: Vec<&str> = code.lines().collect();
    let mut long = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let t = line.trim_start();
        let Some(rest) = ["fn ", "pub fn ", "pub(crate) fn ", "pub(super) fn "]
            .iter()
            .find_map(|p| t.strip_prefix(p))
        else {
            continue;
        };
        let name: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        let indent = line.len() - t.len();
        let end = lines[i..]
            .iter()
            .position(|l| l.get(..indent + 1) == Some(&format!("{}}}", " ".repeat(indent))))
            .map(|k| i + k);
        if let Some(end) = end {
            if end - i + 1 > max {
                long.push(format!("{name}: {} lines", end - i + 1));
            }
        }
    }
    long
}

#[test]
fn the_commands_are_thin() {
    // Each subcommand's `exec` reads its flags and calls the library (cargo's shape): no function
    // of src/cli longer than 80 lines.
    let cli = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/cli");
    let mut long = Vec::new();
    for file in crate::common::files_with_extension(&cli, "rs") {
        let text = std::fs::read_to_string(&file).unwrap();
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        long.extend(
            long_functions(&text, 80)
                .into_iter()
                .map(|f| format!("{name}: {f}")),
        );
    }
    assert!(long.is_empty(), "functions over 80 lines: {long:?}");
    // The check counts a function's lines.
    let body = "fn short() {\n    x();\n}\n\npub fn long() {\n".to_string()
        + &"    y();\n".repeat(80)
        + "}\n";
    assert_eq!(long_functions(&body, 80), ["long: 82 lines"]);
}

/// The `thread_local!` blocks of `code`.
fn thread_locals(code: &str) -> Vec<&str> {
    code.match_indices("thread_local!")
        .map(|(at, _)| {
            let rest = &code[at..];
            &rest[..rest.find("\n}").map_or(rest.len(), |e| e + 2)]
        })
        .collect()
}

#[test]
fn no_thread_local_holds_a_backend_or_a_kernel_choice() {
    // The backend is a value the model holds and every op is given; what threads keep for
    // themselves are counters (launches, buffers, one-kernel ops), which choose nothing.
    let mut choosing = Vec::new();
    let mut counters = 0;
    for file in all_sources() {
        let text = std::fs::read_to_string(&file).unwrap();
        for block in thread_locals(&text) {
            counters += 1;
            if ["Backend", "Kernels", "SimdLevel", "bool", "Option<"]
                .iter()
                .any(|t| block.contains(t))
            {
                choosing.push(format!("{}: {block}", file.display()));
            }
        }
    }
    assert!(
        choosing.is_empty(),
        "thread-locals that choose: {choosing:?}"
    );
    assert!(counters >= 2, "found {counters} thread_local! blocks");
    // The check reads a block that would choose.
    let planted = "thread_local! {\n    static IN_FORCE: Cell<Option<Backend>> = None;\n}\n";
    assert_eq!(thread_locals(planted).len(), 1);
    assert!(thread_locals(planted)[0].contains("Backend"));
}
