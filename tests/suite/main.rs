//! poslab's integration tests, one binary (linking a release test binary per file is slow).

mod analysis;
mod blocks;
mod checkpoint;
mod cli;
mod common;
mod compare;
mod config;
mod cuda;
mod finetune;
mod fused;
mod gradients;
mod hardening;
mod layers;
mod layout;
mod length_suite;
mod modernbert;
mod precision;
mod pretrained;
mod properties;
mod recent;
mod reference;
mod rope;
mod runs;
mod schemes;
mod training;
mod userdata;
