//! The library's error type. Every message names the problem and, where there is one, the fix.

use std::path::PathBuf;

/// Errors returned by poslab's library code. The binary wraps them in `anyhow`.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A model configuration that cannot describe a working encoder.
    #[error("invalid config: {0}")]
    Config(String),

    /// A configuration file that could not be parsed (syntax, unknown field or option, wrong type).
    #[error("cannot parse config {path}: {message}")]
    ConfigParse {
        /// The file.
        path: PathBuf,
        /// What is wrong, and the fix.
        message: String,
    },

    /// A data file with a problem, at a line where there is one.
    #[error("{}{}: {message}", path.display(), line.map(|l| format!(":{l}")).unwrap_or_default())]
    Data {
        /// The file.
        path: PathBuf,
        /// The line (1-based), where the problem has one.
        line: Option<usize>,
        /// What is wrong, and the fix.
        message: String,
    },

    /// Input tensors that do not fit the model (shapes, ids, masks, lengths).
    #[error("invalid input: {0}")]
    Input(String),

    /// A checkpoint that does not match the model or is not a readable safetensors file.
    #[error("checkpoint {path}: {message}")]
    Checkpoint {
        /// The checkpoint file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },

    /// A training run that cannot go on (a non-finite loss or gradient).
    #[error("training stopped: {0}")]
    Training(String),

    /// A cell of an experiment failed; `cause` says how. (Not a `source`: the message holds
    /// it already, and a chain printed with `{:#}` would repeat it.)
    #[error("cell {cell}: {cause}")]
    Cell {
        /// The cell, `task/variant/seedN`.
        cell: String,
        /// How it failed.
        cause: Box<Error>,
    },

    /// A run stopped by a failed cell; the cells it finished are kept in its folder.
    #[error("cell {cell}: {cause} ({})", stopped_advice(cause, *done, *total, dir))]
    RunStopped {
        /// The cell that failed, `task/variant/seedN`.
        cell: String,
        /// How it failed.
        cause: Box<Error>,
        /// Cells finished and kept.
        done: usize,
        /// Cells the run has.
        total: usize,
        /// The run folder that keeps them.
        dir: PathBuf,
    },

    /// A plot could not be drawn.
    #[error("plot {path}: {message}")]
    Plot {
        /// The image file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },

    /// Filesystem failures, with the path involved where poslab knows it (the message includes
    /// the cause, and for a relative path not found, the folder it was looked for in). A bare
    /// [`std::io::Error`] converts with `?` (an empty path: the error alone).
    #[error("{}", io_message(path, error))]
    Io {
        /// The path involved.
        path: PathBuf,
        /// The operating system's error.
        error: std::io::Error,
    },

    /// Errors raised inside candle's tensor operations.
    #[error(transparent)]
    Candle(candle::Error),
}

/// `path: error`, and where a relative path that is not there was looked for.
fn io_message(path: &std::path::Path, error: &std::io::Error) -> String {
    if path.as_os_str().is_empty() {
        return error.to_string();
    }
    let mut message = format!("{}: {error}", path.display());
    if error.kind() == std::io::ErrorKind::NotFound && path.is_relative() {
        if let Ok(cwd) = std::env::current_dir() {
            message += &format!(" (looked for in the working directory, {})", cwd.display());
        }
    }
    message
}

impl From<std::io::Error> for Error {
    /// An I/O error of the caller's, so that `?` works on it in a function returning
    /// [`Result`]; poslab's own errors carry their path.
    fn from(error: std::io::Error) -> Self {
        Error::Io {
            path: PathBuf::new(),
            error,
        }
    }
}

impl From<candle::Error> for Error {
    /// Keeps candle's message and drops the backtrace candle appends to it when
    /// `RUST_BACKTRACE` is set, so every message stays the one line it should be.
    fn from(error: candle::Error) -> Self {
        Error::Candle(without_backtrace(error))
    }
}

/// `error` without candle's `WithBacktrace` wrappers (also inside `WithPath`).
pub fn without_backtrace(error: candle::Error) -> candle::Error {
    match error {
        candle::Error::WithBacktrace { inner, .. } => without_backtrace(*inner),
        candle::Error::WithPath { inner, path } => candle::Error::WithPath {
            inner: Box::new(without_backtrace(*inner)),
            path,
        },
        other => other,
    }
}

/// A result with poslab's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// Names the file a config error came from.
    pub fn in_file(self, path: &std::path::Path) -> Self {
        match self {
            Error::ConfigParse { message, .. } => Error::ConfigParse {
                path: path.into(),
                message,
            },
            Error::Config(message) => Error::Config(format!("{}: {message}", path.display())),
            other => other,
        }
    }

    /// The error of an I/O operation on `path`.
    pub fn io(path: impl Into<PathBuf>, error: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            error,
        }
    }
}

/// What a stopped run keeps, and how to go on. Training is deterministic, so a cell that stopped
/// in training ([`Error::Training`]) stops the same way under the same config: the config must
/// change, and a changed config is another experiment, which a folder with finished cells does
/// not take. Any other failure (a full disk, a file) can be fixed and the run continued.
fn stopped_advice(cause: &Error, done: usize, total: usize, dir: &std::path::Path) -> String {
    let dir = dir.display();
    match (cause, done) {
        (Error::Training(_), 0) => format!(
            "no cell finished, of {total}: training is deterministic, so this config stops \
             here again; change it, then run it with --overwrite to start {dir} over, or into \
             another folder"
        ),
        (Error::Training(_), _) => format!(
            "{done} of {total} cells are done and kept in {dir}: training is deterministic, so \
             this config stops here again; a changed config is another experiment, so run it \
             into another folder"
        ),
        _ => format!(
            "{done} of {total} cells are done and kept in {dir}: fix the cause and run the same \
             command again, which continues from them"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candle_errors_lose_their_backtrace_and_keep_their_message() {
        let traced = |inner: candle::Error| candle::Error::WithBacktrace {
            inner: Box::new(inner),
            backtrace: Box::new(std::backtrace::Backtrace::force_capture()),
        };
        // What candle makes when RUST_BACKTRACE is set: the message, then a multi-line trace.
        let raw = traced(candle::Error::Msg("no CUDA device".into()));
        assert!(raw.to_string().lines().count() > 1, "{raw}");
        assert_eq!(Error::from(raw).to_string(), "no CUDA device");

        let nested = candle::Error::WithPath {
            inner: Box::new(traced(candle::Error::Msg("bad header".into()))),
            path: "model.safetensors".into(),
        };
        let message = Error::from(nested).to_string();
        assert_eq!(message.lines().count(), 1, "{message}");
        assert!(
            message.contains("bad header") && message.contains("model.safetensors"),
            "{message}"
        );
    }

    #[test]
    fn a_stopped_run_says_how_to_go_on_by_its_cause() {
        let stopped = |cause: Error, done| Error::RunStopped {
            cell: "t/v/seed0".into(),
            cause: Box::new(cause),
            done,
            total: 4,
            dir: "runs/r".into(),
        };
        let diverged = || Error::Training("the loss became NaN at step 3".into());
        let first = stopped(diverged(), 0).to_string();
        assert!(
            first.contains("the loss became NaN at step 3 (no cell finished, of 4")
                && first.contains("--overwrite to start runs/r over")
                && !first.contains("same command again"),
            "{first}"
        );
        let later = stopped(diverged(), 2).to_string();
        assert!(
            later.contains("2 of 4 cells are done and kept in runs/r")
                && later.contains("into another folder")
                && !later.contains("--overwrite")
                && !later.contains("same command again"),
            "{later}"
        );
        let full = std::io::Error::new(std::io::ErrorKind::StorageFull, "no space left");
        let disk = stopped(Error::io("runs/r/cells/x.json", full), 2).to_string();
        assert!(
            disk.contains("2 of 4 cells are done") && disk.contains("same command again"),
            "{disk}"
        );
        // The cause is in the message, and not a source too: `{:#}` shows it once.
        let chained = format!("{:#}", anyhow::Error::from(stopped(diverged(), 0)));
        assert_eq!(chained.matches("became NaN").count(), 1, "{chained}");
    }
}
