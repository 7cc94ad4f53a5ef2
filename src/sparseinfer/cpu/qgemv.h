/* sparseinfer CPU kernels: shared declarations.
 *
 * Weights are GGUF blocks exactly as the file stores them (row-major, each row a run of blocks).
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
    SI_N_TYPES = 9,
};

/* One quantized activation vector: q[cols] int8, d[cols/32], s[cols/32]; f the fp32 source (F16
 * weights use it directly). */
typedef struct {
    const int8_t *q;
    const float *d;
    const float *s;
    const float *f;
} si_xq;

/* Per-ISA entry points (kernels.c compiled once per ISA with SI_ISA set). */
#define SI_DECLARE(isa)                                                                        \
    void si_rows_##isa(int type, const uint8_t *w, size_t row_bytes, int nrows, const si_xq *x, \
                       int cols, float *y);                                                    \
    void si_quantize_x_##isa(const float *x, int cols, int8_t *q, float *d, float *s);         \
    void si_sparse_q4_##isa(const uint8_t *bundles, size_t bundle_bytes, int gated,            \
                            const int32_t *idx, int k, const si_xq *x, int T, int d_model,     \
                            int ga, int ua, const float *bias, float *out);

SI_DECLARE(avx2)
SI_DECLARE(avx512)

#endif
