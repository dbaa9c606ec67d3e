//! How large a model and its batches may be: checked once, before anything is allocated, so
//! that a size typed wrong (`d_model = 1e9`, `n_layers = 1e8`, a 10 MB line of text) is an error
//! with the figure, not an abort of the allocator or a machine out of memory.
//!
//! The limits are a value, [`Limits`], passed to what checks them (a run's options, a
//! predictor, a benchmark). Their defaults are generous for a lab (a BERT-large has 3.4e8
//! parameters); the `poslab` command raises them from `POSLAB_MAX_PARAMS` (a number of
//! parameters) and `POSLAB_MAX_MEMORY` (bytes), which only the command line reads.

use crate::io::human_bytes;

/// The sizes of a model that its limits are checked on.
#[derive(Clone, Copy, Debug)]
pub struct Sizes {
    /// Width of the residual stream.
    pub d_model: usize,
    /// Width of the feed-forward hidden layer.
    pub ffn_dim: usize,
    /// Attention heads per layer.
    pub n_heads: usize,
    /// Encoder layers.
    pub n_layers: usize,
    /// Token ids of the embedding table.
    pub vocab_size: usize,
    /// Longest sequence the position tables are built for.
    pub max_len: usize,
    /// Attention tables of `(b, h, t, t)` a layer holds at its peak in a forward pass and in a
    /// training step (see [`crate::positional::ScoreMemory::score_tensors`]).
    pub score_tensors: [usize; 2],
}

impl Sizes {
    /// The fields a parameter count grows with, as a refusal names them: `d_model = 16,
    /// ffn_dim = 32, n_layers = 1, vocab_size = 100 and max_len = 16`.
    fn counted_fields(&self) -> String {
        format!(
            "d_model = {}, ffn_dim = {}, n_layers = {}, vocab_size = {} and max_len = {}",
            self.d_model, self.ffn_dim, self.n_layers, self.vocab_size, self.max_len
        )
    }
}

/// Default most parameters: 2^31 (8 GiB of f32 weights; with gradients and AdamW's two
/// moments, 32 GiB).
pub const DEFAULT_MAX_PARAMS: u64 = 1 << 31;
/// The most memory a batch's activations may take by default on a machine with room for it:
/// 32 GiB. A machine (or a container, or a Slurm job's cgroup) with less gets
/// [`default_max_memory`].
pub const DEFAULT_MAX_MEMORY: u64 = 32 << 30;

/// The share of the memory this process may use that a batch's activations may take by
/// default, in quarters: the rest is for the weights, the data and everything else.
const MEMORY_QUARTERS: u64 = 3;

/// The default most memory of a batch's activations: [`DEFAULT_MAX_MEMORY`], or three quarters
/// of the memory this process may use ([`usable_memory`]) where that is less. A batch that fits
/// the limit then fits the machine, and one that does not is refused with the figure instead of
/// the process being killed for memory.
pub fn default_max_memory() -> u64 {
    match usable_memory() {
        Some(m) => DEFAULT_MAX_MEMORY.min(m / 4 * MEMORY_QUARTERS),
        None => DEFAULT_MAX_MEMORY,
    }
}

/// The memory this process may use, where it can be read (Linux): the least of the machine's
/// (`MemTotal` in /proc/meminfo) and the limits of its cgroup and the cgroup's parents (v2
/// `memory.max`, v1 `memory.limit_in_bytes`): a container's, or a Slurm job's `--mem`.
pub fn usable_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok();
    let total = meminfo.as_deref().and_then(mem_total);
    let cgroups = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let limits = cgroup_limit_files(&cgroups)
        .into_iter()
        .filter_map(|f| std::fs::read_to_string(f).ok())
        .filter_map(|v| v.trim().parse::<u64>().ok());
    total.into_iter().chain(limits).min()
}

/// `MemTotal` of /proc/meminfo, in bytes.
fn mem_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// The files that hold the memory limits of the cgroups in /proc/self/cgroup (`cgroups`), from
/// the process's own up to the hierarchy's root: v2 (`0::/path`) and v1 (`N:...memory...:/path`).
/// "max" (v2's no limit) does not parse as a number, and v1's no limit is a number near 2^63,
/// so neither lowers the least.
fn cgroup_limit_files(cgroups: &str) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    for line in cgroups.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let (root, file) = if id == "0" && controllers.is_empty() {
            ("/sys/fs/cgroup", "memory.max")
        } else if controllers.split(',').any(|c| c == "memory") {
            ("/sys/fs/cgroup/memory", "memory.limit_in_bytes")
        } else {
            continue;
        };
        let mut at = std::path::Path::new(path.trim());
        loop {
            let relative = at.strip_prefix("/").unwrap_or(at);
            files.push(std::path::Path::new(root).join(relative).join(file));
            match at.parent() {
                Some(parent) => at = parent,
                None => break,
            }
        }
    }
    files
}

/// Bytes a batch of `batch` sequences of `t` tokens needs at its peak: in training, what every
/// layer keeps for the backward pass (about `8 d + 2 ffn` values per token and the `h t²`
/// attention weights, times the scheme's [`Sizes::score_tensors`]); in inference, one layer's
/// worth. f32 values.
pub fn activation_bytes(config: &Sizes, batch: usize, t: usize, training: bool) -> u128 {
    let (b, t) = (batch as u128, t as u128);
    let (d, f, h) = (
        config.d_model as u128,
        config.ffn_dim as u128,
        config.n_heads as u128,
    );
    let tables = config.score_tensors[usize::from(training)].max(1) as u128;
    let per_layer = b * t * (8 * d + 2 * f) + b * h * t * t * tables;
    let layers = if training { config.n_layers as u128 } else { 2 };
    4 * per_layer * layers
}

/// Bytes a generated word costs until its task is tokenized (the word, its token id and its
/// label), generously.
pub const BYTES_PER_GENERATED_WORD: u128 = 64;

/// How large a model and its batches may be: what a run, a predictor or a benchmark checks
/// sizes against before allocating. A value, never read from the environment here: the
/// `poslab` command builds it from `POSLAB_MAX_PARAMS` and `POSLAB_MAX_MEMORY`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// The most parameters a model may have.
    pub max_params: u64,
    /// The most bytes a batch's activations (or a generated task's words) may take.
    pub max_memory: u64,
}

impl Default for Limits {
    /// [`DEFAULT_MAX_PARAMS`], and [`default_max_memory`] (what this machine allows).
    fn default() -> Self {
        Self {
            max_params: DEFAULT_MAX_PARAMS,
            max_memory: default_max_memory(),
        }
    }
}

impl Limits {
    /// Refuses a model of `n` parameters, more than [`Limits::max_params`]: the message gives
    /// the count.
    pub fn check_params(&self, n: u128, config: &Sizes) -> std::result::Result<(), String> {
        let max = self.max_params;
        if n > max as u128 {
            return Err(format!(
                "this model would have {n} parameters ({} of f32 weights), more than the limit of \
                 {max}: check {} (set POSLAB_MAX_PARAMS to raise the limit)",
                human(4 * n),
                config.counted_fields()
            ));
        }
        Ok(())
    }

    /// Refuses a batch whose activations would need more than [`Limits::max_memory`]; `what`
    /// says where the batch comes from, for the message.
    pub fn check_batch(
        &self,
        config: &Sizes,
        batch: usize,
        t: usize,
        training: bool,
        what: &str,
    ) -> std::result::Result<(), String> {
        self.check_batches(config, batch, t, training, what, 1)
    }

    /// [`Limits::check_batch`] for `at_once` such batches in memory together (`compare`'s jobs):
    /// each may take its share of [`Limits::max_memory`].
    pub fn check_batches(
        &self,
        config: &Sizes,
        batch: usize,
        t: usize,
        training: bool,
        what: &str,
        at_once: usize,
    ) -> std::result::Result<(), String> {
        let at_once = at_once.max(1) as u128;
        let need = activation_bytes(config, batch, t, training) * at_once;
        let max = self.max_memory;
        if need > max as u128 {
            let (jobs, fewer) = match at_once {
                1 => (String::new(), ""),
                n => (
                    format!(" ({n} jobs at once: {n} such batches)"),
                    ", run fewer jobs at once (--jobs)",
                ),
            };
            return Err(format!(
                "{what}: a batch of {batch} x {t} tokens{jobs} needs about {} of activations ({} \
                 attention weights per layer grow with the square of the length), more than the \
                 limit of {}: shorten the inputs (max_tokens, --truncate), lower the batch size{fewer}, \
                 or set POSLAB_MAX_MEMORY",
                human(need),
                human(4 * batch as u128 * config.n_heads as u128 * (t as u128).pow(2)),
                human_bytes(max)
            ));
        }
        Ok(())
    }

    /// Refuses a generated task whose examples would hold more than [`Limits::max_memory`]:
    /// `words` is the most words its splits can have.
    pub fn check_generated(&self, words: u128, what: &str) -> std::result::Result<(), String> {
        let need = words * BYTES_PER_GENERATED_WORD;
        let max = self.max_memory;
        if need > max as u128 {
            return Err(format!(
                "{what}: up to {words} generated words need about {} of memory, more than the limit \
                 of {}: lower train_examples or eval_examples, shorten the lengths, or set \
                 POSLAB_MAX_MEMORY",
                human(need),
                human_bytes(max)
            ));
        }
        Ok(())
    }

    /// The longest input of which a batch of `batch` fits [`Limits::max_memory`] (at least 1).
    pub fn longest_fitting(&self, config: &Sizes, batch: usize, training: bool) -> usize {
        let (mut lo, mut hi) = (1usize, 1usize << 24);
        let max = self.max_memory as u128;
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            if activation_bytes(config, batch, mid, training) <= max {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        lo
    }
}

/// Refuses weights of `n` f32 parameters larger than the memory this process may use
/// ([`usable_memory`], where it can be read): the bound every built model is held to, whatever
/// its caller's [`Limits`], so that a size typed wrong is an error, never an abort of the
/// allocator.
pub fn check_weights_fit(n: u128, config: &Sizes) -> std::result::Result<(), String> {
    let Some(memory) = usable_memory() else {
        return Ok(());
    };
    if 4 * n > memory as u128 {
        return Err(format!(
            "this model would have {n} parameters ({} of f32 weights), more than the memory \
             this process may use ({}): check {}",
            human(4 * n),
            human_bytes(memory),
            config.counted_fields()
        ));
    }
    Ok(())
}

fn human(n: u128) -> String {
    human_bytes(u64::try_from(n).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_default_memory_limit_is_what_the_machine_and_its_cgroups_allow() {
        use super::*;
        let meminfo = "MemTotal:       24684084 kB\nMemFree:         1000 kB\n";
        assert_eq!(mem_total(meminfo), Some(24684084 * 1024));
        assert_eq!(mem_total("MemFree: 5 kB\n"), None);
        let files = |cgroups: &str| -> Vec<String> {
            let found = cgroup_limit_files(cgroups);
            found.iter().map(|p| p.display().to_string()).collect()
        };
        // v2: the process's cgroup and each parent up to the root.
        assert_eq!(
            files("0::/slurm/uid_1/job_7\n"),
            [
                "/sys/fs/cgroup/slurm/uid_1/job_7/memory.max",
                "/sys/fs/cgroup/slurm/uid_1/memory.max",
                "/sys/fs/cgroup/slurm/memory.max",
                "/sys/fs/cgroup/memory.max",
            ]
        );
        // v1: only the memory controller's line counts.
        assert_eq!(
            files("4:memory:/job\n3:cpuset:/other\n0::/\n"),
            [
                "/sys/fs/cgroup/memory/job/memory.limit_in_bytes",
                "/sys/fs/cgroup/memory/memory.limit_in_bytes",
                "/sys/fs/cgroup/memory.max",
            ]
        );
        // On this machine: within the machine's memory, and the default within both.
        if let Some(total) = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|m| mem_total(&m))
        {
            let usable = usable_memory().unwrap();
            assert!(usable > 0 && usable <= total, "{usable} of {total}");
            let default = default_max_memory();
            assert!(default <= DEFAULT_MAX_MEMORY && default <= usable / 4 * 3);
        }
    }
}
