//! The head products of [`super::tiled`] in AVX-512 registers, for `f32`.
//!
//! With heads 8 wide, a head's products are `t x t x 8` (`q kᵀ`, `dout vᵀ`) or `t x 8 x t`
//! (`P v`, `Pᵀ dout`, `dS k`, `dSᵀ q`). Written as portable code, their tiles come out of the
//! compiler as 8-lane vectors or as scalar code, at a quarter of what one core's fused
//! multiply-adds can do. These kernels name the registers instead, in three shapes:
//! - [`wide`]: outputs along the lanes of a row (`t x t` products), 4 rows by 32 columns;
//! - [`tall`]: outputs along the lanes of a column, 32 rows by 8 columns, for the products whose
//!   left operand is read along its columns (`Pᵀ dout`, `dSᵀ q`): the tile is transposed in
//!   registers before it is stored;
//! - [`narrow`]: 8-lane rows, 16 at a time, for the products whose left operand is read along
//!   its rows (`P v`, `dS k`).
//!
//! Every value is summed as [`super::tile`] sums it, so the bits are the same: fused
//! multiply-adds from zero in order of depth, then one multiply by the scale.

use std::arch::x86_64::*;

/// The operands of one product, as [`super::Tiles`] holds them: `dst (m x n) = scale · lhs (m x
/// k) · rhs (k x n)`, `rhs` in contiguous rows of `rhs_rs`, `dst` in rows of `dst_rs`.
#[derive(Clone, Copy)]
pub(super) struct Product {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub dst: *mut f32,
    pub dst_rs: usize,
    pub lhs: *const f32,
    pub lhs_rs: isize,
    pub lhs_cs: isize,
    pub rhs: *const f32,
    pub rhs_rs: usize,
    pub scale: f32,
}

/// Computes `p` if one of the three kernels fits its shape, and says whether it did.
///
/// # Safety
/// The CPU must have AVX-512 F and VL, and every pointer of `p` must be valid for its rows,
/// columns and strides.
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
pub(super) unsafe fn product(p: Product) -> bool {
    // SAFETY (all): per the contract.
    if p.n == 8 && p.lhs_rs == 1 {
        unsafe { tall(p) };
    } else if p.n == 8 {
        unsafe { narrow(p) };
    } else if p.n >= 16 {
        unsafe { wide(p) };
    } else {
        return false;
    }
    true
}

/// The lanes of the first `n` of 16 (at most 16).
#[inline(always)]
fn lanes(n: usize) -> __mmask16 {
    if n >= 16 {
        0xFFFF
    } else {
        (1u16 << n) - 1
    }
}

/// `lhs(i, kk)` for this product.
///
/// # Safety
/// `(i, kk)` must be within `lhs`.
#[inline(always)]
unsafe fn lhs_at(p: &Product, i: usize, kk: usize) -> *const f32 {
    // SAFETY: per the contract.
    unsafe { p.lhs.offset(i as isize * p.lhs_rs + kk as isize * p.lhs_cs) }
}

/// Outputs along the lanes of a row: tiles of `R` rows by `V` vectors of 16 columns from `j0`,
/// the last vector `last` lanes wide.
///
/// # Safety
/// As [`product`]'s, for the tile's rows and columns.
#[inline]
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
unsafe fn wide_tile<const R: usize, const V: usize>(
    p: &Product,
    i0: usize,
    j0: usize,
    last: usize,
) {
    let mask = |v: usize| if v + 1 == V { lanes(last) } else { 0xFFFF };
    let mut acc = [[_mm512_setzero_ps(); V]; R];
    for kk in 0..p.k {
        // SAFETY: row kk of rhs has the tile's columns; lhs has its rows at column kk.
        let row = unsafe { p.rhs.add(kk * p.rhs_rs + j0) };
        let b: [__m512; V] =
            std::array::from_fn(|v| unsafe { _mm512_maskz_loadu_ps(mask(v), row.add(16 * v)) });
        for (r, acc) in acc.iter_mut().enumerate() {
            let a = _mm512_set1_ps(unsafe { *lhs_at(p, i0 + r, kk) });
            for (acc, b) in acc.iter_mut().zip(&b) {
                *acc = _mm512_fmadd_ps(a, *b, *acc);
            }
        }
    }
    let scale = _mm512_set1_ps(p.scale);
    for (r, acc) in acc.iter().enumerate() {
        // SAFETY: dst holds the tile's rows and columns.
        let out = unsafe { p.dst.add((i0 + r) * p.dst_rs + j0) };
        for (v, acc) in acc.iter().enumerate() {
            unsafe { _mm512_mask_storeu_ps(out.add(16 * v), mask(v), _mm512_mul_ps(scale, *acc)) };
        }
    }
}

/// Every row, `R` at a time, for `V` vectors of columns from `j0`.
///
/// # Safety
/// As [`product`]'s.
#[inline]
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
unsafe fn wide_columns<const V: usize>(p: &Product, j0: usize, last: usize) {
    let mut i = 0;
    // SAFETY (both): per the contract; the tiles stay within the m rows.
    while i + 4 <= p.m {
        unsafe { wide_tile::<4, V>(p, i, j0, last) };
        i += 4;
    }
    while i < p.m {
        unsafe { wide_tile::<1, V>(p, i, j0, last) };
        i += 1;
    }
}

/// `n >= 16` columns: 32 at a time, then 16, then the rest in a masked vector.
///
/// # Safety
/// As [`product`]'s.
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
unsafe fn wide(p: Product) {
    // SAFETY (both): per the contract; the blocks stay within the n columns.
    in_vectors(
        p.n,
        |j| unsafe { wide_columns::<2>(&p, j, 16) },
        |j, last| unsafe { wide_columns::<1>(&p, j, last) },
    );
}

/// Splits `0..len` into blocks of two vectors (`two(at)`, 32 values), then one of a vector
/// (`one(at, 16)`) and a masked one for the rest (`one(at, lanes)`).
#[inline(always)]
fn in_vectors(len: usize, mut two: impl FnMut(usize), mut one: impl FnMut(usize, usize)) {
    let mut at = 0;
    while at + 32 <= len {
        two(at);
        at += 32;
    }
    if at + 16 <= len {
        one(at, 16);
        at += 16;
    }
    if at < len {
        one(at, len - at);
    }
}

/// Rows of 8 outputs in 8-lane vectors, `R` rows at a time from `i0`: each value of `lhs` is
/// broadcast from memory into the multiply-add that uses it.
///
/// # Safety
/// As [`product`]'s, for the tile's rows; `n` is 8.
#[inline]
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
unsafe fn narrow_tile<const R: usize>(p: &Product, i0: usize) {
    let mut acc = [_mm256_setzero_ps(); R];
    for kk in 0..p.k {
        // SAFETY: row kk of rhs has 8 columns; lhs has the tile's rows at column kk.
        let b = unsafe { _mm256_loadu_ps(p.rhs.add(kk * p.rhs_rs)) };
        for (r, acc) in acc.iter_mut().enumerate() {
            let a = _mm256_set1_ps(unsafe { *lhs_at(p, i0 + r, kk) });
            *acc = _mm256_fmadd_ps(a, b, *acc);
        }
    }
    let scale = _mm256_set1_ps(p.scale);
    for (r, acc) in acc.iter().enumerate() {
        // SAFETY: dst holds the tile's rows, 8 columns each.
        unsafe { _mm256_storeu_ps(p.dst.add((i0 + r) * p.dst_rs), _mm256_mul_ps(scale, *acc)) };
    }
}

/// `n == 8`, `lhs` read along its rows: 16 rows at a time, then 4, then 1.
///
/// # Safety
/// As [`product`]'s.
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
unsafe fn narrow(p: Product) {
    let mut i = 0;
    // SAFETY (all): per the contract; the tiles stay within the m rows.
    while i + 16 <= p.m {
        unsafe { narrow_tile::<16>(&p, i) };
        i += 16;
    }
    while i + 4 <= p.m {
        unsafe { narrow_tile::<4>(&p, i) };
        i += 4;
    }
    while i < p.m {
        unsafe { narrow_tile::<1>(&p, i) };
        i += 1;
    }
}

/// `n == 8`, `lhs` read along its columns (`lhs_rs` 1): 32 rows at a time, then 16, then the
/// rest, each column of the tile one vector per 16 rows.
///
/// # Safety
/// As [`product`]'s.
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
unsafe fn tall(p: Product) {
    // SAFETY (both): per the contract; the tiles stay within the m rows.
    in_vectors(
        p.m,
        |i| unsafe { tall_tile::<2>(&p, i, 16) },
        |i, last| unsafe { tall_tile::<1>(&p, i, last) },
    );
}

/// `16 V` rows (the last vector `last` of them) by 8 columns from row `i0`.
///
/// # Safety
/// As [`product`]'s, for the tile's rows; `n` is 8 and `lhs_rs` 1.
#[inline]
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
#[allow(clippy::needless_range_loop)] // `v` picks a vector of every column's
unsafe fn tall_tile<const V: usize>(p: &Product, i0: usize, last: usize) {
    let mask = |v: usize| if v + 1 == V { lanes(last) } else { 0xFFFF };
    // acc[c][v]: column c of rows i0 + 16 v .. i0 + 16 v + 16.
    let mut acc = [[_mm512_setzero_ps(); V]; 8];
    for kk in 0..p.k {
        // SAFETY: lhs's column kk has the tile's rows, adjacent; row kk of rhs has 8 columns.
        let col = unsafe { lhs_at(p, i0, kk) };
        let a: [__m512; V] =
            std::array::from_fn(|v| unsafe { _mm512_maskz_loadu_ps(mask(v), col.add(16 * v)) });
        let row = unsafe { p.rhs.add(kk * p.rhs_rs) };
        for (c, acc) in acc.iter_mut().enumerate() {
            let b = _mm512_set1_ps(unsafe { *row.add(c) });
            for (acc, a) in acc.iter_mut().zip(&a) {
                *acc = _mm512_fmadd_ps(*a, b, *acc);
            }
        }
    }
    let scale = _mm512_set1_ps(p.scale);
    for v in 0..V {
        let cols: [__m512; 8] = std::array::from_fn(|c| _mm512_mul_ps(scale, acc[c][v]));
        let base = i0 + 16 * v;
        if mask(v) == 0xFFFF {
            // SAFETY: dst holds rows base..base + 16, 8 columns each.
            unsafe { store_transposed(&cols, p.dst.add(base * p.dst_rs), p.dst_rs) };
        } else {
            let mut block = [[0f32; 16]; 8];
            for (b, c) in block.iter_mut().zip(&cols) {
                // SAFETY: b holds 16 values.
                unsafe { _mm512_storeu_ps(b.as_mut_ptr(), *c) };
            }
            for r in 0..last {
                for (c, b) in block.iter().enumerate() {
                    // SAFETY: dst holds rows base..base + last, 8 columns each.
                    unsafe { *p.dst.add((base + r) * p.dst_rs + c) = b[r] };
                }
            }
        }
    }
}

/// A two-source permutation's indices: lane `l` takes `f(l)` (`16 +` for the second source).
#[inline(always)]
fn indices(f: impl Fn(i32) -> i32) -> __m512i {
    let i: [i32; 16] = std::array::from_fn(|l| f(l as i32));
    // SAFETY: 16 i32 make one 512-bit vector.
    unsafe { std::mem::transmute::<[i32; 16], __m512i>(i) }
}

/// Stores 16 rows by 8 columns, given as 8 columns of 16 rows (`cols[c]` lane `r` is row `r`,
/// column `c`), to rows of `rs` from `dst`: three rounds of two-source permutations gather
/// columns in pairs, then fours, then eights, so that each vector ends with two whole rows.
///
/// # Safety
/// `dst` must be valid for 16 rows of 8 values, `rs` (at least 8) apart.
#[inline]
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
#[allow(clippy::needless_range_loop)] // `h`, `q` pick a vector of both halves of the columns
unsafe fn store_transposed(cols: &[__m512; 8], dst: *mut f32, rs: usize) {
    // Round 1, columns 2c and 2c + 1 of rows 8h..8h + 8: lane 2r + j is row 8h + r, column
    // 2c + j.
    let pairs: [[__m512; 2]; 4] = std::array::from_fn(|c| {
        std::array::from_fn(|h| {
            let idx = indices(|l| 8 * h as i32 + l / 2 + 16 * (l % 2));
            _mm512_permutex2var_ps(cols[2 * c], idx, cols[2 * c + 1])
        })
    });
    // Round 2, columns 4c..4c + 4 of rows 8h + 4q..8h + 4q + 4: lane 4r + j is row
    // 8h + 4q + r, column 4c + j.
    let fours: [[[__m512; 2]; 2]; 2] = std::array::from_fn(|c| {
        std::array::from_fn(|h| {
            std::array::from_fn(|q| {
                let idx = indices(|l| 8 * q as i32 + 2 * (l / 4) + l % 2 + 16 * ((l % 4) / 2));
                _mm512_permutex2var_ps(pairs[2 * c][h], idx, pairs[2 * c + 1][h])
            })
        })
    });
    // Round 3, all 8 columns of rows 8h + 4q + 2s, + 1: lane 8r + j is row 8h + 4q + 2s + r,
    // column j.
    for h in 0..2 {
        for q in 0..2 {
            for s in 0..2 {
                let idx = indices(|l| 8 * s as i32 + 4 * (l / 8) + l % 4 + 16 * ((l % 8) / 4));
                let rows = _mm512_permutex2var_ps(fours[0][h][q], idx, fours[1][h][q]);
                let r = 8 * h + 4 * q + 2 * s;
                // SAFETY: rows r and r + 1 are within the 16; the second store's masked-off
                // lanes fall on row r, which is not written through them.
                unsafe {
                    _mm512_mask_storeu_ps(dst.add(r * rs), 0x00FF, rows);
                    _mm512_mask_storeu_ps(dst.add((r + 1) * rs).sub(8), 0xFF00, rows);
                }
            }
        }
    }
}

/// Packs the transpose of `n` rows of 8 values (`src`, rows `rs` apart) into 8 rows of `n`:
/// `dst[c n + j] = src[j rs + c]`, 16 rows at a time by [`load_transposed`], the rest one by
/// one. This is how [`super::tiled`] packs `kᵀ` and `vᵀ` for heads 8 wide.
///
/// # Safety
/// The CPU must have AVX-512 F and VL; `src` must be valid for `n` rows of 8 values `rs` (at
/// least 8) apart, and `dst` for `8 n` values.
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
pub(super) unsafe fn pack_transposed(src: *const f32, rs: usize, n: usize, dst: *mut f32) {
    let mut j = 0;
    while j + 16 <= n {
        // SAFETY: rows j..j + 16 are within the n; dst row c has columns j..j + 16.
        unsafe {
            let cols = load_transposed(src.add(j * rs), rs);
            for (c, col) in cols.iter().enumerate() {
                _mm512_storeu_ps(dst.add(c * n + j), *col);
            }
        }
        j += 16;
    }
    for j in j..n {
        for c in 0..8 {
            // SAFETY: as above, for row j.
            unsafe { *dst.add(c * n + j) = *src.add(j * rs + c) };
        }
    }
}

/// 16 rows of 8 values (`src`, rows `rs` apart) as 8 columns of 16 (`cols[c]` lane `r` is row
/// `r`, column `c`): the rounds of [`store_transposed`] undone, last first.
///
/// # Safety
/// `src` must be valid for 16 rows of 8 values, `rs` (at least 8) apart.
#[inline]
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
unsafe fn load_transposed(src: *const f32, rs: usize) -> [__m512; 8] {
    // Lane 8r + j of rows[h][q][s] is row 8h + 4q + 2s + r, column j. The second load's
    // masked-off lanes fall on the row before, which is not read through them.
    let rows: [[[__m512; 2]; 2]; 2] = std::array::from_fn(|h| {
        std::array::from_fn(|q| {
            std::array::from_fn(|s| {
                let r = 8 * h + 4 * q + 2 * s;
                // SAFETY: rows r and r + 1 are within the 16.
                unsafe {
                    let low = _mm512_maskz_loadu_ps(0x00FF, src.add(r * rs));
                    _mm512_mask_loadu_ps(low, 0xFF00, src.add((r + 1) * rs).sub(8))
                }
            })
        })
    });
    // Lane 4r + j of fours[c][h][q] is row 8h + 4q + r, column 4c + j.
    let fours: [[[__m512; 2]; 2]; 2] = std::array::from_fn(|c| {
        std::array::from_fn(|h| {
            std::array::from_fn(|q| {
                let idx = indices(|l| 16 * (l / 8) + 8 * ((l / 4) % 2) + 4 * c as i32 + l % 4);
                _mm512_permutex2var_ps(rows[h][q][0], idx, rows[h][q][1])
            })
        })
    });
    // Lane 2r + j of pairs[c][h] is row 8h + r, column 2c + j.
    let pairs: [[__m512; 2]; 4] = std::array::from_fn(|c| {
        std::array::from_fn(|h| {
            let idx = indices(|l| 16 * (l / 8) + 4 * ((l / 2) % 4) + 2 * (c as i32 % 2) + l % 2);
            _mm512_permutex2var_ps(fours[c / 2][h][0], idx, fours[c / 2][h][1])
        })
    });
    std::array::from_fn(|c| {
        let idx = indices(|l| 16 * (l / 8) + 2 * (l % 8) + c as i32 % 2);
        _mm512_permutex2var_ps(pairs[c / 2][0], idx, pairs[c / 2][1])
    })
}
