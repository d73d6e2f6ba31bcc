// Fused paged attention over quantized pages (decode and prefill alike), appended to formats.cl and
// compiled once per (device, K_FMT, V_FMT, HEAD_DIM, N_KV_HEADS, BLOCK_SIZE, GROUP, QT).
//
// One work item = (query row, KV head, tile of QT query heads of that KV head's group, KV split):
// it dequantizes each K/V row of its split once for all QT heads (GQA), keeps an online softmax in
// base 2 with f32 accumulators, and walks its KV range in page-local tiles of up to TILE tokens.
// The host turns block_table / seq_lens / q_lens / causal / window into one visible range [lo, hi)
// per query row. With n_splits > 1 each split writes (m, l, unnormalized acc) and attention_merge
// combines them (split-K, for long sequences with few query rows).

#pragma OPENCL FP_CONTRACT ON

#define N_TILES (GROUP / QT)
#define N_HEADS (N_KV_HEADS * GROUP)
#define K_DQ32 CAT(dq32_, K_FMT)
#define V_DQ32 CAT(dq32_, V_FMT)
#define K_DQ1 CAT(dq1_, K_FMT)
#define V_DQ1 CAT(dq1_, V_FMT)

float hsum16(float16 a) {
    const float8 b = a.lo + a.hi;
    const float4 c = b.lo + b.hi;
    const float2 d = c.lo + c.hi;
    return d.x + d.y;
}

// s[t*TILE + k] = q_t . K row k for the n rows starting at krow (q pre-scaled by scale*log2(e))
void tile_scores(global const uchar* krow, int n, const float* qv, float* s) {
    for (int k = 0; k < n; k++) {
        global const uchar* row = krow + (ulong)k * K_ROW_BYTES;
#if HEAD_DIM % QK == 0
        float16 dot[QT];  // lane sums, reduced once per row
        for (int t = 0; t < QT; t++) dot[t] = 0.0f;
        for (int c = 0; c < HEAD_DIM / QK; c++) {
            float16 lo, hi;
            K_DQ32(row, c, &lo, &hi);
            for (int t = 0; t < QT; t++) {
                const float* qt = qv + t * HEAD_DIM;
                dot[t] += lo * vload16(2 * c, qt) + hi * vload16(2 * c + 1, qt);
            }
        }
        for (int t = 0; t < QT; t++) s[t * TILE + k] = hsum16(dot[t]);
#else
        for (int t = 0; t < QT; t++) s[t * TILE + k] = 0.0f;
        for (int i = 0; i < HEAD_DIM; i++) {
            const float x = K_DQ1(row, i);
            for (int t = 0; t < QT; t++) s[t * TILE + k] += x * qv[t * HEAD_DIM + i];
        }
#endif
    }
}

// acc_t += p[t*TILE + k] * V row k
void tile_accumulate(global const uchar* vrow, int n, const float* p, float* acc) {
    for (int k = 0; k < n; k++) {
        global const uchar* row = vrow + (ulong)k * V_ROW_BYTES;
#if HEAD_DIM % QK == 0
        for (int c = 0; c < HEAD_DIM / QK; c++) {
            float16 lo, hi;
            V_DQ32(row, c, &lo, &hi);
            for (int t = 0; t < QT; t++) {
                float* at = acc + t * HEAD_DIM;
                const float w = p[t * TILE + k];
                vstore16(vload16(2 * c, at) + w * lo, 2 * c, at);
                vstore16(vload16(2 * c + 1, at) + w * hi, 2 * c + 1, at);
            }
        }
#else
        for (int i = 0; i < HEAD_DIM; i++) {
            const float x = V_DQ1(row, i);
            for (int t = 0; t < QT; t++) acc[t * HEAD_DIM + i] += p[t * TILE + k] * x;
        }
#endif
    }
}

// q, out: [n_rows, N_HEADS, HEAD_DIM]; rows: [n_rows, 3] = (sequence, lo, hi);
// part_acc: [n_splits, n_rows, N_HEADS, HEAD_DIM], part_ml: [n_splits, n_rows, N_HEADS, 2]
kernel void attention(global const float* q, global const uchar* kpool, global const uchar* vpool,
                      global const int* block_table, int max_blocks, global const int* rows, float scale_log2,
                      int n_rows, int n_splits, global float* out, global float* part_acc, global float* part_ml) {
    const int item = get_global_id(0);
    const int split = get_global_id(1);
    if (item >= n_rows * N_KV_HEADS * N_TILES) return;
    const int row = item / (N_KV_HEADS * N_TILES);
    const int kvh = (item / N_TILES) % N_KV_HEADS;
    const int h0 = kvh * GROUP + (item % N_TILES) * QT;
    const int lo = rows[3 * row + 1], hi = rows[3 * row + 2];
    const int chunk = (hi - lo + n_splits - 1) / n_splits;
    const int j0 = min(hi, lo + split * chunk);
    const int j1 = min(hi, j0 + chunk);
    global const int* table = block_table + (ulong)rows[3 * row] * max_blocks;

    float qv[QT * HEAD_DIM], acc[QT * HEAD_DIM], m[QT], l[QT], s[QT * TILE];
    global const float* qrow = q + ((ulong)row * N_HEADS + h0) * HEAD_DIM;  // the QT heads are adjacent
    for (int i = 0; i < QT * HEAD_DIM; i++) {
        qv[i] = qrow[i] * scale_log2;
        acc[i] = 0.0f;
    }
    for (int t = 0; t < QT; t++) {
        m[t] = -INFINITY;
        l[t] = 0.0f;
    }

    for (int j = j0; j < j1;) {
        const int off = j % BLOCK_SIZE;
        const int n = min(min(TILE, BLOCK_SIZE - off), j1 - j);
        const ulong base = ((ulong)table[j / BLOCK_SIZE] * N_KV_HEADS + kvh) * BLOCK_SIZE + off;
        tile_scores(kpool + base * K_ROW_BYTES, n, qv, s);
        for (int t = 0; t < QT; t++) {
            float mt = m[t];
            for (int k = 0; k < n; k++) mt = fmax(mt, s[t * TILE + k]);
            const float corr = exp2(m[t] - mt);  // 0 on the first tile (m = -inf)
            m[t] = mt;
            l[t] *= corr;
            for (int i = 0; i < HEAD_DIM; i++) acc[t * HEAD_DIM + i] *= corr;
            for (int k = 0; k < n; k++) {
                const float p = exp2(s[t * TILE + k] - mt);
                s[t * TILE + k] = p;
                l[t] += p;
            }
        }
        tile_accumulate(vpool + base * V_ROW_BYTES, n, s, acc);
        j += n;
    }

    for (int t = 0; t < QT; t++) {
        const ulong g = (ulong)row * N_HEADS + h0 + t;
        if (n_splits == 1) {
            const float inv = 1.0f / l[t];
            for (int i = 0; i < HEAD_DIM; i++) out[g * HEAD_DIM + i] = acc[t * HEAD_DIM + i] * inv;
        } else {
            const ulong p = (ulong)split * n_rows * N_HEADS + g;
            for (int i = 0; i < HEAD_DIM; i++) part_acc[p * HEAD_DIM + i] = acc[t * HEAD_DIM + i];
            part_ml[2 * p] = m[t];
            part_ml[2 * p + 1] = l[t];
        }
    }
}

// one work item per (query row, head): out = sum_s acc_s 2^(m_s - M) / sum_s l_s 2^(m_s - M)
kernel void attention_merge(global const float* part_acc, global const float* part_ml, int n_rows, int n_splits,
                            global float* out) {
    const int g = get_global_id(0);
    if (g >= n_rows * N_HEADS) return;
    const ulong stride = (ulong)n_rows * N_HEADS;
    float mx = -INFINITY, total = 0.0f, acc[HEAD_DIM];
    for (int s = 0; s < n_splits; s++) mx = fmax(mx, part_ml[2 * (s * stride + g)]);
    for (int i = 0; i < HEAD_DIM; i++) acc[i] = 0.0f;
    for (int s = 0; s < n_splits; s++) {
        const ulong p = s * stride + g;
        const float w = exp2(part_ml[2 * p] - mx);  // 0 for an empty split (m = -inf)
        total += part_ml[2 * p + 1] * w;
        for (int i = 0; i < HEAD_DIM; i++) acc[i] += part_acc[p * HEAD_DIM + i] * w;
    }
    const float inv = 1.0f / total;
    for (int i = 0; i < HEAD_DIM; i++) out[(ulong)g * HEAD_DIM + i] = acc[i] * inv;
}
