//! The reflections kernels held to their reference compositions.
use crate::nn::{Projections, Transport};
use candle::{DType, Device, Tensor, Var};

/// `[w | β]` and the gradients of u, the taps and z, fused or composed.
fn run(dtype: DType, fused: bool, k: usize, masked: bool) -> Vec<Vec<f64>> {
    let (b, t, d, h) = (3, 11, 12, 3);
    let uniform = |len: usize, seed: u64, dims: &[usize], scale: f64| {
        let v: Vec<f64> = crate::kernels::testing::uniform(len, seed)
            .map(|u| (u * 2.0 - 1.0) * scale)
            .collect();
        Var::from_tensor(
            &Tensor::from_vec(v, dims, &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap(),
        )
        .unwrap()
    };
    let u = uniform(b * t * d, 1, &[b, t, d], 2.0);
    let conv = uniform(d * k.max(1), 2, &[d, 1, k.max(1)], 1.5);
    let z = uniform(b * t * h, 3, &[b, t, h], 3.0);
    // Padding at the end of one row and in the middle of another (the conv reads past it).
    let mut real = vec![1f32; b * t];
    if masked {
        real[t - 3..t].fill(0.0);
        real[t + 4] = 0.0;
    }
    let mask = Tensor::from_vec(real, (b, t), &Device::Cpu).unwrap();
    let p = Projections {
        u: u.as_tensor(),
        conv: (k > 0).then(|| conv.as_tensor()),
        z: z.as_tensor(),
        mask: masked.then_some(&mask),
        heads: h,
        eps: 1e-6,
    };
    let transport = match fused {
        true => Transport::from_projections(p, crate::nn::Backend::default()).unwrap(),
        false => {
            Transport::compose(p, crate::nn::Backend::reference())
                .unwrap()
                .1
        }
    };
    let r = transport.reflections();
    assert_eq!(r.dims(), [b, h, t, d / h + 1]);
    let weights = uniform(r.elem_count(), 4, r.dims(), 1.0);
    let loss = (r * weights.as_tensor()).unwrap().sum_all().unwrap();
    let grads = loss.backward().unwrap();
    let flat = |x: &Tensor| {
        x.flatten_all()
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
            .to_vec1::<f64>()
            .unwrap()
    };
    let mut out = vec![flat(r), flat(grads.get(u.as_tensor()).unwrap())];
    if k > 0 {
        out.push(flat(grads.get(conv.as_tensor()).unwrap()));
    }
    out.push(flat(grads.get(z.as_tensor()).unwrap()));
    out
}

#[test]
fn fused_reflections_match_their_composition_forward_and_backward() {
    // Conv widths 0 (no conv, no silu), 1, 3 and 4, with and without padding, f64 and f32;
    // relative to the largest value of each: [w | beta], du, the taps' gradient, dz.
    for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 2e-5)] {
        for k in [0, 1, 3, 4] {
            for masked in [false, true] {
                let fused = run(dtype, true, k, masked);
                let composed = run(dtype, false, k, masked);
                for (i, (f, c)) in fused.iter().zip(&composed).enumerate() {
                    let top = c.iter().fold(0.0f64, |m, v| m.max(v.abs()));
                    assert!(top > 1e-3, "{dtype:?} k {k} result {i}: all zero");
                    let err = f
                        .iter()
                        .zip(c)
                        .map(|(a, b)| (a - b).abs())
                        .fold(0.0, f64::max);
                    assert!(
                        err / top < tol,
                        "{dtype:?} k {k} masked {masked} result {i}: differs by {:e}",
                        err / top
                    );
                }
            }
        }
    }
}
