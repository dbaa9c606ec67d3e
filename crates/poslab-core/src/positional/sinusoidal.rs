//! The sinusoidal table of Vaswani et al. (2017), computed in f64 on the host.
//!
//! Angles reach `p * w_0 = p` radians, thousands for long inputs; computing them in f32 would
//! lose about `p * 6e-8` of absolute accuracy before `sin` is even taken, so the table is built
//! in f64 and rounded once to the model's dtype.

use super::TableLayout;

/// `w_i = base^(-2i/dim)` for `i` in `0..dim/2`: the angular frequency of pair `i`.
pub fn inverse_frequencies(dim: usize, base: f64) -> Vec<f64> {
    (0..dim / 2)
        .map(|i| base.powf(-((2 * i) as f64) / dim as f64))
        .collect()
}

/// Where pair `i` of a `dim`-wide row sits: `(2i, 2i + 1)` interleaved, `(i, i + dim/2)` in
/// halves. The same two conventions lay out sinusoidal tables and pair RoPE's coordinates.
pub fn pair_slots(interleaved: bool, i: usize, dim: usize) -> (usize, usize) {
    if interleaved {
        (2 * i, 2 * i + 1)
    } else {
        (i, dim / 2 + i)
    }
}

/// A `[len, dim]` row-major table: for every position `p` in `start..start + len` and pair
/// `i`, `place(row, i, p * w_i)` writes the pair's entries of the row. Sinusoidal tables and
/// RoPE's cos/sin tables differ only in `place`.
pub fn angle_table(
    start: usize,
    len: usize,
    dim: usize,
    base: f64,
    place: impl FnMut(&mut [f64], usize, f64),
) -> Vec<f64> {
    let positions: Vec<usize> = (start..start + len).collect();
    angles_at(&positions, dim, &inverse_frequencies(dim, base), place)
}

/// As [`angle_table`], for any positions and any frequencies `inv_freq` (`dim / 2` of them):
/// row `r` is position `positions[r]`.
pub(crate) fn angles_at(
    positions: &[usize],
    dim: usize,
    inv_freq: &[f64],
    mut place: impl FnMut(&mut [f64], usize, f64),
) -> Vec<f64> {
    let mut out = vec![0.0; positions.len() * dim];
    for (row, &p) in out.chunks_exact_mut(dim).zip(positions) {
        let p = p as f64;
        for (i, &w) in inv_freq.iter().enumerate() {
            place(row, i, p * w);
        }
    }
    out
}

/// Rows `start..start + len` of the table, row-major `[len, dim]`.
///
/// Row `p` depends on `p` only, never on `len`: a table of 10 rows is the first 10 rows of a
/// table of 10 000. `dim` must be even (configs are validated before this is called).
pub fn sinusoidal_table(
    start: usize,
    len: usize,
    dim: usize,
    base: f64,
    layout: TableLayout,
) -> Vec<f64> {
    debug_assert!(
        dim.is_multiple_of(2),
        "sinusoidal width must be even, got {dim}"
    );
    let interleaved = layout == TableLayout::Interleaved;
    angle_table(start, len, dim, base, |row, i, angle| {
        let (sin_slot, cos_slot) = pair_slots(interleaved, i, dim);
        (row[sin_slot], row[cos_slot]) = angle.sin_cos();
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_rows_match_closed_form() {
        // Position 0: sin 0 = 0, cos 0 = 1 in every pair; position 1 pair 0 has angle 1 rad.
        let t = sinusoidal_table(0, 2, 4, 10_000.0, TableLayout::Interleaved);
        assert_eq!(&t[..4], &[0.0, 1.0, 0.0, 1.0]);
        assert_eq!(t[4], 1f64.sin());
        assert_eq!(t[5], 1f64.cos());
        // Pair 1 of width 4: w_1 = 10000^(-1/2) = 0.01.
        assert!((t[6] - 0.01f64.sin()).abs() < 1e-15);
        let h = sinusoidal_table(0, 2, 4, 10_000.0, TableLayout::Half);
        assert_eq!(&h[..4], &[0.0, 0.0, 1.0, 1.0]);
        assert_eq!(h[4], 1f64.sin());
        assert_eq!(h[6], 1f64.cos());
    }
}
