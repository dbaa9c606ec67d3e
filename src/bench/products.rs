//! `poslab bench --products`: the matrix products of an encoder layer's training step one by
//! one (the linear layers' and the attention core's per-head ones), through the calls the fused
//! layers make, beside gemm's rate at 1024³ and (with `--torch`) beside `torch.matmul` on the
//! same products, in interleaved rounds.
//!
//! It answers where a step at some shape is bound by the matrix-multiply library: a step whose
//! products run at PyTorch's rate cannot train faster than PyTorch by more than its other parts
//! allow, and a product that runs far below the 1024³ rate is one a layout or a split might
//! speed up.

use std::collections::BTreeMap;

use serde::Serialize;

use super::Shape;
use crate::error::{Error, Result};
use crate::nn::{head_product_gflops, linear_pass_gflops, matmul_gflops, HeadProduct, LinearPass};
use crate::render::table::TextTable;

/// The side of the square product measured beside the step's, `SQUARE`³.
pub const SQUARE: usize = 1024;

/// Which product: the square reference, a linear layer's, or the attention core's per head.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// `SQUARE`³, the matrix-multiply peak's reference.
    Square,
    /// A linear layer's output, input gradient or weight gradient.
    Linear(LinearPass),
    /// One of the attention core's products, for each of `count` (batch, head) pairs.
    Head(HeadProduct),
}

/// One matrix product of a training step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Product {
    /// `square` (the reference product), the linear layer (`qkv`, `attn_out`, `ffn_up`,
    /// `ffn_down`) or `attention`.
    pub layer: &'static str,
    /// Which product.
    pub kind: Kind,
    /// Output rows.
    pub m: usize,
    /// Output columns.
    pub n: usize,
    /// Depth: the multiply-adds summed into each output.
    pub k: usize,
    /// Products of `m x n x k` in one call: `batch x heads` for the attention's, else 1.
    pub count: usize,
    /// How many calls a training step makes (one per encoder layer; the square one none).
    pub per_step: usize,
    /// Whether the output is added onto rows already there (a bias or the residual), as the
    /// fused layer writes it.
    pub onto: bool,
    /// The attention's `(batch, heads, d_head)`, for its products (`count` is `batch x heads`).
    pub heads: Option<(usize, usize, usize)>,
}

impl Product {
    /// `layer.pass`, the name both sides report rates under (`square` for the square one).
    pub fn name(&self) -> String {
        let what = match self.kind {
            Kind::Square => return self.layer.to_string(),
            Kind::Linear(LinearPass::Output) => "output",
            Kind::Linear(LinearPass::InputGradient) => "input_gradient",
            Kind::Linear(LinearPass::WeightGradient) => "weight_gradient",
            Kind::Head(HeadProduct::Scores) => "scores",
            Kind::Head(HeadProduct::Outputs) => "outputs",
            Kind::Head(HeadProduct::ProbsGradient) => "probs_gradient",
            Kind::Head(HeadProduct::ValuesGradient) => "values_gradient",
            Kind::Head(HeadProduct::QueriesGradient) => "queries_gradient",
            Kind::Head(HeadProduct::KeysGradient) => "keys_gradient",
        };
        format!("{}.{what}", self.layer)
    }

    /// Floating-point operations of one call: 2 per multiply-add.
    pub fn gflop(&self) -> f64 {
        2.0 * (self.m * self.n * self.k * self.count) as f64 / 1e9
    }

    /// Floating-point operations of a training step's calls.
    pub fn step_gflop(&self) -> f64 {
        self.per_step as f64 * self.gflop()
    }

    /// poslab's best rate over `reps` runs, in GFLOP/s, on the current rayon pool.
    pub fn poslab_gflops(&self, reps: usize) -> f64 {
        match self.kind {
            Kind::Square => matmul_gflops(self.m, self.n, self.k, reps),
            Kind::Linear(pass) => {
                let (rows, inp, out) = match pass {
                    LinearPass::Output => (self.m, self.k, self.n),
                    LinearPass::InputGradient => (self.m, self.n, self.k),
                    LinearPass::WeightGradient => (self.k, self.n, self.m),
                };
                linear_pass_gflops(pass, (rows, inp, out), self.onto, reps)
            }
            Kind::Head(which) => {
                let (batch, heads, d_head) = self.heads.unwrap_or((1, 1, self.n));
                let simd = crate::nn::SimdLevel::detected();
                head_product_gflops(which, (batch, heads, self.m, d_head), reps, simd)
            }
        }
    }
}

/// The square product, then the output, input gradient and weight gradient of each linear
/// layer of an encoder layer at `shape`, over `batch x seq` rows, then the attention core's six
/// products per (batch, head). (The embedding's, the concatenated sinusoid's projection and the
/// head are outside the layers and left out.)
pub fn step_products(shape: &Shape) -> Vec<Product> {
    let rows = shape.batch * shape.seq;
    let (d, f) = (shape.d_model, shape.ffn_dim);
    let mut out = vec![Product {
        layer: "square",
        kind: Kind::Square,
        m: SQUARE,
        n: SQUARE,
        k: SQUARE,
        count: 1,
        per_step: 0,
        onto: false,
        heads: None,
    }];
    // (layer, in, out, whether its output is added onto rows: the bias rows of q, k and v; the
    // residual for the attention's output projection and the FFN's down projection; the FFN's
    // up projection is written fresh and its bias added by the activation's pass).
    for (layer, inp, width, onto) in [
        ("qkv", d, 3 * d, true),
        ("attn_out", d, d, true),
        ("ffn_up", d, f, false),
        ("ffn_down", f, d, true),
    ] {
        for pass in [
            LinearPass::Output,
            LinearPass::InputGradient,
            LinearPass::WeightGradient,
        ] {
            let (m, n, k) = pass.dims((rows, inp, width));
            out.push(Product {
                layer,
                kind: Kind::Linear(pass),
                m,
                n,
                k,
                count: 1,
                per_step: shape.n_layers,
                onto: onto && pass == LinearPass::Output,
                heads: None,
            });
        }
    }
    let d_head = shape.d_model / shape.n_heads.max(1);
    for which in HeadProduct::ALL {
        let (m, n, k) = which.dims(shape.seq, d_head);
        out.push(Product {
            layer: "attention",
            kind: Kind::Head(which),
            m,
            n,
            k,
            count: shape.batch * shape.n_heads,
            per_step: shape.n_layers,
            onto: false,
            heads: Some((shape.batch, shape.n_heads, d_head)),
        });
    }
    out
}

/// A product's rates, one per round.
#[derive(Clone, Debug, Serialize)]
pub struct ProductRates {
    /// [`Product::name`].
    pub name: String,
    /// The product measured.
    #[serde(flatten)]
    pub product: Product,
    /// poslab's GFLOP/s, one per round.
    pub poslab: Vec<f64>,
    /// PyTorch's, one per round (empty without `--torch`).
    pub torch: Vec<f64>,
}

impl ProductRates {
    fn best(v: &[f64]) -> Option<f64> {
        v.iter().copied().filter(|r| r.is_finite()).reduce(f64::max)
    }

    /// poslab's best round.
    pub fn poslab_best(&self) -> Option<f64> {
        Self::best(&self.poslab)
    }

    /// PyTorch's best round.
    pub fn torch_best(&self) -> Option<f64> {
        Self::best(&self.torch)
    }
}

/// Measures `products` in `rounds` rounds of `reps` runs each (the best run of each round
/// kept), poslab's on a pool of `threads` threads of its own, poslab then PyTorch in even rounds
/// and the other way round in odd ones, so that a drift in the machine's speed favours neither.
/// `torch` returns PyTorch's rates by [`Product::name`] for a round.
pub fn measure(
    products: &[Product],
    threads: usize,
    reps: usize,
    rounds: usize,
    mut torch: Option<&mut dyn FnMut() -> Result<BTreeMap<String, f64>>>,
    log: &mut dyn FnMut(&str),
) -> Result<Vec<ProductRates>> {
    let mut rates: Vec<ProductRates> = products
        .iter()
        .map(|p| ProductRates {
            name: p.name(),
            product: p.clone(),
            poslab: Vec::new(),
            torch: Vec::new(),
        })
        .collect();
    let rounds = rounds.max(1);
    for round in 0..rounds {
        log(&format!("round {} of {rounds}", round + 1));
        let mut torch_round = None;
        if round % 2 == 1 {
            torch_round = torch.as_mut().map(|f| f()).transpose()?;
        }
        let poslab: Vec<f64> = crate::nn::with_threads(threads, || {
            products.iter().map(|p| p.poslab_gflops(reps)).collect()
        });
        for (rate, r) in poslab.into_iter().zip(&mut rates) {
            r.poslab.push(rate);
        }
        if round % 2 == 0 {
            torch_round = torch.as_mut().map(|f| f()).transpose()?;
        }
        if let Some(by_name) = torch_round {
            for r in &mut rates {
                let rate = by_name.get(&r.name).copied().ok_or_else(|| {
                    Error::Input(format!(
                        "--products: the PyTorch script reported no rate for `{}`",
                        r.name
                    ))
                })?;
                r.torch.push(rate);
            }
        }
    }
    Ok(rates)
}

/// Milliseconds a step's products take at each product's best rate (poslab's or PyTorch's),
/// if every product has one.
pub fn step_ms(rates: &[ProductRates], torch: bool) -> Option<f64> {
    rates
        .iter()
        .filter(|r| r.product.per_step > 0)
        .map(|r| {
            let rate = match torch {
                true => r.torch_best(),
                false => r.poslab_best(),
            }?;
            Some(r.product.step_gflop() / rate * 1e3)
        })
        .sum()
}

/// The printed table: each product's best rate, its share of the step's product FLOPs, the
/// ratio to PyTorch, and the step's products timed at those rates.
pub fn table(rates: &[ProductRates], rows: usize, threads: usize) -> String {
    let torch = rates.iter().any(|r| !r.torch.is_empty());
    let total: f64 = rates.iter().map(|r| r.product.step_gflop()).sum();
    let mut header = vec!["product", "m x n x k", "share", "poslab GFLOP/s"];
    if torch {
        header.extend(["PyTorch GFLOP/s", "ratio"]);
    }
    let right: Vec<bool> = (0..header.len()).map(|c| c >= 2).collect();
    let mut t = TextTable::new(header, right);
    let fmt = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.0}"));
    for r in rates {
        let p = &r.product;
        let share = match p.per_step {
            0 => "-".to_string(),
            _ => format!("{:.1}%", 100.0 * p.step_gflop() / total),
        };
        let times = match p.count {
            1 => String::new(),
            c => format!(" (x{c})"),
        };
        let mut row = vec![
            r.name.clone(),
            format!("{}x{}x{}{times}", p.m, p.n, p.k),
            share,
            fmt(r.poslab_best()),
        ];
        if torch {
            row.push(fmt(r.torch_best()));
            row.push(match (r.poslab_best(), r.torch_best()) {
                (Some(p), Some(t)) if t > 0.0 => format!("{:.2}x", p / t),
                _ => "-".into(),
            });
        }
        t.push(row);
    }
    let rounds = rates.first().map_or(0, |r| r.poslab.len());
    let mut out = format!(
        "matrix products of one training step's encoder layers ({rows} rows, f32, {threads} \
         thread{}), best of {rounds} round{}; share: of the layers' product FLOPs; (xN): N \
         (batch, head) products in one call\n",
        if threads == 1 { "" } else { "s" },
        if rounds == 1 { "" } else { "s" },
    );
    out += &t.text();
    if let Some(p) = step_ms(rates, false) {
        out += &format!("\nthe step's products at these rates: poslab {p:.1} ms");
        if let Some(t) = step_ms(rates, true).filter(|_| torch) {
            out += &format!(", PyTorch {t:.1} ms ({:.2}x)", t / p);
        }
        out += "\n";
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rates(
        name: &str,
        dims: (usize, usize, usize),
        per_step: usize,
        p: &[f64],
        t: &[f64],
    ) -> ProductRates {
        ProductRates {
            name: name.into(),
            product: Product {
                layer: "a",
                kind: Kind::Linear(LinearPass::Output),
                m: dims.0,
                n: dims.1,
                k: dims.2,
                count: 1,
                per_step,
                onto: false,
                heads: None,
            },
            poslab: p.to_vec(),
            torch: t.to_vec(),
        }
    }

    #[test]
    fn the_step_has_each_linear_layers_three_products_and_the_attentions_six_at_its_shape() {
        let shape = Shape {
            d_model: 64,
            n_heads: 8,
            n_layers: 5,
            ffn_dim: 256,
            batch: 128,
            seq: 64,
            ..Default::default()
        };
        let products = step_products(&shape);
        let names: Vec<String> = products.iter().map(Product::name).collect();
        assert_eq!(names.len(), 19);
        assert_eq!(names[0], "square");
        assert_eq!(names[1], "qkv.output");
        assert_eq!(names[12], "ffn_down.weight_gradient");
        assert_eq!(names[13], "attention.scores");
        assert_eq!(names[18], "attention.keys_gradient");
        let dims = |name: &str| {
            let p = &products[names.iter().position(|n| n == name).unwrap()];
            if let Some((b, h, _)) = p.heads {
                assert_eq!(p.count, b * h, "{name}");
            }
            (p.m, p.n, p.k, p.per_step, p.onto)
        };
        assert_eq!(dims("square"), (1024, 1024, 1024, 0, false));
        assert_eq!(dims("qkv.output"), (8192, 192, 64, 5, true));
        assert_eq!(dims("qkv.input_gradient"), (8192, 64, 192, 5, false));
        assert_eq!(dims("qkv.weight_gradient"), (192, 64, 8192, 5, false));
        assert_eq!(dims("ffn_up.output"), (8192, 256, 64, 5, false));
        assert_eq!(dims("ffn_down.output"), (8192, 64, 256, 5, true));
        assert_eq!(dims("ffn_down.weight_gradient"), (64, 256, 8192, 5, false));
        // Per (batch, head): 64 tokens, heads 8 wide, 128 x 8 of them per call.
        assert_eq!(dims("attention.scores"), (64, 64, 8, 5, false));
        assert_eq!(dims("attention.probs_gradient"), (64, 64, 8, 5, false));
        for name in [
            "outputs",
            "values_gradient",
            "queries_gradient",
            "keys_gradient",
        ] {
            assert_eq!(dims(&format!("attention.{name}")), (64, 8, 64, 5, false));
        }
        let scores = &products[13];
        assert_eq!(
            (scores.count, scores.heads, scores.gflop()),
            (
                1024,
                Some((128, 8, 8)),
                2.0 * 1024.0 * 64.0 * 64.0 * 8.0 / 1e9
            )
        );
        // Heads wider than the tape: d_head is the heads' width, not the smaller side.
        let wide = step_products(&Shape {
            d_model: 128,
            n_heads: 2,
            seq: 16,
            ..shape
        });
        assert_eq!(
            (wide[13].m, wide[13].n, wide[13].k, wide[13].heads),
            (16, 16, 64, Some((128, 2, 64)))
        );
        // Each layer's three products have the same FLOPs.
        let f: Vec<f64> = products[1..4].iter().map(Product::gflop).collect();
        assert!(f.iter().all(|&g| g == 2.0 * 8192.0 * 192.0 * 64.0 / 1e9));
    }

    #[test]
    fn the_step_is_timed_at_each_products_best_round() {
        let r = vec![
            rates(
                "square",
                (1024, 1024, 1024),
                0,
                &[300.0, 350.0],
                &[340.0, 330.0],
            ),
            // 2 GFLOP each, 2 per step: at 100 GFLOP/s 40 ms, at 200 20 ms.
            rates(
                "a.output",
                (1000, 1000, 1000),
                2,
                &[50.0, 100.0],
                &[200.0, 150.0],
            ),
            // 0.2 GFLOP, 2 per step: 4 ms at 100 and at 100.
            rates(
                "a.weight_gradient",
                (100, 1000, 1000),
                2,
                &[100.0, f64::NAN],
                &[100.0, 90.0],
            ),
        ];
        assert_eq!(step_ms(&r, false), Some(44.0));
        assert_eq!(step_ms(&r, true), Some(24.0));
        let text = table(&r, 4096, 2);
        assert!(
            text.contains("poslab 44.0 ms, PyTorch 24.0 ms (0.55x)"),
            "{text}"
        );
        assert!(text.contains("0.50x"), "{text}");
        assert!(text.contains("90.9%"), "{text}");
        // A product with no rate on a side leaves the step's time unknown on that side.
        let missing = vec![rates("b.output", (10, 10, 10), 1, &[1.0], &[])];
        assert_eq!(step_ms(&missing, true), None);
        assert!(!table(&missing, 10, 1).contains("PyTorch"));
    }

    #[test]
    fn each_product_is_timed_at_a_positive_rate() {
        // Heads 8 wide (register tiles) and 32 wide (gemm, and wider than the 20 tokens), and
        // every linear pass.
        for d_model in [16, 64] {
            let shape = Shape {
                d_model,
                n_heads: 2,
                n_layers: 1,
                ffn_dim: 48,
                batch: 3,
                seq: if d_model == 64 { 20 } else { 24 },
                ..Default::default()
            };
            for p in step_products(&shape)
                .iter()
                .filter(|p| p.kind != Kind::Square)
            {
                let rate = p.poslab_gflops(2);
                assert!(rate.is_finite() && rate > 0.0, "{}: {rate}", p.name());
            }
        }
    }
}
