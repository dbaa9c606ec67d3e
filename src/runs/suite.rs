//! The length suite's summary over tasks: each variant's score (Ruoss et al.'s mean accuracy
//! over every test length above the training lengths), and what randomized positions gain.
//!
//! A variant with `random_positions` is paired with the variant of the same scheme, options,
//! width and mask (causal or not) without them, or failing that with the one variant of the
//! same scheme, width and mask without them (a scheme whose options follow the range the
//! positions are drawn from: FIRE's threshold); the gain of a pair is the mean over tasks of the difference of their scores
//! (each a mean over seeds), in points.

use super::results::{Results, Stat, SCORE};

/// Ruoss et al. (ACL 2023): randomized positions raised test accuracy by 12.0 points on
/// average over their 15 tasks and positional schemes.
pub const PAPER_GAIN: f64 = 12.0;

/// What randomized positions did for one scheme.
#[derive(Clone, Debug, PartialEq)]
pub struct Gain {
    /// The scheme (`rope`, `alibi`, ...).
    pub scheme: String,
    /// The variant without and the variant with randomized positions.
    pub plain: String,
    /// The variant with randomized positions.
    pub random: String,
    /// Mean over tasks of (random - plain) score, in points; the extremes over tasks.
    pub mean: f64,
    /// The same with each variant's best seed (the paper reports the best model).
    pub best: f64,
    /// The smallest gain of a task, in points.
    pub min: f64,
    /// The largest gain of a task, in points.
    pub max: f64,
    /// Tasks where random scored above / below plain.
    pub better: usize,
    /// Tasks where random scored below plain.
    pub worse: usize,
    /// Tasks both variants have a score on.
    pub tasks: usize,
}

/// Scores by task and variant, and the gains of randomized positions.
#[derive(Clone, Debug, PartialEq)]
pub struct SuiteSummary {
    /// The length-suite tasks, in config order.
    pub tasks: Vec<String>,
    /// The variants, in config order.
    pub variants: Vec<String>,
    /// `scores[task][variant]`: the score over seeds, `None` where it was not run or could not
    /// be scored.
    pub scores: Vec<Vec<Option<Stat>>>,
    /// One gain per scheme run both with and without randomized positions.
    pub gains: Vec<Gain>,
}

impl SuiteSummary {
    /// The mean gain over every (scheme, task) pair, over seeds' means and over best seeds:
    /// the numbers the paper's 12.0 summarises.
    pub fn overall_gain(&self) -> Option<(f64, f64)> {
        let n: usize = self.gains.iter().map(|g| g.tasks).sum();
        let total = |f: fn(&Gain) -> f64| {
            self.gains
                .iter()
                .map(|g| f(g) * g.tasks as f64)
                .sum::<f64>()
                / n as f64
        };
        (n > 0).then(|| (total(|g| g.mean), total(|g| g.best)))
    }
}

/// The summary of `results`' length-suite tasks; `None` when it has none.
pub fn summarize(results: &Results) -> Option<SuiteSummary> {
    let tasks: Vec<String> = results
        .tasks
        .iter()
        .filter(|t| t.score_above.is_some())
        .map(|t| t.name.clone())
        .filter(|t| results.summary.iter().any(|r| &r.task == t))
        .collect();
    if tasks.is_empty() {
        return None;
    }
    let variants: Vec<String> = results
        .variants
        .iter()
        .map(|v| v.name.clone())
        .filter(|v| {
            results
                .summary
                .iter()
                .any(|r| &r.variant == v && tasks.contains(&r.task))
        })
        .collect();
    let score = |task: &str, variant: &str| -> Option<Stat> {
        results
            .summary
            .iter()
            .find(|r| r.task == task && r.variant == variant)?
            .columns
            .iter()
            .find(|c| c.name == SCORE)?
            .accuracy
    };
    let scores: Vec<Vec<Option<Stat>>> = tasks
        .iter()
        .map(|t| variants.iter().map(|v| score(t, v)).collect())
        .collect();
    let mut gains = Vec::new();
    for random in results
        .variants
        .iter()
        .filter(|v| v.random_positions.is_some())
    {
        let plain_kin = |p: &&super::results::VariantInfo| {
            p.random_positions.is_none()
                && p.width == random.width
                && p.causal == random.causal
                && p.positional.name() == random.positional.name()
        };
        let exact = results
            .variants
            .iter()
            .filter(plain_kin)
            .find(|p| p.positional == random.positional);
        let mut kin = results.variants.iter().filter(plain_kin);
        let only = match (kin.next(), kin.next()) {
            (Some(p), None) => Some(p),
            _ => None,
        };
        let Some(plain) = exact.or(only) else {
            continue;
        };
        let pairs: Vec<(Stat, Stat)> = tasks
            .iter()
            .filter_map(|t| Some((score(t, &random.name)?, score(t, &plain.name)?)))
            .collect();
        if pairs.is_empty() {
            continue;
        }
        let diffs: Vec<f64> = pairs
            .iter()
            .map(|(r, p)| 100.0 * (r.mean - p.mean))
            .collect();
        let best = pairs
            .iter()
            .map(|(r, p)| 100.0 * (r.max - p.max))
            .sum::<f64>()
            / pairs.len() as f64;
        gains.push(Gain {
            scheme: plain.positional.name().to_string(),
            plain: plain.name.clone(),
            random: random.name.clone(),
            mean: diffs.iter().sum::<f64>() / diffs.len() as f64,
            best,
            min: diffs.iter().copied().fold(f64::INFINITY, f64::min),
            max: diffs.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            better: diffs.iter().filter(|d| **d > 0.0).count(),
            worse: diffs.iter().filter(|d| **d < 0.0).count(),
            tasks: diffs.len(),
        });
    }
    Some(SuiteSummary {
        tasks,
        variants,
        scores,
        gains,
    })
}
