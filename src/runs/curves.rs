//! Curves over seeds: score against input length, and training loss against step, each point
//! the mean over seeds with a band from the lowest seed to the highest. The plots and
//! `report.html` draw them.
//!
//! A task's **length curve** ([`LENGTHS`]) pools its test sets by length (`1x`, `2x`, `4x`, or
//! the ranges): at each input length `L`, a seed's accuracy is the right outputs over the
//! counted outputs of that seed's examples of length `L`, whichever test set they came from.
//! The shuffle and shift tests each give their own curve, over the lengths of the test set
//! they run on. Lengths are grouped into at most [`MAX_POINTS`] bins of equal width, restarting
//! after the longest training length so that no bin mixes trained and untrained lengths; a
//! bin's accuracy is the mean over its lengths (each length weighs the same, as the length
//! suite weighs them), and its `x` the mean of its lengths. A record made before poslab kept
//! example outcomes is read from its scores by length, where it has them.

use std::collections::BTreeMap;

use super::results::{Outcome, Results, TaskInfo, SHUFFLED};

/// The curve of every test set by length, pooled (see the module's documentation).
pub const LENGTHS: &str = "lengths";

/// The most points a length curve has.
pub const MAX_POINTS: usize = 60;

/// One point of a curve: the mean over seeds, the lowest and highest seed.
#[derive(Clone, Debug, PartialEq)]
pub struct Point {
    /// The input length (the mean of a bin's lengths), or the training step.
    pub x: f64,
    /// The mean over seeds (accuracy in %, or loss).
    pub mean: f64,
    /// The lowest seed's value.
    pub low: f64,
    /// The highest seed's value.
    pub high: f64,
    /// The seeds behind the point.
    pub seeds: usize,
    /// Length curves: the examples behind the point, per seed.
    pub examples: usize,
}

/// One variant's curve.
#[derive(Clone, Debug, PartialEq)]
pub struct Curve {
    /// The variant.
    pub variant: String,
    /// Its points, by increasing `x`.
    pub points: Vec<Point>,
}

/// The curves a task has against length: [`LENGTHS`], then the shuffle and shift tests.
pub fn evaluations(task: &TaskInfo) -> Vec<String> {
    let mut names = vec![LENGTHS.to_string()];
    if task.shuffle_test {
        names.push(SHUFFLED.into());
    }
    if let Some(s) = task.shift {
        names.push(super::results::shift_column(s));
    }
    names
}

/// The right and counted outputs, and examples, at each length, of one cell's evaluations.
type ByLength = BTreeMap<usize, (f64, f64, usize)>;

/// A seed's bin: the sum of its lengths, the sum of their accuracies (%), how many lengths,
/// and the examples.
type Bin = (f64, f64, usize, usize);

/// A bin's key: trained (0) or not (1), and its index.
type BinKey = (u8, usize);

/// Adds evaluation `name` of a cell's `evaluations` to `acc`, by length: each example at its
/// length in `lengths` (its test set's, where recorded), else at its stratum's (the length
/// suite's); a record without example outcomes by its scores by length.
fn add_evaluation(
    acc: &mut ByLength,
    evaluations: &[super::results::Evaluation],
    name: &str,
    lengths: Option<&[usize]>,
) {
    let Some(e) = evaluations.iter().find(|e| e.name == name) else {
        return;
    };
    let Outcome::Scored { by_length, .. } = &e.outcome else {
        return;
    };
    let (Some(packed), Some(outcomes)) = (
        &e.examples,
        e.examples.as_ref().and_then(|x| x.unpack().ok()),
    ) else {
        for s in by_length {
            let entry = acc.entry(s.length).or_default();
            entry.0 += s.accuracy * s.examples as f64;
            entry.1 += s.examples as f64;
            entry.2 += s.examples;
        }
        return;
    };
    // (length, right, counted) of every example.
    let examples: Vec<(usize, u32, u32)> = match lengths {
        Some(lengths) if outcomes.len() == lengths.len() => outcomes
            .strata
            .iter()
            .flatten()
            .zip(lengths)
            .map(|(&(r, c), &l)| (l, r, c))
            .collect(),
        _ if packed.strata.iter().all(|[k, _]| *k > 0) => packed
            .strata
            .iter()
            .zip(&outcomes.strata)
            .flat_map(|([l, _], stratum)| stratum.iter().map(move |&(r, c)| (*l, r, c)))
            .collect(),
        _ => return,
    };
    for (l, r, c) in examples {
        let entry = acc.entry(l).or_default();
        entry.0 += f64::from(r);
        entry.1 += f64::from(c);
        entry.2 += 1;
    }
}

impl Curve {
    /// Its band, `(x, lowest seed, highest seed)` at each point.
    pub fn band(&self) -> Vec<(f64, f64, f64)> {
        self.points.iter().map(|p| (p.x, p.low, p.high)).collect()
    }
}

/// Whether `task`'s length plot says anything: its test examples span at least two lengths
/// (bins of the plot). A file of sentences all of one length would draw one column of dots.
pub fn lengths_vary(results: &Results, task: &TaskInfo) -> bool {
    vary(&length_curves(results, task, LENGTHS))
}

/// Whether `curves` have points at more than one length.
pub fn vary(curves: &[Curve]) -> bool {
    let mut xs = curves
        .iter()
        .flat_map(|c| c.points.iter().map(|p| p.x.to_bits()));
    match xs.next() {
        Some(first) => xs.any(|x| x != first),
        None => false,
    }
}

/// Every variant's curve of evaluation `of` ([`LENGTHS`], `shuffled`, `shift+k`) on `task`,
/// in the results' variant order; a variant with no scored length is left out.
pub fn length_curves(results: &Results, task: &TaskInfo, of: &str) -> Vec<Curve> {
    let names: Vec<&str> = if of == LENGTHS {
        task.tests.iter().map(|t| t.name.as_str()).collect()
    } else {
        vec![of]
    };
    // Each evaluation's example lengths, decoded once for every cell.
    let lengths: Vec<Option<Vec<usize>>> = names
        .iter()
        .map(|n| {
            task.test_of(n)
                .and_then(|t| t.lengths_of_examples().ok().flatten())
        })
        .collect();
    let trained = task.train_lengths[1];
    let longest = task.tests.iter().map(|t| t.lengths[1]).max().unwrap_or(1);
    let width = longest.div_ceil(MAX_POINTS).max(1);
    // Bins of `width` lengths from 1, restarting after the longest training length.
    let bin = |l: usize| {
        if l <= trained {
            (0u8, l.saturating_sub(1) / width)
        } else {
            (1u8, (l - trained - 1) / width)
        }
    };
    results
        .variants
        .iter()
        .filter_map(|v| {
            // Per bin, each seed's.
            let mut bins: BTreeMap<BinKey, Vec<Bin>> = BTreeMap::new();
            for c in results
                .cells
                .iter()
                .filter(|c| c.task == task.name && c.variant == v.name)
            {
                let mut acc = ByLength::new();
                for (name, lengths) in names.iter().zip(&lengths) {
                    add_evaluation(&mut acc, &c.summary.evaluations, name, lengths.as_deref());
                }
                let mut seed: BTreeMap<BinKey, Bin> = BTreeMap::new();
                for (l, (r, n, examples)) in acc.into_iter().filter(|(_, (_, n, _))| *n > 0.0) {
                    let b = seed.entry(bin(l)).or_default();
                    b.0 += l as f64;
                    b.1 += 100.0 * r / n;
                    b.2 += 1;
                    b.3 += examples;
                }
                for (k, b) in seed {
                    bins.entry(k).or_default().push(b);
                }
            }
            let points: Vec<Point> = bins
                .into_values()
                .map(|seeds| {
                    let values: Vec<f64> = seeds.iter().map(|b| b.1 / b.2 as f64).collect();
                    point(
                        seeds[0].0 / seeds[0].2 as f64,
                        &values,
                        seeds.iter().map(|b| b.3).max().unwrap_or(0),
                    )
                })
                .collect();
            (!points.is_empty()).then(|| Curve {
                variant: v.name.clone(),
                points,
            })
        })
        .collect()
}

/// The point of `values` (one per seed) at `x`.
fn point(x: f64, values: &[f64], examples: usize) -> Point {
    Point {
        x,
        mean: values.iter().sum::<f64>() / values.len() as f64,
        low: values.iter().copied().fold(f64::INFINITY, f64::min),
        high: values.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        seeds: values.len(),
        examples,
    }
}

/// Every variant's training-loss curve on `task`: at each recorded step, the mean, lowest and
/// highest loss over seeds (up to the shortest seed's curve).
pub fn loss_curves(results: &Results, task: &TaskInfo) -> Vec<Curve> {
    results
        .variants
        .iter()
        .filter_map(|v| {
            let curves: Vec<&Vec<[f64; 2]>> = results
                .cells
                .iter()
                .filter(|c| c.task == task.name && c.variant == v.name)
                .map(|c| &c.summary.loss_curve)
                .collect();
            let n = curves.iter().map(|c| c.len()).min()?;
            let points = (0..n)
                .map(|i| {
                    let values: Vec<f64> = curves.iter().map(|c| c[i][1]).collect();
                    point(curves[0][i][0], &values, 0)
                })
                .collect();
            Some(Curve {
                variant: v.name.clone(),
                points,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runs::results::{
        CellResult, Evaluation, Examples, TestInfo, TrainSummary, VariantInfo,
    };

    fn test(name: &str, lengths: [usize; 2], of_examples: &[usize]) -> TestInfo {
        TestInfo {
            name: name.into(),
            factor: None,
            lengths,
            examples: of_examples.len(),
            example_lengths: Some(TestInfo::pack_lengths(of_examples.iter().copied())),
        }
    }

    fn evaluation(name: &str, right: &[u32]) -> Evaluation {
        let outcomes: Vec<(u32, u32)> = right.iter().map(|&r| (r, 1)).collect();
        let accuracy = right.iter().sum::<u32>() as f64 / right.len() as f64;
        Evaluation {
            name: name.into(),
            outcome: Outcome::scored(accuracy, 0.5),
            examples: Some(Examples::pack(&[(0, outcomes)])),
        }
    }

    fn cell(seed: u64, evaluations: Vec<Evaluation>, loss_curve: Vec<[f64; 2]>) -> CellResult {
        CellResult {
            task: "t".into(),
            variant: "v".into(),
            seed,
            config_sha256: String::new(),
            summary: TrainSummary {
                params: 1,
                d_model: 8,
                max_len: 4,
                steps: 3,
                tokens: 12,
                kept_step: 3,
                stopped_early: false,
                final_train_loss: 0.5,
                loss_curve,
                validation: Vec::new(),
                evaluations,
            },
            model_dir: String::new(),
        }
    }

    /// Two seeds; test `1x` (lengths 2-3) and `2x` (3-4), which share length 3.
    fn results() -> (Results, TaskInfo) {
        let task = TaskInfo {
            name: "t".into(),
            kind: "t".into(),
            metric: "accuracy".into(),
            train_lengths: [2, 3],
            tests: vec![
                test("1x", [2, 3], &[2, 3, 2, 3]),
                test("2x", [3, 4], &[3, 4, 4, 3]),
            ],
            shift: Some(1),
            shuffle_test: false,
            order_blind_ceiling: None,
            vocab_size: 4,
            notes: Vec::new(),
            score_above: None,
        };
        let variant = VariantInfo {
            name: "v".into(),
            positional: crate::positional::PositionalConfig::None(Default::default()),
            placement: "nowhere".into(),
            d_model: 8,
            token_dim: 8,
            width: "8".into(),
            random_positions: None,
            layers: None,
            causal: false,
        };
        let cells = vec![
            cell(
                0,
                vec![
                    evaluation("1x", &[1, 0, 1, 1]),
                    evaluation("2x", &[1, 1, 0, 0]),
                    evaluation("shift+1", &[0, 0, 0, 1]),
                ],
                vec![[1.0, 2.0], [2.0, 1.0]],
            ),
            cell(
                1,
                vec![
                    evaluation("1x", &[0, 0, 1, 1]),
                    evaluation("2x", &[1, 1, 1, 1]),
                    evaluation("shift+1", &[1, 1, 1, 1]),
                ],
                vec![[1.0, 4.0], [2.0, 3.0], [3.0, 0.5]],
            ),
        ];
        let results = Results {
            experiment: "e".into(),
            partial: None,
            tasks: vec![task.clone()],
            variants: vec![variant],
            cells,
            summary: Vec::new(),
            comparisons: Vec::new(),
            comparisons_skipped: Vec::new(),
            data_seed: Default::default(),
        };
        (results, task)
    }

    fn triples(curve: &Curve) -> Vec<[f64; 6]> {
        curve
            .points
            .iter()
            .map(|p| {
                [
                    p.x,
                    p.mean,
                    p.low,
                    p.high,
                    p.seeds as f64,
                    p.examples as f64,
                ]
            })
            .collect()
    }

    #[test]
    fn length_curves_pool_the_test_sets_by_length_and_band_the_seeds() {
        let (results, task) = results();
        // Seed 0: length 2 two of two right, length 3 two of four (two from each test), length
        // 4 one of two; seed 1: one of two, three of four, two of two.
        let curves = length_curves(&results, &task, LENGTHS);
        assert_eq!(
            triples(&curves[0]),
            vec![
                [2.0, 75.0, 50.0, 100.0, 2.0, 2.0],
                [3.0, 62.5, 50.0, 75.0, 2.0, 4.0],
                [4.0, 75.0, 50.0, 100.0, 2.0, 2.0],
            ]
        );
        // The shift test runs on the first test set's examples: lengths 2, 3, 2, 3.
        let shift = length_curves(&results, &task, "shift+1");
        assert_eq!(
            triples(&shift[0]),
            vec![
                [2.0, 50.0, 0.0, 100.0, 2.0, 2.0],
                [3.0, 75.0, 50.0, 100.0, 2.0, 2.0],
            ]
        );
        assert_eq!(evaluations(&task), vec!["lengths", "shift+1"]);
    }

    #[test]
    fn loss_curves_band_the_seeds_up_to_the_shortest_curve() {
        let (results, task) = results();
        let curves = loss_curves(&results, &task);
        assert_eq!(
            triples(&curves[0]),
            vec![
                [1.0, 3.0, 2.0, 4.0, 2.0, 0.0],
                [2.0, 2.0, 1.0, 3.0, 2.0, 0.0]
            ]
        );
    }

    #[test]
    fn lengths_past_the_points_limit_are_binned_without_crossing_the_trained_length() {
        let (mut results, mut task) = results();
        // Lengths 1-130 trained on 1-61: bins of 3 lengths, restarting at 62.
        let lengths: Vec<usize> = (1..=130).collect();
        task.train_lengths = [1, 61];
        task.tests = vec![test("1x", [1, 130], &lengths)];
        task.shift = None;
        let right: Vec<u32> = lengths.iter().map(|&l| u32::from(l > 61)).collect();
        for c in &mut results.cells {
            c.summary.evaluations = vec![evaluation("1x", &right)];
        }
        results.tasks = vec![task.clone()];
        let curve = &length_curves(&results, &task, LENGTHS)[0];
        assert!(curve.points.len() <= MAX_POINTS, "{}", curve.points.len());
        // No bin mixes a trained length (all wrong) with an untrained one (all right).
        assert!(curve
            .points
            .iter()
            .all(|p| p.mean == 0.0 || p.mean == 100.0));
        let first_untrained = curve.points.iter().find(|p| p.mean == 100.0).unwrap();
        assert_eq!(first_untrained.x, 63.0, "the bin of 62, 63 and 64");
        assert_eq!(curve.points[0].x, 2.0, "the bin of 1, 2 and 3");
    }
}
