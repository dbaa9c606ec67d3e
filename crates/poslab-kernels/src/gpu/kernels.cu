// poslab's device-path kernels (src/nn/device/): compiled by NVRTC the first time a process needs
// them. Each kernel's CPU twin is in twin.rs and computes the same values in the same precision:
// f64 storage in double, f32, bf16 and f16 storage in float, rounded to the storage type where
// a value is stored. No headers: bf16 and f16 are converted by hand (bits) and by PTX's cvt.
//
// Every reduction (row sums, maxima) is taken in a fixed order within one block, so results do
// not depend on scheduling: the same inputs give the same bits, launch after launch.
//
// Kernels are templates over the storage type S, instantiated as `extern "C"` functions named
// `<kernel>_<f64|f32|bf16|f16>` by the macros at the end.

typedef unsigned short u16;
typedef long long i64;

struct bf16_t {
    u16 x;
};
struct f16_t {
    u16 x;
};

template <typename S> struct E;

template <> struct E<float> {
    typedef float C;
    __device__ static float get(float v) { return v; }
    __device__ static float put(float c) { return c; }
};

template <> struct E<double> {
    typedef double C;
    __device__ static double get(double v) { return v; }
    __device__ static double put(double c) { return c; }
};

template <> struct E<bf16_t> {
    typedef float C;
    __device__ static float get(bf16_t v) { return __uint_as_float(((unsigned int)v.x) << 16); }
    // round to nearest, ties to even; NaN stays NaN
    __device__ static bf16_t put(float c) {
        unsigned int u = __float_as_uint(c);
        bf16_t r;
        if ((u & 0x7fffffffu) > 0x7f800000u) {
            r.x = (u16)0x7fc0;
            return r;
        }
        u += 0x7fffu + ((u >> 16) & 1u);
        r.x = (u16)(u >> 16);
        return r;
    }
};

template <> struct E<f16_t> {
    typedef float C;
    __device__ static float get(f16_t v) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.x));
        return f;
    }
    __device__ static f16_t put(float c) {
        f16_t r;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.x) : "f"(c));
        return r;
    }
};

__device__ inline float ex(float x) { return expf(x); }
__device__ inline double ex(double x) { return exp(x); }
__device__ inline float er(float x) { return erff(x); }
__device__ inline double er(double x) { return erf(x); }
__device__ inline float l1p(float x) { return log1pf(x); }
__device__ inline double l1p(double x) { return log1p(x); }
__device__ inline float sq(float x) { return sqrtf(x); }
__device__ inline double sq(double x) { return sqrt(x); }
__device__ inline float lg(float x) { return logf(x); }
__device__ inline double lg(double x) { return log(x); }
__device__ inline float mx(float a, float b) { return fmaxf(a, b); }
__device__ inline double mx(double a, double b) { return fmax(a, b); }

template <typename C> __device__ C neg_inf();
template <> __device__ float neg_inf<float>() { return __int_as_float(0xff800000); }
template <> __device__ double neg_inf<double>() {
    return __longlong_as_double((long long)0xfff0000000000000ULL);
}

template <typename C> __device__ C quiet_nan();
template <> __device__ float quiet_nan<float>() { return __int_as_float(0x7fc00000); }
template <> __device__ double quiet_nan<double>() {
    return __longlong_as_double((long long)0x7ff8000000000000ULL);
}

// The masked score (poslab's MASKED_SCORE): weight exactly 0 after exp, finite.
#define MASKED (-1e9)

template <typename C> __device__ C warp_sum(C v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

template <typename C> __device__ C warp_max(C v) {
    for (int o = 16; o > 0; o >>= 1) v = mx(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// The sum over the block of every thread's `v`, in a fixed order, returned to every thread.
// `red` holds 32 values of shared memory.
template <typename C> __device__ C block_sum(C v, C* red) {
    v = warp_sum(v);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    const int warps = (blockDim.x + 31) >> 5;
    v = threadIdx.x < warps ? red[threadIdx.x] : (C)0;
    if (warp == 0) v = warp_sum(v);
    if (threadIdx.x == 0) red[0] = v;
    __syncthreads();
    return red[0];
}

template <typename C> __device__ C block_max(C v, C* red) {
    v = warp_max(v);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    const int warps = (blockDim.x + 31) >> 5;
    v = threadIdx.x < warps ? red[threadIdx.x] : neg_inf<C>();
    if (warp == 0) v = warp_max(v);
    if (threadIdx.x == 0) red[0] = v;
    __syncthreads();
    return red[0];
}

#define GRID_STRIDE(i, n) \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)gridDim.x * blockDim.x)

template <typename S> __device__ void fill(S* out, double value, i64 n) {
    typedef typename E<S>::C C;
    GRID_STRIDE(i, n) out[i] = E<S>::put((C)value);
}

template <typename S> __device__ void mul(const S* x, const S* m, S* out, i64 n) {
    GRID_STRIDE(i, n) out[i] = E<S>::put(E<S>::get(x[i]) * E<S>::get(m[i]));
}

// 32 random bits for entry `index` of a dropout mask seeded by `seed`: SplitMix64's output at
// the state seed + (index + 1) gamma, its upper half (spec.rs's dropout_bits).
__device__ unsigned int dropout_bits(unsigned long long seed, unsigned long long index) {
    unsigned long long z = seed + (index + 1ULL) * 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return (unsigned int)((z ^ (z >> 31)) >> 32);
}

// A seeded dropout's multipliers: `scale` (already rounded to S) where the entry's bits are at
// or above `threshold`, else 0.
template <typename S>
__device__ void dropout_mask(S* out, unsigned long long seed, unsigned long long threshold,
                             double scale, i64 n) {
    typedef typename E<S>::C C;
    GRID_STRIDE(i, n) {
        const bool keep = (unsigned long long)dropout_bits(seed, (unsigned long long)i) >= threshold;
        out[i] = E<S>::put(keep ? (C)scale : (C)0);
    }
}

template <typename S, typename D> __device__ void convert(const S* x, D* out, i64 n) {
    typedef typename E<D>::C C;
    GRID_STRIDE(i, n) out[i] = E<D>::put((C)E<S>::get(x[i]));
}

// LayerNorm of the row at `x` (width values) into `y`, its [mean, rstd] into `stats`. Called by
// the whole block; `x` may be a row this block has just written (its writes are visible after
// the barrier in block_sum).
template <typename S>
__device__ void norm_row(const S* x, const S* w, const S* b, double eps, S* y,
                         typename E<S>::C* stats, int width, typename E<S>::C* red) {
    typedef typename E<S>::C C;
    C s = 0;
    for (int j = threadIdx.x; j < width; j += blockDim.x) s += E<S>::get(x[j]);
    const C mean = block_sum(s, red) / (C)width;
    C v = 0;
    for (int j = threadIdx.x; j < width; j += blockDim.x) {
        const C c = E<S>::get(x[j]) - mean;
        v += c * c;
    }
    const C var = block_sum(v, red) / (C)width;
    const C rstd = (C)1 / sq(var + (C)eps);
    for (int j = threadIdx.x; j < width; j += blockDim.x)
        y[j] = E<S>::put((E<S>::get(x[j]) - mean) * rstd * E<S>::get(w[j]) + E<S>::get(b[j]));
    if (threadIdx.x == 0) {
        stats[0] = mean;
        stats[1] = rstd;
    }
}

// One block per row.
template <typename S>
__device__ void layer_norm(const S* x, const S* w, const S* b, double eps, S* y,
                           typename E<S>::C* stats, i64 rows, int width) {
    typedef typename E<S>::C C;
    __shared__ C red[32];
    const i64 r = blockIdx.x;
    if (r >= rows) return;
    norm_row(x + r * width, w, b, eps, y + r * width, stats + 2 * r, width, red);
}

// sum = res + m ⊙ (z + bias) by rows, then (when `out` is given) out = LN(sum). One block per row.
template <typename S>
__device__ void residual(const S* res, const S* z, const S* bias, const S* mask, S* sum,
                         const S* w, const S* b, double eps, S* out, typename E<S>::C* stats,
                         i64 rows, int width) {
    typedef typename E<S>::C C;
    __shared__ C red[32];
    const i64 r = blockIdx.x;
    if (r >= rows) return;
    const i64 at = r * width;
    for (int j = threadIdx.x; j < width; j += blockDim.x) {
        C v = E<S>::get(z[at + j]) + E<S>::get(bias[j]);
        if (mask) v *= E<S>::get(mask[at + j]);
        sum[at + j] = E<S>::put(E<S>::get(res[at + j]) + v);
    }
    if (out) norm_row(sum + at, w, b, eps, out + at, stats + 2 * r, width, red);
}

// LayerNorm's backward by rows: out = add + dx, masked = out ⊙ mask, params row = [g ⊙ x̂, g].
template <typename S>
__device__ void norm_back(const S* x, const typename E<S>::C* stats, const S* w, const S* g,
                          const S* add, S* out, const S* mask, S* masked, S* params, i64 rows,
                          int width) {
    typedef typename E<S>::C C;
    __shared__ C red[32];
    const i64 r = blockIdx.x;
    if (r >= rows) return;
    const i64 at = r * width;
    const C mean = stats[2 * r], rstd = stats[2 * r + 1];
    C m1 = 0, m2 = 0;
    for (int j = threadIdx.x; j < width; j += blockDim.x) {
        const C xh = (E<S>::get(x[at + j]) - mean) * rstd;
        const C gw = E<S>::get(g[at + j]) * E<S>::get(w[j]);
        m1 += gw;
        m2 += gw * xh;
    }
    m1 = block_sum(m1, red) / (C)width;
    m2 = block_sum(m2, red) / (C)width;
    for (int j = threadIdx.x; j < width; j += blockDim.x) {
        const C xh = (E<S>::get(x[at + j]) - mean) * rstd;
        const C gj = E<S>::get(g[at + j]);
        C d = rstd * (gj * E<S>::get(w[j]) - m1 - xh * m2);
        if (add) d += E<S>::get(add[at + j]);
        params[2 * at + j] = E<S>::put(gj * xh);
        params[2 * at + width + j] = E<S>::put(gj);
        if (mask) masked[at + j] = E<S>::put(d * E<S>::get(mask[at + j]));
        out[at + j] = E<S>::put(d);
    }
}

// act(u + bias) in place and its derivative; act 0 = GELU (erf), 1 = ReLU.
template <typename S>
__device__ void bias_act(S* u, const S* bias, S* grad, i64 rows, int width, int act) {
    typedef typename E<S>::C C;
    const C inv_sqrt2 = (C)0.70710678118654752440, inv_sqrt_2pi = (C)0.39894228040143267794;
    GRID_STRIDE(i, rows * width) {
        const C x = E<S>::get(u[i]) + E<S>::get(bias[i % width]);
        C a, d;
        if (act == 0) {
            const C cdf = (C)0.5 * ((C)1 + er(x * inv_sqrt2));
            const C pdf = inv_sqrt_2pi * ex((C)-0.5 * x * x);
            a = x * cdf;
            d = cdf + x * pdf;
        } else {
            a = x > (C)0 ? x : (C)0;
            d = x > (C)0 ? (C)1 : (C)0;
        }
        u[i] = E<S>::put(a);
        grad[i] = E<S>::put(d);
    }
}

// Between projections (n, 3d) and heads (3, b, h, t, dh): forward (back = 0) reads the
// projection row plus its bias and writes the head row, q and k rotated; back (1) reads the head
// row and writes the projection row, q and k rotated back. One thread per value.
template <typename S, typename I>
__device__ void heads_at(const S* src, const S* bias, const typename E<S>::C* cos_t,
                      const typename E<S>::C* sin_t, S* out, int b, int t, int h, int dh,
                      int rope_rows, int rope_width, int interleaved, int back) {
    typedef typename E<S>::C C;
    const int d = h * dh;
    const I per = (I)b * h * t * dh;
    for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < 3 * per; i += (I)gridDim.x * blockDim.x) {
        // the head row (which, bi, hd, ti) and the value c in it
        const I hrow = i / dh;
        const int c = (int)(i - hrow * dh);
        const int ti = (int)(hrow % t);
        const I bh = hrow / t;
        const int hd = (int)(bh % h);
        const I wb = bh / h;
        const int bi = (int)(wb % b), which = (int)(wb / b);
        const I token = ((I)bi * t + ti) * 3 * d + which * d + hd * dh;
        const I head = i - c;  // start of this head row
        const I from = back ? head : token, to = back ? token : head;
        const int col = which * d + hd * dh;
        // value j of the source row (the bias added going forward)
#define VAL(j) (E<S>::get(src[from + (j)]) + (back || !bias ? (C)0 : E<S>::get(bias[col + (j)])))
        C y;
        if (which < 2 && cos_t && c < rope_width) {
            const int half = rope_width / 2;
            int ia, ib, it, first;
            if (interleaved) {
                it = c & ~1;
                ia = it;
                ib = it + 1;
                first = (c & 1) == 0;
            } else {
                first = c < half;
                it = first ? c : c - half;
                ia = it;
                ib = it + half;
            }
            const I row = rope_rows == 1 ? (I)ti : (I)bi * t + ti;
            // forward rounds the biased value to S before rotating, as the twin does
            C a = VAL(ia), bb = VAL(ib);
            if (!back) {
                a = E<S>::get(E<S>::put(a));
                bb = E<S>::get(E<S>::put(bb));
            }
            const C co = cos_t[row * rope_width + it];
            const C si = (back ? (C)-1 : (C)1) * sin_t[row * rope_width + it];
            y = first ? a * co - bb * si : bb * co + a * si;
        } else {
            y = VAL(c);
        }
#undef VAL
        out[to + c] = E<S>::put(y);
    }
}

// Index arithmetic in 32 bits where every index fits (integer division of 64-bit values takes
// several times the instructions), else in 64.
template <typename S>
__device__ void heads(const S* src, const S* bias, const typename E<S>::C* cos_t,
                      const typename E<S>::C* sin_t, S* out, int b, int t, int h, int dh,
                      int rope_rows, int rope_width, int interleaved, int back) {
    if (3 * (i64)b * h * t * dh < (i64)0x7fffffff - (i64)gridDim.x * blockDim.x)
        heads_at<S, int>(src, bias, cos_t, sin_t, out, b, t, h, dh, rope_rows, rope_width,
                         interleaved, back);
    else
        heads_at<S, i64>(src, bias, cos_t, sin_t, out, b, t, h, dh, rope_rows, rope_width,
                         interleaved, back);
}

// (A, B, C, D) to (A, C, B, D); one thread per value.
template <typename S, typename I>
__device__ void transpose12_at(const S* x, S* out, I A, I B, I Cn, I D) {
    for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < A * B * Cn * D; i += (I)gridDim.x * blockDim.x) {
        I rest = i / D;
        const I dd = i - rest * D;
        I next = rest / Cn;
        const I c = rest - next * Cn;
        rest = next / B;
        const I bb = next - rest * B, a = rest;
        out[((a * Cn + c) * B + bb) * D + dd] = x[i];
    }
}

// In 32 bits where every index fits (see heads).
template <typename S> __device__ void transpose12(const S* x, S* out, i64 A, i64 B, i64 Cn, i64 D) {
    if (A * B * Cn * D < (i64)0x7fffffff - (i64)gridDim.x * blockDim.x)
        transpose12_at<S, int>(x, out, (int)A, (int)B, (int)Cn, (int)D);
    else
        transpose12_at<S, i64>(x, out, A, B, Cn, D);
}

// The score of key j in row (bi, hd, i): scores plus bias, window and key bias. The window
// hides keys more than `before` tokens before the query or `after` after it (-1: no limit).
template <typename S>
__device__ typename E<S>::C biased(const S* row, int j, int i, int bi, int hd, int h, int t,
                                   const typename E<S>::C* key_bias, int bias_kind,
                                   const typename E<S>::C* bias, int bias_rows, int before, int after,
                                   i64 half) {
    typedef typename E<S>::C C;
    C v = E<S>::get(row[j]);
    if (bias_kind == 1) {
        const int block = bias_rows == 1 ? 0 : bi;
        v += bias[(((i64)block * h + hd) * t + i) * t + j];
    } else if (bias_kind == 2) {
        const i64 at = ((i64)bi * h + hd) * t;
        v += j <= i ? bias[at + i] - bias[at + j] : bias[half + at + j] - bias[half + at + i];
    }
    if (j > i ? (after >= 0 && j - i > after) : (before >= 0 && i - j > before)) v += (C)MASKED;
    return v + key_bias[(i64)bi * t + j];
}

// Softmax of every row of scores in place; P ⊙ M into pm with a mask. One block per row.
// bias_kind: 0 none, 1 a (bias_rows, h, t, t) table, 2 running sums (2, b, h, t).
template <typename S>
__device__ void softmax(S* sp, const typename E<S>::C* key_bias, int bias_kind,
                        const typename E<S>::C* bias, int bias_rows, int before, int after, const S* mask,
                        S* pm, int b, int h, int t) {
    typedef typename E<S>::C C;
    __shared__ C red[32];
    const i64 r = blockIdx.x;
    if (r >= (i64)b * h * t) return;
    const int i = (int)(r % t);
    const i64 bh = r / t;
    const int bi = (int)(bh / h), hd = (int)(bh % h);
    S* row = sp + r * t;
    const i64 half = (i64)b * h * t;
    C m = neg_inf<C>();
    for (int j = threadIdx.x; j < t; j += blockDim.x)
        m = mx(m, biased(row, j, i, bi, hd, h, t, key_bias, bias_kind, bias, bias_rows, before, after, half));
    m = block_max(m, red);
    C s = 0;
    for (int j = threadIdx.x; j < t; j += blockDim.x)
        s += ex(biased(row, j, i, bi, hd, h, t, key_bias, bias_kind, bias, bias_rows, before, after, half) - m);
    s = block_sum(s, red);  // (its barriers order every read of the row before the writes below)
    for (int j = threadIdx.x; j < t; j += blockDim.x) {
        const C e = ex(biased(row, j, i, bi, hd, h, t, key_bias, bias_kind, bias, bias_rows, before, after, half) - m);
        const S p = E<S>::put(e / s);
        if (mask) pm[r * t + j] = E<S>::put(E<S>::get(p) * E<S>::get(mask[r * t + j]));
        row[j] = p;
    }
}

// Rows of at most 32 ROW_VALUES keys (1024): the softmax above with one warp per row (each
// launch's block holds blockDim.x / 32 rows), every score read once into registers and every
// weight written once, the row's maximum and sum reduced across the warp in a fixed order (no
// barrier). Where the block kernel reads a row three times, this one reads it once.
#define ROW_VALUES 32
template <typename S>
__device__ void softmax_rows(S* sp, const typename E<S>::C* key_bias, int bias_kind,
                             const typename E<S>::C* bias, int bias_rows, int before, int after,
                             const S* mask, S* pm, int b, int h, int t) {
    typedef typename E<S>::C C;
    const int lane = threadIdx.x & 31;
    const i64 r = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= (i64)b * h * t) return;  // the whole warp: r is the warp's
    const int i = (int)(r % t);
    const i64 bh = r / t;
    const int bi = (int)(bh / h), hd = (int)(bh % h);
    S* row = sp + r * t;
    const i64 half = (i64)b * h * t;
    C v[ROW_VALUES];
    C m = neg_inf<C>();
#pragma unroll
    for (int k = 0; k < ROW_VALUES; ++k) {
        const int j = lane + 32 * k;
        v[k] = j < t ? biased(row, j, i, bi, hd, h, t, key_bias, bias_kind, bias, bias_rows, before, after,
                              half)
                     : neg_inf<C>();
        m = mx(m, v[k]);
    }
    m = warp_max(m);
    C s = 0;
#pragma unroll
    for (int k = 0; k < ROW_VALUES; ++k) {
        if (lane + 32 * k < t) {
            v[k] = ex(v[k] - m);
            s += v[k];
        }
    }
    s = warp_sum(s);
#pragma unroll
    for (int k = 0; k < ROW_VALUES; ++k) {
        const int j = lane + 32 * k;
        if (j < t) {
            const S p = E<S>::put(v[k] / s);
            if (mask) pm[r * t + j] = E<S>::put(E<S>::get(p) * E<S>::get(mask[r * t + j]));
            row[j] = p;
        }
    }
}

// softmax_back below for rows of at most 32 ROW_VALUES: one warp per row, P and dP read once.
template <typename S>
__device__ void softmax_back_rows(const S* p, S* dp, const S* mask, i64 rows, int t) {
    typedef typename E<S>::C C;
    const int lane = threadIdx.x & 31;
    const i64 r = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= rows) return;
    const i64 at = r * t;
    C pv[ROW_VALUES], gv[ROW_VALUES];
    C s = 0;
#pragma unroll
    for (int k = 0; k < ROW_VALUES; ++k) {
        const int j = lane + 32 * k;
        if (j < t) {
            C g = E<S>::get(dp[at + j]);
            if (mask) g *= E<S>::get(mask[at + j]);
            pv[k] = E<S>::get(p[at + j]);
            gv[k] = g;
            s += g * pv[k];
        }
    }
    s = warp_sum(s);
#pragma unroll
    for (int k = 0; k < ROW_VALUES; ++k) {
        const int j = lane + 32 * k;
        if (j < t) dp[at + j] = E<S>::put(pv[k] * (gv[k] - s));
    }
}

// dS = P ⊙ (dP' - rowsum(dP' ⊙ P)), dP' = dP ⊙ M, in place of dp. One block per row.
template <typename S>
__device__ void softmax_back(const S* p, S* dp, const S* mask, i64 rows, int t) {
    typedef typename E<S>::C C;
    __shared__ C red[32];
    const i64 r = blockIdx.x;
    if (r >= rows) return;
    const i64 at = r * t;
    C s = 0;
    for (int j = threadIdx.x; j < t; j += blockDim.x) {
        C g = E<S>::get(dp[at + j]);
        if (mask) g *= E<S>::get(mask[at + j]);
        s += g * E<S>::get(p[at + j]);
    }
    s = block_sum(s, red);
    for (int j = threadIdx.x; j < t; j += blockDim.x) {
        C g = E<S>::get(dp[at + j]);
        if (mask) g *= E<S>::get(mask[at + j]);
        dp[at + j] = E<S>::put(E<S>::get(p[at + j]) * (g - s));
    }
}

// The running sums' gradient: df[i] = Σ_{j<=i} dS[i,j] - Σ_{r>=i} dS[r,i],
// dg[i] = Σ_{r<i} dS[r,i] - Σ_{j>i} dS[i,j]. One block per (b h, i).
template <typename S> __device__ void sided_back(const S* ds, S* out, int b, int h, int t) {
    typedef typename E<S>::C C;
    __shared__ C red[32];
    const i64 task = blockIdx.x;
    if (task >= (i64)b * h * t) return;
    const i64 bh = task / t;
    const int i = (int)(task % t);
    const S* block = ds + bh * t * t;
    C row_le = 0, row_gt = 0, col_ge = 0, col_lt = 0;
    for (int j = threadIdx.x; j < t; j += blockDim.x) {
        const C v = E<S>::get(block[(i64)i * t + j]);
        if (j <= i) row_le += v; else row_gt += v;
        const C c = E<S>::get(block[(i64)j * t + i]);
        if (j >= i) col_ge += c; else col_lt += c;
    }
    row_le = block_sum(row_le, red);
    row_gt = block_sum(row_gt, red);
    col_ge = block_sum(col_ge, red);
    col_lt = block_sum(col_lt, red);
    if (threadIdx.x == 0) {
        out[bh * t + i] = E<S>::put(row_le - col_ge);
        out[(i64)b * h * t + bh * t + i] = E<S>::put(col_lt - row_gt);
    }
}

// FoX's gates: running sums along the tokens of log σ(z + bias) into sums (2, b, h, t), or
// (back) dz = σ(-(z + bias)) times the sums' gradient summed from each token to the last. One
// thread per (batch element, channel), along the tokens in order.
template <typename S>
__device__ void gates(const S* z, const S* bias, typename E<S>::C* sums, const S* dsums, S* dz,
                      int b, int t, int h, int back) {
    typedef typename E<S>::C C;
    const int width = 2 * h;
    const i64 task = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (task >= (i64)b * width) return;
    const int bi = (int)(task / width), ch = (int)(task % width);
    const int s = ch / h, c = ch % h;
    const i64 at = (((i64)s * b + bi) * h + c) * t;
    const C bch = E<S>::get(bias[ch]);
    C acc = 0;
    if (!back) {
        for (int j = 0; j < t; ++j) {
            const C x = E<S>::get(z[((i64)bi * t + j) * width + ch]) + bch;
            const C u = ex(-(x < (C)0 ? -x : x));
            acc += -((x < (C)0 ? -x : (C)0) + l1p(u));
            sums[at + j] = acc;
        }
    } else {
        for (int j = t - 1; j >= 0; --j) {
            const C x = E<S>::get(z[((i64)bi * t + j) * width + ch]) + bch;
            const C u = ex(-(x < (C)0 ? -x : x));
            const C inv = (C)1 / ((C)1 + u);
            acc += E<S>::get(dsums[at + j]);
            dz[((i64)bi * t + j) * width + ch] = E<S>::put(acc * (x >= (C)0 ? u * inv : inv));
        }
    }
}

// f64::MAX in C, as Rust's `as` converts it: f32's is infinite.
template <typename C> __device__ C f64_max();
template <> __device__ double f64_max<double>() { return 1.7976931348623157e308; }
template <> __device__ float f64_max<float>() { return __int_as_float(0x7f800000); }

// AdamW over many variables in one launch. `parts` holds 7 values per variable: the addresses of
// its weights, gradient, m and v, its length, and the bits of its decay factor and of its lower
// bound (doubles; the bound NaN where there is none); `chunks` 2 per block: the variable, and
// the first value of the block's ADAMW_CHUNK.
#define ADAMW_CHUNK 65536
template <typename S>
__device__ void adamw(const unsigned long long* parts, const unsigned long long* chunks, double b1,
                      double b2, double eps, double bias1, double bias2, double lr, double scale) {
    typedef typename E<S>::C C;
    const unsigned long long* ch = chunks + 2 * (i64)blockIdx.x;
    const unsigned long long* p = parts + 7 * ch[0];
    S* w = (S*)p[0];
    const S* g = (const S*)p[1];
    S* m = (S*)p[2];
    S* v = (S*)p[3];
    const i64 n = (i64)p[4];
    const double keep_d = __longlong_as_double((long long)p[5]);
    // The lower bound (NaN: none), applied as candle's clamp(lower, f64::MAX) in C.
    const double lower_d = __longlong_as_double((long long)p[6]);
    const bool bounded = lower_d == lower_d;
    const C lower = (C)lower_d, high = f64_max<C>();
    const i64 start = (i64)ch[1];
    const i64 end = start + ADAMW_CHUNK < n ? start + ADAMW_CHUNK : n;
    const C cb1 = (C)b1, cb2 = (C)b2, c1 = (C)(1.0 - b1), c2 = (C)(1.0 - b2), s = (C)scale;
    const C clr = (C)lr, keep = (C)keep_d, ceps = (C)eps, cbias1 = (C)bias1, cbias2 = (C)bias2;
    for (i64 i = start + threadIdx.x; i < end; i += blockDim.x) {
        C gi = E<S>::get(g[i]);
        if (scale != 1.0) gi = gi * s;
        const C mi = E<S>::get(m[i]) * cb1 + gi * c1;
        const C vi = E<S>::get(v[i]) * cb2 + gi * gi * c2;
        const C update = (mi / cbias1) / (sq(vi / cbias2) + ceps);
        const C wi = keep_d != 1.0 ? E<S>::get(w[i]) * keep : E<S>::get(w[i]);
        C wn = wi - update * clr;
        if (bounded) {
            wn = wn < lower ? lower : wn;
            wn = wn > high ? high : wn;
        }
        m[i] = E<S>::put(mi);
        v[i] = E<S>::put(vi);
        w[i] = E<S>::put(wn);
    }
}

// The sum of squares of many variables (the gradient norm), in double: `parts` holds 2 values
// per variable (its address and length), `chunks` 2 per block (the variable, and the first value
// of the block's ADAMW_CHUNK); each block writes its chunk's sum to sums[blockIdx.x], in a fixed
// order (each thread's strided values in turn, then the block's tree).
template <typename S>
__device__ void sum_squares(const unsigned long long* parts, const unsigned long long* chunks,
                            double* sums) {
    __shared__ double red[32];
    const unsigned long long* ch = chunks + 2 * (i64)blockIdx.x;
    const unsigned long long* p = parts + 2 * ch[0];
    const S* g = (const S*)p[0];
    const i64 n = (i64)p[1];
    const i64 start = (i64)ch[1];
    const i64 end = start + ADAMW_CHUNK < n ? start + ADAMW_CHUNK : n;
    double acc = 0;
    for (i64 i = start + threadIdx.x; i < end; i += blockDim.x) {
        const double v = (double)E<S>::get(g[i]);
        acc += v * v;
    }
    acc = block_sum(acc, red);
    if (threadIdx.x == 0) sums[blockIdx.x] = acc;
}

// The token embedding's gradient: out[v, :] = Σ_{i : ids[i] = v} g[i, :] over the n tokens in
// their order, in the compute type, every row of out written (zeros where no token has the id).
// No atomics: the same bits launch after launch. Block (x: EMB_BYTES / (blockDim.x sizeof(C))
// rows of the table, y: blockDim.x columns), one column a thread, the rows' sums in shared
// memory. Each warp reads the ids 32 at a time and keeps, by ballot, those in its block's rows.
#define EMB_BYTES 32768
template <typename S>
__device__ void embedding_back(const unsigned int* ids, const S* g, S* out, i64 n, int vocab,
                               int d) {
    typedef typename E<S>::C C;
    __shared__ __align__(16) unsigned char raw[EMB_BYTES];
    C* acc = (C*)raw;
    const int rows = EMB_BYTES / (blockDim.x * (int)sizeof(C));
    const unsigned int v0 = blockIdx.x * (unsigned int)rows;
    const int col = blockIdx.y * blockDim.x + threadIdx.x;
    const int lane = threadIdx.x & 31;
    for (int r = 0; r < rows; ++r) acc[r * blockDim.x + threadIdx.x] = (C)0;
    for (i64 base = 0; base < n; base += 32) {
        const i64 i = base + lane;
        const unsigned int id = i < n ? ids[i] : 0xffffffffu;
        const unsigned int rel = id - v0;  // wraps above rows where id < v0
        unsigned int hit = __ballot_sync(0xffffffffu, i < n && rel < (unsigned int)rows);
        while (hit) {
            const int k = __ffs(hit) - 1;
            hit &= hit - 1;
            const int r = __shfl_sync(0xffffffffu, (int)rel, k);
            if (col < d) acc[r * blockDim.x + threadIdx.x] += E<S>::get(g[(base + k) * d + col]);
        }
    }
    if (col < d)
        for (int r = 0; r < rows && v0 + r < (unsigned int)vocab; ++r)
            out[(i64)(v0 + r) * d + col] = E<S>::put(acc[r * blockDim.x + threadIdx.x]);
}

// The task head's pooling: the mean over each sequence's real tokens (mask 1), x (b, t, d) to
// out (b, d), summed in token order; back: the gradient, x (b, d) to out (b, t, d). One thread
// per (sequence, column).
template <typename S>
__device__ void pool_mean(const S* x, const unsigned int* mask, S* out, int b, int t, int d,
                          int back) {
    typedef typename E<S>::C C;
    GRID_STRIDE(i, (i64)b * d) {
        const i64 s = i / d, c = i - s * d;
        const unsigned int* m = mask + s * t;
        C count = 0;
        for (int j = 0; j < t; ++j) count += (C)m[j];
        if (back) {
            const C g = E<S>::get(x[i]);
            for (int j = 0; j < t; ++j) out[(s * t + j) * d + c] = E<S>::put(g / count * (C)m[j]);
        } else {
            C acc = 0;
            for (int j = 0; j < t; ++j) acc += E<S>::get(x[(s * t + j) * d + c]) * (C)m[j];
            out[i] = E<S>::put(acc / count);
        }
    }
}

// A cross-entropy's rows, one block per row: logits += bias (stored), lse = log Σ exp, and
// nll = lse - logits[target] (NaN for a target that is not a class).
template <typename S>
__device__ void xent(S* logits, const S* bias, const unsigned int* targets, typename E<S>::C* lse,
                     S* nll, i64 rows, int classes) {
    typedef typename E<S>::C C;
    __shared__ C red[32];
    const i64 r = blockIdx.x;
    if (r >= rows) return;
    S* row = logits + r * classes;
    C m = neg_inf<C>();
    for (int j = threadIdx.x; j < classes; j += blockDim.x) {
        row[j] = E<S>::put(E<S>::get(row[j]) + E<S>::get(bias[j]));
        m = mx(m, E<S>::get(row[j]));
    }
    m = block_max(m, red);
    C sum = 0;
    for (int j = threadIdx.x; j < classes; j += blockDim.x) sum += ex(E<S>::get(row[j]) - m);
    sum = block_sum(sum, red);
    if (threadIdx.x == 0) {
        const C l = m + lg(sum);
        const unsigned int target = targets[r];
        lse[r] = l;
        nll[r] = E<S>::put(target < (unsigned int)classes ? l - E<S>::get(row[target])
                                                          : quiet_nan<C>());
    }
}

// out[0] = scale Σ w[i] x[i] (w all 1 when null), in one block.
template <typename S>
__device__ void weighted_sum(const S* x, const float* w, double scale, S* out, i64 n) {
    typedef typename E<S>::C C;
    __shared__ C red[32];
    C sum = 0;
    for (i64 i = threadIdx.x; i < n; i += blockDim.x) {
        const C v = E<S>::get(x[i]);
        sum += w ? v * (C)w[i] : v;
    }
    sum = block_sum(sum, red);
    if (threadIdx.x == 0) out[0] = E<S>::put(sum * (C)scale);
}

// The cross-entropy's backward in place of the logits:
// logits = g[0] scale w[r] (exp(logits - lse[r]) - [j = target[r]]).
template <typename S>
__device__ void xent_back(S* logits, const typename E<S>::C* lse, const unsigned int* targets,
                          const float* w, const S* g, double scale, i64 rows, int classes) {
    typedef typename E<S>::C C;
    const C k = E<S>::get(g[0]) * (C)scale;
    GRID_STRIDE(i, rows * classes) {
        const i64 r = i / classes;
        const unsigned int j = (unsigned int)(i - r * classes);
        C p = ex(E<S>::get(logits[i]) - lse[r]);
        if (j == targets[r]) p -= (C)1;
        logits[i] = E<S>::put((w ? k * (C)w[r] : k) * p);
    }
}

// ---------------------------------------------------------------------------------------------
// The exported kernels, one per storage type.

#define KERNELS(N, S)                                                                              \
    extern "C" __global__ void fill_##N(S* out, double value, i64 n) { fill<S>(out, value, n); } \
    extern "C" __global__ void mul_##N(const S* x, const S* m, S* out, i64 n) {                    \
        mul<S>(x, m, out, n);                                                                      \
    }                                                                                              \
    extern "C" __global__ void dropout_mask_##N(S* out, unsigned long long seed,                  \
                                                unsigned long long threshold, double scale,        \
                                                i64 n) {                                           \
        dropout_mask<S>(out, seed, threshold, scale, n);                                           \
    }                                                                                              \
    extern "C" __global__ void layer_norm_##N(const S* x, const S* w, const S* b, double eps,     \
                                              S* y, E<S>::C* stats, i64 rows, int width) {         \
        layer_norm<S>(x, w, b, eps, y, stats, rows, width);                                        \
    }                                                                                              \
    extern "C" __global__ void residual_##N(const S* res, const S* z, const S* bias,              \
                                            const S* mask, S* sum, const S* w, const S* b,         \
                                            double eps, S* out, E<S>::C* stats, i64 rows,          \
                                            int width) {                                           \
        residual<S>(res, z, bias, mask, sum, w, b, eps, out, stats, rows, width);                  \
    }                                                                                              \
    extern "C" __global__ void norm_back_##N(const S* x, const E<S>::C* stats, const S* w,        \
                                             const S* g, const S* add, S* out, const S* mask,      \
                                             S* masked, S* params, i64 rows, int width) {          \
        norm_back<S>(x, stats, w, g, add, out, mask, masked, params, rows, width);                 \
    }                                                                                              \
    extern "C" __global__ void bias_act_##N(S* u, const S* bias, S* grad, i64 rows, int width,    \
                                            int act) {                                             \
        bias_act<S>(u, bias, grad, rows, width, act);                                              \
    }                                                                                              \
    extern "C" __global__ void heads_##N(const S* src, const S* bias, const E<S>::C* cos_t,       \
                                         const E<S>::C* sin_t, S* out, int b, int t, int h,        \
                                         int dh, int rope_rows, int rope_width, int interleaved,   \
                                         int back) {                                               \
        heads<S>(src, bias, cos_t, sin_t, out, b, t, h, dh, rope_rows, rope_width, interleaved,    \
                 back);                                                                            \
    }                                                                                              \
    extern "C" __global__ void transpose12_##N(const S* x, S* out, i64 a, i64 b, i64 c, i64 d) {  \
        transpose12<S>(x, out, a, b, c, d);                                                        \
    }                                                                                              \
    extern "C" __global__ void softmax_##N(S* sp, const E<S>::C* key_bias, int bias_kind,         \
                                           const E<S>::C* bias, int bias_rows, int before, int after,         \
                                           const S* mask, S* pm, int b, int h, int t) {            \
        softmax<S>(sp, key_bias, bias_kind, bias, bias_rows, before, after, mask, pm, b, h, t);           \
    }                                                                                              \
    extern "C" __global__ void softmax_rows_##N(S* sp, const E<S>::C* key_bias, int bias_kind,    \
                                                const E<S>::C* bias, int bias_rows, int before, int after,    \
                                                const S* mask, S* pm, int b, int h, int t) {       \
        softmax_rows<S>(sp, key_bias, bias_kind, bias, bias_rows, before, after, mask, pm, b, h, t);      \
    }                                                                                              \
    extern "C" __global__ void softmax_back_rows_##N(const S* p, S* dp, const S* mask, i64 rows,  \
                                                     int t) {                                      \
        softmax_back_rows<S>(p, dp, mask, rows, t);                                                \
    }                                                                                              \
    extern "C" __global__ void embedding_back_##N(const unsigned int* ids, const S* g, S* out,     \
                                                  i64 n, int vocab, int d) {                       \
        embedding_back<S>(ids, g, out, n, vocab, d);                                               \
    }                                                                                              \
    extern "C" __global__ void pool_mean_##N(const S* x, const unsigned int* mask, S* out, int b,  \
                                             int t, int d, int back) {                             \
        pool_mean<S>(x, mask, out, b, t, d, back);                                                 \
    }                                                                                              \
    extern "C" __global__ void xent_##N(S* logits, const S* bias, const unsigned int* targets,     \
                                        E<S>::C* lse, S* nll, i64 rows, int classes) {             \
        xent<S>(logits, bias, targets, lse, nll, rows, classes);                                   \
    }                                                                                              \
    extern "C" __global__ void weighted_sum_##N(const S* x, const float* w, double scale, S* out,  \
                                                i64 n) {                                           \
        weighted_sum<S>(x, w, scale, out, n);                                                      \
    }                                                                                              \
    extern "C" __global__ void xent_back_##N(S* logits, const E<S>::C* lse,                       \
                                             const unsigned int* targets, const float* w,          \
                                             const S* g, double scale, i64 rows, int classes) {    \
        xent_back<S>(logits, lse, targets, w, g, scale, rows, classes);                            \
    }                                                                                              \
    extern "C" __global__ void sum_squares_##N(const unsigned long long* parts,                    \
                                               const unsigned long long* chunks, double* sums) {   \
        sum_squares<S>(parts, chunks, sums);                                                       \
    }                                                                                              \
    extern "C" __global__ void softmax_back_##N(const S* p, S* dp, const S* mask, i64 rows,       \
                                                int t) {                                           \
        softmax_back<S>(p, dp, mask, rows, t);                                                     \
    }                                                                                              \
    extern "C" __global__ void sided_back_##N(const S* ds, S* out, int b, int h, int t) {         \
        sided_back<S>(ds, out, b, h, t);                                                           \
    }                                                                                              \
    extern "C" __global__ void gates_##N(const S* z, const S* bias, E<S>::C* sums,               \
                                         const S* dsums, S* dz, int b, int t, int h, int back) {   \
        gates<S>(z, bias, sums, dsums, dz, b, t, h, back);                                         \
    }                                                                                              \
    extern "C" __global__ void adamw_##N(const unsigned long long* parts,                          \
                                         const unsigned long long* chunks, double b1, double b2,   \
                                         double eps, double bias1, double bias2, double lr,        \
                                         double scale) {                                           \
        adamw<S>(parts, chunks, b1, b2, eps, bias1, bias2, lr, scale);                             \
    }

KERNELS(f64, double)
KERNELS(f32, float)
KERNELS(bf16, bf16_t)
KERNELS(f16, f16_t)

#define CONVERT(A, SA, B, SB)                                                                      \
    extern "C" __global__ void convert_##A##_##B(const SA* x, SB* out, i64 n) {                   \
        convert<SA, SB>(x, out, n);                                                                \
    }
#define CONVERT_FROM(A, SA)                                                                        \
    CONVERT(A, SA, f64, double)                                                                    \
    CONVERT(A, SA, f32, float)                                                                     \
    CONVERT(A, SA, bf16, bf16_t)                                                                   \
    CONVERT(A, SA, f16, f16_t)
CONVERT_FROM(f64, double)
CONVERT_FROM(f32, float)
CONVERT_FROM(bf16, bf16_t)
CONVERT_FROM(f16, f16_t)
