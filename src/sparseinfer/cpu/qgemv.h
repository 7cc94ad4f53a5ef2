/* sparseinfer CPU kernels: shared declarations.
 *
 * Weights are GGUF blocks as the file stores them (row-major, each row a run of blocks), or
 * blocks rearranged in panels of 16 rows (SI_Q4_0P ... SI_Q5_KB below).
 * The activation vector is quantized once per call into blocks of 32 int8 values with a float
 * scale d and s = d * sum(q) (the offset term of Q4_1/Q5_1/K-quant minima and Q4_0/Q5_0/Q6_K
 * zero points uses s).
 */
#ifndef SI_QGEMV_H
#define SI_QGEMV_H

#include <stddef.h>
#include <stdint.h>

enum si_type {
    SI_Q4_0 = 0,
    SI_Q4_1 = 1,
    SI_Q5_0 = 2,
    SI_Q5_1 = 3,
    SI_Q8_0 = 4,
    SI_Q4_K = 5,
    SI_Q5_K = 6,
    SI_Q6_K = 7,
    SI_F16 = 8,
    SI_F32 = 9,
    /* Q4_0 / Q4_1 / Q8_0 blocks rearranged in panels of 16 rows (cpu/panels.py makes them from
     * the file's rows): per panel, per block column b, the 16 rows' block b as [d x 16 (fp16),
     * Q4_1: m x 16 (fp16), quants: W x (16 rows x 4 bytes)], where quant word c of row r is
     * bytes 4c..4c+3 of its block's quants (Q4: W = 4, elements 4c..4c+3 in the low nibbles,
     * 16+4c.. in the high; Q8_0: W = 8, elements 4c..4c+3). The same bytes per row as the file;
     * a panel is 16 rows' bytes, rows % 16 == 0. */
    SI_Q4_0P = 10,
    SI_Q4_1P = 11,
    SI_Q8_0P = 12,
    /* Q5_0 in panels: per block column [d x 16 (fp16), fifth bits: 16 rows x 4 bytes, quants:
     * 4 x (16 rows x 4 bytes) as Q4_0P]; a row's 32 fifth bits are stored transposed (bit 8k + s
     * of its word = the file's bit 4s + k), so byte k's bit s belongs to quant word s % 4's byte
     * k, low nibble for s < 4, high for s >= 4: one shift puts the bits of all 4 bytes of a word
     * at bit 4 of their bytes. */
    SI_Q5_0P = 13,
    /* Q4_K in panels: per super-block column (256 weights) of a panel, 2304 bytes: [d x 16
     * (fp16), dmin x 16 (fp16), scales' low nibbles: 4 x 16 bytes (byte k of row r: sc[k] & 15 |
     * (sc[k + 4] & 15) << 4), minima's the same, scales' top bits: 16 words (row r's: bits 2j,
     * 2j + 1 = sc[j] >> 4), minima's the same, quants: 32 x (16 rows x 4 bytes)], where quant
     * word 8p + c of row r is bytes 32p + 4c .. 32p + 4c + 3 of its qs (sub-block 2p in their low
     * nibbles, 2p + 1 in the high). sc[j], m[j]: the six-bit fields of the file's 12 scale bytes.
     * The same bytes per row as the file. */
    SI_Q4_KP = 14,
    /* Q5_K in panels: per super-block column, 2816 bytes: SI_Q4_KP's 256 bytes of d, dmin,
     * scales and minima, then the fifth bits: 8 x (16 rows x 4 bytes), word c of row r its qh
     * bytes 4c .. 4c + 3 (bit j of qh byte l: sub-block j's weight l), then SI_Q4_KP's quants. */
    SI_Q5_KP = 15,
    /* Q6_K in panels: per super-block column, 3360 bytes: [d x 16 (fp16), scales: 16 x (16 rows'
     * int8 scale i), qh: 16 x (16 rows x 4 bytes: the row's qh word v = bytes 4v .. 4v + 3), ql: 32
     * x (16 rows x 4 bytes: ql word u)]. */
    SI_Q6_KP = 16,
    /* Q5_1 in panels: per block column [d x 16 (fp16), m x 16 (fp16), then SI_Q5_0P's fifth bits
     * (transposed) and quants]. */
    SI_Q5_1P = 17,
    /* Q6_K in panels with its six-bit weights byte-aligned (the 256-bit builds' Q6_K panels: a
     * third fewer operations to unpack than SI_Q6_KP): per super-block column, 3360 bytes: SI_Q6_KP's
     * d and scales (288 bytes), then per sub-block i of 16 weights three words m = 0, 1, 2 of 16
     * rows x 4 bytes, where byte e of row r's word m holds in bits 0-5 the row's weight
     * 16 i + 4 m + e (the file's 6-bit code, q + 32) and in bits 6-7 bits 2 m, 2 m + 1 of its
     * weight 16 i + 12 + e. */
    SI_Q6_KB = 18,
    /* Q5_K in panels with its five-bit weights byte-aligned (the 256-bit builds' Q5_K panels):
     * per super-block column, 2816 bytes: SI_Q4_KP's 256 bytes of d, dmin, scales and minima,
     * then per sub-block j of 32 weights five words m = 0..4 of 16 rows x 4 bytes, where byte e
     * of row r's word m holds in bits 0-4 the row's weight 32 j + 4 m + e (the file's 5-bit
     * code) and in bits 5-7 bits 3 m .. 3 m + 2 of t = q(20 + e) | q(24 + e) << 5 | q(28 + e)
     * << 10, the sub-block's weights 32 j + 20 + e, 24 + e, 28 + e. */
    SI_Q5_KB = 19,
    /* bfloat16 rows (a float32's top half: Hugging Face's usual weights), as SI_F16's */
    SI_BF16 = 20,
    SI_N_TYPES = 21,
};
#define SI_PANEL 16 /* rows per panel of SI_Q4_0P ... SI_Q5_KB */

static inline int si_is_panel(int type) {
    return type == SI_Q4_0P || type == SI_Q4_1P || type == SI_Q8_0P || type == SI_Q5_0P ||
           type == SI_Q4_KP || type == SI_Q5_KP || type == SI_Q6_KP || type == SI_Q5_1P ||
           type == SI_Q6_KB || type == SI_Q5_KB;
}

/* One quantized activation vector: q[cols] int8, d[cols/32], s[cols/32]; f the fp32 source (F16
 * weights use it directly); g the same blocks rearranged for the kernels of one ISA
 * (si_xgroups, at most SI_XG_BYTES of ceil(cols / 128) groups): in groups of 4 blocks for the
 * AVX-512 Q4_0/Q4_1/Q5_0 and sparse Q4_0 kernels, in pairs for the plain AVX2 Q4_0/Q4_1 ones;
 * NULL where the ISA has no use for it (avx2_128). */
typedef struct {
    const int8_t *q;
    const float *d;
    const float *s;
    const float *f;
    const uint8_t *g;
    /* x in blocks of 128 (si_quantize_xk; llama.cpp's Q8_K takes 256): kq[cols] int8, kd[cols /
     * 128] scales, kbs[cols / 16] sums of kq per 16, ks[cols / 32] the rounded x's sums per 32
     * (kd times the sums of kq); for the kernels that sum half a super-block in integers (plain
     * AVX2's Q6_K, AVX-512's Q5_K and Q6_K, every ISA's Q6_K panels of either layout); NULL
     * elsewhere */
    const int8_t *kq;
    const float *kd;
    const int16_t *kbs;
    const float *ks;
} si_xq;

/* Bytes of si_xgroups' output for G groups of 4 blocks (see kernels.c). */
#define SI_XG_BYTES(G) ((size_t)(G) * 192)

/* Per-ISA entry points (kernels.c compiled once per ISA with SI_ISA set). */
#define SI_DECLARE(isa)                                                                        \
    void si_rows_multi_##isa(int type, const uint8_t *w, size_t row_bytes, int nrows,          \
                             const si_xq *x, int T, int cols, float *y, int64_t y_stride);     \
    void si_rows_##isa(int type, const uint8_t *w, size_t row_bytes, int nrows, const si_xq *x, \
                       int cols, float *y);                                                    \
    void si_quantize_x_##isa(const float *x, int cols, int8_t *q, float *d, float *s);         \
    int si_xgroups_##isa(const si_xq *x, int cols, uint8_t *out);                              \
    void si_sparse_q4_##isa(const uint8_t *bundles, size_t bundle_bytes, int gated,            \
                            const int32_t *idx, int k, const uint8_t *mask, size_t mstride,   \
                            const si_xq *x, int T, int d_model, int ga, int ua,               \
                            const float *bias, float *out);                                    \
    void si_sparse_q4_gates_##isa(const uint8_t *bundles, size_t bundle_bytes,                 \
                                  const int32_t *idx, int k, const si_xq *x, int d_model,     \
                                  float *z);                                                   \
    void si_sparse_i8_##isa(const int8_t *rows, size_t bundle_bytes, const float *scales,      \
                            int nbk, int block, int gated, const int32_t *idx, int k,          \
                            const uint8_t *mask, size_t mstride, const float *x,              \
                            const si_xq *xq, int T, int d_model, int ga, int ua,              \
                            const float *bias, float *out, const uint8_t *gq, size_t gstride, \
                            int q4u);                                                          \
    void si_sparse_i8_ups_##isa(const int8_t *rows, size_t bundle_bytes, const float *scales,  \
                                int nbk, int block, int q4u, const int32_t *nid, const float *g, \
                                int k, const float *x, const si_xq *xq, int d_model, int ua,  \
                                float *out);                                                   \
    void si_quantize_xk_##isa(const float *x, int cols, int8_t *q, float *d, int16_t *bs,      \
                              float *ks);                                                      \
    void si_attend_group_##isa(const float *q, const float *kc, const float *vc, int n, int hd, \
                               float scale, float cap, int G, float *scores, size_t sstride,   \
                               float *out);                                                    \
    void si_attend_group16_##isa(const float *q, const uint16_t *kc, const uint16_t *vc, int n, \
                                 int hd, float scale, float cap, int G, float *scores,         \
                                 size_t sstride, float *out);                                  \
    void si_glu_##isa(int gated, int ga, int ua, const float *in, const float *bias, int n,    \
                      float *out);

/* Bytes of one neuron's bundle of q4 ups (PackedFFN dtype "q4i8"; si_sparse_i8's q4_ups): its
 * down row's float32 scales (one per `block` weights), its up row as a q4 row (d_model / 32 · 18
 * bytes: the file's Q4_0 numbers, scales first), its int8 down row; rounded up to a multiple of 4
 * (the next bundle's scales aligned). sparse/packed.py's q4i8_layout makes the same. */
static inline size_t si_q4u_bytes(int d_model, int block) {
    const size_t n = 4 * (size_t)((d_model + block - 1) / block) + (size_t)d_model / 32 * 18 +
                     (size_t)d_model;
    return (n + 3) / 4 * 4;
}

/* Activation codes (as sparse/kernels.py ACT_CODES). */
enum { SI_ACT_NONE = 0, SI_ACT_RELU = 1, SI_ACT_SILU = 2, SI_ACT_GELU = 3, SI_ACT_GELU_TANH = 4 };

/* One weight of a block: matrices sharing one input, their rows stacked in this order (e.g. q, k,
 * v), plus an optional bias over all the rows. */
#define SI_LINEAR_MATS 4
typedef struct {
    int n;
    int type[SI_LINEAR_MATS];
    const void *w[SI_LINEAR_MATS];
    int64_t rows[SI_LINEAR_MATS];
    const float *bias;
} si_linear;

/* A block's FFN computed neuron by neuron (the sparse FFN of a converted file; see
 * si_block_desc.sparse): neuron bundles as si_sparse_i8 (int8 rows, scales given; a ReLU gate's
 * rows possibly apart as q4 rows) or si_sparse_q4 (Q4_0 rows, scales NULL) take them, and the
 * neurons each row computes chosen by a float16 predictor as si_predict_f16's (fc1 NULL: every
 * neuron). */
typedef struct {
    const void *rows;     /* [d_ff, n_mats, ...] bundles; NULL: the block's FFN is dense */
    const float *scales;  /* int8 rows: [d_ff, n_mats, ceil(d_model / block)]; NULL: Q4_0 rows */
    int n_mats, block, round_x; /* (block, round_x: int8 rows, as si_sparse_i8's) */
    const void *gates;    /* int8 rows of a ReLU gate: the gates' q4 rows apart, gate_stride
                           * bytes apart (si_sparse_i8's; one row: si_sparse_i8_q4g's), or NULL */
    size_t gate_stride;
    const float *up_bias; /* [d_ff] or NULL */
    const void *fc1, *fc2; /* float16 [rank, d_model], [d_ff, rank]; rank a multiple of 32 */
    int rank, on_residual; /* on_residual: the predictor reads x, not the FFN's normed input */
    const float *thr;     /* [d_ff]: neuron i selected iff its logit >= thr[i] */
    const int32_t *mode;  /* read at each call of several rows (or NULL: 0): 0 each row its own
                           * set, 1 every row the union of the rows' sets, 2 every neuron, 3
                           * every neuron by the block's w_in and down (a dense copy of the FFN,
                           * given beside the bundles; without one, as 2) */
    int64_t *counts;      /* [2] or NULL: rows and neurons computed, added by each call (modes 2
                           * and 3's rows not counted) */
    int q4_ups;           /* int8 rows with gates apart: each bundle its down row's scales, its up
                           * row as a q4 row and its int8 down row (si_q4u_bytes; n_mats 1,
                           * scales NULL), as si_sparse_i8's q4_ups */
} si_sparse_ffn;

/* A pre-norm llama block (RMSNorm, RoPE, grouped-query attention, FFN) for one-token decode,
 * with Gemma's and Qwen3's extras as options: RMSNorm of each q and k head before rope (q_norm,
 * k_norm [head_dim]), RMSNorm of the attention and FFN outputs before their residual adds
 * (attn_post_norm, ffn_post_norm [d_model]), attention over the last `window` positions only
 * (0: all), and a score scale other than 1/sqrt(head_dim) (scale > 0). NULL / 0: not used.
 * d_ff 0 with no w_in, down, sparse FFN or ffn_post_norm: attention only (x += the attention's
 * output; the caller computes the FFN — a mixture of experts); not in a stack of blocks. */
typedef struct {
    int d_model, n_heads, n_kv_heads, head_dim, d_ff, gated, gate_act, up_act, interleaved;
    float eps;
    const float *attn_norm, *ffn_norm;
    si_linear qkv, wo, w_in, down;
    const float *q_norm, *k_norm, *attn_post_norm, *ffn_post_norm;
    int window;
    float scale;
    float softcap; /* > 0: attention scores soft-capped, cap tanh(score / cap) (Gemma 2) */
    si_sparse_ffn sparse; /* sparse.rows not NULL: the FFN is this; w_in and down then n 0 (down's
                           * bias the FFN's output bias), or the same FFN as dense matrices for
                           * calls of several rows in mode 3 (w_in's bias: gate rows' 0, up's) */
    float residual; /* > 0: the attention's and FFN's outputs times this before their residual
                     * adds (Granite's residual_multiplier); 0: 1 */
} si_block_desc;

SI_DECLARE(avx2)
SI_DECLARE(avx512)
SI_DECLARE(avx2_128)
SI_DECLARE(avx2_vnni)

#endif
