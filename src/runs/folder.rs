//! A run folder's bookkeeping, so that a long run survives kills, never mixes two runs, and is
//! cleared without touching anything poslab did not write.
//!
//! - `.poslab-lock`: one writer at a time ([`FolderLock`]): `compare` and `report --out` hold it
//!   while they write, as `train` does.
//! - `run.json`, the manifest ([`Manifest`]): what the folder holds (a `compare` run or a
//!   `report`), the experiment and the SHA-256 of its config, the cells it holds (its
//!   selection), the kind of device they were computed on, and every file the run writes. It is
//!   written before any of them, so `--overwrite` removes exactly those files (and their
//!   temporaries), and a fresh run refuses a folder where one of them already exists unwritten
//!   by poslab.
//! - `cells/<task>/<variant>/seed<N>.json` ([`CellRecord`]): each finished cell, written
//!   atomically after its model. The record is the cell's commit: a run killed at any moment and
//!   started again into the folder skips the cells that have one and trains the rest, and its
//!   `results.json` is rebuilt from the records, byte for byte what an uninterrupted run writes.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::results::{CellResult, Results, TaskInfo, Timing, VariantInfo};
use super::{ExperimentConfig, Selection, Shard};
use crate::error::{Error, Result};
use crate::io::{is_temporary_of, write_atomic, FolderLock};

/// The manifest's file name.
pub const MANIFEST: &str = "run.json";
/// The experiment config as run, every default filled in.
pub const CONFIG_TOML: &str = "config.toml";
/// The results' file name (deterministic: the same cells give the same bytes).
pub const RESULTS_JSON: &str = "results.json";
/// The timings' file name (wall clock: varies between runs).
pub const TIMING_JSON: &str = "timing.json";
/// Where finished cells' records go.
pub const CELLS: &str = "cells";
/// Where trained models go.
pub const MODELS: &str = "models";
const FORMAT: &str = "poslab-run/1";
const CELL_FORMAT: &str = "poslab-cell/1";
/// The files of a saved model (see [`crate::saved`]).
const MODEL_FILES: [&str; 3] = [
    crate::saved::CONFIG,
    crate::saved::WEIGHTS,
    crate::saved::TOKENIZER,
];
/// The report files every run and merge writes at the top of its folder (`results.json` last:
/// its presence says the folder is complete).
pub const REPORT_FILES: [&str; 7] = [
    CONFIG_TOML,
    TIMING_JSON,
    "results.csv",
    "summary.csv",
    "report.md",
    "report.html",
    RESULTS_JSON,
];

/// What a folder holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FolderKind {
    /// Cells trained by `poslab compare`.
    Compare,
    /// Run folders merged by `poslab report`.
    Report,
}

impl FolderKind {
    fn command(self) -> &'static str {
        match self {
            Self::Compare => "poslab compare",
            Self::Report => "poslab report",
        }
    }
}

/// A selection as the command line gave it (empty lists: all), kept in the manifest.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SelectionRecord {
    /// Task names selected.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tasks: Vec<String>,
    /// Variant names selected.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub variants: Vec<String>,
    /// Seeds selected.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub seeds: Vec<u64>,
    /// `K/N`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<String>,
}

impl SelectionRecord {
    /// The record of a selection.
    pub fn of(selection: &Selection) -> Self {
        Self {
            tasks: selection.tasks.clone(),
            variants: selection.variants.clone(),
            seeds: selection.seeds.clone(),
            shard: selection.shard.map(|s| s.to_string()),
        }
    }

    /// The selection back (an error for a shard the manifest cannot have written).
    pub fn selection(&self) -> Result<Selection> {
        Ok(Selection {
            tasks: self.tasks.clone(),
            variants: self.variants.clone(),
            seeds: self.seeds.clone(),
            shard: self.shard.as_deref().map(str::parse::<Shard>).transpose()?,
        })
    }

    /// `shard 1/4`, `--variant rope --seed 0`, or `every cell`.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(s) = &self.shard {
            parts.push(format!("shard {s}"));
        }
        parts.extend(self.tasks.iter().map(|t| format!("--task {t}")));
        parts.extend(self.variants.iter().map(|v| format!("--variant {v}")));
        parts.extend(self.seeds.iter().map(|s| format!("--seed {s}")));
        if parts.is_empty() {
            "every cell".into()
        } else {
            parts.join(" ")
        }
    }

    /// The command-line flags that select these cells again.
    pub fn flags(&self) -> String {
        let mut flags = String::new();
        for t in &self.tasks {
            flags.push_str(&format!(" --task {t}"));
        }
        for v in &self.variants {
            flags.push_str(&format!(" --variant {v}"));
        }
        for s in &self.seeds {
            flags.push_str(&format!(" --seed {s}"));
        }
        if let Some(s) = &self.shard {
            flags.push_str(&format!(" --shard {s}"));
        }
        flags
    }
}

/// `run.json`: what a run folder holds and every file its run writes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// The manifest's format, `poslab-run/1`.
    pub format: String,
    /// What the folder holds.
    pub kind: FolderKind,
    /// The experiment's name.
    pub experiment: String,
    /// SHA-256 of the experiment config as run (`config.toml`, every default filled in).
    pub config_sha256: String,
    /// The cells a compare folder holds.
    #[serde(default)]
    pub selection: SelectionRecord,
    /// `cpu` or `cuda`: a compare folder's cells are computed on one kind of device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// The kernels the layers computed with (`layer`, `ops` or `reference`): a compare
    /// folder's cells are computed with one, since they agree to within rounding, not bit for
    /// bit. Absent in folders from before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernels: Option<String>,
    /// How many cells the folder holds once complete.
    pub cells: usize,
    /// The folders a report merged, as given.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sources: Vec<String>,
    /// Every file the run writes, relative to the folder.
    pub files: Vec<String>,
    /// The comparisons planned when the run began: its verdicts' family. `[[comparisons]]`
    /// added later (the config edited before the run is continued) are exploratory. Absent in
    /// folders from before it was recorded, whose config's comparisons are taken as planned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub planned: Option<Vec<super::ComparisonSpec>>,
}

/// The comparisons of `config` for a folder whose manifest is `manifest`: those planned when
/// the run began (the config's, where the manifest records none), and the config's others as
/// exploratory.
pub fn comparison_plan(
    manifest: Option<&Manifest>,
    config: &ExperimentConfig,
) -> super::results::ComparisonPlan {
    let now = config.comparison_pairs();
    match manifest.and_then(|m| m.planned.as_ref()) {
        Some(planned) => super::results::ComparisonPlan::of(
            planned.iter().map(|c| (c.a.clone(), c.b.clone())).collect(),
            &now,
        ),
        None => super::results::ComparisonPlan::planned(now),
    }
}

/// The SHA-256 of a config's canonical TOML, in hex.
pub fn config_sha256(config: &ExperimentConfig) -> String {
    // Of what shapes the cells: comparisons are the report's, and may change between runs.
    crate::io::sha256(config.shaping_cells().to_toml().as_bytes())
}

/// `cells/<task>/<variant>/seed<N>.json`.
pub fn cell_path(task: &str, variant: &str, seed: u64) -> String {
    format!("{CELLS}/{task}/{variant}/seed{seed}.json")
}

/// `models/<task>/<variant>/seed<N>`, relative to the run folder.
pub fn model_dir(task: &str, variant: &str, seed: u64) -> String {
    format!("{MODELS}/{task}/{variant}/seed{seed}")
}

/// The plots of a report over `tasks`.
fn plot_files(tasks: &BTreeSet<&str>) -> Vec<String> {
    let mut files: Vec<String> = tasks
        .iter()
        .flat_map(|t| {
            [
                format!("plots/loss_{t}.png"),
                format!("plots/length_{t}.png"),
            ]
        })
        .collect();
    files.push("plots/length_suite.png".into());
    files
}

/// Every file a compare of `cells` (indices into the config, as [`ExperimentConfig::cells`]
/// gives them) writes.
pub fn compare_files(config: &ExperimentConfig, cells: &[(usize, usize, u64)]) -> Vec<String> {
    let mut files: Vec<String> = REPORT_FILES.iter().map(|f| f.to_string()).collect();
    let tasks: BTreeSet<&str> = cells
        .iter()
        .map(|c| config.tasks[c.0].name.as_str())
        .collect();
    files.extend(plot_files(&tasks));
    for &(t, v, seed) in cells {
        let (task, variant) = (&config.tasks[t].name, &config.variants[v].name);
        files.push(cell_path(task, variant, seed));
        let model = model_dir(task, variant, seed);
        files.extend(MODEL_FILES.iter().map(|f| format!("{model}/{f}")));
    }
    files
}

/// Every file a report of `config` writes.
pub fn report_files(config: &ExperimentConfig) -> Vec<String> {
    let mut files: Vec<String> = REPORT_FILES.iter().map(|f| f.to_string()).collect();
    files.extend(plot_files(
        &config.tasks.iter().map(|t| t.name.as_str()).collect(),
    ));
    files
}

/// What a command is about to write into a folder.
pub struct Plan<'a> {
    /// What the folder will hold.
    pub kind: FolderKind,
    /// The experiment as run.
    pub config: &'a ExperimentConfig,
    /// The cells selected, as the command line gave them.
    pub selection: SelectionRecord,
    /// The cells, as [`ExperimentConfig::cells`] gives them (compare).
    pub cells: Vec<(usize, usize, u64)>,
    /// The device the run uses (compare: a resumed run must use the same).
    pub device: Option<String>,
    /// The kernels the run computes with (compare: a resumed run must use the same).
    pub kernels: Option<String>,
    /// The run folders a merge reads (report).
    pub sources: Vec<String>,
    /// Every file the command writes, relative to the folder.
    pub files: Vec<String>,
    /// The comparisons planned before the run (`(a, b)`): the family the verdicts correct for.
    pub planned: Vec<(String, String)>,
}

/// A folder opened for writing: locked until this is dropped.
#[derive(Debug)]
pub struct Opened {
    /// The lock that makes this process the folder's one writer.
    pub lock: FolderLock,
    /// The folder already held this run (same config, cells and device): its finished cells
    /// are kept.
    pub resumed: bool,
}

/// Reads a folder's manifest; `None` when it has none.
pub fn read_manifest(dir: &Path) -> Result<Option<Manifest>> {
    let path = dir.join(MANIFEST);
    if !path.exists() {
        return Ok(None);
    }
    let text = crate::io::read_text_bounded(&path, crate::io::MAX_CONFIG_BYTES, "manifest")?;
    serde_json::from_str(&text).map(Some).map_err(|e| {
        Error::Input(format!(
            "{}: not a readable poslab manifest ({e}): it was edited or damaged, so poslab \
             cannot tell its files from others in the folder; choose another folder",
            path.display()
        ))
    })
}

/// Locks `dir` and makes it ready for `plan`:
///
/// - a folder without a manifest is new: refused if any file the plan writes is already there
///   (poslab did not write it), otherwise the manifest is written;
/// - a folder of another experiment config is refused, naming the first difference, unless it
///   is a compare run with no finished cell (one stopped at its first failure) and `overwrite`,
///   which replaces it: it holds no result to lose;
/// - a compare folder with this config, these cells and this device kind is resumed, unless
///   `overwrite`;
/// - anything else of this config (other cells, a report) is refused unless `overwrite`, which
///   removes the files its manifest lists, and only those.
pub fn open(dir: &Path, plan: &Plan, overwrite: bool) -> Result<Opened> {
    crate::io::create_folder(dir)?;
    let lock = FolderLock::exclusive(dir, plan.kind.command())?;
    let manifest = Manifest::of(plan);
    match opening(dir, plan, &manifest, overwrite)? {
        Opening::Resume { files } => {
            remove_temporaries(dir, &files);
            remove_temporaries(dir, &[MANIFEST.to_string()]);
            Ok(Opened {
                lock,
                resumed: true,
            })
        }
        Opening::New { replaces } => {
            remove_listed(dir, &replaces)?;
            let json = serde_json::to_string_pretty(&manifest).expect("a manifest serializes");
            write_atomic(&dir.join(MANIFEST), (json + "\n").as_bytes())?;
            Ok(Opened {
                lock,
                resumed: false,
            })
        }
    }
}

/// What [`open`] would do with `dir` for `plan`, found by the same rules but changing nothing:
/// the error it would give (a writer at work in the folder included), or what it would start
/// or continue there. A dry run says this before anything is spent.
pub fn preview(dir: &Path, plan: &Plan, overwrite: bool) -> Result<Preview> {
    // What `create_folder` refuses; a path that is simply absent is a new folder.
    if let Some(e) = crate::io::not_a_folder(dir) {
        return Err(e);
    }
    if dir.symlink_metadata().is_err() {
        return Ok(Preview::NewFolder);
    }
    if !dir.is_dir() {
        // A link to nowhere, which `exists` does not see: no folder either.
        return Err(Error::Input(format!(
            "{} is a file, not a folder: give a folder's path",
            dir.display()
        )));
    }
    let _reading = FolderLock::shared(dir)?;
    let manifest = Manifest::of(plan);
    Ok(match opening(dir, plan, &manifest, overwrite)? {
        Opening::Resume { .. } => Preview::Resume,
        Opening::New { replaces } if replaces.is_empty() => Preview::New,
        Opening::New { .. } => Preview::Replace,
    })
}

/// What a run into a folder would find there ([`preview`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preview {
    /// The folder does not exist yet: the run makes it.
    NewFolder,
    /// The folder holds no run: a new one starts there.
    New,
    /// The folder holds a run that `--overwrite` replaces (only the files it wrote).
    Replace,
    /// The folder holds this run, unfinished or finished: it continues.
    Resume,
}

/// Whether a folder's cells computed with `old` kernels may be joined by cells computed with
/// `new`: the same kernels, or a folder from before they were recorded.
fn same_kernels(old: &Option<String>, new: &Option<String>) -> bool {
    old.is_none() || old == new
}

/// What opening a folder does: resume its run (whose files are these), or start a new one
/// after removing the files of the run it replaces.
enum Opening {
    Resume { files: Vec<String> },
    New { replaces: Vec<String> },
}

/// The rules of [`open`], reading `dir` and changing nothing.
fn opening(dir: &Path, plan: &Plan, manifest: &Manifest, overwrite: bool) -> Result<Opening> {
    if dir.join(crate::saved::TRAIN_CONFIG).exists() {
        return Err(Error::Input(format!(
            "{} holds a `poslab train` run ({}): choose another folder",
            dir.display(),
            crate::saved::TRAIN_CONFIG
        )));
    }
    let mut replaces = Vec::new();
    if let Some(old) = read_manifest(dir)? {
        if old.config_sha256 != manifest.config_sha256 {
            let finished = old.finished_cells(dir);
            if !(overwrite && old.kind == FolderKind::Compare && finished == 0) {
                return Err(other_config(dir, &old, plan.config, finished));
            }
        } else {
            let same_cells = old.kind == plan.kind
                && old.device == plan.device
                && same_kernels(&old.kernels, &plan.kernels)
                && old.sources == plan.sources
                && cells_of(plan.config, &old)? == plan.cells;
            if same_cells && plan.kind == FolderKind::Compare && !overwrite {
                return Ok(Opening::Resume { files: old.files });
            }
            if !overwrite {
                return Err(Error::Input(format!(
                    "{} already holds {} of this experiment, and this is {}: give each its own \
                     folder, or pass --overwrite to replace it (only the files that run wrote \
                     are removed)",
                    dir.display(),
                    describe(&old),
                    describe(manifest)
                )));
            }
        }
        check_listed(dir, &old.files)?;
        replaces = old.files;
    }
    // A new run: refused if a file the plan writes is there, which no manifest lists (the
    // files of the run it replaces are removed first).
    let taken: Vec<&String> = plan
        .files
        .iter()
        .filter(|f| {
            let there = dir.join(f).symlink_metadata();
            there.is_ok() && !(replaces.contains(f) && there.is_ok_and(|m| m.is_file()))
        })
        .collect();
    if !taken.is_empty() {
        let shown: Vec<&str> = taken.iter().take(3).map(|s| s.as_str()).collect();
        return Err(Error::Input(format!(
            "{} holds {}{}, which no poslab run recorded writing there (no {MANIFEST} lists \
             it): poslab writes only into files it owns; move {}, or choose another folder",
            dir.display(),
            shown.join(", "),
            if taken.len() > 3 {
                format!(" and {} more", taken.len() - 3)
            } else {
                String::new()
            },
            if taken.len() == 1 { "it" } else { "them" }
        )));
    }
    Ok(Opening::New { replaces })
}

impl Manifest {
    /// The manifest of a run of `plan`.
    fn of(plan: &Plan) -> Self {
        Manifest {
            format: FORMAT.into(),
            kind: plan.kind,
            experiment: plan.config.name.clone(),
            config_sha256: config_sha256(plan.config),
            selection: plan.selection.clone(),
            device: plan.device.clone(),
            kernels: plan.kernels.clone(),
            cells: plan.cells.len(),
            sources: plan.sources.clone(),
            files: plan.files.clone(),
            planned: Some(
                plan.planned
                    .iter()
                    .map(|(a, b)| super::ComparisonSpec {
                        a: a.clone(),
                        b: b.clone(),
                    })
                    .collect(),
            ),
        }
    }

    /// How many of the cells this run writes have their record in `dir`: a compare folder's
    /// results.
    pub fn finished_cells(&self, dir: &Path) -> usize {
        self.files
            .iter()
            .filter(|f| f.starts_with(&format!("{CELLS}/")) && dir.join(f).is_file())
            .count()
    }
}

/// The finished cells of the run in `dir` and its cells, from its manifest.
pub(crate) fn progress_of(dir: &Path) -> Option<(usize, usize)> {
    let m = read_manifest(dir).ok()??;
    Some((m.finished_cells(dir), m.cells))
}

/// The cells a manifest's selection names under `config`.
fn cells_of(config: &ExperimentConfig, m: &Manifest) -> Result<Vec<(usize, usize, u64)>> {
    match m.kind {
        FolderKind::Compare => config.cells(&m.selection.selection()?),
        FolderKind::Report => Ok(Vec::new()),
    }
}

/// `a compare run (shard 1/4, 15 cells, on cpu with the layer kernels)` or `a report merged from
/// 4 folders`.
pub fn describe(m: &Manifest) -> String {
    match m.kind {
        FolderKind::Compare => format!(
            "a compare run ({}, {} cells{}{})",
            m.selection.describe(),
            m.cells,
            m.device
                .as_deref()
                .map_or(String::new(), |d| format!(", on {d}")),
            m.kernels
                .as_deref()
                .map_or(String::new(), |k| format!(" with the {k} kernels"))
        ),
        FolderKind::Report => format!(
            "a report merged from {} folder{}",
            m.sources.len(),
            if m.sources.len() == 1 { "" } else { "s" }
        ),
    }
}

/// The refusal of a folder of another experiment config, which holds `finished` cells.
fn other_config(dir: &Path, old: &Manifest, config: &ExperimentConfig, finished: usize) -> Error {
    let diff = load_run_config(dir).ok().and_then(|theirs| {
        crate::io::first_difference(
            "",
            &toml::Value::try_from(&theirs).expect("a config is TOML"),
            &toml::Value::try_from(config).expect("a config is TOML"),
        )
    });
    let way_out = if old.kind == FolderKind::Compare && finished == 0 {
        "it has no finished cell, so --overwrite starts it over with this config; or choose \
         another folder"
            .to_string()
    } else {
        format!(
            "choose another folder (--overwrite never replaces another experiment's results{}: \
             delete the folder yourself if it is no longer wanted)",
            match old.kind {
                FolderKind::Compare => format!(
                    ", and this run has {finished} finished cell{}",
                    if finished == 1 { "" } else { "s" }
                ),
                FolderKind::Report => String::new(),
            }
        )
    };
    Error::Input(format!(
        "{} holds {} of another experiment config ({}): one folder holds one experiment; \
         {way_out}",
        dir.display(),
        describe(old),
        match diff {
            Some(d) => format!("{d}, the folder's vs this one"),
            None => format!(
                "`{}` with config SHA-256 {:.12}…",
                old.experiment, old.config_sha256
            ),
        }
    ))
}

/// What a folder without a model's `config.json` is instead, when poslab made it: a `train` run
/// that has not finished, or a `compare` run (whose models are in `models/`); `None` otherwise,
/// and for any folder that has a `config.json`.
pub fn not_a_model(dir: &Path) -> Option<String> {
    if dir.join(crate::saved::CONFIG).exists() {
        return None;
    }
    if dir.join(crate::saved::STOPPED).is_file() {
        return Some(
            "a `poslab train` run that stopped for good before it finished (its loss \
             diverged; `poslab inspect` on it says where), so it holds no model: train a changed \
             config into another --out"
                .to_string(),
        );
    }
    if dir.join(crate::saved::TRAIN_CONFIG).is_file() {
        return Some(format!(
            "a `poslab train` run that has not finished, so it holds no model yet: finish it \
             with `poslab train --resume {}`",
            dir.display()
        ));
    }
    if dir.join(MANIFEST).is_file() && dir.join(CONFIG_TOML).is_file() {
        return Some(format!(
            "a `poslab compare` run folder, not a model: each cell's model is in \
             {}/{MODELS}/<task>/<variant>/seed<N>",
            dir.display()
        ));
    }
    None
}

/// The experiment config a run folder was made with (`config.toml`, which `compare` writes).
pub fn load_run_config(dir: &Path) -> Result<ExperimentConfig> {
    let path = dir.join(CONFIG_TOML);
    if !path.is_file() {
        return Err(Error::Input(format!(
            "{} has no {CONFIG_TOML} (poslab compare writes one into every run folder): without \
             it nothing says the runs share their settings",
            dir.display()
        )));
    }
    ExperimentConfig::load(&path)
}

/// Removes the temporaries that killed writes of `files` left (`.name.PID.tmp`).
fn remove_temporaries(dir: &Path, files: &[String]) {
    let mut by_parent: std::collections::BTreeMap<PathBuf, Vec<String>> = Default::default();
    for f in files {
        let path = dir.join(f);
        if let (Some(parent), Some(name)) = (path.parent(), path.file_name()) {
            by_parent
                .entry(parent.to_path_buf())
                .or_default()
                .push(name.to_string_lossy().into_owned());
        }
    }
    for (parent, names) in by_parent {
        let Ok(entries) = std::fs::read_dir(&parent) else {
            continue;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if names.iter().any(|n| is_temporary_of(&name, n)) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
}

/// Refuses a manifest that lists a path outside its folder.
fn check_listed(dir: &Path, files: &[String]) -> Result<()> {
    match files.iter().find(|f| {
        f.split('/')
            .any(|part| part.is_empty() || part == "." || part == "..")
    }) {
        Some(f) => Err(Error::Input(format!(
            "{}: lists `{f}`, which is not a path inside the folder: the manifest was edited, \
             so nothing was removed; choose another folder",
            dir.join(MANIFEST).display()
        ))),
        None => Ok(()),
    }
}

/// Removes `files` (plain files only) and their temporaries, then the folders that held them
/// if that left them empty (never `dir` itself, never a folder that holds anything else).
pub fn remove_listed(dir: &Path, files: &[String]) -> Result<()> {
    check_listed(dir, files)?;
    remove_temporaries(dir, files);
    let mut parents = BTreeSet::new();
    for f in files {
        let path = dir.join(f);
        match path.symlink_metadata() {
            Ok(meta) if meta.is_file() => {
                std::fs::remove_file(&path).map_err(|e| Error::io(&path, e))?
            }
            _ => {}
        }
        let mut parent = Path::new(f).parent();
        while let Some(p) = parent.filter(|p| !p.as_os_str().is_empty()) {
            parents.insert(p.to_path_buf());
            parent = p.parent();
        }
    }
    // Deepest first, so a folder is emptied of its subfolders before it is tried.
    let mut parents: Vec<PathBuf> = parents.into_iter().collect();
    parents.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for p in parents {
        let _ = std::fs::remove_dir(dir.join(p));
    }
    Ok(())
}

/// One variant row a cell's model was re-scored as (`rope + yarn`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Rescored {
    /// The re-scored variant row.
    pub variant: VariantInfo,
    /// The model's results under it.
    pub result: CellResult,
}

/// A finished cell, `cells/<task>/<variant>/seed<N>.json`: everything the run's results need
/// from it, so that a resumed run (or a partial merge) rebuilds them without training it again.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CellRecord {
    /// The record's format, `poslab-cell/1`.
    pub format: String,
    /// The task.
    pub task: TaskInfo,
    /// The variant.
    pub variant: VariantInfo,
    /// The cell's results.
    pub result: CellResult,
    /// The same model re-scored under each `[eval] rope_scaling`, each a row of its own.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rescored: Vec<Rescored>,
    /// Its wall-clock measurements.
    pub timing: Timing,
}

impl CellRecord {
    /// A record in the current format.
    pub fn new(
        task: TaskInfo,
        variant: VariantInfo,
        result: CellResult,
        rescored: Vec<Rescored>,
        timing: Timing,
    ) -> Self {
        Self {
            format: CELL_FORMAT.into(),
            task,
            variant,
            result,
            rescored,
            timing,
        }
    }

    /// `task/variant/seedN`.
    pub fn name(&self) -> String {
        self.result.name()
    }
}

/// The first 12 hex digits of a fingerprint, for messages (`none` when empty).
pub fn short(sha: &str) -> &str {
    match sha {
        "" => "none",
        s => &s[..s.len().min(12)],
    }
}

/// How many of `cells` (as [`ExperimentConfig::cells`] gives them) have a record in `dir`.
pub fn cells_done(dir: &Path, config: &ExperimentConfig, cells: &[(usize, usize, u64)]) -> usize {
    cells
        .iter()
        .filter(|&&(t, v, seed)| {
            dir.join(cell_path(
                &config.tasks[t].name,
                &config.variants[v].name,
                seed,
            ))
            .is_file()
        })
        .count()
}

/// The records of `cells` (as [`ExperimentConfig::cells`] gives them) found in `dir`, one per
/// cell: `None` where a cell has none yet, or an unusable one, which `unusable` is told of with
/// the cell's name.
pub fn read_cells(
    dir: &Path,
    config: &ExperimentConfig,
    cells: &[(usize, usize, u64)],
    unusable: &dyn Fn(String, Error),
) -> Vec<Option<CellRecord>> {
    cells
        .iter()
        .map(|&(t, v, seed)| {
            let (task, variant) = (&config.tasks[t].name, &config.variants[v].name);
            read_cell(dir, config, task, variant, seed).unwrap_or_else(|e| {
                unusable(config.cell_name((t, v, seed)), e);
                None
            })
        })
        .collect()
}

/// Writes a cell's record atomically, calling `halfway` with half of it in the temporary file.
pub fn write_cell(dir: &Path, record: &CellRecord, halfway: &dyn Fn()) -> Result<()> {
    let path = dir.join(cell_path(
        &record.result.task,
        &record.result.variant,
        record.result.seed,
    ));
    let json = serde_json::to_string_pretty(record).expect("a cell record serializes") + "\n";
    crate::io::write_atomic_with(&path, json.as_bytes(), halfway)
}

/// The record of a finished cell of `config`: `Ok(None)` when it has none yet, an error
/// (saying why) when its record or its model is unusable, or it was made by another config.
pub fn read_cell(
    dir: &Path,
    config: &ExperimentConfig,
    task: &str,
    variant: &str,
    seed: u64,
) -> Result<Option<CellRecord>> {
    let path = dir.join(cell_path(task, variant, seed));
    if !path.exists() {
        return Ok(None);
    }
    let text = crate::io::read_text_bounded(&path, crate::io::MAX_CONFIG_BYTES, "cell record")?;
    let record: CellRecord = serde_json::from_str(&text)
        .map_err(|e| Error::Input(format!("{}: unreadable ({e})", path.display())))?;
    let r = &record.result;
    if record.format != CELL_FORMAT
        || (r.task.as_str(), r.variant.as_str(), r.seed) != (task, variant, seed)
    {
        return Err(Error::Input(format!(
            "{}: holds cell {} in format `{}`, not {} in `{CELL_FORMAT}`",
            path.display(),
            record.name(),
            record.format,
            super::results::cell_name(task, variant, seed)
        )));
    }
    let expected = config_sha256(config);
    let rows = std::iter::once(&record.result).chain(record.rescored.iter().map(|r| &r.result));
    if let Some(foreign) = rows.map(|r| &r.config_sha256).find(|f| **f != expected) {
        return Err(Error::Input(format!(
            "{}: holds cell {} made by another config (its fingerprint `{}`, this run's `{}`{})",
            path.display(),
            record.name(),
            short(foreign),
            short(&expected),
            if foreign.is_empty() {
                ": a record of an older poslab, which carried none"
            } else {
                ""
            }
        )));
    }
    // Every test's per-example outcomes: what the verdicts pair across seeds.
    let rows = std::iter::once(&record.result).chain(record.rescored.iter().map(|r| &r.result));
    for row in rows {
        for e in &row.summary.evaluations {
            if let Err(why) = super::results::check_examples(&e.outcome, e.examples.as_ref()) {
                return Err(Error::Input(format!(
                    "{}: cell {}, test `{}`: {why}",
                    path.display(),
                    row.name(),
                    e.name
                )));
            }
        }
    }
    let model = dir.join(model_dir(task, variant, seed));
    if let Some(missing) = MODEL_FILES.iter().find(|f| !model.join(f).is_file()) {
        return Err(Error::Input(format!(
            "its model lacks {}",
            model.join(missing).display()
        )));
    }
    Ok(Some(record))
}

/// The results and timings of finished cells (in the selection's order), as `results.json` and
/// `timing.json` hold them: the same records give the same bytes, however many runs wrote them.
pub fn assemble(
    config: &ExperimentConfig,
    records: Vec<CellRecord>,
    plan: &super::results::ComparisonPlan,
) -> (Results, Vec<Timing>) {
    let mut results = Results {
        experiment: config.name.clone(),
        tasks: Vec::new(),
        variants: Vec::new(),
        cells: Vec::new(),
        summary: Vec::new(),
        partial: None,
        comparisons: Vec::new(),
        comparisons_skipped: Vec::new(),
        data_seed: Default::default(),
    };
    let mut timings = Vec::new();
    for record in records {
        if !results.tasks.iter().any(|t| t.name == record.task.name) {
            results.tasks.push(record.task);
        }
        let rows = std::iter::once((record.variant, record.result))
            .chain(record.rescored.into_iter().map(|r| (r.variant, r.result)));
        for (variant, result) in rows {
            if !results.variants.iter().any(|v| v.name == variant.name) {
                results.variants.push(variant);
            }
            results.cells.push(result);
        }
        timings.push(record.timing);
    }
    results.order_as(config, plan);
    (results, timings)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removing_a_run_keeps_what_it_did_not_write() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        for f in [
            "results.json",
            "models/t/v/seed0/config.json",
            "models/t/v/seed0/.model.safetensors.77.tmp",
            "models/mine/weights.bin",
            "plots/loss_t.png",
            "plots/my_plot.png",
            "notes.txt",
        ] {
            let p = d.join(f);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, "x").unwrap();
        }
        let listed = [
            "results.json",
            "report.md",
            "models/t/v/seed0/config.json",
            "models/t/v/seed0/model.safetensors",
            "plots/loss_t.png",
        ]
        .map(String::from);
        remove_listed(d, &listed).unwrap();
        assert!(!d.join("results.json").exists() && !d.join("models/t").exists());
        for kept in ["models/mine/weights.bin", "plots/my_plot.png", "notes.txt"] {
            assert!(d.join(kept).is_file(), "{kept}");
        }
        let err = remove_listed(d, &["../notes.txt".to_string()]).unwrap_err();
        assert!(
            err.to_string().contains("not a path inside the folder"),
            "{err}"
        );
    }
}
