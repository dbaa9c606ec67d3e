//! The running sums kernels held to their reference compositions.
use candle::{DType, Device, Tensor, Var};

/// Values in [-1, 1) from a fixed linear congruential sequence, with a few zeros of both
/// signs and a few large values.
fn values(len: usize, seed: u64) -> Vec<f64> {
    crate::kernels::testing::uniform(len, seed)
        .enumerate()
        .map(|(i, u)| match i % 29 {
            3 => -0.0,
            7 => 0.0,
            11 => 1e6,
            _ => u * 2.0 - 1.0,
        })
        .collect()
}

/// The sums and the input's gradient under a weighted sum of them, as bits.
fn sums_and_grad(
    dtype: DType,
    dims: (usize, usize, usize),
    groups: usize,
    backend: crate::nn::Backend,
) -> (Vec<u64>, Vec<u64>) {
    let (b, t, w) = dims;
    let dev = Device::Cpu;
    let x = Var::from_tensor(
        &Tensor::from_vec(values(b * t * w, 1), dims, &dev)
            .unwrap()
            .to_dtype(dtype)
            .unwrap(),
    )
    .unwrap();
    let y = crate::nn::running_sums(x.as_tensor(), groups, backend).unwrap();
    assert_eq!(y.dims(), [groups, b, w / groups, t]);
    let weights = Tensor::from_vec(values(b * t * w, 2), y.shape(), &dev)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    let grads = (&y * &weights)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let bits = |t: &Tensor| -> Vec<u64> {
        t.flatten_all()
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
            .to_vec1::<f64>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect()
    };
    (bits(&y), bits(grads.get(&x).unwrap()))
}

#[test]
fn fused_running_sums_give_the_compositions_bits_forward_and_backward() {
    for dtype in [DType::F32, DType::F64] {
        // In order (fused) and not (the composition both ways: still equal).
        for (dims, groups) in [
            ((3, 37, 10), 2),
            ((2, 64, 16), 2),
            ((32, 3, 16), 2),
            ((1, 5, 3), 3),
            ((4, 1, 4), 1),
        ] {
            let fused = sums_and_grad(dtype, dims, groups, crate::nn::Backend::default());
            let composed = sums_and_grad(dtype, dims, groups, crate::nn::Backend::reference());
            assert!(fused.0.iter().any(|v| f64::from_bits(*v) != 0.0));
            assert!(fused.1.iter().any(|v| f64::from_bits(*v) != 0.0));
            assert_eq!(fused.0, composed.0, "{dtype:?} {dims:?} / {groups}: sums");
            assert_eq!(
                fused.1, composed.1,
                "{dtype:?} {dims:?} / {groups}: gradient"
            );
        }
    }
}

#[test]
fn running_sums_refuse_channels_that_do_not_split_into_the_groups() {
    let x = Tensor::zeros((2, 3, 5), DType::F32, &Device::Cpu).unwrap();
    let err = crate::nn::running_sums(&x, 2, crate::nn::Backend::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("5 channels do not split into 2 groups"),
        "{err}"
    );
    let err = crate::nn::running_sums(&x, 2, crate::nn::Backend::reference())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("5 channels do not split into 2 groups"),
        "{err}"
    );
}
