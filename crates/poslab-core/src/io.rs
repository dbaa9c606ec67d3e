//! Files: reads bounded in size, atomic writes, and TOML documents.

use std::io::{Read, Write};
use std::path::Path;

use crate::error::{Error, Result};

/// The largest config, state or JSON file poslab reads (configs, `config.json`,
/// `tokenizer.json`, trainer state, results): 256 MiB.
pub const MAX_CONFIG_BYTES: u64 = 256 << 20;
/// The largest weights file: 64 GiB.
pub const MAX_WEIGHTS_BYTES: u64 = 64 << 30;

/// Reads a regular file of at most `max` bytes. A device, a pipe or a folder (`/dev/zero`,
/// `/dev/urandom`, a FIFO) would never end or is no file at all, and a larger file is refused
/// before anything is allocated for it; `what` names the file's role in the message.
pub fn read_bounded(path: &Path, max: u64, what: &str) -> Result<Vec<u8>> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if !meta.is_file() {
        return Err(Error::Input(format!(
            "{}: not a regular file (a folder, device or pipe); give the path of the {what} file",
            path.display()
        )));
    }
    if meta.len() > max {
        return Err(too_large(path, meta.len(), max, what));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    std::fs::File::open(path)
        .and_then(|f| f.take(max + 1).read_to_end(&mut bytes))
        .map_err(|e| Error::io(path, e))?;
    if bytes.len() as u64 > max {
        return Err(too_large(path, bytes.len() as u64, max, what));
    }
    Ok(bytes)
}

/// [`read_bounded`] as UTF-8 text.
pub fn read_text_bounded(path: &Path, max: u64, what: &str) -> Result<String> {
    String::from_utf8(read_bounded(path, max, what)?).map_err(|e| {
        Error::Input(format!(
            "{}: the {what} file is not UTF-8 text (invalid byte at {}): convert it to UTF-8",
            path.display(),
            e.utf8_error().valid_up_to()
        ))
    })
}

fn too_large(path: &Path, len: u64, max: u64, what: &str) -> Error {
    Error::Input(format!(
        "{}: {} is too large for a {what} file (the limit is {}): is this the right file?",
        path.display(),
        human_bytes(len),
        human_bytes(max)
    ))
}

/// `1.5 GiB`, `12.0 MiB`, `512 B`.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

/// Writes `bytes` to `path` atomically: into a temporary file beside it, flushed to disk, then
/// renamed over `path`. A crash at any point leaves either the old file or the new one, never a
/// torn mix. Parent folders are created. The file gets the mode an ordinary create gives (on
/// Unix 0666 less the umask).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_with(path, bytes, &|| {})
}

/// Creates the folder `dir` and its parents. A file where a folder must be is named, with the
/// fix, instead of the system's "File exists" or "Not a directory".
pub fn create_folder(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| not_a_folder(dir).unwrap_or_else(|| Error::io(dir, e)))
}

/// The error of a folder path that is a file, or lies under one; `None` when it can be a
/// folder (it is one, or could be made).
pub fn not_a_folder(dir: &Path) -> Option<Error> {
    let blocking = dir
        .ancestors()
        .find(|a| !a.as_os_str().is_empty() && a.exists() && !a.is_dir())?;
    Some(match blocking == dir {
        true => Error::Input(format!(
            "{} is a file, not a folder: give a folder's path",
            dir.display()
        )),
        false => Error::Input(format!(
            "{}: {} is a file, not a folder: give a folder's path",
            dir.display(),
            blocking.display()
        )),
    })
}

/// [`write_atomic`], calling `halfway` once half of `bytes` is in the temporary file (a test
/// kills the process there, to show that a torn write never replaces the file).
pub fn write_atomic_with(path: &Path, bytes: &[u8], halfway: &dyn Fn()) -> Result<()> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    create_folder(dir)?;
    let name = path
        .file_name()
        .ok_or_else(|| Error::io(path, std::io::Error::other("not a file path")))?;
    // `.name.XXXXXXXX.tmp` beside the file (see [`is_temporary_of`]); removed if the write
    // fails, left for the next run's clean-up if the process is killed.
    let prefix = format!(".{}.", name.to_string_lossy());
    let mut builder = tempfile::Builder::new();
    builder
        .prefix(&prefix)
        .suffix(".tmp")
        .rand_bytes(TEMP_RANDOM);
    // The mode an ordinary create gives (0666 less the umask), where the temporary file's own
    // would be 0600 and the renamed file unreadable to the group and others.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        builder.permissions(std::fs::Permissions::from_mode(0o666));
    }
    let mut file = builder.tempfile_in(dir).map_err(|e| Error::io(dir, e))?;
    let (first, second) = bytes.split_at(bytes.len() / 2);
    let written = (|| {
        file.write_all(first)?;
        file.flush()?;
        halfway();
        file.write_all(second)?;
        file.as_file().sync_all()
    })();
    written.map_err(|e| Error::io(path, e))?;
    file.persist(path).map_err(|e| Error::io(path, e.error))?;
    // Make the rename itself durable where the platform allows opening a folder.
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// The random characters in the name of [`write_atomic`]'s temporary file.
pub const TEMP_RANDOM: usize = 8;

/// Parses a TOML document; the error carries the line, the column and serde's message (an
/// unknown field lists the valid ones); the caller names the file.
pub fn parse_toml<T: serde::de::DeserializeOwned>(text: &str) -> Result<T> {
    toml::from_str(text).map_err(|e| Error::ConfigParse {
        path: "<toml>".into(),
        message: e.to_string(),
    })
}
