//! poslab's integration tests, one binary (linking a release test binary per file is slow).

mod checkpoint;
mod common;
mod config;
mod gradients;
mod properties;
mod reference;
