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

    /// A cell of an experiment failed; the source says how.
    #[error("cell {cell}: {source}")]
    Cell {
        /// The cell, `task/variant/seedN`.
        cell: String,
        /// How it failed.
        source: Box<Error>,
    },

    /// A run stopped by a failed cell; the cells it finished are kept in its folder.
    #[error(
        "cell {cell}: {source} ({done} of {total} cells are done and kept in {}: fix the cause \
         and run the same command again, which continues from them)",
        dir.display()
    )]
    RunStopped {
        /// The cell that failed, `task/variant/seedN`.
        cell: String,
        /// How it failed.
        source: Box<Error>,
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

    /// Filesystem failures, with the path involved (the message includes the cause).
    #[error("{path}: {error}")]
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

impl From<candle::Error> for Error {
    /// Keeps candle's message and drops the backtrace candle appends to it when
    /// `RUST_BACKTRACE` is set, so every message stays the one line it should be.
    fn from(error: candle::Error) -> Self {
        Error::Candle(without_backtrace(error))
    }
}

/// `error` without candle's `WithBacktrace` wrappers (also inside `WithPath`).
pub(crate) fn without_backtrace(error: candle::Error) -> candle::Error {
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
    pub(crate) fn in_file(self, path: &std::path::Path) -> Self {
        match self {
            Error::ConfigParse { message, .. } => Error::ConfigParse {
                path: path.into(),
                message,
            },
            Error::Config(message) => Error::Config(format!("{}: {message}", path.display())),
            other => other,
        }
    }

    pub(crate) fn io(path: impl Into<PathBuf>, error: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            error,
        }
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
}
