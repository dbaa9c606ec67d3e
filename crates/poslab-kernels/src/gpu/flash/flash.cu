// The fused attention on CUDA (flash.rs is its specification and CPU twin): compiled by NVRTC
// after kernels.cu, as a program of its own, so that it can fail alone. No `t x t` tensor:
// tiles of keys (or queries) in shared memory, an online softmax, and a backward that
// recomputes each weight from the rows' statistics.
//
// Correctness first, as written without a GPU: one thread a query row (the forward, dq) or a
// key row (dk, dv), and every sum in a fixed order, no atomics, so that the same inputs give the
// same bits. The bias's gradient by offset has a kernel of its own, one block an (offset,
// head), which recomputes the weights it sums.
//
// Layouts: q, k, v, dq, dk, dv (b, h, t, dh); the output and its gradient the heads side by
// side (b, t, h dh); the rows' statistics (2, b, h, t) in the compute dtype, m then l; the key
// bias (b, t); a bias by offset (h, 2t - 1); running sums (2, b, h, t).

// Query (or key) rows of a block, one a thread.
#define FQ 64
// Keys (or queries) of a tile in shared memory.
#define FK 16
// The widest head.
#define FDH 128

// The score bias of query i and key j: 1 by offset, 2 running sums (f before, g after).
template <typename C>
__device__ C flash_bias(int kind, const C* bias, int i, int j, int hd, i64 bh, int t, i64 half) {
    if (kind == 1) return bias[(i64)hd * (2 * t - 1) + j - i + t - 1];
    if (kind == 2) {
        const i64 at = bh * t;
        return j <= i ? bias[at + i] - bias[at + j] : bias[half + at + j] - bias[half + at + i];
    }
    return (C)0;
}

__device__ bool flash_hides(int i, int j, int before, int after) {
    return j > i ? (after >= 0 && j - i > after) : (before >= 0 && i - j > before);
}

// Everything the scores and the weights read besides q, k and v.
template <typename C> struct FlashArgs {
    double scale;
    const C* key_bias;
    int kind;
    const C* bias;
    int before, after;
    int dropout;
    unsigned long long seed, threshold;
    double keep;
    int b, h, t, dh;
};

// The score of query i (its row `qi`, compute dtype) and key j (`kj`), everything added, in
// flash.rs's order: c q.k + key bias, then the bias, then the window.
template <typename C>
__device__ C flash_score(const FlashArgs<C>& a, const C* qi, const C* kj, int i, int j, int bi,
                         int hd, i64 bh) {
    C dot = 0;
    for (int d = 0; d < a.dh; ++d) dot += qi[d] * kj[d];
    C s = (C)a.scale * dot + a.key_bias[(i64)bi * a.t + j];
    s += flash_bias<C>(a.kind, a.bias, i, j, hd, bh, a.t, (i64)a.b * a.h * a.t);
    if (flash_hides(i, j, a.before, a.after)) s += (C)MASKED;
    return s;
}

// The dropout's multiplier of query i and key j (1 without dropout).
template <typename C> __device__ C flash_kept(const FlashArgs<C>& a, i64 bh, int i, int j) {
    if (!a.dropout) return (C)1;
    const unsigned long long index =
        ((unsigned long long)bh * a.t + (unsigned long long)i) * a.t + (unsigned long long)j;
    return (unsigned long long)dropout_bits(a.seed, index) >= a.threshold ? (C)a.keep : (C)0;
}

// A row whose largest score is m saw only masked keys.
template <typename C> __device__ bool flash_dead(C m) { return m < (C)(MASKED / 2); }

// The keys the queries [i0, i1) may see: [lo, hi).
__device__ void flash_keys(int i0, int i1, int before, int after, int t, int* lo, int* hi) {
    *lo = before >= 0 ? max(0, i0 - before) : 0;
    *hi = after >= 0 ? min(t, i1 - 1 + after + 1) : t;
    if (*hi < *lo) *hi = *lo;
}

// The queries that may see a key of [j0, j1): [lo, hi).
__device__ void flash_queries(int j0, int j1, int before, int after, int t, int* lo, int* hi) {
    *lo = after >= 0 ? max(0, j0 - after) : 0;
    *hi = before >= 0 ? min(t, j1 - 1 + before + 1) : t;
    if (*hi < *lo) *hi = *lo;
}

// Rows [r0, r0 + FK) of x (b, h, t, dh) of (batch, head) bh into shared `out` (FK x dh).
template <typename S>
__device__ void flash_load(const S* x, i64 bh, int r0, int t, int dh, typename E<S>::C* out) {
    for (int e = threadIdx.x; e < FK * dh; e += blockDim.x) {
        const int r = r0 + e / dh;
        out[e] = r < t ? E<S>::get(x[(bh * t + r) * dh + e % dh]) : (typename E<S>::C)0;
    }
}

// Where row i of (batch, head) bh starts in a tensor of the heads side by side.
__device__ i64 flash_token_row(i64 bh, int i, int h, int t, int dh) {
    const i64 bi = bh / h, hd = bh % h;
    return ((bi * t + i) * h + hd) * dh;
}

// One tile of keys [j0, j0 + FK) in the forward: the online softmax's update of row i.
template <typename C>
__device__ void flash_fwd_tile(const FlashArgs<C>& a, const C* qi, const C* ks, const C* vs,
                               int j0, int i, int bi, int hd, i64 bh, C* m, C* l, C* acc) {
    C s[FK];
    C top = *m;
    for (int x = 0; x < FK; ++x) {
        const int j = j0 + x;
        if (j < a.t) {
            s[x] = flash_score<C>(a, qi, ks + x * a.dh, i, j, bi, hd, bh);
            top = mx(top, s[x]);
        }
    }
    const C rescale = ex(*m - top);
    for (int d = 0; d < a.dh; ++d) acc[d] *= rescale;
    *l *= rescale;
    for (int x = 0; x < FK; ++x) {
        const int j = j0 + x;
        if (j < a.t) {
            C p = ex(s[x] - top);
            *l += p;
            p *= flash_kept<C>(a, bh, i, j);
            for (int d = 0; d < a.dh; ++d) acc[d] += p * vs[x * a.dh + d];
        }
    }
    *m = top;
}

// The forward: grid (b h, query blocks), FQ threads. `out` (b, t, h dh), `stats` (2, b, h, t).
template <typename S>
__device__ void flash_fwd(const S* q, const S* k, const S* v, FlashArgs<typename E<S>::C> a,
                          S* out, typename E<S>::C* stats) {
    typedef typename E<S>::C C;
    __shared__ C ks[FK * FDH];
    __shared__ C vs[FK * FDH];
    const i64 bh = blockIdx.x;
    const int bi = (int)(bh / a.h), hd = (int)(bh % a.h);
    const int i0 = blockIdx.y * FQ, i1 = min(a.t, i0 + FQ);
    const int i = i0 + threadIdx.x;
    const bool row = i < a.t;
    C qi[FDH], acc[FDH];
    for (int d = 0; d < a.dh; ++d) {
        qi[d] = row ? E<S>::get(q[(bh * a.t + i) * a.dh + d]) : (C)0;
        acc[d] = 0;
    }
    C m = neg_inf<C>(), l = 0;
    int lo, hi;
    flash_keys(i0, i1, a.before, a.after, a.t, &lo, &hi);
    const int first = lo / FK * FK, last = (hi + FK - 1) / FK * FK;
    for (int j0 = first; j0 < last; j0 += FK) {
        __syncthreads();
        flash_load<S>(k, bh, j0, a.t, a.dh, ks);
        flash_load<S>(v, bh, j0, a.t, a.dh, vs);
        __syncthreads();
        if (row) flash_fwd_tile<C>(a, qi, ks, vs, j0, i, bi, hd, bh, &m, &l, acc);
    }
    // A row that saw only masked keys spreads its weight over every masked key, as the
    // composition does: its block visits the other tiles too (the other rows' weights there
    // are exactly 0).
    if (__syncthreads_or(row && flash_dead<C>(m))) {
        for (int j0 = 0; j0 < a.t; j0 += FK) {
            if (j0 >= first && j0 < last) continue;
            __syncthreads();
            flash_load<S>(k, bh, j0, a.t, a.dh, ks);
            flash_load<S>(v, bh, j0, a.t, a.dh, vs);
            __syncthreads();
            if (row) flash_fwd_tile<C>(a, qi, ks, vs, j0, i, bi, hd, bh, &m, &l, acc);
        }
    }
    if (!row) return;
    const i64 at = flash_token_row(bh, i, a.h, a.t, a.dh);
    for (int d = 0; d < a.dh; ++d) out[at + d] = E<S>::put(acc[d] / l);
    stats[bh * a.t + i] = m;
    stats[(i64)a.b * a.h * a.t + bh * a.t + i] = l;
}

// D = dO . o of every row (b h t of them), into `dd` (compute dtype).
template <typename S>
__device__ void flash_dd(const S* out, const S* dout, typename E<S>::C* dd, int b, int h, int t,
                         int dh) {
    typedef typename E<S>::C C;
    GRID_STRIDE(r, (i64)b * h * t) {
        const i64 at = flash_token_row(r / t, (int)(r % t), h, t, dh);
        C s = 0;
        for (int d = 0; d < dh; ++d) s += E<S>::get(out[at + d]) * E<S>::get(dout[at + d]);
        dd[r] = s;
    }
}

// The backward by key: grid (b h, key blocks), FQ threads, thread j's dk and dv, and the
// running sums' column parts into `cols` (2, b, h, t) when given: -sum_{i >= j} ds_ij for f
// and sum_{i < j} ds_ij for g.
template <typename S>
__device__ void flash_cols(const S* q, const S* k, const S* v, FlashArgs<typename E<S>::C> a,
                           const S* dout, const typename E<S>::C* stats,
                           const typename E<S>::C* dd, S* dk, S* dv, typename E<S>::C* cols) {
    typedef typename E<S>::C C;
    __shared__ C qs[FK * FDH];
    __shared__ C dos[FK * FDH];
    __shared__ C ms[FK], ls[FK], ds_[FK];
    __shared__ int dead;
    const i64 bh = blockIdx.x;
    const int bi = (int)(bh / a.h), hd = (int)(bh % a.h);
    const int j0 = blockIdx.y * FQ, j1 = min(a.t, j0 + FQ);
    const int j = j0 + threadIdx.x;
    const bool col = j < a.t;
    const i64 n = (i64)a.b * a.h * a.t;
    C kj[FDH], vj[FDH], gk[FDH], gv[FDH];
    for (int d = 0; d < a.dh; ++d) {
        kj[d] = col ? E<S>::get(k[(bh * a.t + j) * a.dh + d]) : (C)0;
        vj[d] = col ? E<S>::get(v[(bh * a.t + j) * a.dh + d]) : (C)0;
        gk[d] = 0;
        gv[d] = 0;
    }
    C part_f = 0, part_g = 0;
    int lo, hi;
    flash_queries(j0, j1, a.before, a.after, a.t, &lo, &hi);
    const int first = lo / FK * FK, last = (hi + FK - 1) / FK * FK;
    for (int r0 = 0; r0 < a.t; r0 += FK) {
        __syncthreads();
        if (threadIdx.x < FK) {
            const int r = r0 + threadIdx.x;
            ms[threadIdx.x] = r < a.t ? stats[bh * a.t + r] : (C)0;
            ls[threadIdx.x] = r < a.t ? stats[n + bh * a.t + r] : (C)1;
            ds_[threadIdx.x] = r < a.t ? dd[bh * a.t + r] : (C)0;
        }
        if (threadIdx.x == 0) dead = 0;
        __syncthreads();
        if (threadIdx.x < FK && r0 + threadIdx.x < a.t && flash_dead<C>(ms[threadIdx.x])) dead = 1;
        __syncthreads();
        // Tiles no query of which sees these keys, nor spreads its weight over every key.
        if ((r0 < first || r0 >= last) && !dead) continue;
        // dO's rows of the tile (side by side), then q's.
        for (int e = threadIdx.x; e < FK * a.dh; e += blockDim.x) {
            const int r = r0 + e / a.dh;
            dos[e] = r < a.t ? E<S>::get(dout[flash_token_row(bh, r, a.h, a.t, a.dh) + e % a.dh])
                             : (C)0;
        }
        flash_load<S>(q, bh, r0, a.t, a.dh, qs);
        __syncthreads();
        if (!col) continue;
        for (int x = 0; x < FK; ++x) {
            const int i = r0 + x;
            if (i >= a.t) break;
            const C* qi = qs + x * a.dh;
            const C* gi = dos + x * a.dh;
            const C p = ex(flash_score<C>(a, qi, kj, i, j, bi, hd, bh) - ms[x]) / ls[x];
            const C mult = flash_kept<C>(a, bh, i, j);
            C dp = 0;
            for (int d = 0; d < a.dh; ++d) dp += gi[d] * vj[d];
            const C ds = p * (dp * mult - ds_[x]);
            const C pm = p * mult;
            for (int d = 0; d < a.dh; ++d) {
                gv[d] += pm * gi[d];
                gk[d] += (C)a.scale * ds * qi[d];
            }
            if (i >= j)
                part_f -= ds;
            else
                part_g += ds;
        }
    }
    if (!col) return;
    for (int d = 0; d < a.dh; ++d) {
        dk[(bh * a.t + j) * a.dh + d] = E<S>::put(gk[d]);
        dv[(bh * a.t + j) * a.dh + d] = E<S>::put(gv[d]);
    }
    if (cols) {
        cols[bh * a.t + j] = part_f;
        cols[n + bh * a.t + j] = part_g;
    }
}

// The backward by query: grid (b h, query blocks), FQ threads, thread i's dq and, with running
// sums, their gradient (2, b, h, t) into `dsums`: the rows' parts (sum_{j <= i} ds_ij for f,
// -sum_{j > i} ds_ij for g) added to the columns' in `cols`.
template <typename S>
__device__ void flash_rows(const S* q, const S* k, const S* v, FlashArgs<typename E<S>::C> a,
                           const S* dout, const typename E<S>::C* stats,
                           const typename E<S>::C* dd, S* dq, const typename E<S>::C* cols,
                           typename E<S>::C* dsums) {
    typedef typename E<S>::C C;
    __shared__ C ks[FK * FDH];
    __shared__ C vs[FK * FDH];
    const i64 bh = blockIdx.x;
    const int bi = (int)(bh / a.h), hd = (int)(bh % a.h);
    const int i0 = blockIdx.y * FQ, i1 = min(a.t, i0 + FQ);
    const int i = i0 + threadIdx.x;
    const bool row = i < a.t;
    const i64 n = (i64)a.b * a.h * a.t;
    C qi[FDH], gi[FDH], gq[FDH];
    const i64 token = row ? flash_token_row(bh, i, a.h, a.t, a.dh) : 0;
    for (int d = 0; d < a.dh; ++d) {
        qi[d] = row ? E<S>::get(q[(bh * a.t + i) * a.dh + d]) : (C)0;
        gi[d] = row ? E<S>::get(dout[token + d]) : (C)0;
        gq[d] = 0;
    }
    const C m = row ? stats[bh * a.t + i] : (C)0;
    const C l = row ? stats[n + bh * a.t + i] : (C)1;
    const C dri = row ? dd[bh * a.t + i] : (C)0;
    C part_f = 0, part_g = 0;
    int lo, hi;
    flash_keys(i0, i1, a.before, a.after, a.t, &lo, &hi);
    int first = lo / FK * FK, last = (hi + FK - 1) / FK * FK;
    if (__syncthreads_or(row && flash_dead<C>(m))) {
        first = 0;
        last = (a.t + FK - 1) / FK * FK;
    }
    for (int j0 = first; j0 < last; j0 += FK) {
        __syncthreads();
        flash_load<S>(k, bh, j0, a.t, a.dh, ks);
        flash_load<S>(v, bh, j0, a.t, a.dh, vs);
        __syncthreads();
        if (!row) continue;
        for (int x = 0; x < FK; ++x) {
            const int j = j0 + x;
            if (j >= a.t) break;
            const C* kj = ks + x * a.dh;
            const C p = ex(flash_score<C>(a, qi, kj, i, j, bi, hd, bh) - m) / l;
            const C mult = flash_kept<C>(a, bh, i, j);
            C dp = 0;
            for (int d = 0; d < a.dh; ++d) dp += gi[d] * vs[x * a.dh + d];
            const C ds = p * (dp * mult - dri);
            for (int d = 0; d < a.dh; ++d) gq[d] += (C)a.scale * ds * kj[d];
            if (j <= i)
                part_f += ds;
            else
                part_g -= ds;
        }
    }
    if (!row) return;
    for (int d = 0; d < a.dh; ++d) dq[(bh * a.t + i) * a.dh + d] = E<S>::put(gq[d]);
    if (dsums) {
        dsums[bh * a.t + i] = part_f + cols[bh * a.t + i];
        dsums[n + bh * a.t + i] = cols[n + bh * a.t + i] + part_g;
    }
}

// The bias's gradient by offset (h, 2t - 1): grid (2t - 1, h), one block an (offset, head),
// the sum over the batch and the queries of ds_{i, i + offset}, each recomputed, reduced in a
// fixed order.
template <typename S>
__device__ void flash_offsets_back(const S* q, const S* k, const S* v,
                                   FlashArgs<typename E<S>::C> a, const S* dout,
                                   const typename E<S>::C* stats, const typename E<S>::C* dd,
                                   typename E<S>::C* dbias) {
    typedef typename E<S>::C C;
    __shared__ C red[32];
    const int o = blockIdx.x, hd = blockIdx.y;
    const i64 n = (i64)a.b * a.h * a.t;
    C sum = 0;
    for (i64 x = threadIdx.x; x < (i64)a.b * a.t; x += blockDim.x) {
        const int bi = (int)(x / a.t), i = (int)(x % a.t);
        const int j = i + o - (a.t - 1);
        if (j < 0 || j >= a.t) continue;
        const i64 bh = (i64)bi * a.h + hd;
        C qi[FDH], kj[FDH];
        for (int d = 0; d < a.dh; ++d) {
            qi[d] = E<S>::get(q[(bh * a.t + i) * a.dh + d]);
            kj[d] = E<S>::get(k[(bh * a.t + j) * a.dh + d]);
        }
        const C p = ex(flash_score<C>(a, qi, kj, i, j, bi, hd, bh) - stats[bh * a.t + i]) /
                    stats[n + bh * a.t + i];
        const i64 token = flash_token_row(bh, i, a.h, a.t, a.dh);
        C dp = 0;
        for (int d = 0; d < a.dh; ++d)
            dp += E<S>::get(dout[token + d]) * E<S>::get(v[(bh * a.t + j) * a.dh + d]);
        sum += p * (dp * flash_kept<C>(a, bh, i, j) - dd[bh * a.t + i]);
    }
    sum = block_sum(sum, red);
    if (threadIdx.x == 0) dbias[(i64)hd * (2 * a.t - 1) + o] = sum;
}

// The kernels' common parameters (FlashArgs, flattened: each launch passes scalars and
// pointers only), and the FlashArgs they make.
#define FLASH_PARAMS(S)                                                                            \
    const S *q, const S *k, const S *v, double scale, const E<S>::C *key_bias, int kind,           \
        const E<S>::C *bias, int before, int after, int dropout, unsigned long long seed,          \
        unsigned long long threshold, double keep, int b, int h, int t, int dh
#define FLASH_ARGS(S)                                                                              \
    FlashArgs<E<S>::C> a = {scale, key_bias, kind,      bias, before, after, dropout,              \
                            seed,  threshold, keep, b, h,    t,     dh}

#define FLASH_KERNELS(N, S)                                                                        \
    extern "C" __global__ void flash_fwd_##N(FLASH_PARAMS(S), S* out, E<S>::C* stats) {          \
        FLASH_ARGS(S);                                                                             \
        flash_fwd<S>(q, k, v, a, out, stats);                                                      \
    }                                                                                              \
    extern "C" __global__ void flash_dd_##N(const S* out, const S* dout, E<S>::C* dd, int b,      \
                                            int h, int t, int dh) {                                \
        flash_dd<S>(out, dout, dd, b, h, t, dh);                                                   \
    }                                                                                              \
    extern "C" __global__ void flash_cols_##N(FLASH_PARAMS(S), const S* dout,                      \
                                              const E<S>::C* stats, const E<S>::C* dd, S* dk,      \
                                              S* dv, E<S>::C* cols) {                              \
        FLASH_ARGS(S);                                                                             \
        flash_cols<S>(q, k, v, a, dout, stats, dd, dk, dv, cols);                                  \
    }                                                                                              \
    extern "C" __global__ void flash_rows_##N(FLASH_PARAMS(S), const S* dout,                      \
                                              const E<S>::C* stats, const E<S>::C* dd, S* dq,      \
                                              const E<S>::C* cols, E<S>::C* dsums) {               \
        FLASH_ARGS(S);                                                                             \
        flash_rows<S>(q, k, v, a, dout, stats, dd, dq, cols, dsums);                               \
    }                                                                                              \
    extern "C" __global__ void flash_offsets_back_##N(FLASH_PARAMS(S), const S* dout,              \
                                                      const E<S>::C* stats, const E<S>::C* dd,     \
                                                      E<S>::C* dbias) {                            \
        FLASH_ARGS(S);                                                                             \
        flash_offsets_back<S>(q, k, v, a, dout, stats, dd, dbias);                                 \
    }

FLASH_KERNELS(f64, double)
FLASH_KERNELS(f32, float)
FLASH_KERNELS(bf16, bf16_t)
FLASH_KERNELS(f16, f16_t)
