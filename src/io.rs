//! Filesystem helpers: atomic writes, and reads bounded in size.

use std::io::{Read, Write};
use std::path::Path;

use crate::error::{Error, Result};

pub use poslab_core::io::{
    create_folder, human_bytes, not_a_folder, parse_toml, read_bounded, read_text_bounded,
    write_atomic, write_atomic_with, MAX_CONFIG_BYTES, MAX_WEIGHTS_BYTES, TEMP_RANDOM,
};

/// The largest data file (TSV, CSV, JSONL, text): 4 GiB.
pub const MAX_DATA_BYTES: u64 = 4 << 30;
/// Writes `line` and a newline to standard error, ignoring a failure: a closed pipe or a dead
/// `tee` must not stop the run whose progress it was reading (`eprintln!` would panic).
pub fn note(line: &str) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// The SHA-256 of `bytes`, in hex.
pub fn sha256(bytes: &[u8]) -> String {
    use sha2::Digest as _;
    hex(&sha2::Sha256::digest(bytes))
}

fn hex(digest: &[u8]) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// The SHA-256 of a regular file, in hex, read in blocks (any size, little memory).
pub fn sha256_file(path: &Path) -> Result<String> {
    use sha2::Digest as _;
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if !meta.is_file() {
        return Err(Error::Input(format!(
            "{}: not a regular file (a folder, device or pipe)",
            path.display()
        )));
    }
    let mut file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut hasher = sha2::Sha256::new();
    let mut block = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut block).map_err(|e| Error::io(path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&block[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

/// Whether `name` is a temporary file of [`write_atomic`] (or of a checkpoint folder) for a file
/// called `of`: `.{of}.{pid}.tmp`, or `.{of}.{pid}.tmp.png`, which plots left behind before they
/// were written through [`write_atomic`] (recognised so that old folders are cleaned too).
pub fn is_temporary_of(name: &str, of: &str) -> bool {
    name.strip_prefix('.')
        .and_then(|rest| rest.strip_prefix(of))
        .and_then(|rest| rest.strip_prefix('.'))
        .is_some_and(|rest| {
            let middle = rest
                .strip_suffix(".tmp")
                .or_else(|| rest.strip_suffix(".tmp.png"));
            // A process id (the files of earlier versions) or write_atomic's random name.
            middle.is_some_and(|p| {
                let digits = !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit());
                let random = p.len() == TEMP_RANDOM && p.bytes().all(|b| b.is_ascii_alphanumeric());
                digits || random
            })
        })
}

/// An advisory lock on a folder (the file `.poslab-lock` in it, locked through the `fs4`
/// crate): one writer per run folder. `poslab train`, `compare` and `report --out` hold it
/// exclusively while they write; `report` holds it shared on each folder it reads, so a folder
/// is never merged while a run is still writing it. The operating system releases it when the
/// process ends, however it ends (a kill -9 included), so a killed run never leaves a folder
/// stuck.
#[derive(Debug)]
pub struct FolderLock {
    _file: std::fs::File,
}

impl FolderLock {
    /// The lock file's name inside the folder it guards.
    pub const FILE: &'static str = ".poslab-lock";

    /// The exclusive lock of a writer; `who` (`poslab compare`, ...) is written into the lock
    /// file with the process id, so that a second writer's refusal can say who holds it.
    pub fn exclusive(dir: &Path, who: &str) -> Result<Self> {
        use fs4::fs_std::FileExt;
        let path = dir.join(Self::FILE);
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| Error::io(&path, e))?;
        // A lock this process released can outlive it for an instant: a child process another
        // thread is spawning holds a copy of the descriptor between fork and exec. So when the
        // recorded holder is this process, try again for up to a second before refusing.
        let ours = format!("pid {} (", std::process::id());
        let mut tries = 0;
        loop {
            match file.try_lock_exclusive() {
                Ok(true) => break,
                Ok(false) => {
                    let recorded = std::fs::read_to_string(&path).unwrap_or_default();
                    if !recorded.starts_with(&ours) || tries == 50 {
                        return Err(Self::busy(dir, &path, "another"));
                    }
                    tries += 1;
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                Err(e) => return Err(Error::io(&path, e)),
            }
        }
        let holder = format!("pid {} ({who})\n", std::process::id());
        let written = file
            .set_len(0)
            .and_then(|_| file.write_all(holder.as_bytes()))
            .and_then(|_| file.flush());
        written.map_err(|e| Error::io(&path, e))?;
        Ok(Self { _file: file })
    }

    /// The shared lock of a reader: refused while a writer holds the folder. A folder that has
    /// never been locked (no lock file, or a read-only copy) is read without one.
    pub fn shared(dir: &Path) -> Result<Option<Self>> {
        let path = dir.join(Self::FILE);
        let file = match std::fs::File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io(&path, e)),
        };
        // fs4's, not std's newer method of the same name (Rust 1.89).
        match fs4::fs_std::FileExt::try_lock_shared(&file) {
            Ok(true) => Ok(Some(Self { _file: file })),
            Ok(false) => Err(Self::busy(dir, &path, "a")),
            Err(e) => Err(Error::io(&path, e)),
        }
    }

    fn busy(dir: &Path, path: &Path, article: &str) -> Error {
        let holder = std::fs::read_to_string(path)
            .ok()
            .map(|h| h.trim().to_string())
            .filter(|h| !h.is_empty() && h.len() < 200)
            .map_or(String::new(), |h| format!(" ({h})"));
        Error::Input(format!(
            "{} is being written by {article} poslab process right now{holder}: one writer per \
             run folder; wait for it to finish, or choose another folder",
            dir.display()
        ))
    }
}

// TOML documents: configs, manifests.

/// Whether `text` is a TOML document with `key` at its top level (which config a file is, when
/// it does not parse as the one expected).
pub fn toml_has_key(text: &str, key: &str) -> bool {
    text.parse::<toml::Table>()
        .is_ok_and(|table| table.contains_key(key))
}

/// The first place two TOML values differ, as `path: a vs b`.
pub fn first_difference(path: &str, a: &toml::Value, b: &toml::Value) -> Option<String> {
    use toml::Value;
    let at = |key: &str| {
        if path.is_empty() {
            key.to_string()
        } else {
            format!("{path}.{key}")
        }
    };
    match (a, b) {
        (Value::Table(x), Value::Table(y)) => {
            let mut keys: Vec<&String> = x.keys().chain(y.keys()).collect();
            keys.sort();
            keys.dedup();
            keys.into_iter().find_map(|k| match (x.get(k), y.get(k)) {
                (Some(u), Some(v)) => first_difference(&at(k), u, v),
                (Some(u), None) => Some(format!("{}: {u} vs (unset)", at(k))),
                (None, Some(v)) => Some(format!("{}: (unset) vs {v}", at(k))),
                (None, None) => None,
            })
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => x
            .iter()
            .zip(y)
            .enumerate()
            .find_map(|(i, (u, v))| first_difference(&format!("{path}[{i}]"), u, v)),
        _ if a == b => None,
        _ => Some(format!("{path}: {a} vs {b}")),
    }
}

// Run folders.

/// `YYYYMMDD-HHMMSS` in UTC.
pub fn utc_timestamp() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}{month:02}{day:02}-{:02}{:02}{:02}",
        rem / 3_600,
        rem % 3_600 / 60,
        rem % 60
    )
}

/// What the names of [`new_run_dir`]'s folders for `command` and `name` begin with, up to
/// their timestamp: `train-reviews-`, `compare-`.
pub fn run_dir_prefix(command: &str, name: &str) -> String {
    match name == command {
        true => format!("{command}-"),
        false => format!("{command}-{name}-"),
    }
}

/// A new folder `root/<command>-<name>-<timestamp>` (with `-2`, `-3`, ... if taken), created:
/// the folders of different commands differ by their first word (`train-reviews-…`,
/// `compare-reviews-…`), and a `name` that is the command's own is not repeated
/// (`compare-…` for the default experiment, named `compare`).
pub fn new_run_dir(root: &Path, command: &str, name: &str) -> Result<std::path::PathBuf> {
    let name = run_dir_prefix(command, name);
    let name = name.trim_end_matches('-');
    let stamp = utc_timestamp();
    for n in 1.. {
        let dir = if n == 1 {
            root.join(format!("{name}-{stamp}"))
        } else {
            root.join(format!("{name}-{stamp}-{n}"))
        };
        match std::fs::create_dir_all(root).and_then(|_| std::fs::create_dir(&dir)) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(Error::io(&dir, e)),
        }
    }
    unreachable!("an unbounded search ends by returning")
}

/// The folder a config's relative paths resolve against: the folder of the config file they
/// were read from, or (`None`, for a config made from text) the working directory. A task's
/// `train`, `valid`, `test`, `text_file` and tokenizer `path`, and `init`'s local folder.
///
/// It says where a config was written, not what it is: two configs that differ only here are
/// equal, and it is never written into a config (a run folder's copy keeps the paths as the
/// user wrote them, so that its fingerprint is the same from any folder and on any machine).
#[derive(Clone, Debug, Default)]
pub struct PathBase(pub Option<std::path::PathBuf>);

impl PartialEq for PathBase {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl PathBase {
    /// `path` as it is read: joined to the base when relative.
    pub fn join(&self, path: &Path) -> std::path::PathBuf {
        match &self.0 {
            Some(base) if path.is_relative() => base.join(path),
            _ => path.to_path_buf(),
        }
    }

    /// Why a relative path was looked for where it was: for messages.
    pub fn rule(&self) -> String {
        match &self.0 {
            Some(base) => format!(
                "a relative path in a config is relative to the config file's folder, {}",
                base.display()
            ),
            None => match std::env::current_dir() {
                Ok(cwd) => format!("relative to the working directory, {}", cwd.display()),
                Err(_) => "relative to the working directory".into(),
            },
        }
    }

    /// `key = path` checked to exist where it is read from, or an error that says where it
    /// was looked for, and the path to write when the working directory holds the file.
    pub fn existing(
        &self,
        key: &str,
        path: &Path,
    ) -> std::result::Result<std::path::PathBuf, String> {
        let at = self.join(path);
        if at.exists() {
            return Ok(at);
        }
        let mut message = format!(
            "{key} = {:?}: no such file at {}",
            path.display(),
            at.display()
        );
        if path.is_relative() {
            message += &format!(" ({})", self.rule());
            if let (Some(base), true) = (&self.0, path.exists()) {
                if let Some(fix) = relative_path(path, base) {
                    message += &format!(
                        "; the working directory holds {}: from the config's folder that is \
                         {key} = {:?}",
                        path.display(),
                        fix.display()
                    );
                }
            }
        }
        Err(message)
    }
}

/// The path from the folder `base` to the existing `target`, both made absolute.
fn relative_path(target: &Path, base: &Path) -> Option<std::path::PathBuf> {
    let (target, base) = (target.canonicalize().ok()?, base.canonicalize().ok()?);
    let (t, b): (Vec<_>, Vec<_>) = (target.components().collect(), base.components().collect());
    let common = t.iter().zip(&b).take_while(|(x, y)| x == y).count();
    let mut path: std::path::PathBuf = b[common..].iter().map(|_| "..").collect();
    path.extend(&t[common..]);
    Some(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_reads_refuse_devices_and_large_files() {
        let err = read_bounded(Path::new("/dev/zero"), 100, "config").unwrap_err();
        assert!(err.to_string().contains("not a regular file"), "{err}");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("big.toml");
        std::fs::write(&path, vec![b'a'; 2000]).unwrap();
        let err = read_bounded(&path, 1024, "config").unwrap_err();
        assert!(
            err.to_string()
                .contains("2.0 KiB is too large for a config file (the limit is 1.0 KiB)"),
            "{err}"
        );
        assert_eq!(read_bounded(&path, 2000, "config").unwrap().len(), 2000);
        std::fs::write(&path, [0xff, 0xfe]).unwrap();
        assert!(read_text_bounded(&path, 10, "config")
            .unwrap_err()
            .to_string()
            .contains("not UTF-8"));
    }

    #[test]
    fn temporaries_are_recognised_by_name() {
        assert!(is_temporary_of(".results.json.123.tmp", "results.json"));
        assert!(is_temporary_of(".loss_x.png.9.tmp.png", "loss_x.png"));
        assert!(!is_temporary_of(".results.json.tmp", "results.json"));
        assert!(!is_temporary_of("results.json", "results.json"));
        assert!(!is_temporary_of(".results.json.12a.tmp", "results.json"));
        assert!(is_temporary_of(
            ".results.json.aB3dE9xZ.tmp",
            "results.json"
        ));
        assert!(!is_temporary_of(
            ".results.json.aB3d-9xZ.tmp",
            "results.json"
        ));
        assert!(!is_temporary_of(".results.jsonx.1.tmp", "results.json"));
    }

    #[test]
    fn a_folder_has_one_writer_and_no_reader_while_it_writes() {
        let dir = tempfile::tempdir().unwrap();
        assert!(
            FolderLock::shared(dir.path()).unwrap().is_none(),
            "never locked"
        );
        let writer = FolderLock::exclusive(dir.path(), "poslab compare").unwrap();
        let err = FolderLock::exclusive(dir.path(), "poslab report")
            .unwrap_err()
            .to_string();
        let pid = std::process::id();
        assert!(
            err.contains("is being written by another poslab process")
                && err.contains(&format!("(pid {pid} (poslab compare))")),
            "{err}"
        );
        assert!(FolderLock::shared(dir.path()).is_err());
        drop(writer);
        let reader = FolderLock::shared(dir.path()).unwrap().unwrap();
        let second = FolderLock::shared(dir.path()).unwrap();
        assert!(second.is_some(), "readers share");
        assert!(FolderLock::exclusive(dir.path(), "x").is_err());
        drop((reader, second));
        FolderLock::exclusive(dir.path(), "x").unwrap();
    }

    #[test]
    fn replaces_whole_file_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub").join("f.bin");
        write_atomic(&path, b"first version, longer").unwrap();
        write_atomic(&path, b"second").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"second");
        let names: Vec<_> = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("f.bin")]);
    }
}
