//! The layer kernels held to their reference compositions.
use crate::kernels::cpu::{encoder_layer, layer_norm, Attention};
use crate::kernels::spec::{Act, LayerMasks, LayerShape, TransportShape};
use crate::nn::{AttentionBias, ForgetGates, SimdLevel, Window};
use candle::{DType, Device, Tensor, Var};

fn uniform(len: usize, seed: u64, dims: &[usize]) -> Tensor {
    let v: Vec<f64> = crate::kernels::testing::uniform(len, seed)
        .map(|u| u - 0.5)
        .collect();
    Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
}

/// What the layer's attention reads: `LN1(x)` (eps 1e-5) pre-norm, `x` post-norm.
fn attention_input(x: &Var, layer: &Var, d: usize, pre_norm: bool) -> Tensor {
    if !pre_norm {
        return x.as_tensor().clone();
    }
    let p = layer.as_tensor();
    let (w, b) = (p.narrow(0, 0, d).unwrap(), p.narrow(0, d, d).unwrap());
    layer_norm(x, &w, &b, 1e-5, SimdLevel::detected()).unwrap()
}

/// `a` within `1e-12` of `b`'s largest magnitude, which is not 0.
fn assert_close(a: &Tensor, b: &Tensor, what: &str) {
    let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f64>().unwrap();
    let (a, b) = (flat(a), flat(b));
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let scale = b.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let err = a
        .iter()
        .zip(&b)
        .fold(0.0f64, |m, (p, q)| m.max((p - q).abs()));
    assert!(scale > 1e-6, "{what}: zero");
    assert!(
        err <= 1e-12 * scale,
        "{what}: differs by {err:e} of {scale:e}"
    );
}

/// The gradients of `Σ y ⊙ r`.
fn grads_of(y: &Tensor, r: &Tensor) -> candle::backprop::GradStore {
    (y * r).unwrap().sum_all().unwrap().backward().unwrap()
}

/// The forget gates computed inside the layer against the same layer given their running
/// sums from the composition ([`ForgetGates::sums`] of `LN1(x)`, or of `x` post-norm), in
/// f64: the output bit for bit, and the gradients of `x`, every layer parameter and the
/// gates' weights and bias to 1e-12 (the attention input's gradient is summed before
/// LN1's backward instead of after it). Fails when the gates' forward, their backward or
/// the sum of their gradient with q, k and v's into the attention input is wrong.
#[test]
fn gates_inside_the_layer_match_their_composition() {
    let (b, t, d, h, f) = (2, 7, 8, 2, 12);
    for pre_norm in [true, false] {
        let base = LayerShape {
            d,
            ffn: f,
            eps: 1e-5,
            pre_norm,
            activation: Act::Gelu,
            gates: 0,
            transport: None,
        };
        let with_gates = LayerShape {
            gates: 2 * h,
            ..base
        };
        let (np, ng) = (base.packed_len(), with_gates.packed_len());
        let x = Var::from_tensor(&uniform(b * t * d, 1, &[b, t, d])).unwrap();
        let layer = Var::from_tensor(&uniform(np, 2, &[np])).unwrap();
        // The gates' bias near FoX's start (5) so the sums stay in the gates' working range.
        let weight = Var::from_tensor(&uniform(2 * h * d, 3, &[2 * h, d])).unwrap();
        let bias = Var::from_tensor(&(uniform(2 * h, 4, &[2 * h]) + 3.0).unwrap()).unwrap();
        let key_bias = Tensor::zeros((b, t), DType::F64, &Device::Cpu).unwrap();
        let r = uniform(b * t * d, 5, &[b, t, d]);
        let scale = 1.0 / ((d / h) as f64).sqrt();

        // Inside: the gates packed after the layer's parameters.
        let packed = Tensor::cat(
            &[layer.as_tensor(), &weight.flatten_all().unwrap(), &bias],
            0,
        )
        .unwrap();
        let attention = Attention::new(
            h,
            scale,
            &key_bias,
            None,
            None,
            Window::ALL,
            SimdLevel::detected(),
        );
        let inside = encoder_layer(
            &x,
            &packed,
            with_gates,
            attention,
            LayerMasks::default(),
            true,
            None,
            false,
        )
        .unwrap();

        // Outside: the composition's sums given as the score bias.
        let attn_in = attention_input(&x, &layer, d, pre_norm);
        let gates = ForgetGates {
            weight: weight.as_tensor().clone(),
            bias: bias.as_tensor().clone(),
        };
        let sums = gates.sums(&attn_in, crate::nn::Backend::default()).unwrap();
        let attention = Attention::new(
            h,
            scale,
            &key_bias,
            None,
            Some(AttentionBias::SidedSums(&sums).owned()),
            Window::ALL,
            SimdLevel::detected(),
        );
        let outside = encoder_layer(
            &x,
            &layer,
            base,
            attention,
            LayerMasks::default(),
            true,
            None,
            false,
        )
        .unwrap();

        let close = |a: &Tensor, b: &Tensor, what: &str| {
            assert_close(a, b, &format!("{what} (pre-norm {pre_norm})"))
        };
        // The forward runs the composition's kernels in its order: the same bits.
        let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f64>().unwrap();
        assert_eq!(
            flat(&inside),
            flat(&outside),
            "output (pre-norm {pre_norm})"
        );
        let (gi, go) = (grads_of(&inside, &r), grads_of(&outside, &r));
        close(gi.get(&x).unwrap(), go.get(&x).unwrap(), "d x");
        assert_eq!(ng, np + 2 * h * d + 2 * h);
        for (var, what) in [
            (&layer, "d layer"),
            (&weight, "d gate weight"),
            (&bias, "d gate bias"),
        ] {
            close(gi.get(var).unwrap(), go.get(var).unwrap(), what);
        }
    }
}

/// A transport's reflections made inside the layer from its attention input against the
/// same layer given them from the composition ([`Transport::compose`] of `LN1(x)`, or of
/// `x` post-norm), in f64, with a padded token and with and without the short conv: the
/// output and the gradients of `x`, every layer parameter and every reflection weight
/// (`W_w`, the taps, `W_b`, `b_b`) to 1e-12. Fails when the reflections' forward, their
/// backward, their weights' gradients or the sum of their gradient with q, k and v's into
/// the attention input is wrong.
#[test]
fn reflections_inside_the_layer_match_their_composition() {
    use crate::nn::{key_padding_bias, InputReflections, Projections, Transport};
    let (b, t, d, h, f) = (2, 7, 8, 2, 12);
    let mask = Tensor::from_vec(
        vec![1.0f64, 1., 1., 1., 1., 1., 1., 1., 1., 1., 1., 1., 0., 0.],
        (b, t),
        &Device::Cpu,
    )
    .unwrap();
    for (pre_norm, k) in [(true, 3), (false, 3), (true, 0), (false, 2)] {
        let base = LayerShape {
            d,
            ffn: f,
            eps: 1e-5,
            pre_norm,
            activation: Act::Gelu,
            gates: 0,
            transport: None,
        };
        let with_transport = LayerShape {
            transport: Some(TransportShape { heads: h, taps: k }),
            ..base
        };
        let np = base.packed_len();
        assert_eq!(with_transport.packed_len(), np + d * d + d * k + h * d + h);
        let x = Var::from_tensor(&uniform(b * t * d, 1, &[b, t, d])).unwrap();
        let layer = Var::from_tensor(&uniform(np, 2, &[np])).unwrap();
        let w = Var::from_tensor(&(uniform(d * d, 3, &[d, d]) * 2.0).unwrap()).unwrap();
        let conv = Var::from_tensor(&(uniform(d * k.max(1), 4, &[d, 1, k.max(1)]) * 3.0).unwrap())
            .unwrap();
        let beta_weight = Var::from_tensor(&uniform(h * d, 5, &[h, d])).unwrap();
        let beta_bias = Var::from_tensor(&uniform(h, 6, &[h])).unwrap();
        let key_bias = key_padding_bias(&mask, DType::F64).unwrap();
        let r = uniform(b * t * d, 7, &[b, t, d]);
        let scale = 1.0 / ((d / h) as f64).sqrt();
        let reflections = InputReflections {
            w: w.as_tensor(),
            conv: (k > 0).then_some(conv.as_tensor()),
            beta_weight: beta_weight.as_tensor(),
            beta_bias: beta_bias.as_tensor(),
            mask: Some(&mask),
            eps: 1e-6,
        };

        // Inside: the reflections' weights packed after the layer's parameters.
        let packed = Tensor::cat(
            &[vec![layer.as_tensor().clone()], reflections.flat().unwrap()].concat(),
            0,
        )
        .unwrap();
        let attention = Attention::new(
            h,
            scale,
            &key_bias,
            None,
            None,
            Window::ALL,
            SimdLevel::detected(),
        );
        let inside = encoder_layer(
            &x,
            &packed,
            with_transport,
            attention,
            LayerMasks::default(),
            true,
            Some(reflections.spec().unwrap()),
            false,
        )
        .unwrap();

        // Outside: the composition's reflections given to the attention.
        let attn_in = attention_input(&x, &layer, d, pre_norm);
        let u = attn_in.broadcast_matmul(&w.t().unwrap()).unwrap();
        let z = attn_in
            .broadcast_matmul(&beta_weight.t().unwrap())
            .unwrap()
            .broadcast_add(&beta_bias)
            .unwrap();
        let (_, transport) = Transport::compose(
            Projections {
                u: &u,
                conv: reflections.conv,
                z: &z,
                mask: Some(&mask),
                heads: h,
                eps: 1e-6,
            },
            crate::nn::Backend::default(),
        )
        .unwrap();
        let attention = Attention::new(
            h,
            scale,
            &key_bias,
            None,
            None,
            Window::ALL,
            SimdLevel::detected(),
        )
        .with_transport(Some(transport.spec()));
        let outside = encoder_layer(
            &x,
            &layer,
            base,
            attention,
            LayerMasks::default(),
            true,
            None,
            false,
        )
        .unwrap();

        let case = format!("pre-norm {pre_norm}, conv {k}");
        let close =
            |a: &Tensor, b: &Tensor, what: &str| assert_close(a, b, &format!("{what} ({case})"));
        close(&inside, &outside, "output");
        let (gi, go) = (grads_of(&inside, &r), grads_of(&outside, &r));
        close(gi.get(&x).unwrap(), go.get(&x).unwrap(), "d x");
        let mut vars = vec![
            (&layer, "d layer"),
            (&w, "d W_w"),
            (&beta_weight, "d W_b"),
            (&beta_bias, "d b_b"),
        ];
        if k > 0 {
            vars.push((&conv, "d taps"));
        }
        for (var, what) in vars {
            close(gi.get(var).unwrap(), go.get(var).unwrap(), what);
        }
    }
}
