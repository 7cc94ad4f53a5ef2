/* Row kernels over native GGUF blocks, compiled once per instruction set (SI_ISA = avx2,
 * avx2_vnni, avx512 or avx2_128; the build passes the matching -m flags). Most of it is 256-bit
 * wide; the AVX-512 and avx2_vnni builds have their integer dot products in VNNI vpdpbusd, which
 * replaces the two-instruction AVX2 sequence (vpmaddubsw + vpmaddwd) and cannot saturate
 * (dot_us, chain_add); the AVX-512 build (SI_AVX512) also has 512-bit kernels
 * of its own: Q4_0/Q4_1/Q5_0 in groups of 4 blocks against x rearranged once per row
 * (si_xgroups), Q4_K/Q5_K/Q6_K 64 weights per vector, short Q8_0 rows two blocks per step, and
 * the sparse Q4_0 bundles in groups of 4; the avx2_128 build (SI_NARROW) works the blocks in
 * 128-bit registers, for CPUs whose vector units split 256-bit instructions. Q4_0/Q4_1/Q5_0/Q8_0 in
 * panels of 16 rows (the loader's layout for them) have kernels of their own ("panels of 16
 * rows" below), one per ISA family, shared by the GEMV and the GEMM.
 *
 * A row kernel walks R rows (4, or 1 for the tail) side by side, block by block, so R weight
 * streams are in flight and each activation block is loaded once for all of them. Per block of
 * 32 weights: unpack to 32 unsigned bytes, integer dot with the int8 activation block (8 int32
 * partial sums), convert and fused-multiply-add with the block's scale product into a float
 * accumulator; zero points and minima go through the activation block sums (x->s) in a scalar
 * accumulator. One horizontal sum per row at the end. Plain AVX2's Q6_K and AVX-512's Q5_K and
 * Q6_K take x in blocks of 128 instead (x->kq): half a super-block sums in integers, its
 * sub-block scales folded in.
 */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "qgemv.h"

#ifndef SI_ISA
#error "compile with -DSI_ISA=avx2, avx512, avx2_vnni (with -mavxvnni) or avx2_128 (with -DSI_NARROW=1)"
#endif
#define SI_CAT2(a, b) a##_##b
#define SI_CAT(a, b) SI_CAT2(a, b)
#define FN(name) SI_CAT(name, SI_ISA)

#define INLINE static inline __attribute__((always_inline))

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SI_AVX512 1
#else
#define SI_AVX512 0
#endif

INLINE int ld16(const uint8_t *p) { /* an unaligned 16-bit word */
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}
INLINE float f16(const uint8_t *p) { return _cvtsh_ss((unsigned short)ld16(p)); }
INLINE __m128i load128(const void *p) { return _mm_loadu_si128((const __m128i *)p); }

/* Byte products in 256-bit vectors: unsigned bytes a times signed bytes b, 4 products per
 * 32-bit lane. With VNNI (AVX-512's, or AVX-VNNI on CPUs without AVX-512) one vpdpbusd adds
 * them into int32 lanes; plain AVX2 needs two instructions (vpmaddubsw into int16 pairs,
 * vpmaddwd to widen). A chain sums several such products: chain_add keeps it in int16 on plain
 * AVX2 (each caller bounds its chain so that nothing saturates) and in int32 with VNNI;
 * chain_sum gives the int32 lane sums. dot_us: the 8 int32 sums of one product; dot_us_add: s
 * plus them. The integers are the same either way. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define SI_DPBUSD(s, a, b) _mm256_dpbusd_epi32(s, a, b)
#elif defined(__AVXVNNI__)
#define SI_DPBUSD(s, a, b) _mm256_dpbusd_avx_epi32(s, a, b)
#endif
#ifdef SI_DPBUSD
INLINE __m256i dot_us_add(__m256i s, __m256i a, __m256i b) { return SI_DPBUSD(s, a, b); }
INLINE __m256i chain_add(__m256i s, __m256i a, __m256i b) { return SI_DPBUSD(s, a, b); }
INLINE __m256i chain_sum(__m256i s) { return s; }
#else
INLINE __m256i chain_add(__m256i s, __m256i a, __m256i b) {
    return _mm256_add_epi16(s, _mm256_maddubs_epi16(a, b));
}
INLINE __m256i chain_sum(__m256i s) { return _mm256_madd_epi16(s, _mm256_set1_epi16(1)); }
INLINE __m256i dot_us_add(__m256i s, __m256i a, __m256i b) {
    return _mm256_add_epi32(s, chain_sum(_mm256_maddubs_epi16(a, b)));
}
#endif
INLINE __m256i dot_us(__m256i a, __m256i b) { return dot_us_add(_mm256_setzero_si256(), a, b); }

INLINE float hsum(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

INLINE int hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

INLINE float hmax(__m256 v) {
    __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_max_ps(a, _mm_movehl_ps(a, a));
    a = _mm_max_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

/* The permute index that puts scales k and k+1 on lanes 0..3 and 4..7 (two blocks of a pair, two
 * sub-blocks of a Q6_K group). */
INLINE __m256i pair_idx(const int k) {
    return _mm256_setr_epi32(k, k, k, k, k + 1, k + 1, k + 1, k + 1);
}

/* 16 bytes of nibbles -> 32 bytes 0..15: low nibbles are elements 0..15, high ones 16..31. */
INLINE __m256i nib32(const uint8_t *p) {
    __m128i v = _mm_loadu_si128((const __m128i *)p);
    __m256i r = _mm256_set_m128i(_mm_srli_epi16(v, 4), v);
    return _mm256_and_si256(r, _mm256_set1_epi8(0x0F));
}

/* Bit i of `bits` -> byte i = 0x10 if set, else 0 (the fifth bit of Q5_0/Q5_1). */
INLINE __m256i bit5(const uint8_t *p) {
    uint32_t bits;
    memcpy(&bits, p, 4);
    const __m256i shuf = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2,
                                          2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i mask = _mm256_set1_epi64x(0x8040201008040201LL);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), shuf);
    v = _mm256_cmpeq_epi8(_mm256_and_si256(v, mask), mask);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
}

/* Prefetch `n` bytes (for the panel and row passes a compile-time constant after inlining;
 * attention's run lengths vary) starting at p. The rows of a chunk
 * are contiguous, so while a group of 4 rows is walked, the next group's bytes are fetched at the
 * same pace: a short row (a few KB) is otherwise over before the hardware prefetcher ramps up.
 * `far` (a group of more than PF_NEAR_BYTES) fetches into L2 only: into L1 the next group would
 * evict x's blocks, which every row reads again, and the group being read. Where the line lies
 * was measured (benchmarks/RESULTS.md): 9-10 KiB groups (4096-wide Q4_0, Q4_1, Q4_K rows) gain
 * in L1 (AVX2's Q4_K decode of a 7B file lost ~9% without), 11 KiB ones (Q5_0, Q5_K) lose
 * (plain AVX2's 4096-wide Q5_K rows ran at half speed). */
#define PF_NEAR_BYTES 10240
INLINE void prefetch(const uint8_t *p, const int n, const int far) {
    if (far)
        for (int o = 0; o < n; o += 64) _mm_prefetch((const char *)(p + o), _MM_HINT_T1);
    else
        for (int o = 0; o < n; o += 64) _mm_prefetch((const char *)(p + o), _MM_HINT_T0);
}

INLINE __m256i loadx(const si_xq *x, int b) {
    return _mm256_loadu_si256((const __m256i *)(x->q + 32 * (size_t)b));
}

/* ------------------------------------------------------------------ blocks of 32 weights */

/* A Q4_0/Q4_1/Q5_0/Q5_1 block's 32 weights as unsigned bytes (nibbles, and the fifth bits). */
INLINE __m256i unpack_b32(const int type, const uint8_t *p) {
    if (type == SI_Q4_0) return nib32(p + 2);
    if (type == SI_Q4_1) return nib32(p + 4);
    if (type == SI_Q5_0) return _mm256_or_si256(nib32(p + 6), bit5(p + 2));
    return _mm256_or_si256(nib32(p + 8), bit5(p + 4));
}

/* The integer dot product of one block of type `type` at p with the activation block xv. */
INLINE __m256i dot_b32(const int type, const uint8_t *p, __m256i xv) {
    if (type != SI_Q8_0) return dot_us(unpack_b32(type, p), xv);
    /* SI_Q8_0: signed x signed as |w| times x with w's sign */
    const __m256i wv = _mm256_loadu_si256((const __m256i *)(p + 2));
    return dot_us(_mm256_abs_epi8(wv), _mm256_sign_epi8(xv, wv));
}

/* The fp16 fields at byte `off` of 8 consecutive blocks (bsize apart) as 8 floats. */
INLINE __m256 f16x8(const uint8_t *p, const int bsize, const int off) {
    uint16_t h[8];
    for (int k = 0; k < 8; k++) memcpy(&h[k], p + k * bsize + off, 2);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
}

/* ------------------------------------------------------------------ groups of 4 blocks */

#if SI_AVX512
/* The AVX-512 Q4_0/Q4_1 kernels work a row in groups of 4 blocks (72 or 80 bytes, 128 weights).
 * One 64-byte load and one 16-byte load cover a group; a word permute (AVX512BW) gathers its
 * 4 x 16 quant bytes into one vector and another its 4 scales, so a group costs two dpbusd
 * against x rearranged to match (si_xgroups, once per x row: si_xq.g) where decoding two blocks
 * per step took two unpacks, two dot products and two scale permutes. Lane l of a group's
 * dpbusd (bytes 4l..4l+3 of the 64) meets elements 4j..4j+3 (low nibbles) and 16+4j..16+4j+3
 * (high nibbles) of the group's block k = l / 4, j = l % 4. */
/* x's part of group g (si_xgroups), XG_STRIDE bytes at x->g + XG_STRIDE * g: lo[64] (elements
 * 0..15 of the group's 4 x blocks), hi[64] (elements 16..31), z int16[16] (-8 times the sum of
 * the 8 x bytes lane l multiplies: Q4_0's zero point, put in the integer sums), d float[4] (the
 * blocks' scales), s4 float[4] (a quarter of the blocks' sum terms s: Q4_1's minima). One
 * contiguous stream per x row, 176 bytes of it read per group. */
#define XG_STRIDE ((int)SI_XG_BYTES(1)) /* 192 */
#define XG_LO 0
#define XG_HI 64
#define XG_Z 128
#define XG_D 160
#define XG_S4 176

INLINE const uint8_t *xg_at(const si_xq *x, int g) { return x->g + (size_t)XG_STRIDE * g; }
/* Lane l of a group: block l / 4 (the permute index of the per-block fields). */
INLINE __m512i lane_block(void) {
    return _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
}
INLINE __m512i xg_z(const uint8_t *xg) {
    return _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(xg + XG_Z)));
}
/* The 4 floats at byte `off` of the group, each on its block's 4 lanes. */
INLINE __m512 xg_f4(const uint8_t *xg, const int off, __m512i lb) {
    return _mm512_permutexvar_ps(lb, _mm512_castps128_ps512(_mm_loadu_ps((const float *)(xg + off))));
}

/* The byte of a group at which its second load starts, for blocks of bsize bytes (18: Q4_0,
 * 20: Q4_1, 22: Q5_0, 24: Q5_1): the last 16 bytes of a Q4_0/Q4_1 group; 32 bytes from byte 56
 * for Q5_0, whose block 2 has its last quant word at bytes 64..65, and from byte 64 for Q5_1. */
INLINE int q4g_second(const int bsize) {
    return bsize == 22 ? 56 : bsize == 24 ? 64 : 4 * bsize - 16;
}

/* Word indices of the group gathers: QIDX picks the 4 x 8 quant words (word bsize/2 * k +
 * bsize/2 - 8 + m of the group), DIDX the fp16 word bsize/2 * (l / 4) + off for each of 16 lanes
 * (off 0: the block's scale; 1: Q4_1's minimum). Words past the first 64 bytes come from the
 * second load (q4g_second): index 32 + their word counted from its start. */
INLINE int16_t q4g_word(const int bsize, const int w) {
    return (int16_t)(w < 32 ? w : 32 + w - q4g_second(bsize) / 2);
}
INLINE __m512i q4g_qidx(const int bsize) {
    const int h = bsize / 2;
    int16_t v[32];
    for (int j = 0; j < 32; j++) v[j] = q4g_word(bsize, h * (j / 8) + h - 8 + j % 8);
    return _mm512_loadu_si512((const void *)v);
}
INLINE __m512i q4g_didx(const int bsize, const int off) {
    int16_t v[32];
    for (int j = 0; j < 32; j++) v[j] = q4g_word(bsize, bsize / 2 * ((j % 16) / 4) + off);
    return _mm512_loadu_si512((const void *)v);
}
/* The 16 fp16 words of the group (already loaded: a) that didx picks, as 16 floats. */
INLINE __m512 q4g_halfs(__m512i a, __m512i didx) {
    return _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(didx, a)));
}
/* A group at p: its first 64 bytes (*a, for q4g_halfs) and its 64 quant bytes (block k's 16 at
 * bytes 16k..16k+15). */
INLINE __m512i q4g_quants(const uint8_t *p, const int bsize, __m512i qidx, __m512i *a) {
    *a = _mm512_loadu_si512((const void *)p);
    const __m512i b = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(p + q4g_second(bsize))));
    return _mm512_permutex2var_epi16(*a, qidx, b);
}
/* The bytes [off, off + 64) of a partial group of n bytes at p, zero past n (masked: nothing
 * past the row is read). */
INLINE __m512i load_part(const uint8_t *p, const int off, const int n) {
    const int k = n - off <= 0 ? 0 : n - off >= 64 ? 64 : n - off;
    const __mmask64 m = k == 64 ? ~(__mmask64)0 : (((__mmask64)1 << k) - 1);
    return _mm512_maskz_loadu_epi8(m, (const void *)(p + off));
}
/* q4g_quants for the last, partial group of a row: rem (1..3) blocks, the rest read as zero. */
INLINE __m512i q4g_quants_part(const uint8_t *p, const int bsize, const int rem, __m512i qidx,
                               __m512i *a) {
    *a = load_part(p, 0, rem * bsize);
    return _mm512_permutex2var_epi16(*a, qidx, load_part(p, q4g_second(bsize), rem * bsize));
}
/* The int32 dot products of a group's quants q with x's group: 16 lanes, 4 per block, starting
 * from z (Q4_0: -8 * x's sums, so the zero point is in the integers; Q4_1: zero). */
INLINE __m512i q4g_dot(__m512i lo, __m512i hi, __m512i z, const uint8_t *xg) {
    const __m512i d = _mm512_dpbusd_epi32(z, lo, _mm512_loadu_si512(xg + XG_LO));
    return _mm512_dpbusd_epi32(d, hi, _mm512_loadu_si512(xg + XG_HI));
}
/* A group's quants q as unsigned nibbles: lo = low nibbles, hi = high ones. */
INLINE __m512i nib_lo(__m512i q) { return _mm512_and_si512(q, _mm512_set1_epi8(0x0F)); }
INLINE __m512i nib_hi(__m512i q) {
    return _mm512_and_si512(_mm512_srli_epi16(q, 4), _mm512_set1_epi8(0x0F));
}
#endif

/* x's blocks rearranged into out for this ISA's kernels: AVX-512, the groups of 4 (XG_STRIDE
 * above; SI_XG_BYTES of ceil(cols / 128) groups, a last partial group padded with zero blocks,
 * whose products are zero); plain AVX2, pairs of blocks (pair_q4 below; cols bytes). Returns 1,
 * or 0 where this ISA does not use them (avx2_128). */
int FN(si_xgroups)(const si_xq *x, int cols, uint8_t *out) {
#if SI_AVX512
    const int nb = cols / 32;
    for (int g = 0; g < (nb + 3) / 4; g++) { /* a last partial group padded with zero blocks */
        uint8_t *o = out + (size_t)XG_STRIDE * g;
        int16_t z[16] = {0};
        float d[4] = {0}, s4[4] = {0};
        memset(o, 0, XG_Z);
        for (int k = 0; k < 4 && 4 * g + k < nb; k++) {
            const int8_t *q = x->q + 32 * (size_t)(4 * g + k);
            memcpy(o + XG_LO + 16 * k, q, 16);
            memcpy(o + XG_HI + 16 * k, q + 16, 16);
            for (int j = 0; j < 4; j++) {
                int sum = 0;
                for (int e = 0; e < 4; e++) sum += q[4 * j + e] + q[16 + 4 * j + e];
                z[4 * k + j] = (int16_t)(-8 * sum); /* |8 * 8 * 127| fits */
            }
            d[k] = x->d[4 * g + k];
            s4[k] = 0.25f * x->s[4 * g + k];
        }
        memcpy(o + XG_Z, z, sizeof z);
        memcpy(o + XG_D, d, sizeof d);
        memcpy(o + XG_S4, s4, sizeof s4);
        memset(o + XG_S4 + sizeof s4, 0, XG_STRIDE - XG_S4 - sizeof s4);
    }
    return 1;
#elif !SI_NARROW
    /* plain AVX2: pairs of blocks (2p, 2p+1) as [x_2p[0..15], x_2p+1[0..15], x_2p[16..31],
     * x_2p+1[16..31]] (see pair_q4), the first cols / 64 pairs; cols bytes */
    for (int pr = 0; pr < cols / 64; pr++) {
        const int8_t *q0 = x->q + 64 * (size_t)pr, *q1 = q0 + 32;
        uint8_t *o = out + 64 * (size_t)pr;
        memcpy(o, q0, 16);
        memcpy(o + 16, q1, 16);
        memcpy(o + 32, q0 + 16, 16);
        memcpy(o + 48, q1 + 16, 16);
    }
    return 1;
#else
    (void)x, (void)cols, (void)out;
    return 0;
#endif
}

#if !SI_AVX512 && !SI_NARROW
/* Plain AVX2, Q4_0/Q4_1: blocks k and k+1 of a row (quants at q, bsize apart) in one 256-bit
 * step: their 16 quant bytes side by side in the two lanes (one load and one insert), the low
 * nibbles against x's first halves and the high ones against its second halves (x->g's pair
 * layout, at xp), the two int16 products added before one widening madd (at most
 * 2 * 2 * 15 * 127: no overflow): 8 int32 sums, 4 per block. Half the work per block of the
 * block-by-block loop, which unpacks each block with a lane insert and widens it alone. */
INLINE void pair_unpack(const uint8_t *q, const int bsize, __m256i *lo, __m256i *hi) {
    const __m256i v = _mm256_loadu2_m128i((const __m128i *)(q + bsize), (const __m128i *)q);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    *lo = _mm256_and_si256(v, m4);
    *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
}
INLINE __m256i pair_dot(__m256i lo, __m256i hi, const int8_t *xp) {
    const __m256i s = chain_add(_mm256_setzero_si256(), lo, _mm256_loadu_si256((const __m256i *)xp));
    return chain_sum(chain_add(s, hi, _mm256_loadu_si256((const __m256i *)(xp + 32))));
}
INLINE __m256i pair_q4(const uint8_t *q, const int bsize, const int8_t *xp) {
    __m256i lo, hi;
    pair_unpack(q, bsize, &lo, &hi);
    return pair_dot(lo, hi, xp);
}
#endif

#ifndef SI_NARROW
#define SI_NARROW 0
#endif
#if SI_NARROW
/* The AVX2 build for CPUs whose vector units are 128 bits wide (AMD Zen, Zen+, Hygon Dhyana):
 * there each 256-bit instruction runs as two halves and the lane-crossing ones the 256-bit path
 * uses per block (vinserti128 to pair the nibble halves, vpermps to broadcast a block's scale)
 * cost several operations, so a block is worked in 128-bit registers with no lane crossing: the
 * low nibbles against x's first 16 bytes, the high ones against its last 16. */

/* Bits 0..15 of `bits` -> byte i = 0x10 if bit i is set, else 0. */
INLINE __m128i bit5_128(uint32_t bits) {
    const __m128i shuf = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m128i mask = _mm_set1_epi64x(0x8040201008040201LL);
    __m128i v = _mm_shuffle_epi8(_mm_set1_epi32((int)bits), shuf);
    v = _mm_cmpeq_epi8(_mm_and_si128(v, mask), mask);
    return _mm_and_si128(v, _mm_set1_epi8(0x10));
}

/* A Q4_0/Q4_1/Q5_0/Q5_1 block in 128-bit registers: lo = elements 0..15, hi = 16..31 (fifth bits
 * or'ed in), unpacked once for any number of x blocks. */
INLINE void unpack_b32_128(const int type, const uint8_t *p, __m128i *lo, __m128i *hi) {
    const int qo = type == SI_Q4_0 ? 2 : type == SI_Q4_1 ? 4 : type == SI_Q5_0 ? 6 : 8;
    const __m128i m4 = _mm_set1_epi8(0x0F), v = load128(p + qo);
    *lo = _mm_and_si128(v, m4);
    *hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
    if (type == SI_Q5_0 || type == SI_Q5_1) {
        uint32_t bits;
        memcpy(&bits, p + (type == SI_Q5_0 ? 2 : 4), 4);
        *lo = _mm_or_si128(*lo, bit5_128(bits));
        *hi = _mm_or_si128(*hi, bit5_128(bits >> 16));
    }
}
/* An unpacked block times x's block at xq: 4 int32 partial sums. The two int16 halves are added
 * before widening (at most 2 * 2 * 31 * 127 = 15,748: no overflow). */
INLINE __m128i dot_unpacked_128(__m128i lo, __m128i hi, const int8_t *xq) {
    const __m128i s = _mm_add_epi16(_mm_maddubs_epi16(lo, load128(xq)),
                                    _mm_maddubs_epi16(hi, load128(xq + 16)));
    return _mm_madd_epi16(s, _mm_set1_epi16(1));
}

/* dot_b32 in 128-bit registers: 4 int32 partial sums of one block times x's block at xq; Q8_0's
 * halves are widened before they are added (2 * 127 * 127 each). */
INLINE __m128i dot_b32_128(const int type, const uint8_t *p, const int8_t *xq) {
    if (type == SI_Q8_0) {
        const __m128i x0 = load128(xq), x1 = load128(xq + 16), one = _mm_set1_epi16(1);
        const __m128i w0 = load128(p + 2), w1 = load128(p + 18);
        const __m128i a = _mm_maddubs_epi16(_mm_abs_epi8(w0), _mm_sign_epi8(x0, w0));
        const __m128i b = _mm_maddubs_epi16(_mm_abs_epi8(w1), _mm_sign_epi8(x1, w1));
        return _mm_add_epi32(_mm_madd_epi16(a, one), _mm_madd_epi16(b, one));
    }
    __m128i lo, hi;
    unpack_b32_128(type, p, &lo, &hi);
    return dot_unpacked_128(lo, hi, xq);
}

/* The integer sums of 4 consecutive 4-bit blocks, unpacked (lo/hi as dot_b32_128 makes them),
 * against x's 4 blocks at xq: one int32 per block. The int16 sums of each block are folded by
 * horizontal adds before one widening madd (at most 16 products of 15 * 127 = 30,480 per
 * int16: 4-bit blocks only), so 4 blocks take one convert and one FMA. */
INLINE __m128i sums4_q4(const __m128i *lo, const __m128i *hi, const int8_t *xq) {
    __m128i s[4];
    for (int k = 0; k < 4; k++)
        s[k] = _mm_add_epi16(_mm_maddubs_epi16(lo[k], load128(xq + 32 * k)),
                             _mm_maddubs_epi16(hi[k], load128(xq + 32 * k + 16)));
    const __m128i h = _mm_hadd_epi16(_mm_hadd_epi16(s[0], s[1]), _mm_hadd_epi16(s[2], s[3]));
    return _mm_madd_epi16(h, _mm_set1_epi16(1));
}
#endif

/* type: SI_Q4_0, SI_Q4_1, SI_Q5_0, SI_Q5_1 or SI_Q8_0 (a constant after inlining).
 * Blocks go 8 at a time: the 8 scale products d_w*d_x are made in one vector and broadcast per
 * block with a permute; the zero-point/minimum terms accumulate as a vector (per row: accm). */
INLINE void rows_b32(const int type, const int bsize, const uint8_t *w, size_t rb, const int R,
                     const si_xq *x, int nb, float *y, const uint8_t *pf,
                     const int far) {
    __m256 acc[4], accm[4];
    for (int r = 0; r < R; r++) {
        acc[r] = _mm256_setzero_ps();
        accm[r] = _mm256_setzero_ps();
    }
    const int has_min = type == SI_Q4_1 || type == SI_Q5_1;
#if SI_NARROW
    __m128 n0[4], n1[4]; /* two chains: a block's FMA waits on the one before it but one */
    for (int r = 0; r < R; r++) n0[r] = n1[r] = _mm_setzero_ps();
#endif
    int b = 0;
    for (; b + 8 <= nb; b += 8) {
        const __m256 xd = _mm256_loadu_ps(x->d + b), xs = _mm256_loadu_ps(x->s + b);
        if (pf) prefetch(pf + (size_t)b * R * bsize, 8 * R * bsize, far);
        for (int r = 0; r < R; r++) {
            const uint8_t *p = w + (size_t)r * rb + (size_t)b * bsize;
            const __m256 dw = f16x8(p, bsize, 0);
            const __m256 scale = _mm256_mul_ps(dw, xd);
            if (has_min) accm[r] = _mm256_fmadd_ps(f16x8(p, bsize, 2), xs, accm[r]);
            else if (type != SI_Q8_0) accm[r] = _mm256_fmadd_ps(dw, xs, accm[r]);
#if SI_NARROW
            {
                const __m128 s0 = _mm256_castps256_ps128(scale), s1 = _mm256_extractf128_ps(scale, 1);
                const int8_t *xb = x->q + 32 * (size_t)b;
                if (type == SI_Q4_0 || type == SI_Q4_1) { /* 4 blocks per convert and FMA */
                    __m128i lo[8], hi[8];
                    for (int k = 0; k < 8; k++)
                        unpack_b32_128(type, p + (size_t)k * bsize, &lo[k], &hi[k]);
                    n0[r] = _mm_fmadd_ps(_mm_cvtepi32_ps(sums4_q4(lo, hi, xb)), s0, n0[r]);
                    n1[r] = _mm_fmadd_ps(_mm_cvtepi32_ps(sums4_q4(lo + 4, hi + 4, xb + 128)), s1,
                                         n1[r]);
                    continue;
                }
#define NARROW(k, S, i, A)                                                                     \
    A[r] = _mm_fmadd_ps(_mm_cvtepi32_ps(dot_b32_128(type, p + (k) * bsize, xb + 32 * (k))),    \
                        _mm_shuffle_ps(S, S, _MM_SHUFFLE(i, i, i, i)), A[r])
                NARROW(0, s0, 0, n0); NARROW(1, s0, 1, n1); NARROW(2, s0, 2, n0);
                NARROW(3, s0, 3, n1); NARROW(4, s1, 0, n0); NARROW(5, s1, 1, n1);
                NARROW(6, s1, 2, n0); NARROW(7, s1, 3, n1);
#undef NARROW
                continue;
            }
#endif
#if !SI_AVX512 && !SI_NARROW
            if ((type == SI_Q4_0 || type == SI_Q4_1) && x->g) {
                const int off = type == SI_Q4_0 ? 2 : 4;
                for (int k = 0; k < 8; k += 2) {
                    const __m256i dot = pair_q4(p + off + k * bsize, bsize,
                                                (const int8_t *)x->g + 32 * (size_t)(b + k));
                    const __m256 sk = _mm256_permutevar8x32_ps(scale, pair_idx(k));
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), sk, acc[r]);
                }
                continue;
            }
#endif
            for (int k = 0; k < 8; k++) {
                const __m256i dot = dot_b32(type, p + k * bsize, loadx(x, b + k));
                const __m256 sk = _mm256_permutevar8x32_ps(scale, _mm256_set1_epi32(k));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), sk, acc[r]);
            }
        }
    }
#if SI_NARROW
    for (int r = 0; r < R; r++) /* the 128-bit sums into the 256-bit ones' low half */
        acc[r] = _mm256_add_ps(acc[r], _mm256_setr_m128(_mm_add_ps(n0[r], n1[r]), _mm_setzero_ps()));
#endif
    float cs[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (; b < nb; b++) { /* the last nb % 8 blocks, one at a time */
        const __m256i xv = loadx(x, b);
        const float xd = x->d[b], xs = x->s[b];
        for (int r = 0; r < R; r++) {
            const uint8_t *p = w + (size_t)r * rb + (size_t)b * bsize;
            const float dw = f16(p);
            if (has_min) cs[r] += f16(p + 2) * xs;
            else if (type != SI_Q8_0) cs[r] += dw * xs;
            const __m256i dot = dot_b32(type, p, xv);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dw * xd), acc[r]);
        }
    }
    /* offset per unit of the zero-point terms: w = d*(q - z) for Q4_0 (z = 8), Q5_0 (z = 16);
     * w = d*q + m for Q4_1/Q5_1 */
    const float zk = type == SI_Q4_0 ? -8.0f : type == SI_Q5_0 ? -16.0f : 1.0f;
    for (int r = 0; r < R; r++) {
        float z = hsum(accm[r]) + cs[r];
        y[r] = hsum(acc[r]) + (type == SI_Q8_0 ? 0.0f : zk * z);
    }
}

#if SI_AVX512
/* R Q4_0/Q4_1 rows against x (x->g set) in groups of 4 blocks (see XG_STRIDE): per group and row
 * one gather, two dpbusd (Q4_0's zero point is in the integers: they start from x's z), one
 * convert and one FMA with the 16 lanes' scale products; Q4_1's minima go through x's s4. */
INLINE void rows_q4g(const int type, const uint8_t *w, size_t rb, const int R, const si_xq *x,
                     int nb, float *y, const uint8_t *pf, const int far) {
    const int bsize = type == SI_Q4_0 ? 18 : 20, G = nb / 4, rem = nb % 4;
    const __m512i qidx = q4g_qidx(bsize), didx = q4g_didx(bsize, 0), midx = q4g_didx(bsize, 1);
    const __m512i lb = lane_block();
    __m512 acc[4], accm[4];
    for (int r = 0; r < R; r++) acc[r] = accm[r] = _mm512_setzero_ps();
    for (int g = 0; g < G + (rem > 0); g++) {
        if (pf) prefetch(pf + (size_t)g * R * 4 * bsize, 4 * R * bsize, far);
        const uint8_t *xg = xg_at(x, g);
        const __m512i z = type == SI_Q4_0 ? xg_z(xg) : _mm512_setzero_si512();
        const __m512 xd = xg_f4(xg, XG_D, lb);
        const __m512 xs = type == SI_Q4_1 ? xg_f4(xg, XG_S4, lb) : _mm512_setzero_ps();
        for (int r = 0; r < R; r++) {
            const uint8_t *p = w + (size_t)r * rb + (size_t)g * 4 * bsize;
            __m512i a;
            const __m512i q = g < G ? q4g_quants(p, bsize, qidx, &a)
                                    : q4g_quants_part(p, bsize, rem, qidx, &a);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q4g_dot(nib_lo(q), nib_hi(q), z, xg)),
                                     _mm512_mul_ps(q4g_halfs(a, didx), xd), acc[r]);
            if (type == SI_Q4_1) accm[r] = _mm512_fmadd_ps(q4g_halfs(a, midx), xs, accm[r]);
        }
    }
    for (int r = 0; r < R; r++)
        y[r] = _mm512_reduce_add_ps(type == SI_Q4_1 ? _mm512_add_ps(acc[r], accm[r]) : acc[r]);
}
/* R Q5_0 or Q5_1 rows against x (x->g set) in groups of 4 blocks (88 / 96 bytes): the quant
 * bytes and scales gathered as for Q4_0 / Q4_1 (the second load 32 bytes at byte 56 / 64), each
 * block's 32 fifth bits turned into two byte masks (elements 0..15 and 16..31 of the 4 blocks)
 * that add 16 where set; Q5_0's zero point (16) through twice x's z, Q5_1's minima through x's
 * s4 as Q4_1's. */
INLINE void rows_q5g(const int type, const uint8_t *w, size_t rb, const int R, const si_xq *x,
                     int nb, float *y, const uint8_t *pf, const int far) {
    const int one = type == SI_Q5_1, bsize = one ? 24 : 22, gsize = 4 * bsize, hoff = one ? 4 : 2;
    const int G = nb / 4, rem = nb % 4;
    /* block 3's scale (and minimum) is in the second load: the scales take a two-table permute */
    const __m512i qidx = q4g_qidx(bsize), didx = q4g_didx(bsize, 0), midx = q4g_didx(bsize, 1);
    const __m512i lb = lane_block(), k16 = _mm512_set1_epi8(16);
    __m512 acc[4], accm[4];
    for (int r = 0; r < R; r++) acc[r] = accm[r] = _mm512_setzero_ps();
    for (int g = 0; g < G + (rem > 0); g++) { /* a last partial group read as zero past the row */
        if (pf) prefetch(pf + (size_t)g * R * gsize, R * gsize, far);
        const int nk = g < G ? 4 : rem;
        const uint8_t *xg = xg_at(x, g);
        const __m512i z = one ? _mm512_setzero_si512() : xg_z(xg), z16 = _mm512_add_epi32(z, z);
        const __m512 xd = xg_f4(xg, XG_D, lb);
        const __m512 xs = one ? xg_f4(xg, XG_S4, lb) : _mm512_setzero_ps();
        for (int r = 0; r < R; r++) {
            const uint8_t *p = w + (size_t)r * rb + (size_t)g * gsize;
            const __m512i a = g < G ? _mm512_loadu_si512((const void *)p) : load_part(p, 0, bsize * rem);
            const __m512i b = g < G ? _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p + q4g_second(bsize))))
                                    : load_part(p, q4g_second(bsize), bsize * rem);
            const __m512i q = _mm512_permutex2var_epi16(a, qidx, b);
            uint64_t mlo = 0, mhi = 0;
            for (int k = 0; k < nk; k++) {
                uint32_t h;
                memcpy(&h, p + bsize * k + hoff, 4);
                mlo |= (uint64_t)(h & 0xFFFFu) << (16 * k);
                mhi |= (uint64_t)(h >> 16) << (16 * k);
            }
            __m512i lo = nib_lo(q), hi = nib_hi(q);
            lo = _mm512_mask_add_epi8(lo, (__mmask64)mlo, lo, k16);
            hi = _mm512_mask_add_epi8(hi, (__mmask64)mhi, hi, k16);
            const __m512 dwv = _mm512_cvtph_ps(
                _mm512_castsi512_si256(_mm512_permutex2var_epi16(a, didx, b)));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q4g_dot(lo, hi, z16, xg)),
                                     _mm512_mul_ps(dwv, xd), acc[r]);
            if (one)
                accm[r] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(
                                              _mm512_permutex2var_epi16(a, midx, b))),
                                          xs, accm[r]);
        }
    }
    for (int r = 0; r < R; r++)
        y[r] = _mm512_reduce_add_ps(one ? _mm512_add_ps(acc[r], accm[r]) : acc[r]);
}
/* Q8_0 two blocks (68 bytes) per 512-bit step: a word permute gathers the pair's 64 quant bytes
 * from a 64-byte and a 16-byte load (at byte 52: word 26), a sign flip (xor 0x80) makes them
 * unsigned for one dpbusd, from which 128 times x's sums (one dpbusd per step, shared by the
 * rows) is taken back; one convert and one FMA with the pair's scale products. The last block
 * of an odd row as rows_b32 does it. Shared by the GEMV (rows_q8_512) and the GEMM (multi_q8),
 * which so give the same bits. */
INLINE __m512i q8p_qidx(void) { /* block 0's quants: words 1..16, block 1's: 18..33 */
    int16_t v[32];
    for (int j = 0; j < 32; j++) {
        const int wd = j < 16 ? 1 + j : 18 + j - 16;
        v[j] = (int16_t)(wd < 32 ? wd : 32 + wd - 26);
    }
    return _mm512_loadu_si512((const void *)v);
}
INLINE __m512i q8p_didx(void) { /* lanes 0..7: block 0's scale (word 0), 8..15: block 1's (17) */
    int16_t v[32];
    for (int j = 0; j < 32; j++) v[j] = (int16_t)(j % 16 < 8 ? 0 : 17);
    return _mm512_loadu_si512((const void *)v);
}
/* x's blocks b and b + 1: their 64 bytes, 128 times each dpbusd lane's 4-byte sum, and the
 * lanes' scales. */
typedef struct {
    __m512i v, z;
    __m512 d;
} q8p_x;
INLINE q8p_x q8p_xpair(const si_xq *x, const int b) {
    const __m512i v = _mm512_loadu_si512((const void *)(x->q + 32 * (size_t)b));
    const __m512i z = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8((char)0x80), v);
    const __m512 d = _mm512_castpd_ps(_mm512_insertf64x4(
        _mm512_castps_pd(_mm512_set1_ps(x->d[b])), _mm256_castps_pd(_mm256_set1_ps(x->d[b + 1])), 1));
    return (q8p_x){v, z, d};
}
/* The pair of blocks at p: its quants, sign-flipped, and (*dw) its scales on the lanes. */
INLINE __m512i q8p_quants(const uint8_t *p, __m512i qidx, __m512i didx, __m512 *dw) {
    const __m512i a = _mm512_loadu_si512((const void *)p);
    const __m512i c = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(p + 52)));
    *dw = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(didx, a)));
    return _mm512_xor_si512(_mm512_permutex2var_epi16(a, qidx, c), _mm512_set1_epi8((char)0x80));
}
/* acc plus the pair (q, dw) times x's pair. */
INLINE __m512 q8p_fma(__m512i q, __m512 dw, const q8p_x xp, __m512 acc) {
    const __m512i dot = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), q, xp.v), xp.z);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, xp.d), acc);
}
/* acc plus the odd last block b of a row (p: its start) times x's block b. */
INLINE __m256 q8_last(const uint8_t *p, const si_xq *x, const int b, __m256 acc) {
    const uint8_t *pb = p + (size_t)b * 34;
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_b32(SI_Q8_0, pb, loadx(x, b))),
                           _mm256_set1_ps(f16(pb) * x->d[b]), acc);
}

/* R Q8_0 rows against x two blocks per step (above). */
INLINE void rows_q8_512(const uint8_t *w, size_t rb, const int R, const si_xq *x, int nb,
                        float *y, const uint8_t *pf, const int far) {
    const __m512i qidx = q8p_qidx(), didx = q8p_didx();
    __m512 acc[4];
    __m256 acc8[4];
    for (int r = 0; r < R; r++) {
        acc[r] = _mm512_setzero_ps();
        acc8[r] = _mm256_setzero_ps();
    }
    __m512 dw;
    int b = 0;
    for (; b + 4 <= nb; b += 4) { /* 4 blocks of a row before the next row: longer runs per stream */
        if (pf) prefetch(pf + (size_t)b * R * 34, 4 * R * 34, far);
        const q8p_x x0 = q8p_xpair(x, b), x1 = q8p_xpair(x, b + 2);
        for (int r = 0; r < R; r++) {
            const uint8_t *p = w + (size_t)r * rb + (size_t)b * 34;
            __m512i q = q8p_quants(p, qidx, didx, &dw);
            acc[r] = q8p_fma(q, dw, x0, acc[r]);
            q = q8p_quants(p + 68, qidx, didx, &dw);
            acc[r] = q8p_fma(q, dw, x1, acc[r]);
        }
    }
    for (; b + 2 <= nb; b += 2) {
        const q8p_x x0 = q8p_xpair(x, b);
        for (int r = 0; r < R; r++) {
            const __m512i q = q8p_quants(w + (size_t)r * rb + (size_t)b * 34, qidx, didx, &dw);
            acc[r] = q8p_fma(q, dw, x0, acc[r]);
        }
    }
    if (b < nb)
        for (int r = 0; r < R; r++) acc8[r] = q8_last(w + (size_t)r * rb, x, b, acc8[r]);
    for (int r = 0; r < R; r++) y[r] = _mm512_reduce_add_ps(acc[r]) + hsum(acc8[r]);
}
#endif

/* ------------------------------------------------------------------ K-quants (256 weights) */

/* Q4_K/Q5_K: 8 six-bit scales and minima packed into 12 bytes (a = bytes 0..3, b = 4..7,
 * c = 8..11): sc[0..3] = low 6 bits of a, m[0..3] = low 6 bits of b; sc[4..7] = low nibbles of c
 * with the top 2 bits of a above them, m[4..7] = high nibbles of c with the top 2 bits of b.
 * Returns the 8 scales and the 8 minima as bytes of two 64-bit words. */
INLINE void scales_k(const uint8_t *s, uint64_t *sc, uint64_t *m) {
    uint32_t a, b, c;
    memcpy(&a, s, 4);
    memcpy(&b, s + 4, 4);
    memcpy(&c, s + 8, 4);
    const uint32_t lo6 = 0x3f3f3f3fu, lo4 = 0x0f0f0f0fu, lo2 = 0x03030303u;
    const uint32_t sc_hi = (c & lo4) | (((a >> 6) & lo2) << 4);
    const uint32_t m_hi = ((c >> 4) & lo4) | (((b >> 6) & lo2) << 4);
    *sc = (uint64_t)(a & lo6) | ((uint64_t)sc_hi << 32);
    *m = (uint64_t)(b & lo6) | ((uint64_t)m_hi << 32);
}

/* The 8 lane sums of 8 vectors of 16 int16 sums of 2 products (v[j]'s lanes summed into lane
 * j) of 4- or 5-bit weights and x bytes (each at most 2 x 31 x 127 = 7874): two levels of
 * horizontal adds within 128-bit halves stay in int16 (8 products: at most 31496), then
 * widened, then the halves added. */
INLINE __m256i sums8_16(const __m256i *v) {
    const __m256i one = _mm256_set1_epi16(1);
    const __m256i q0 = _mm256_madd_epi16(
        _mm256_hadd_epi16(_mm256_hadd_epi16(v[0], v[1]), _mm256_hadd_epi16(v[2], v[3])), one);
    const __m256i q1 = _mm256_madd_epi16(
        _mm256_hadd_epi16(_mm256_hadd_epi16(v[4], v[5]), _mm256_hadd_epi16(v[6], v[7])), one);
    return _mm256_add_epi32(_mm256_permute2x128_si256(q0, q1, 0x20), _mm256_permute2x128_si256(q0, q1, 0x31));
}

/* v's 16-bit lanes shifted left by n (right by -n when n < 0); n a constant after inlining. */
INLINE __m256i shift16(const __m256i v, const int n) {
    return n >= 0 ? _mm256_slli_epi16(v, n) : _mm256_srli_epi16(v, -n);
}

INLINE __m256 bytes8_ps(uint64_t v) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)v)));
}

#if SI_NARROW
/* The 8 sub-block integer sums of one Q4_K/Q5_K super-block (qs: 128 nibble bytes; qh: Q5_K's
 * 32 fifth-bit bytes; xq: x's 256 bytes) as 8 floats, in 128-bit registers: per sub-block two
 * maddubs of 16 (int16 sums of 4 products), widened with one madd per sub-block, the 8 sums
 * gathered by horizontal adds so the caller scales them with one FMA. */
INLINE __m256 k45_sums_128(const int five, const uint8_t *qs, const uint8_t *qh, const int8_t *xq) {
    const __m128i m4 = _mm_set1_epi8(0x0F), one = _mm_set1_epi16(1), b5 = _mm_set1_epi8(0x10);
    __m128i h0 = _mm_setzero_si128(), h1 = _mm_setzero_si128();
    if (five) h0 = load128(qh), h1 = load128(qh + 16);
    __m128i s[8];
    for (int c = 0; c < 4; c++) {
        const __m128i v0 = load128(qs + 32 * c), v1 = load128(qs + 32 * c + 16);
        __m128i a0 = _mm_and_si128(v0, m4), a1 = _mm_and_si128(v1, m4);
        __m128i b0 = _mm_and_si128(_mm_srli_epi16(v0, 4), m4), b1 = _mm_and_si128(_mm_srli_epi16(v1, 4), m4);
        if (five) {
            const __m128i bj0 = _mm_set1_epi8((char)(1 << (2 * c))), bj1 = _mm_set1_epi8((char)(2 << (2 * c)));
            a0 = _mm_or_si128(a0, _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(h0, bj0), bj0), b5));
            a1 = _mm_or_si128(a1, _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(h1, bj0), bj0), b5));
            b0 = _mm_or_si128(b0, _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(h0, bj1), bj1), b5));
            b1 = _mm_or_si128(b1, _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(h1, bj1), bj1), b5));
        }
        const int8_t *x0 = xq + 64 * c, *x1 = x0 + 32;
        s[2 * c] = _mm_madd_epi16(_mm_add_epi16(_mm_maddubs_epi16(a0, load128(x0)),
                                                _mm_maddubs_epi16(a1, load128(x0 + 16))), one);
        s[2 * c + 1] = _mm_madd_epi16(_mm_add_epi16(_mm_maddubs_epi16(b0, load128(x1)),
                                                    _mm_maddubs_epi16(b1, load128(x1 + 16))), one);
    }
    const __m128i lo = _mm_hadd_epi32(_mm_hadd_epi32(s[0], s[1]), _mm_hadd_epi32(s[2], s[3]));
    const __m128i hi = _mm_hadd_epi32(_mm_hadd_epi32(s[4], s[5]), _mm_hadd_epi32(s[6], s[7]));
    return _mm256_cvtepi32_ps(_mm256_setr_m128i(lo, hi));
}
#endif

/* Q4_K (144 bytes: d, dmin, scales[12], qs[128]) and Q5_K (176 bytes: d, dmin, scales[12],
 * qh[32], qs[128]). Sub-block j (32 weights) of a super-block: nibbles of qs[32*(j/2) ..] (low
 * for even j, high for odd j), fifth bit = bit j of qh[0..31]. w = d*sc[j]*q - dmin*m[j].
 * The 8 scale products d*sc[j]*xd[j] are made in one vector and broadcast per sub-block; the
 * minima terms dmin*m[j]*xs[j] accumulate as a vector too. */
INLINE void rows_k45(const int five, const uint8_t *w, size_t rb, const int R, const si_xq *x,
                     int nsb, float *y, const uint8_t *pf,
                     const int far) {
    const int bsize = five ? 176 : 144;
    __m256 acc[4], accm[4];
    for (int r = 0; r < R; r++) {
        acc[r] = _mm256_setzero_ps();
        accm[r] = _mm256_setzero_ps();
    }
    const __m256i lo4 = _mm256_set1_epi8(0x0F);
    for (int sb = 0; sb < nsb; sb++) {
        const __m256 xd = _mm256_loadu_ps(x->d + 8 * (size_t)sb);
        const __m256 xs = _mm256_loadu_ps(x->s + 8 * (size_t)sb);
        if (pf) prefetch(pf + (size_t)sb * R * bsize, R * bsize, far);
#pragma GCC unroll 4 /* the rows unrolled: one row's super-block work interleaves with the next's */
        for (int r = 0; r < R; r++) {
            const uint8_t *p = w + (size_t)r * rb + (size_t)sb * bsize;
            uint64_t sc8, m8;
            scales_k(p + 4, &sc8, &m8);
            const __m256 scale = _mm256_mul_ps(_mm256_mul_ps(bytes8_ps(sc8), xd), _mm256_set1_ps(f16(p)));
            accm[r] = _mm256_fmadd_ps(_mm256_mul_ps(bytes8_ps(m8), _mm256_set1_ps(f16(p + 2))), xs,
                                      accm[r]);
            const uint8_t *qs = p + (five ? 48 : 16);
#if SI_NARROW
            {
                acc[r] = _mm256_fmadd_ps(k45_sums_128(five, qs, p + 16, x->q + 256 * (size_t)sb),
                                         scale, acc[r]);
                continue;
            }
#endif
            __m256i qh = _mm256_setzero_si256(), ps[8];
            if (five) qh = _mm256_loadu_si256((const __m256i *)(p + 16));
            for (int c = 0; c < 4; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
                __m256i lo = _mm256_and_si256(v, lo4);
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
                const int j0 = 2 * c, j1 = 2 * c + 1;
                if (five) { /* bit j of each qh byte to bit 4 of sub-block j's bytes */
                    const __m256i b5 = _mm256_set1_epi8(0x10);
                    lo = _mm256_or_si256(lo, _mm256_and_si256(shift16(qh, 4 - j0), b5));
                    hi = _mm256_or_si256(hi, _mm256_and_si256(shift16(qh, 4 - j1), b5));
                }
                /* int16 sums of 2 products, reduced in int16 (sums8_16: 8 products of 5-bit
                 * weights are at most 8 x 31 x 127 = 31496 too) */
                ps[j0] = _mm256_maddubs_epi16(lo, loadx(x, 8 * sb + j0));
                ps[j1] = _mm256_maddubs_epi16(hi, loadx(x, 8 * sb + j1));
            }
            const __m256i sums = sums8_16(ps);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) y[r] = hsum(_mm256_sub_ps(acc[r], accm[r]));
}

#if SI_AVX512
/* rows_k45_512's lane constants: dword d of pair c belongs to sub-block 2c + d / 8, whose scale
 * is dword 2c + d / 8 of the vector of 8 scales (sidx; k4_fold's floats, k45_scales' words). */
INLINE void k45_idx(__m512i *sidx) {
    for (int c = 0; c < 4; c++)
        sidx[c] = _mm512_inserti64x4(_mm512_set1_epi32(2 * c), _mm256_set1_epi32(2 * c + 1), 1);
}

/* The 256 weights of the Q4_K/Q5_K super-block at p as rows_k45_512 takes them: q[c] = sub-blocks
 * 2c and 2c + 1. */
INLINE void k45_quants_512(const int five, const uint8_t *p, __m512i *q) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), b5 = _mm512_set1_epi8(0x10);
    const __m512i cnt_nib = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(4), 1);
    const uint8_t *qs = p + (five ? 48 : 16);
    const __m512i QH = five ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(p + 16)))
                            : _mm512_setzero_si512();
    for (int c = 0; c < 4; c++) {
        const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + 32 * c)));
        q[c] = _mm512_and_si512(_mm512_srlv_epi16(v, cnt_nib), m4);
        if (five) { /* bit j = 2c + half of each qh byte to bit 4 (a word shift moves each byte's
                     * own bits), or'ed in under the 0x10 mask */
            const int j0 = 2 * c, j1 = 2 * c + 1;
            const __m512i h = j1 <= 4 ? _mm512_sllv_epi16(QH, _mm512_inserti64x4(_mm512_set1_epi16((short)(4 - j0)), _mm256_set1_epi16((short)(4 - j1)), 1))
                                      : _mm512_srlv_epi16(QH, _mm512_inserti64x4(_mm512_set1_epi16((short)(j0 - 4)), _mm256_set1_epi16((short)(j1 - 4)), 1));
            q[c] = _mm512_ternarylogic_epi32(q[c], h, b5, 0xF8); /* q | (h & b5) */
        }
    }
}

/* Q5_K in 512-bit registers against x in blocks of 128 (x->kq, kd, ks; Q4_K: k4_fold below):
 * a pair of sub-blocks (2c, 2c+1: the low and high nibbles of qs[32c .. 32c+31]) is one vector
 * of 64 weights in x's order (k45_quants_512). Per pair: maddubs (2 products in int16: at most
 * 2 x 31 x 127), then vpdpwssd times the two sub-blocks' 6-bit scales (words, k45_scales) into int32:
 * the scales stay integer across the 4 sub-blocks of a half super-block, which share one x
 * scale, so a half costs one convert and one FMA (with d kd) where x in blocks of 32 took one of
 * each per pair and a permute of the scales. The minima: dmin m[j] times x's sums per 32 (ks),
 * a 256-bit FMA per super-block. */
INLINE void k45_scales(const uint64_t sc8, const __m512i *sidx, __m512i *scl) {
    const __m256i s32 = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc8));
    /* each scale in both words of its dword: vpdpwssd multiplies word pairs */
    const __m512i s2 = _mm512_castsi256_si512(_mm256_or_si256(s32, _mm256_slli_epi32(s32, 16)));
    for (int c = 0; c < 4; c++) scl[c] = _mm512_permutexvar_epi32(sidx[c], s2);
}
/* One super-block's two half sums against x's 256 bytes at xq (q: its 4 vectors of 64 unsigned
 * weights; scl: their scale words), each converted and folded into acc with d kd[half] (d: the
 * weights' scale; kd: x's two scales). Q5_K's and Q6_K's, shared by the GEMV and the GEMM: the
 * same bits. */
INLINE __m512 xk_fold(const __m512i *q, const __m512i *scl, const int8_t *xq, const float d,
                      const float *kd, __m512 acc) {
    __m512i h[2];
    for (int k = 0; k < 2; k++) {
        const __m512i x0 = _mm512_loadu_si512((const void *)(xq + 128 * k));
        const __m512i x1 = _mm512_loadu_si512((const void *)(xq + 128 * k + 64));
        h[k] = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_maddubs_epi16(q[2 * k], x0), scl[2 * k]);
        h[k] = _mm512_dpwssd_epi32(h[k], _mm512_maddubs_epi16(q[2 * k + 1], x1), scl[2 * k + 1]);
    }
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(h[0]), _mm512_set1_ps(d * kd[0]), acc);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(h[1]), _mm512_set1_ps(d * kd[1]), acc);
}
/* Q4_K against x in blocks of 32 (x->q, d, s): per pair of sub-blocks one dpbusd, one convert
 * and one FMA with the lanes' scale products (scale: d sc[j] xd[j], 8 floats, permuted to the
 * lanes). The blocks-of-128 fold above cost Q4_K's GEMV ~13% from memory on one Zen 4 thread
 * (its scale words and two more multiplies a pair, for every row) for 10-30% on its GEMM, and a
 * 7B Q4_K_M file's one-thread decode 15%: Q4_K stays here (benchmarks/RESULTS.md). Shared by the
 * GEMV and the GEMM: the same bits. */
INLINE __m512 k4_fold(const __m512i *q, const __m512i *sidx, const int8_t *xq, const __m256 scale,
                      __m512 acc) {
    const __m512 sc = _mm512_castps256_ps512(scale);
    for (int c = 0; c < 4; c++) {
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[c],
                                                _mm512_loadu_si512((const void *)(xq + 64 * c)));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(sidx[c], sc), acc);
    }
    return acc;
}
INLINE void rows_k45_512(const int five, const uint8_t *w, size_t rb, const int R, const si_xq *x,
                         int nsb, float *y, const uint8_t *pf, const int far) {
    const int bsize = five ? 176 : 144;
    __m512 acc[4];
    __m256 accm[4];
    for (int r = 0; r < R; r++) {
        acc[r] = _mm512_setzero_ps();
        accm[r] = _mm256_setzero_ps();
    }
    __m512i sidx[4];
    k45_idx(sidx);
    for (int sb = 0; sb < nsb; sb++) {
        /* x's sums per 32 (the minima), its bytes and (Q4_K) its scales per 32 */
        const __m256 xs = _mm256_loadu_ps((five ? x->ks : x->s) + 8 * (size_t)sb);
        const __m256 xd = five ? _mm256_setzero_ps() : _mm256_loadu_ps(x->d + 8 * (size_t)sb);
        if (pf) prefetch(pf + (size_t)sb * R * bsize, R * bsize, far);
        const int8_t *xq = (five ? x->kq : x->q) + 256 * (size_t)sb;
        for (int r = 0; r < R; r++) {
            const uint8_t *p = w + (size_t)r * rb + (size_t)sb * bsize;
            uint64_t sc8, m8;
            scales_k(p + 4, &sc8, &m8);
            accm[r] = _mm256_fmadd_ps(_mm256_mul_ps(bytes8_ps(m8), _mm256_set1_ps(f16(p + 2))), xs,
                                      accm[r]);
            __m512i q[4];
            k45_quants_512(five, p, q);
            if (five) {
                __m512i scl[4];
                k45_scales(sc8, sidx, scl);
                acc[r] = xk_fold(q, scl, xq, f16(p), x->kd + 2 * (size_t)sb, acc[r]);
            } else {
                acc[r] = k4_fold(q, sidx, xq, _mm256_mul_ps(_mm256_mul_ps(bytes8_ps(sc8), xd),
                                                            _mm256_set1_ps(f16(p))), acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) y[r] = _mm512_reduce_add_ps(acc[r]) - hsum(accm[r]);
}
#endif

#if SI_NARROW
/* The 8 block sums (sum over 32 weights of scale * (q - 32) * x) of one Q6_K super-block at p
 * against x's 256 bytes, as 8 floats, in 128-bit registers (one register = one 16-weight group,
 * which has one scale). Layout as in rows_q6k below. */
INLINE __m256 q6k_sums_128(const uint8_t *p, const int8_t *xq) {
    const __m128i m4 = _mm_set1_epi8(0x0F), m2 = _mm_set1_epi8(0x03), k32 = _mm_set1_epi8(32);
    const int8_t *sc = (const int8_t *)(p + 192);
    __m128i sums[8];
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = p + 64 * h, *qh = p + 128 + 32 * h;
        const __m128i qha = load128(qh), qhb = load128(qh + 16);
        for (int s = 0; s < 4; s++) {
            const int g = 4 * h + s;
            __m128i la = load128(ql + 32 * (s & 1)), lb = load128(ql + 32 * (s & 1) + 16);
            if (s >> 1) la = _mm_srli_epi16(la, 4), lb = _mm_srli_epi16(lb, 4);
            const __m128i qa = _mm_or_si128(_mm_and_si128(la, m4),
                _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(qha, 2 * s), m2), 4));
            const __m128i qb = _mm_or_si128(_mm_and_si128(lb, m4),
                _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(qhb, 2 * s), m2), 4));
            const __m128i xa = load128(xq + 32 * g), xb = load128(xq + 32 * g + 16);
            const __m128i pa = _mm_sub_epi16(_mm_maddubs_epi16(qa, xa), _mm_maddubs_epi16(k32, xa));
            const __m128i pb = _mm_sub_epi16(_mm_maddubs_epi16(qb, xb), _mm_maddubs_epi16(k32, xb));
            sums[g] = _mm_add_epi32(_mm_madd_epi16(pa, _mm_set1_epi16(sc[2 * g])),
                                    _mm_madd_epi16(pb, _mm_set1_epi16(sc[2 * g + 1])));
        }
    }
    const __m128i lo = _mm_hadd_epi32(_mm_hadd_epi32(sums[0], sums[1]), _mm_hadd_epi32(sums[2], sums[3]));
    const __m128i hi = _mm_hadd_epi32(_mm_hadd_epi32(sums[4], sums[5]), _mm_hadd_epi32(sums[6], sums[7]));
    return _mm256_cvtepi32_ps(_mm256_setr_m128i(lo, hi));
}
#endif

/* Q6_K (210 bytes: ql[128], qh[64], int8 scales[16], d). Half h (128 weights) uses ql[64h ..
 * 64h+63] and qh[32h .. 32h+31]; its group s (32 weights, s = 0..3) takes nibble s/2 of
 * ql[64h + 32(s%2) + i] and bits 2s, 2s+1 of qh[32h + i] as bits 4, 5; w = d*scale[16th]*(q-32).
 *
 * Plain AVX2 against x in blocks of 128 (x->kq, si_quantize_xk): half a super-block's products
 * sum in integers, the sub-block scales applied by the widening madd and the q - 32 offset as
 * 32 * sum(scale * x's sums per 16), then one convert and one FMA per half and row, where x's
 * blocks of 32 took a convert, a permute and an FMA per 32 weights (slower, and llama.cpp's
 * blocks of 256 too: benchmarks/RESULTS.md). avx2_128 keeps x's blocks of 32. */
#if !SI_NARROW
/* q6k_sidx(s): for group s of a half, the bytes of int16 scales 2s (low 128 bits) and 2s + 1
 * (high 128 bits) repeated, a shuffle of the half's 8 scales broadcast to both lanes */
INLINE __m256i q6k_sidx(const int s) {
    const char a = (char)(4 * s), b = (char)(4 * s + 2);
    return _mm256_setr_epi8(a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a,
                            a + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b,
                            b + 1, b, b + 1);
}

/* Half h of the Q6_K super-block at p: its 4 groups of 32 6-bit weights (unsigned, q + 32). */
INLINE void q6k_half_256(const uint8_t *p, const int h, __m256i *wq) {
    const __m256i lo4 = _mm256_set1_epi8(0x0F), hi2 = _mm256_set1_epi8(0x30);
    const __m256i l0 = _mm256_loadu_si256((const __m256i *)(p + 64 * h));
    const __m256i l1 = _mm256_loadu_si256((const __m256i *)(p + 64 * h + 32));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * h));
    for (int s = 0; s < 4; s++) {
        __m256i l = (s & 1) ? l1 : l0;
        l = _mm256_and_si256((s >> 1) ? _mm256_srli_epi16(l, 4) : l, lo4);
        wq[s] = _mm256_or_si256(l, _mm256_and_si256(shift16(qh, 4 - 2 * s), hi2)); /* qh bits 2s, 2s+1 */
    }
}

/* The integer sum over half h of the super-block at p of scale * (q - 32) * kq (x's 128 bytes
 * xk, its 8 sums per 16 bs), as 8 int32 lanes; wq: the half's weights (q6k_half_256). */
INLINE __m256i q6k_isum(const uint8_t *p, const int h, const __m256i *wq, const int8_t *xk,
                        const __m128i bs, const __m256i *sidx) {
    const __m128i sc = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(p + 192 + 8 * h)));
    /* -32 * sum(scale * bsum): the offset, in one madd */
    __m256i isum = _mm256_castsi128_si256(_mm_sub_epi32(_mm_setzero_si128(),
                                                        _mm_slli_epi32(_mm_madd_epi16(sc, bs), 5)));
    isum = _mm256_inserti128_si256(isum, _mm_setzero_si128(), 1);
    const __m256i s2 = _mm256_broadcastsi128_si256(sc);
    for (int s = 0; s < 4; s++) {
        const __m256i p16 = _mm256_maddubs_epi16(wq[s], _mm256_loadu_si256((const __m256i *)(xk + 32 * s)));
        isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p16, _mm256_shuffle_epi8(s2, sidx[s])));
    }
    return isum;
}
#endif

INLINE void rows_q6k(const uint8_t *w, size_t rb, const int R, const si_xq *x, int nsb, float *y,
                     const uint8_t *pf,
                     const int far) {
    __m256 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
#if !SI_NARROW
    __m256i sidx[4];
    for (int s = 0; s < 4; s++) sidx[s] = q6k_sidx(s);
#endif
    for (int sb = 0; sb < nsb; sb++) {
        if (pf) prefetch(pf + (size_t)sb * R * 210, R * 210, far);
#if !SI_NARROW
        const __m128i bs0 = _mm_loadu_si128((const __m128i *)(x->kbs + 16 * (size_t)sb));
        const __m128i bs1 = _mm_loadu_si128((const __m128i *)(x->kbs + 16 * (size_t)sb + 8));
        const int8_t *xk = x->kq + 256 * (size_t)sb;
        const float xd0 = x->kd[2 * sb], xd1 = x->kd[2 * sb + 1];
#endif
        for (int r = 0; r < R; r++) {
            const uint8_t *p = w + (size_t)r * rb + (size_t)sb * 210;
            const float d = f16(p + 208);
#if SI_NARROW
            const __m256 dx = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_loadu_ps(x->d + 8 * (size_t)sb));
            acc[r] = _mm256_fmadd_ps(q6k_sums_128(p, x->q + 256 * (size_t)sb), dx, acc[r]);
#else
            __m256i wq[4];
            q6k_half_256(p, 0, wq);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q6k_isum(p, 0, wq, xk, bs0, sidx)),
                                     _mm256_set1_ps(d * xd0), acc[r]);
            q6k_half_256(p, 1, wq);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q6k_isum(p, 1, wq, xk + 128, bs1, sidx)),
                                     _mm256_set1_ps(d * xd1), acc[r]);
#endif
        }
    }
    for (int r = 0; r < R; r++) y[r] = hsum(acc[r]);
}

#if SI_AVX512
/* rows_q6k_512's lane indices: dword l of vector hv (weights 64 hv + 4l .. 4l + 3) belongs to
 * the 16-weight group 4 hv + l / 4, whose scale is dword 4 hv + l / 4 of q6k_scales' vector. */
INLINE void q6k_didx(__m512i *didx) {
    for (int hv = 0; hv < 4; hv++) {
        int32_t a[16];
        for (int l = 0; l < 16; l++) a[l] = 4 * hv + l / 4;
        didx[hv] = _mm512_loadu_si512((const void *)a);
    }
}

/* The 256 weights of the Q6_K super-block at p as rows_q6k_512 takes them, unsigned (q + 32):
 * q[2h] and q[2h + 1] the low and high vectors of half h. */
INLINE void q6k_quants_512(const uint8_t *p, __m512i *q) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    /* the top 2 bits to bits 4-5 by a word shift (each byte's own bits move): low vector (groups
     * 0, 1) bits 0-1 / 2-3 left by 4 / 2, high vector bits 4-5 / 6-7 right by 0 / 2 */
    const __m512i sh_lo = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i sh_hi = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
    for (int h = 0; h < 2; h++) {
        const __m512i L = _mm512_loadu_si512((const void *)(p + 64 * h));
        const __m512i QH = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(p + 128 + 32 * h)));
        /* (nibbles & 0x0F) | top bits, one ternary-logic operation */
        q[2 * h] = _mm512_ternarylogic_epi32(L, _mm512_and_si512(_mm512_sllv_epi16(QH, sh_lo), m30), m4, 0xEC);
        q[2 * h + 1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(L, 4),
                                                 _mm512_and_si512(_mm512_srlv_epi16(QH, sh_hi), m30), m4, 0xEC);
    }
}

/* Q6_K in 512-bit registers against x in blocks of 128 (x->kq, kd, kbs): per half h of a
 * super-block, ql's 64 bytes give the 4-bit parts of weights 0..63 (low nibbles) and 64..127
 * (high nibbles) of the half in order, and qh's 32 bytes (broadcast to both 256-bit halves)
 * their top 2 bits (q6k_quants_512): q + 32, unsigned. Per vector of 64 weights: maddubs
 * (2 products in int16: at most 2 x 63 x 127), then vpdpwssd times the four 16-weight groups'
 * int8 scales (words, q6k_scales) into int32, so a half (one x scale) costs one convert and one
 * FMA; the + 32 comes back as 32 sum_j scale_j (x's sum over group j, kbs), one 256-bit
 * multiply-add per super-block for both halves. */
INLINE void q6k_scales(const uint8_t *p, const __m512i *didx, __m512i *scl, __m256i *sc16) {
    const __m128i sc = _mm_loadu_si128((const __m128i *)(p + 192));
    *sc16 = _mm256_cvtepi8_epi16(sc);
    /* each scale in both words of its dword: vpdpwssd multiplies word pairs */
    const __m512i s32 = _mm512_cvtepi8_epi32(sc);
    const __m512i s2 = _mm512_or_si512(_mm512_and_si512(s32, _mm512_set1_epi32(0xFFFF)),
                                       _mm512_slli_epi32(s32, 16));
    for (int hv = 0; hv < 4; hv++) scl[hv] = _mm512_permutexvar_epi32(didx[hv], s2);
}
/* One Q6_K super-block against x's 256 bytes at xq: xk_fold, and the + 32 taken back into accm
 * (kbs: x's 16 sums per 16; sc16: the 16 scales as words). */
INLINE __m512 q6k_xk_fold(const __m512i *q, const __m512i *scl, const __m256i sc16,
                          const int8_t *xq, const int16_t *kbs, const float d, const float *kd,
                          __m512 acc, __m256 *accm) {
    acc = xk_fold(q, scl, xq, d, kd, acc);
    /* lanes 0-3: half 0's groups in pairs, 4-7: half 1's */
    const __m256i off = _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)kbs));
    const __m256 dk = _mm256_set_m128(_mm_set1_ps(32.0f * (d * kd[1])), _mm_set1_ps(32.0f * (d * kd[0])));
    *accm = _mm256_fmadd_ps(_mm256_cvtepi32_ps(off), dk, *accm);
    return acc;
}
INLINE void rows_q6k_512(const uint8_t *w, size_t rb, const int R, const si_xq *x, int nsb,
                         float *y, const uint8_t *pf, const int far) {
    __m512 acc[4];
    __m256 accm[4];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps(), accm[r] = _mm256_setzero_ps();
    __m512i didx[4];
    q6k_didx(didx);
    for (int sb = 0; sb < nsb; sb++) {
        if (pf) prefetch(pf + (size_t)sb * R * 210, R * 210, far);
        const int8_t *xq = x->kq + 256 * (size_t)sb;
        const int16_t *kbs = x->kbs + 16 * (size_t)sb;
        const float *kd = x->kd + 2 * (size_t)sb;
        for (int r = 0; r < R; r++) {
            const uint8_t *p = w + (size_t)r * rb + (size_t)sb * 210;
            __m512i q[4], scl[4];
            __m256i sc16;
            q6k_quants_512(p, q);
            q6k_scales(p, didx, scl, &sc16);
            acc[r] = q6k_xk_fold(q, scl, sc16, xq, kbs, f16(p + 208), kd, acc[r], &accm[r]);
        }
    }
    for (int r = 0; r < R; r++) y[r] = _mm512_reduce_add_ps(acc[r]) - hsum(accm[r]);
}
#endif

/* ------------------------------------------------------------------ F16 rows, fp32 x */

INLINE void rows_f16(const uint8_t *w, size_t rb, const int R, const si_xq *x, int cols, float *y,
                     const uint8_t *pf,
                     const int far) {
    __m256 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int c = 0; c < cols; c += 8) {
        const __m256 xv = _mm256_loadu_ps(x->f + c);
        if (pf) prefetch(pf + (size_t)c * 2 * R, 16 * R, far);
        for (int r = 0; r < R; r++) {
            const __m128i h = _mm_loadu_si128((const __m128i *)(w + (size_t)r * rb + 2 * (size_t)c));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtph_ps(h), xv, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) y[r] = hsum(acc[r]);
}

/* ------------------------------------------------------------------ BF16 rows, fp32 x */

/* bfloat16 is a float32's top 16 bits: widened and shifted, each weight is exact */
INLINE __m256 bf16_ps(const uint8_t *p) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

INLINE void rows_bf16(const uint8_t *w, size_t rb, const int R, const si_xq *x, int cols,
                      float *y, const uint8_t *pf, const int far) {
    __m256 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int c = 0; c < cols; c += 8) {
        const __m256 xv = _mm256_loadu_ps(x->f + c);
        if (pf) prefetch(pf + (size_t)c * 2 * R, 16 * R, far);
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(bf16_ps(w + (size_t)r * rb + 2 * (size_t)c), xv, acc[r]);
    }
    for (int r = 0; r < R; r++) y[r] = hsum(acc[r]);
}

/* R <= 4 F16 (bf = 0) or BF16 (bf = 1) rows against nt <= F16_XT x rows, R x nt accumulators
 * in registers: each 8 weights widened once for the x rows, each 8 of an x row loaded once for
 * the weight rows (one weight row against many x rows waited on loads of x from L2). Every
 * (row, x row) sums the same products in the same order as rows_f16 / rows_bf16: each GEMM row
 * is its GEMV bit for bit. y[t * ys + r]. */
#define F16_XT 3
/* si_rows_multi takes a chunk's rows F16_RB at a time through every x row: those rows' weights
 * (128 KiB of F16 at 4096 columns) stay in L2 for all the x rows, instead of each group of
 * F16_XT x rows streaming the whole chunk (megabytes) again */
#define F16_RB 16
INLINE void tile_f16(const int bf, const uint8_t *w, const size_t rb, const int R,
                     const si_xq *x, const int nt, const int cols, float *y, const int64_t ys) {
    __m256 acc[4][F16_XT];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < nt; t++) acc[r][t] = _mm256_setzero_ps();
    for (int c = 0; c < cols; c += 8) {
        __m256 xv[F16_XT];
        for (int t = 0; t < nt; t++) xv[t] = _mm256_loadu_ps(x[t].f + c);
        for (int r = 0; r < R; r++) {
            const uint8_t *p = w + (size_t)r * rb + 2 * (size_t)c;
            const __m256 wv = bf ? bf16_ps(p) : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
            for (int t = 0; t < nt; t++) acc[r][t] = _mm256_fmadd_ps(wv, xv[t], acc[r][t]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < nt; t++) y[t * ys + r] = hsum(acc[r][t]);
}

/* ------------------------------------------------------------------ F32 rows, fp32 x */

INLINE void rows_f32(const uint8_t *w, size_t rb, const int R, const si_xq *x, int cols, float *y,
                     const uint8_t *pf,
                     const int far) {
    __m256 acc[4], acc2[4];
    for (int r = 0; r < R; r++) acc[r] = acc2[r] = _mm256_setzero_ps();
    for (int c = 0; c < cols; c += 16) { /* cols is a multiple of 32 */
        const __m256 x0 = _mm256_loadu_ps(x->f + c), x1 = _mm256_loadu_ps(x->f + c + 8);
        (void)pf, (void)far; /* no software prefetch: 4 row streams in order suit the hardware */
        for (int r = 0; r < R; r++) {
            const float *p = (const float *)(w + (size_t)r * rb) + c;
            acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(p), x0, acc[r]);
            acc2[r] = _mm256_fmadd_ps(_mm256_loadu_ps(p + 8), x1, acc2[r]);
        }
    }
    for (int r = 0; r < R; r++) y[r] = hsum(_mm256_add_ps(acc[r], acc2[r]));
}

/* ------------------------------------------------------------------ panels of 16 rows */

/* Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q5_1 in panels (SI_Q4_0P ..., qgemv.h): a block column of a
 * panel is 16 rows x 4 (Q8_0: 8) quant words, so one integer dot product takes 4 bytes of x
 * (broadcast) against 4 weights of each of 16 rows, and a block costs 8 of them per x row with
 * no horizontal sums: every lane is a row. Per x row and block: y_r += d_r * x_d * sum_r +
 * m_r * x_s (Q4_0: m_r = -8 d_r), the two terms in separate accumulators added at the end. The
 * GEMV is the same arithmetic with one x row, so every GEMM row is its GEMV bit for bit. For Q4
 * the AVX2 build computes the same integer sums and float operations per row, so the ISAs agree
 * bit for bit too (Q8_0: to float rounding, see panel_q8). */
#define PANEL_T 8 /* x rows per pass over a panel */
#ifndef PANEL_AHEAD
#define PANEL_AHEAD 8192 /* bytes: the panel rows' stream fetched this far ahead */
#endif
INLINE int panel_bytes(const int type) {
    return type == SI_Q4_0P   ? 16 * 18
           : type == SI_Q4_1P ? 16 * 20
           : type == SI_Q5_0P ? 16 * 22
           : type == SI_Q5_1P ? 16 * 24
           : type == SI_Q4_KP ? 16 * 18 /* a super-block column's 16 x 144 bytes per 256 */
           : type == SI_Q5_KP || type == SI_Q5_KB ? 16 * 22 /* 16 x 176 per 256 */
           : type == SI_Q6_KP || type == SI_Q6_KB ? 16 * 210 / 8
                              : 16 * 34;
}

INLINE int32_t x_word(const si_xq *x, const int b, const int c) {
    int32_t v;
    memcpy(&v, x->q + 32 * (size_t)b + 4 * c, 4);
    return v;
}

/* Q5_0 / Q5_1 panels (SI_Q5_0P, SI_Q5_1P: the fifth bits and quants after one or two fp16
 * fields) in two 256-bit halves (rows 0..7, 8..15), by panel_q4 below in every build, so the ISAs
 * agree bit for bit. q5_half: half h of block column pb (type's) as unsigned 5-bit
 * bytes, lo[c] / hi[c] as q4_half's with the fifth bits or'ed in: the transposed bit words
 * (qgemv.h) put word c's bits of the low nibbles at bit c of each byte and those of the high
 * nibbles at bit 4 + c, so one 16-bit shift per word moves them to bit 4 (no bit crosses a
 * byte). q5_half_dot: the 8 rows' integer sums against x block b, low and high nibbles in two
 * int16 chains of 4 words (at most 4 x 2 x 31 x 127 = 31496 each: no saturation), widened once
 * each. */
INLINE void q5_half(const int type, const uint8_t *pb, const int h, __m256i *lo, __m256i *hi) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), b5 = _mm256_set1_epi8(0x10);
    const int ho = type == SI_Q5_1P ? 64 : 32; /* after d (and m) */
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(pb + ho + 32 * h));
    for (int c = 0; c < 4; c++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(pb + ho + 64 + 64 * c + 32 * h));
        lo[c] = _mm256_or_si256(_mm256_and_si256(q, m4), _mm256_and_si256(shift16(qh, 4 - c), b5));
        hi[c] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4), m4),
                                _mm256_and_si256(shift16(qh, -c), b5));
    }
}
INLINE __m256i q5_half_dot(const __m256i *lo, const __m256i *hi, const si_xq *x, const int b) {
    __m256i sl = _mm256_setzero_si256(), sh = _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
        sl = chain_add(sl, lo[c], _mm256_set1_epi32(x_word(x, b, c)));
        sh = chain_add(sh, hi[c], _mm256_set1_epi32(x_word(x, b, 4 + c)));
    }
    return _mm256_add_epi32(chain_sum(sl), chain_sum(sh));
}
/* Q4_0 / Q4_1 panels in two 256-bit halves (rows 0..7, 8..15), the AVX2 builds' kernel (the
 * AVX-512 one below does 16 rows at once), and Q5_0 panels' kernel in every build: the 8 byte
 * products per row and block summed in int16 by maddubs (at most 8 x 2 x 15 x 127 = 30480: no
 * saturation), widened once (Q5_0: q5_half_dot above). q4_half: half h of a Q4 block column as
 * unsigned bytes (lo[c]: low nibbles of word c, hi[c]: high ones); q4_half_dot: their 8 rows'
 * integer sums against x block b. */
INLINE void q4_half(const uint8_t *pb, const int qoff, const int h, __m256i *lo, __m256i *hi) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int c = 0; c < 4; c++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(pb + qoff + 64 * c + 32 * h));
        lo[c] = _mm256_and_si256(q, m4);
        hi[c] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
    }
}
INLINE __m256i q4_half_dot(const __m256i *lo, const __m256i *hi, const si_xq *x, const int b) {
    __m256i s16 = _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) s16 = chain_add(s16, lo[c], _mm256_set1_epi32(x_word(x, b, c)));
    for (int c = 0; c < 4; c++) s16 = chain_add(s16, hi[c], _mm256_set1_epi32(x_word(x, b, 4 + c)));
    return chain_sum(s16);
}
/* Half h's scales d and minima m (Q4_0: -8 d; Q5_0: -16 d; Q4_1, Q5_1: the blocks' m). */
INLINE void q4_half_dm(const int type, const uint8_t *pb, const int h, __m256 *d, __m256 *m) {
    *d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(pb + 16 * h)));
    *m = type == SI_Q4_0P   ? _mm256_mul_ps(*d, _mm256_set1_ps(-8.0f))
         : type == SI_Q5_0P ? _mm256_mul_ps(*d, _mm256_set1_ps(-16.0f))
                            : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(pb + 32 + 16 * h)));
}
/* Half h of block column pb unpacked (lo, hi) and its 8 rows' integer sums against x block b. */
INLINE void panel_half(const int type, const uint8_t *pb, const int h, __m256i *lo, __m256i *hi) {
    if (type == SI_Q5_0P || type == SI_Q5_1P) q5_half(type, pb, h, lo, hi);
    else q4_half(pb, type == SI_Q4_0P ? 32 : 64, h, lo, hi);
}
INLINE __m256i panel_half_dot(const int type, const __m256i *lo, const __m256i *hi, const si_xq *x,
                              const int b) {
    return type == SI_Q5_0P || type == SI_Q5_1P ? q5_half_dot(lo, hi, x, b)
                                                : q4_half_dot(lo, hi, x, b);
}
INLINE void panel_q4(const int type, const uint8_t *p, const si_xq *x, const int nt, const int nb,
                     float *y, const int64_t ys) {
    const int bb = panel_bytes(type);
    for (int h = 0; h < 2; h++) {
        __m256 acc[PANEL_T], accm[PANEL_T];
#pragma GCC unroll 8
        for (int t = 0; t < nt; t++) acc[t] = accm[t] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            const uint8_t *pb = p + (size_t)b * bb;
            if (h == 0)
                prefetch(pb + PANEL_AHEAD, bb, 0);
            __m256 d, m;
            __m256i lo[4], hi[4];
            q4_half_dm(type, pb, h, &d, &m);
            panel_half(type, pb, h, lo, hi);
#pragma GCC unroll 8
            for (int t = 0; t < nt; t++) {
                const __m256i sum = panel_half_dot(type, lo, hi, &x[t], b);
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, _mm256_set1_ps(x[t].d[b])),
                                         acc[t]);
                accm[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(x[t].s[b]), accm[t]);
            }
        }
#pragma GCC unroll 8
        for (int t = 0; t < nt; t++) _mm256_storeu_ps(y + t * ys + 8 * h, _mm256_add_ps(acc[t], accm[t]));
    }
}
/* panel_q4 for one x row (the GEMV): both halves of a block column in one pass, so the stream
 * is read once and x's words broadcast once per block (faster from memory on a Zen 3:
 * benchmarks/RESULTS.md); the same operations per lane (the same bits). panel_q4_1s takes S
 * panels (p[s] into y[s]; S a constant where inlined, at most 2) block column by block column,
 * each panel's operations as alone: two streams in flight, which a core reads faster from
 * memory than one (benchmarks/RESULTS.md). */
INLINE void panel_q4_1s(const int type, const uint8_t *const *p, const int S, const si_xq *x,
                        const int nb, float *const *y) {
    const int bb = panel_bytes(type);
    __m256 acc[2][2], accm[2][2];
    for (int s = 0; s < S; s++)
        for (int h = 0; h < 2; h++) acc[s][h] = accm[s][h] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++)
        for (int s = 0; s < S; s++) {
            const uint8_t *pb = p[s] + (size_t)b * bb;
            prefetch(pb + PANEL_AHEAD, bb, 0);
            for (int h = 0; h < 2; h++) {
                __m256 d, m;
                __m256i lo[4], hi[4];
                q4_half_dm(type, pb, h, &d, &m);
                panel_half(type, pb, h, lo, hi);
                const __m256i sum = panel_half_dot(type, lo, hi, x, b);
                acc[s][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, _mm256_set1_ps(x->d[b])),
                                            acc[s][h]);
                accm[s][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(x->s[b]), accm[s][h]);
            }
        }
    for (int s = 0; s < S; s++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(y[s] + 8 * h, _mm256_add_ps(acc[s][h], accm[s][h]));
}
INLINE void panel_q4_1(const int type, const uint8_t *p, const si_xq *x, const int nb, float *y) {
    panel_q4_1s(type, &p, 1, x, nb, &y);
}

/* Q4_K and Q5_K in panels (SI_Q4_KP, SI_Q5_KP, qgemv.h): per super-block column of a panel, the
 * 16 rows' d and dmin, their six-bit sub-block scales and minima (low nibbles two to a byte, row
 * by row; the top two bits of a row's 8 in one 16-bit word), Q5_K's fifth bits as 8 words of 16
 * rows x 4 bytes, then each pair of sub-blocks' 32 quant bytes as 8 such words. Sub-block j is
 * the low (j even) or high (j odd) nibbles of pair j / 2, with bit j of the fifth-bit bytes, so
 * a 32-weight sub-block is a Q4_1 block to the panel kernels: per x row, 8 integer dot products
 * of 4 x bytes against 4 weights of each of 16 rows, then y_r += (d_r sc_rj) x_d * sum_r +
 * (-dmin_r m_rj) x_s, the two terms in separate accumulators added at the end (the scale and
 * minimum products are exact in float: 11 x 6 bits). The GEMV is the same arithmetic with one x
 * row, and the AVX2 builds' two halves do the same integer sums and float operations per row:
 * every GEMM row is its GEMV bit for bit, on every ISA. Against the row-major K-quant kernels:
 * no horizontal sums and no permutes of the 8 sub-block scales to lanes, each super-block's
 * scales decoded once for all the pass's x rows. */
INLINE int k45p_bytes(const int five) { return 16 * (five ? 176 : 144); } /* a super-block column */
INLINE int k45p_qoff(const int five) { return five ? 768 : 256; }          /* its quant words */
#define K45P_QH 256 /* Q5_K's fifth-bit words */

/* Half h (rows 8h .. 8h + 7) of a super-block column's fields: d, -dmin, and the top bits of
 * the scales and minima as 8 int32 each. */
typedef struct {
    __m256 d, nmin;
    __m256i hs, hm;
} k4p_fields8;
/* Half h's d and -dmin alone (the one-row GEMV's: its scales and minima come decoded). */
INLINE void k4p_half_dmin(const uint8_t *pb, const int h, __m256 *d, __m256 *nmin) {
    *d = _mm256_cvtph_ps(load128(pb + 16 * h));
    *nmin = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_cvtph_ps(load128(pb + 32 + 16 * h)));
}
INLINE k4p_fields8 k4p_half_fields(const uint8_t *pb, const int h) {
    k4p_fields8 f;
    k4p_half_dmin(pb, h, &f.d, &f.nmin);
    f.hs = _mm256_cvtepu16_epi32(load128(pb + 192 + 16 * h));
    f.hm = _mm256_cvtepu16_epi32(load128(pb + 224 + 16 * h));
    return f;
}
/* Lanes of sub-block j's six-bit fields (scales: lo = pb + 64, top = f.hs; minima: pb + 128,
 * f.hm) of half h as 8 int32. */
INLINE __m256i k4p_six8(const uint8_t *lo, const __m256i top, const int j, const int h) {
    __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(lo + 16 * (j & 3) + 8 * h)));
    if (j >= 4) a = _mm256_srli_epi32(a, 4);
    a = _mm256_and_si256(a, _mm256_set1_epi32(15));
    const __m256i t = _mm256_and_si256(_mm256_srli_epi32(top, 2 * j), _mm256_set1_epi32(3));
    return _mm256_or_si256(a, _mm256_slli_epi32(t, 4));
}
/* Sub-block j's scale products d sc (S) and minimum terms -dmin m (M) of half h. */
INLINE void k4p_sm8(const uint8_t *pb, const k4p_fields8 *f, const int j, const int h, __m256 *S,
                    __m256 *M) {
    *S = _mm256_mul_ps(_mm256_cvtepi32_ps(k4p_six8(pb + 64, f->hs, j, h)), f->d);
    *M = _mm256_mul_ps(_mm256_cvtepi32_ps(k4p_six8(pb + 128, f->hm, j, h)), f->nmin);
}
/* A super-block column's six-bit scales (o[0]) and minima (o[1]) of all 16 rows as bytes,
 * o[f][j][r]: the numbers k4p_six8 gives, for all 8 sub-blocks at once in byte lanes (a pair
 * of sub-blocks a register: their low nibbles from one load, their top bits shifted into place
 * in the rows' 16-bit words, packed to bytes and put in row order). The one-row GEMV then takes
 * a sub-block's fields in one widening load instead of k4p_six8's seven operations. */
INLINE void k4p_decode(const uint8_t *pb, uint8_t o[2][8][16]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi16(0x30);
    for (int f = 0; f < 2; f++) {
        const __m256i top = _mm256_loadu_si256((const __m256i *)(pb + 192 + 32 * f));
        for (int k = 0; k < 2; k++) { /* low-nibble bytes 2k, 2k + 1 of the 16 rows */
            const __m256i lo = _mm256_loadu_si256((const __m256i *)(pb + 64 + 64 * f + 32 * k));
            for (int hi = 0; hi < 2; hi++) { /* sub-blocks j, j + 1: 2k (+4 from the high nibbles) */
                const int j = 2 * k + 4 * hi;
                __m256i t[2];
                for (int u = 0; u < 2; u++) /* bits 2(j + u), 2(j + u) + 1 of each row's word at 4, 5 */
                    t[u] = _mm256_and_si256(2 * (j + u) <= 4 ? _mm256_slli_epi16(top, 4 - 2 * (j + u))
                                                             : _mm256_srli_epi16(top, 2 * (j + u) - 4),
                                            m30);
                /* packed: [j rows 0-7, j+1 rows 0-7 | j rows 8-15, j+1 rows 8-15] -> row order */
                const __m256i tb = _mm256_permute4x64_epi64(_mm256_packus_epi16(t[0], t[1]), 0xD8);
                const __m256i nib = _mm256_and_si256(hi ? _mm256_srli_epi16(lo, 4) : lo, m4);
                _mm256_storeu_si256((__m256i *)o[f][j], _mm256_or_si256(nib, tb));
            }
        }
    }
}
/* Sub-block j's d sc (S) and -dmin m (M) of half h from k4p_decode's bytes: k4p_sm8's numbers. */
INLINE void k4p_sm8_dec(const uint8_t o[2][8][16], const __m256 d, const __m256 nmin, const int j,
                        const int h, __m256 *S, __m256 *M) {
    *S = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(o[0][j] + 8 * h)))), d);
    *M = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(o[1][j] + 8 * h)))), nmin);
}
/* Word c of half h of sub-block j as unsigned bytes (Q5_K: bit j of its fifth-bit bytes, moved
 * to bit 4 by one 16-bit shift: no bit crosses a byte under the 0x10 mask). */
INLINE __m256i k45p_word(const int five, const uint8_t *pb, const int j, const int h, const int c) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)(pb + k45p_qoff(five) + 512 * (j >> 1) + 64 * c + 32 * h));
    __m256i w = _mm256_and_si256((j & 1) ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0F));
    if (five) {
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(pb + K45P_QH + 64 * c + 32 * h));
        w = _mm256_or_si256(w, _mm256_and_si256(shift16(qh, 4 - j), _mm256_set1_epi8(0x10)));
    }
    return w;
}
/* Half h of sub-block j's 8 rows' integer sums against x block b (w: its words, k45p_word): the
 * words' products summed
 * in int16 (4-bit: 8 words, at most 8 x 2 x 15 x 127 = 30480; 5-bit: two chains of 4 words, at
 * most 4 x 2 x 31 x 127 = 31496 each: no saturation), widened once a chain. */
INLINE __m256i k45p_half_dot(const int five, const __m256i *w, const si_xq *x, const int b) {
    __m256i s16[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int c = 0; c < 8; c++) {
        const int k = five ? c >> 2 : 0;
        s16[k] = chain_add(s16[k], w[c], _mm256_set1_epi32(x_word(x, b, c)));
    }
    const __m256i sum = chain_sum(s16[0]);
    return five ? _mm256_add_epi32(sum, chain_sum(s16[1])) : sum;
}

/* SI_Q5_KB (qgemv.h): sub-block j's word m at K5B_QS + 320 j + 64 m. */
#define K5B_QS 256

/* The 8 words of sub-block j (weights 32 j + 4 c .. 32 j + 4 c + 3, c = 0..7) of an SI_Q5_KB
 * super-block column at pb, rows 8 h .. 8 h + 7, as unsigned bytes: five words' low 5 bits,
 * three more from their top 3 bits (t's bits 0-4, 5-9, 10-14). */
INLINE void k5b_words8(const uint8_t *pb, const int j, const int h, __m256i *w) {
    const uint8_t *q = pb + K5B_QS + 320 * j + 32 * h;
    const __m256i m5 = _mm256_set1_epi8(0x1F);
    __m256i b[5];
    for (int m = 0; m < 5; m++) {
        b[m] = _mm256_loadu_si256((const __m256i *)(q + 64 * m));
        w[m] = _mm256_and_si256(b[m], m5);
    }
#define TOP(m, mask, n) _mm256_srli_epi16(_mm256_and_si256(b[m], _mm256_set1_epi8((char)(mask))), n)
    w[5] = _mm256_or_si256(TOP(0, 0xE0, 5), TOP(1, 0x60, 2));                     /* t 0-2, 3-4 */
    w[6] = _mm256_or_si256(_mm256_or_si256(TOP(1, 0x80, 7), TOP(2, 0xE0, 4)), TOP(3, 0x20, 1)); /* t 5-9 */
    w[7] = _mm256_or_si256(TOP(3, 0xC0, 6), TOP(4, 0xE0, 3));                     /* t 10-14 */
#undef TOP
}

/* 16 rows of Q4_K / Q5_K panels (five; kb: SI_Q5_KB, else SI_Q4_KP / SI_Q5_KP) against nt x rows
 * in 256-bit vectors (the AVX2 builds' GEMM, and every build's for SI_Q5_KB): two halves of 8
 * rows, one after the other, each sub-block's words decoded once for the nt x rows. */
INLINE void panel_k45_256(const int five, const int kb, const uint8_t *p, const si_xq *x, const int nt,
                          const int nsb, float *y, const int64_t ys) {
    const int bb = k45p_bytes(five);
    for (int h = 0; h < 2; h++) {
        __m256 acc[PANEL_T], accm[PANEL_T];
#pragma GCC unroll 8
        for (int t = 0; t < nt; t++) acc[t] = accm[t] = _mm256_setzero_ps();
        for (int sb = 0; sb < nsb; sb++) {
            const uint8_t *pb = p + (size_t)sb * bb;
            const k4p_fields8 f = k4p_half_fields(pb, h);
            for (int j = 0; j < 8; j++) {
                if (h == 0)
                    prefetch(pb + PANEL_AHEAD + (bb / 8) * j, bb / 8, 0);
                __m256 S, M;
                k4p_sm8(pb, &f, j, h, &S, &M);
                __m256i w[8];
                if (kb) k5b_words8(pb, j, h, w);
                else
                    for (int c = 0; c < 8; c++) w[c] = k45p_word(five, pb, j, h, c);
                const int b = 8 * sb + j;
#pragma GCC unroll 8
                for (int t = 0; t < nt; t++) {
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(k45p_half_dot(five, w, &x[t], b)),
                                             _mm256_mul_ps(S, _mm256_set1_ps(x[t].d[b])), acc[t]);
                    accm[t] = _mm256_fmadd_ps(M, _mm256_set1_ps(x[t].s[b]), accm[t]);
                }
            }
        }
#pragma GCC unroll 8
        for (int t = 0; t < nt; t++) _mm256_storeu_ps(y + t * ys + 8 * h, _mm256_add_ps(acc[t], accm[t]));
    }
}

/* SI_Q5_KB for one x row, in 256-bit vectors on every build: per sub-block, both halves of 8
 * rows; the integer sums (exact) and float operations, in order, of SI_Q5_KP's one-row pass, so
 * the two layouts give the same bits. */
INLINE void panel_k5b_1(const uint8_t *p, const si_xq *x, const int nsb, float *y) {
    const int bb = k45p_bytes(1);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, accm[2] = {acc[0], acc[1]};
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t *pb = p + (size_t)sb * bb;
        uint8_t sm[2][8][16];
        k4p_decode(pb, sm);
        __m256 d[2], nmin[2];
        for (int h = 0; h < 2; h++) k4p_half_dmin(pb, h, &d[h], &nmin[h]);
        for (int j = 0; j < 8; j++) {
            prefetch(pb + PANEL_AHEAD + (bb / 8) * j, bb / 8, 0);
            const int b = 8 * sb + j;
            for (int h = 0; h < 2; h++) {
                __m256i w[8];
                k5b_words8(pb, j, h, w);
                __m256 S, M;
                k4p_sm8_dec(sm, d[h], nmin[h], j, h, &S, &M);
                acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(k45p_half_dot(1, w, x, b)),
                                         _mm256_mul_ps(S, _mm256_set1_ps(x->d[b])), acc[h]);
                accm[h] = _mm256_fmadd_ps(M, _mm256_set1_ps(x->s[b]), accm[h]);
            }
        }
    }
    for (int h = 0; h < 2; h++) _mm256_storeu_ps(y + 8 * h, _mm256_add_ps(acc[h], accm[h]));
}
INLINE void panel_k5b(const uint8_t *p, const si_xq *x, const int nt, const int nsb, float *y,
                      const int64_t ys) {
    if (nt == 1) panel_k5b_1(p, x, nsb, y);
    else panel_k45_256(1, 1, p, x, nt, nsb, y, ys);
}

#if SI_AVX512
/* One block of 32 weights of 16 panel rows (w: its 8 words as unsigned bytes; d, m: the rows'
 * scales and minimum terms) against block b of x rows 0 .. nt - 1: acc[t] += d x_d sum,
 * accm[t] += m x_s. The Q4/Q8_0 panels' and the Q4_K/Q5_K panels' step, the same operations. */
INLINE void panel_block16(const __m512i *w, const __m512 d, const __m512 m, const si_xq *x,
                          const int nt, const int b, __m512 *acc, __m512 *accm) {
#pragma GCC unroll 8
    for (int t = 0; t < nt; t++) {
        __m512i sum = _mm512_setzero_si512();
        for (int c = 0; c < 8; c++)
            sum = _mm512_dpbusd_epi32(sum, w[c], _mm512_set1_epi32(x_word(&x[t], b, c)));
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, _mm512_set1_ps(x[t].d[b])), acc[t]);
        accm[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(x[t].s[b]), accm[t]);
    }
}
/* Sub-block j's fields of all 16 rows as 16 int32 (k4p_six8's, in one 512-bit register). */
INLINE __m512i k4p_six16(const uint8_t *f, const __m512i hw, const int j) {
    __m512i a = _mm512_cvtepu8_epi32(load128(f + 16 * (j & 3)));
    if (j >= 4) a = _mm512_srli_epi32(a, 4);
    a = _mm512_and_si512(a, _mm512_set1_epi32(15));
    const __m512i h = _mm512_and_si512(_mm512_srli_epi32(hw, 2 * j), _mm512_set1_epi32(3));
    return _mm512_or_si512(a, _mm512_slli_epi32(h, 4));
}
/* A super-block column's fields, all 16 rows: d, -dmin, and the top bits of the scales and
 * minima as 16 int32 each (k4p_half_fields' in one 512-bit register). */
typedef struct {
    __m512 d, nmin;
    __m512i hs, hm;
} k4p_fields16;
INLINE k4p_fields16 k4p_fields(const uint8_t *pb) {
    k4p_fields16 f;
    f.d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)pb));
    f.nmin = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(pb + 32))));
    f.hs = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(pb + 192)));
    f.hm = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(pb + 224)));
    return f;
}
/* Sub-block j's scale products d sc (S) and minimum terms -dmin m (M), all 16 rows. */
INLINE void k4p_sm16(const uint8_t *pb, const k4p_fields16 *f, const int j, __m512 *S, __m512 *M) {
    *S = _mm512_mul_ps(_mm512_cvtepi32_ps(k4p_six16(pb + 64, f->hs, j)), f->d);
    *M = _mm512_mul_ps(_mm512_cvtepi32_ps(k4p_six16(pb + 128, f->hm, j)), f->nmin);
}
/* Bit j of each byte of v at bit 4 (the rest of the byte whatever: masked by the caller). */
INLINE __m512i bit_to4_512(const __m512i v, const int j) {
    return j <= 4 ? _mm512_slli_epi16(v, 4 - j) : _mm512_srli_epi16(v, j - 4);
}
/* Word c of sub-block j of the super-block column at pb, all 16 rows, as unsigned bytes; v its
 * quant word as loaded (shared by the pair's two sub-blocks). */
INLINE __m512i k45p_word16(const int five, const uint8_t *pb, const __m512i v, const int j, const int c) {
    const __m512i w = _mm512_and_si512((j & 1) ? _mm512_srli_epi16(v, 4) : v, _mm512_set1_epi8(0x0F));
    if (!five) return w;
    const __m512i qh = _mm512_loadu_si512((const void *)(pb + K45P_QH + 64 * c));
    return _mm512_ternarylogic_epi32(w, bit_to4_512(qh, j), _mm512_set1_epi8(0x10), 0xF8); /* w | (h & 0x10) */
}
/* panel_k45 (below) for one x row: a pair of sub-blocks per pass over its quant words (each
 * loaded once for both nibbles), their integer sums in four independent chains; the same float
 * operations per row in the same order (the integer sums are exact: the same bits). */
INLINE void panel_k45_1(const int five, const uint8_t *p, const si_xq *x, const int nsb, float *y) {
    const int bb = k45p_bytes(five);
    __m512 acc = _mm512_setzero_ps(), accm = _mm512_setzero_ps();
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t *pb = p + (size_t)sb * bb;
        const k4p_fields16 f = k4p_fields(pb);
        for (int pr = 0; pr < 4; pr++) {
            prefetch(pb + PANEL_AHEAD + (bb / 4) * pr, bb / 4, 0);
            const uint8_t *q = pb + k45p_qoff(five) + 512 * pr;
            const int j0 = 2 * pr, j1 = j0 + 1, b0 = 8 * sb + j0, b1 = b0 + 1;
            __m512i s[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                            _mm512_setzero_si512()};
            for (int c = 0; c < 8; c++) {
                const __m512i v = _mm512_loadu_si512((const void *)(q + 64 * c));
                const int k = c >> 2; /* words 0..3 and 4..7 in separate chains */
                s[k] = _mm512_dpbusd_epi32(s[k], k45p_word16(five, pb, v, j0, c), _mm512_set1_epi32(x_word(x, b0, c)));
                s[2 + k] = _mm512_dpbusd_epi32(s[2 + k], k45p_word16(five, pb, v, j1, c),
                                               _mm512_set1_epi32(x_word(x, b1, c)));
            }
            for (int u = 0; u < 2; u++) {
                __m512 S, M;
                k4p_sm16(pb, &f, j0 + u, &S, &M);
                acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s[2 * u], s[2 * u + 1])),
                                      _mm512_mul_ps(S, _mm512_set1_ps(x->d[b0 + u])), acc);
                accm = _mm512_fmadd_ps(M, _mm512_set1_ps(x->s[b0 + u]), accm);
            }
        }
    }
    _mm512_storeu_ps(y, _mm512_add_ps(acc, accm));
}
/* 16 rows (the panel at p, nsb super-block columns) against nt <= PANEL_T x rows: y[t * ys + r]. */
INLINE void panel_k45(const int five, const uint8_t *p, const si_xq *x, const int nt, const int nsb,
                      float *y, const int64_t ys) {
    if (nt == 1) {
        panel_k45_1(five, p, x, nsb, y);
        return;
    }
    const int bb = k45p_bytes(five);
    __m512 acc[PANEL_T], accm[PANEL_T];
#pragma GCC unroll 8
    for (int t = 0; t < nt; t++) acc[t] = accm[t] = _mm512_setzero_ps();
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t *pb = p + (size_t)sb * bb;
        const k4p_fields16 f = k4p_fields(pb);
        for (int j = 0; j < 8; j++) {
            prefetch(pb + PANEL_AHEAD + (bb / 8) * j, bb / 8, 0);
            __m512 S, M;
            k4p_sm16(pb, &f, j, &S, &M);
            const uint8_t *q = pb + k45p_qoff(five) + 512 * (j >> 1);
            __m512i w[8];
            for (int c = 0; c < 8; c++)
                w[c] = k45p_word16(five, pb, _mm512_loadu_si512((const void *)(q + 64 * c)), j, c);
            panel_block16(w, S, M, x, nt, 8 * sb + j, acc, accm);
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < nt; t++) _mm512_storeu_ps(y + t * ys, _mm512_add_ps(acc[t], accm[t]));
}
#else
/* The AVX2 builds: two halves of 8 rows, one after the other over the panel for several x rows
 * (as panel_q4), both per super-block for one (as panel_q4_1); the same operations per row. */
INLINE void panel_k45(const int five, const uint8_t *p, const si_xq *x, const int nt, const int nsb,
                      float *y, const int64_t ys) {
    const int bb = k45p_bytes(five);
    if (nt == 1) { /* a pair of sub-blocks per pass over its words, each loaded once for both;
                    * Q4_K's two halves in one pass, each x word broadcast once for both (the
                    * compiler shares the inner loop's broadcasts); Q5_K's, with their fifth
                    * bits, ran slower so: one half a pass */
        const __m256i m4 = _mm256_set1_epi8(0x0F), b5 = _mm256_set1_epi8(0x10);
        __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, accm[2] = {acc[0], acc[1]};
        for (int sb = 0; sb < nsb; sb++) {
            const uint8_t *pb = p + (size_t)sb * bb;
            uint8_t sm[2][8][16];
            k4p_decode(pb, sm);
            const int hp = five ? 1 : 2; /* halves a pass */
            for (int h0 = 0; h0 < 2; h0 += hp) {
                __m256 d[2], nmin[2];
                for (int h = h0; h < h0 + hp; h++) k4p_half_dmin(pb, h, &d[h], &nmin[h]);
                for (int pr = 0; pr < 4; pr++) {
                    if (h0 == 0)
                        prefetch(pb + PANEL_AHEAD + (bb / 4) * pr, bb / 4, 0);
                    const int j0 = 2 * pr, b0 = 8 * sb + j0;
                    const uint8_t *q = pb + k45p_qoff(five) + 512 * pr;
                    /* int16 chains as k45p_half_dot's: [half][sub-block][words 0..3, 4..7 (Q5_K)] */
                    __m256i s16[2][2][2];
                    for (int h = h0; h < h0 + hp; h++)
                        for (int u = 0; u < 2; u++) s16[h][u][0] = s16[h][u][1] = _mm256_setzero_si256();
                    for (int c = 0; c < 8; c++) {
                        const int k = five ? c >> 2 : 0;
                        for (int h = h0; h < h0 + hp; h++) {
                            const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 64 * c + 32 * h));
                            __m256i w0 = _mm256_and_si256(v, m4), w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                            if (five) {
                                const __m256i qh = _mm256_loadu_si256((const __m256i *)(pb + K45P_QH + 64 * c + 32 * h));
                                w0 = _mm256_or_si256(w0, _mm256_and_si256(shift16(qh, 4 - j0), b5));
                                w1 = _mm256_or_si256(w1, _mm256_and_si256(shift16(qh, 3 - j0), b5));
                            }
                            s16[h][0][k] = chain_add(s16[h][0][k], w0, _mm256_set1_epi32(x_word(x, b0, c)));
                            s16[h][1][k] = chain_add(s16[h][1][k], w1, _mm256_set1_epi32(x_word(x, b0 + 1, c)));
                        }
                    }
                    for (int h = h0; h < h0 + hp; h++)
                        for (int u = 0; u < 2; u++) {
                            __m256i sum = chain_sum(s16[h][u][0]);
                            if (five) sum = _mm256_add_epi32(sum, chain_sum(s16[h][u][1]));
                            __m256 S, M;
                            k4p_sm8_dec(sm, d[h], nmin[h], j0 + u, h, &S, &M);
                            acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(S, _mm256_set1_ps(x->d[b0 + u])),
                                                     acc[h]);
                            accm[h] = _mm256_fmadd_ps(M, _mm256_set1_ps(x->s[b0 + u]), accm[h]);
                        }
                }
            }
        }
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(y + 8 * h, _mm256_add_ps(acc[h], accm[h]));
        return;
    }
    panel_k45_256(five, 0, p, x, nt, nsb, y, ys);
}
#endif

/* Q6_K in panels (SI_Q6_KP, qgemv.h) against x in blocks of 128 (x->kq, kd, kbs): per super-block
 * column, the 16 rows' d, their int8 scales (scale i of every row, 16 bytes), then the rows' qh
 * and ql words (16 rows x 4 bytes each). Group s (32 weights) of half h takes the low (s < 2) or
 * high nibbles of ql words 16h + 8(s % 2) + c and bits 2s, 2s + 1 of qh words 8h + c (c = 0..7:
 * weights 4c .. 4c + 3), unsigned 6-bit (q + 32); its 16-weight sub-block k = 2s + c / 4 has
 * scale 8h + k. Per x row and half: per sub-block, 4 integer dot products (16 rows in lanes),
 * 32 x (x's sum over the 16, kbs) taken off, times the rows' scales, summed in int32 (at most
 * 8 x (16 x 63 x 127 + 32 x 2032) x 128 < 2^31); then one convert and one FMA with d kd. The
 * integer sums are exact and the float operations the same on every ISA and for any number of
 * x rows: the GEMM rows are their GEMV bit for bit, on every ISA. */
#define Q6P_BYTES (16 * 210)
#define Q6P_SC 32
#define Q6P_QH 288
#define Q6P_QL 1312

/* Group s's word as unsigned bytes (q + 32), from its ql word l and qh word as loaded. */
INLINE __m256i q6p_bits8(const __m256i l, const __m256i qh, const int s) {
    const __m256i lo = _mm256_and_si256((s >> 1) ? _mm256_srli_epi16(l, 4) : l, _mm256_set1_epi8(0x0F));
    return _mm256_or_si256(lo, _mm256_and_si256(shift16(qh, 4 - 2 * s), _mm256_set1_epi8(0x30)));
}
/* Word c of group s of half h, rows 8 rh .. 8 rh + 7, as unsigned bytes (q + 32). */
INLINE __m256i q6p_word8(const uint8_t *pb, const int h, const int s, const int c, const int rh) {
    const __m256i l = _mm256_loadu_si256((const __m256i *)(pb + Q6P_QL + 64 * (16 * h + 8 * (s & 1) + c) + 32 * rh));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(pb + Q6P_QH + 64 * (8 * h + c) + 32 * rh));
    return q6p_bits8(l, qh, s);
}

/* SI_Q6_KB (qgemv.h): sub-block i's word m at Q6B_QS + 192 i + 64 m. */
#define Q6B_QS 288

/* The 4 words of sub-block i (weights 16 i + 4 c .. 16 i + 4 c + 3, c = 0..3) of an SI_Q6_KB
 * super-block column at pb, rows 8 rh .. 8 rh + 7, as unsigned bytes (q + 32): three words'
 * low 6 bits, and the fourth word from their top 2 bits. */
INLINE void q6b_words8(const uint8_t *pb, const int i, const int rh, __m256i *w) {
    const uint8_t *q = pb + Q6B_QS + 192 * i + 32 * rh;
    const __m256i m6 = _mm256_set1_epi8(0x3F), top = _mm256_set1_epi8((char)0xC0);
    __m256i b[3];
    for (int m = 0; m < 3; m++) {
        b[m] = _mm256_loadu_si256((const __m256i *)(q + 64 * m));
        w[m] = _mm256_and_si256(b[m], m6);
    }
    w[3] = _mm256_or_si256(_mm256_or_si256(_mm256_srli_epi16(_mm256_and_si256(b[0], top), 6),
                                           _mm256_srli_epi16(_mm256_and_si256(b[1], top), 4)),
                           _mm256_srli_epi16(_mm256_and_si256(b[2], top), 2));
}

/* A sub-block's 4 words of 8 rows (unsigned, q + 32) against x's 4 words xw: the 8 rows' sums
 * in int32 lanes (two int16 chains of two products: at most 4 x 63 x 127 = 32004). */
INLINE __m256i q6_dot4(const __m256i *w, const int32_t *xw) {
    const __m256i z = _mm256_setzero_si256();
    const __m256i a = chain_add(chain_add(z, w[0], _mm256_set1_epi32(xw[0])), w[1], _mm256_set1_epi32(xw[1]));
    const __m256i b = chain_add(chain_add(z, w[2], _mm256_set1_epi32(xw[2])), w[3], _mm256_set1_epi32(xw[3]));
    return _mm256_add_epi32(chain_sum(a), chain_sum(b));
}

/* 16 rows of Q6_K panels (kb: SI_Q6_KB, else SI_Q6_KP) against nt x rows in 256-bit vectors
 * (the AVX2 builds' GEMM, and every build's for SI_Q6_KB): two halves of 8 rows, one after the
 * other; the same integer sums and float operations as panel_q6k. */
INLINE void panel_q6k_256(const int kb, const uint8_t *p, const si_xq *x, const int nt, const int nsb,
                          float *y, const int64_t ys) {
    for (int rh = 0; rh < 2; rh++) {
        __m256 acc[PANEL_T];
#pragma GCC unroll 8
        for (int t = 0; t < nt; t++) acc[t] = _mm256_setzero_ps();
        for (int sb = 0; sb < nsb; sb++) {
            const uint8_t *pb = p + (size_t)sb * Q6P_BYTES;
            const __m256 d = _mm256_cvtph_ps(load128(pb + 16 * rh));
            for (int h = 0; h < 2; h++) {
                __m256i isum[PANEL_T];
#pragma GCC unroll 8
                for (int t = 0; t < nt; t++) isum[t] = _mm256_setzero_si256();
                for (int k = 0; k < 8; k++) {
                    const int s = k >> 1, c0 = 4 * (k & 1), i = 8 * h + k;
                    if (rh == 0)
                        prefetch(pb + PANEL_AHEAD + (Q6P_BYTES / 16) * i, Q6P_BYTES / 16, 0);
                    __m256i w[4];
                    if (kb) q6b_words8(pb, i, rh, w);
                    else
                        for (int c = 0; c < 4; c++) w[c] = q6p_word8(pb, h, s, c0 + c, rh);
                    const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(pb + Q6P_SC + 16 * i + 8 * rh)));
                    const size_t xo = 256 * (size_t)sb + 128 * h + 32 * s + 4 * c0;
#pragma GCC unroll 8
                    for (int t = 0; t < nt; t++) {
                        int32_t xw[4];
                        memcpy(xw, x[t].kq + xo, 16);
                        __m256i dot = q6_dot4(w, xw);
                        dot = _mm256_add_epi32(dot, _mm256_set1_epi32(-32 * (int32_t)x[t].kbs[16 * (size_t)sb + i]));
                        isum[t] = _mm256_add_epi32(isum[t], _mm256_mullo_epi32(dot, sc));
                    }
                }
#pragma GCC unroll 8
                for (int t = 0; t < nt; t++)
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]),
                                             _mm256_mul_ps(d, _mm256_set1_ps(x[t].kd[2 * (size_t)sb + h])), acc[t]);
            }
        }
#pragma GCC unroll 8
        for (int t = 0; t < nt; t++) _mm256_storeu_ps(y + t * ys + 8 * rh, acc[t]);
    }
}

/* SI_Q6_KB for one x row, in 256-bit vectors on every build: np (1 or 2, a constant) panels
 * pp[n] side by side (two streams in flight), their outputs at yy[n]; per sub-block, x's 4
 * words broadcast once for every panel and half of 8 rows; the integer sums (exact) and float
 * operations of panel_q6k, so the two layouts give the same bits. */
INLINE void panel_q6kb_1s(const int np, const uint8_t *const *pp, const si_xq *x, const int nsb,
                          float *const *yy) {
    __m256 acc[2][2];
    for (int n = 0; n < np; n++) acc[n][0] = acc[n][1] = _mm256_setzero_ps();
    for (int sb = 0; sb < nsb; sb++) {
        const size_t o = (size_t)sb * Q6P_BYTES;
        for (int h = 0; h < 2; h++) {
            __m256i isum[2][2];
            for (int n = 0; n < np; n++) isum[n][0] = isum[n][1] = _mm256_setzero_si256();
            for (int k = 0; k < 8; k++) {
                const int i = 8 * h + k;
                for (int n = 0; n < np; n++) prefetch(pp[n] + o + PANEL_AHEAD + (Q6P_BYTES / 16) * i, Q6P_BYTES / 16, 0);
                int32_t xw[4];
                memcpy(xw, x->kq + 256 * (size_t)sb + 16 * i, 16);
                const __m256i kb = _mm256_set1_epi32(-32 * (int32_t)x->kbs[16 * (size_t)sb + i]);
                for (int n = 0; n < np; n++)
                    for (int rh = 0; rh < 2; rh++) {
                        __m256i w[4];
                        q6b_words8(pp[n] + o, i, rh, w);
                        const __m256i dot = _mm256_add_epi32(q6_dot4(w, xw), kb);
                        const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(pp[n] + o + Q6P_SC + 16 * i + 8 * rh)));
                        isum[n][rh] = _mm256_add_epi32(isum[n][rh], _mm256_mullo_epi32(dot, sc));
                    }
            }
            const __m256 dk = _mm256_set1_ps(x->kd[2 * (size_t)sb + h]);
            for (int n = 0; n < np; n++)
                for (int rh = 0; rh < 2; rh++)
                    acc[n][rh] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[n][rh]),
                                                 _mm256_mul_ps(_mm256_cvtph_ps(load128(pp[n] + o + 16 * rh)), dk), acc[n][rh]);
        }
    }
    for (int n = 0; n < np; n++)
        for (int rh = 0; rh < 2; rh++) _mm256_storeu_ps(yy[n] + 8 * rh, acc[n][rh]);
}
INLINE void panel_q6kb(const uint8_t *p, const si_xq *x, const int nt, const int nsb, float *y,
                       const int64_t ys) {
    if (nt == 1) panel_q6kb_1s(1, &p, x, nsb, &y);
    else panel_q6k_256(1, p, x, nt, nsb, y, ys);
}

#if SI_AVX512
/* Word c of group s of half h, all 16 rows. */
INLINE __m512i q6p_word16(const uint8_t *pb, const int h, const int s, const int c) {
    const __m512i l = _mm512_loadu_si512((const void *)(pb + Q6P_QL + 64 * (16 * h + 8 * (s & 1) + c)));
    const __m512i qh = _mm512_loadu_si512((const void *)(pb + Q6P_QH + 64 * (8 * h + c)));
    const __m512i hi = _mm512_and_si512(bit_to4_512(qh, 2 * s), _mm512_set1_epi8(0x30));
    return _mm512_ternarylogic_epi32((s >> 1) ? _mm512_srli_epi16(l, 4) : l, hi, _mm512_set1_epi8(0x0F),
                                     0xEC); /* (l & 0x0F) | hi */
}
/* 16 rows (the panel at p, nsb super-block columns) against nt <= PANEL_T x rows: y[t * ys + r]. */
INLINE void panel_q6k(const uint8_t *p, const si_xq *x, const int nt, const int nsb, float *y,
                      const int64_t ys) {
    __m512 acc[PANEL_T];
#pragma GCC unroll 8
    for (int t = 0; t < nt; t++) acc[t] = _mm512_setzero_ps();
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t *pb = p + (size_t)sb * Q6P_BYTES;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)pb));
        for (int h = 0; h < 2; h++) {
            __m512i isum[PANEL_T];
#pragma GCC unroll 8
            for (int t = 0; t < nt; t++) isum[t] = _mm512_setzero_si512();
            for (int k = 0; k < 8; k++) {
                const int s = k >> 1, c0 = 4 * (k & 1), i = 8 * h + k;
                prefetch(pb + PANEL_AHEAD + (Q6P_BYTES / 16) * i, Q6P_BYTES / 16, 0);
                __m512i w[4];
                for (int c = 0; c < 4; c++) w[c] = q6p_word16(pb, h, s, c0 + c);
                const __m512i sc = _mm512_cvtepi8_epi32(load128(pb + Q6P_SC + 16 * i));
                const size_t xo = 256 * (size_t)sb + 128 * h + 32 * s + 4 * c0;
#pragma GCC unroll 8
                for (int t = 0; t < nt; t++) {
                    __m512i dot = _mm512_set1_epi32(-32 * (int32_t)x[t].kbs[16 * (size_t)sb + i]);
                    for (int c = 0; c < 4; c++) {
                        int32_t xw;
                        memcpy(&xw, x[t].kq + xo + 4 * c, 4);
                        dot = _mm512_dpbusd_epi32(dot, w[c], _mm512_set1_epi32(xw));
                    }
                    isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(dot, sc));
                }
            }
#pragma GCC unroll 8
            for (int t = 0; t < nt; t++)
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]),
                                         _mm512_mul_ps(d, _mm512_set1_ps(x[t].kd[2 * (size_t)sb + h])), acc[t]);
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < nt; t++) _mm512_storeu_ps(y + t * ys, acc[t]);
}
#else
/* panel_q6k (below) for one x row: one pass over the panel, both halves of 8 rows per
 * super-block half, each qh word and ql word loaded once for the 4 and 2 groups that use it;
 * the same integer sums (exact) and float operations per row, in the same order. */
INLINE void panel_q6k_1(const uint8_t *p, const si_xq *x, const int nsb, float *y) {
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t *pb = p + (size_t)sb * Q6P_BYTES;
        prefetch(pb + PANEL_AHEAD, Q6P_BYTES, 0);
        for (int h = 0; h < 2; h++) {
            const uint8_t *xq = x->kq + 256 * (size_t)sb + 128 * h;
            const int16_t *kbs = x->kbs + 16 * (size_t)sb + 8 * h;
            for (int rh = 0; rh < 2; rh++) {
                __m256i isum = _mm256_setzero_si256();
                for (int cg = 0; cg < 2; cg++) { /* words 4 cg .. 4 cg + 3: sub-blocks 2 s + cg */
                    __m256i d32[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                                      _mm256_setzero_si256()};
                    for (int c = 4 * cg; c < 4 * cg + 4; c += 2) {
                        __m256i a[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                                        _mm256_setzero_si256()};
                        for (int u = 0; u < 2; u++) {
                            const int cc = c + u;
                            const __m256i qh = _mm256_loadu_si256((const __m256i *)(pb + Q6P_QH + 64 * (8 * h + cc) + 32 * rh));
                            const __m256i l0 = _mm256_loadu_si256((const __m256i *)(pb + Q6P_QL + 64 * (16 * h + cc) + 32 * rh));
                            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(pb + Q6P_QL + 64 * (16 * h + 8 + cc) + 32 * rh));
                            for (int g = 0; g < 4; g++) { /* group g: ql word l0 (g even) or l1 */
                                int32_t xw;
                                memcpy(&xw, xq + 32 * g + 4 * cc, 4);
                                a[g] = chain_add(a[g], q6p_bits8((g & 1) ? l1 : l0, qh, g), _mm256_set1_epi32(xw));
                            }
                        }
                        for (int g = 0; g < 4; g++) d32[g] = _mm256_add_epi32(d32[g], chain_sum(a[g]));
                    }
                    for (int g = 0; g < 4; g++) {
                        const int i = 2 * g + cg; /* the sub-block's scale, of this half's 8 */
                        const __m256i sc = _mm256_cvtepi8_epi32(
                            _mm_loadl_epi64((const __m128i *)(pb + Q6P_SC + 16 * (8 * h + i) + 8 * rh)));
                        const __m256i dot = _mm256_add_epi32(d32[g], _mm256_set1_epi32(-32 * (int32_t)kbs[i]));
                        isum = _mm256_add_epi32(isum, _mm256_mullo_epi32(dot, sc));
                    }
                }
                const __m256 d = _mm256_cvtph_ps(load128(pb + 16 * rh));
                acc[rh] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, _mm256_set1_ps(x->kd[2 * (size_t)sb + h])),
                                          acc[rh]);
            }
        }
    }
    for (int rh = 0; rh < 2; rh++) _mm256_storeu_ps(y + 8 * rh, acc[rh]);
}
INLINE void panel_q6k(const uint8_t *p, const si_xq *x, const int nt, const int nsb, float *y,
                      const int64_t ys) {
    if (nt == 1) panel_q6k_1(p, x, nsb, y);
    else panel_q6k_256(0, p, x, nt, nsb, y, ys);
}
#endif

#if SI_AVX512
/* 16 rows of 32-weight blocks (the panel at p, nb block columns) against nt <= PANEL_T x rows:
 * y[t * ys + r]. Per block column, 8 vectors of unsigned weight bytes, word c of the x block
 * against vector c: Q4's low nibbles (elements 4c..) then high ones (16 + 4c..); Q8_0's bytes
 * made unsigned (+128: xor 0x80), the 128 x sum(x) that adds taken back in float with the
 * minima's FMA (m = -128 d; Q4_0: -8 d; Q4_1: the block's m), against x's s. */
INLINE void panel_b32(const int type, const uint8_t *p, const si_xq *x, const int nt, const int nb,
                      float *y, const int64_t ys) {
    if (type == SI_Q5_0P || type == SI_Q5_1P) {
        if (nt == 1) panel_q4_1(type, p, x, nb, y);
        else panel_q4(type, p, x, nt, nb, y, ys);
        return;
    }
    const int bb = panel_bytes(type), qoff = type == SI_Q4_1P ? 64 : 32;
    const __m512i m4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[PANEL_T], accm[PANEL_T];
#pragma GCC unroll 8
    for (int t = 0; t < nt; t++) acc[t] = accm[t] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *pb = p + (size_t)b * bb;
        prefetch(pb + PANEL_AHEAD, bb, 0);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)pb));
        const __m512 m = type == SI_Q4_1P ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(pb + 32)))
                                          : _mm512_mul_ps(d, _mm512_set1_ps(type == SI_Q4_0P ? -8.0f : -128.0f));
        __m512i w[8];
        for (int c = 0; c < 4; c++) {
            if (type == SI_Q8_0P) {
                w[c] = _mm512_xor_si512(_mm512_loadu_si512((const void *)(pb + qoff + 64 * c)), flip);
                w[4 + c] = _mm512_xor_si512(_mm512_loadu_si512((const void *)(pb + qoff + 256 + 64 * c)), flip);
            } else {
                const __m512i q = _mm512_loadu_si512((const void *)(pb + qoff + 64 * c));
                w[c] = _mm512_and_si512(q, m4);
                w[4 + c] = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
            }
        }
        panel_block16(w, d, m, x, nt, b, acc, accm);
    }
#pragma GCC unroll 8
    for (int t = 0; t < nt; t++) _mm512_storeu_ps(y + t * ys, _mm512_add_ps(acc[t], accm[t]));
}
#else
/* Q8_0 panels in two 256-bit halves: signed x signed as |w| times x with w's sign (maddubs,
 * at most 2 x 127 x 127 per int16: no saturation), widened per word. The integer sums are
 * exact, so no 128 x sum(x) to take back: these bits differ from the AVX-512 kernel's by
 * float rounding (Q4 panels agree bit for bit across the ISAs). q8_half_dot: half h of block
 * column pb, its 8 rows' integer sums against x block b. */
INLINE __m256i q8_half_dot(const uint8_t *pb, const int h, const si_xq *x, const int b) {
    __m256i sum = _mm256_setzero_si256();
    for (int c = 0; c < 8; c++) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(pb + 32 + 64 * c + 32 * h));
        const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(x_word(x, b, c)), w);
        sum = dot_us_add(sum, _mm256_abs_epi8(w), xs);
    }
    return sum;
}
INLINE __m256 q8_half_d(const uint8_t *pb, const int h) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(pb + 16 * h)));
}
INLINE void panel_q8(const uint8_t *p, const si_xq *x, const int nt, const int nb, float *y,
                     const int64_t ys) {
    const int bb = panel_bytes(SI_Q8_0P);
    for (int h = 0; h < 2; h++) {
        __m256 acc[PANEL_T];
#pragma GCC unroll 8
        for (int t = 0; t < nt; t++) acc[t] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            const uint8_t *pb = p + (size_t)b * bb;
            if (h == 0)
                prefetch(pb + PANEL_AHEAD, bb, 0);
            const __m256 d = q8_half_d(pb, h);
#pragma GCC unroll 8
            for (int t = 0; t < nt; t++)
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q8_half_dot(pb, h, &x[t], b)),
                                         _mm256_mul_ps(d, _mm256_set1_ps(x[t].d[b])), acc[t]);
        }
#pragma GCC unroll 8
        for (int t = 0; t < nt; t++) _mm256_storeu_ps(y + t * ys + 8 * h, acc[t]);
    }
}
/* panel_q8 for one x row: both halves per block column in one pass (the same bits), over np (1
 * or 2, a constant) panels pp[n] side by side, outputs at yy[n] (two streams in flight). */
INLINE void panel_q8_1s(const int np, const uint8_t *const *pp, const si_xq *x, const int nb,
                        float *const *yy) {
    const int bb = panel_bytes(SI_Q8_0P);
    __m256 acc[2][2];
    for (int n = 0; n < np; n++) acc[n][0] = acc[n][1] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const __m256 dx = _mm256_set1_ps(x->d[b]);
        for (int n = 0; n < np; n++) {
            const uint8_t *pb = pp[n] + (size_t)b * bb;
            prefetch(pb + PANEL_AHEAD, bb, 0);
            for (int h = 0; h < 2; h++)
                acc[n][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q8_half_dot(pb, h, x, b)),
                                            _mm256_mul_ps(q8_half_d(pb, h), dx), acc[n][h]);
        }
    }
    for (int n = 0; n < np; n++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(yy[n] + 8 * h, acc[n][h]);
}
INLINE void panel_b32(const int type, const uint8_t *p, const si_xq *x, const int nt, const int nb,
                      float *y, const int64_t ys) {
    if (type == SI_Q8_0P) {
        if (nt == 1) panel_q8_1s(1, &p, x, nb, &y);
        else panel_q8(p, x, nt, nb, y, ys);
    } else if (nt == 1) {
        panel_q4_1(type, p, x, nb, y);
    } else {
        panel_q4(type, p, x, nt, nb, y, ys);
    }
}
#endif

/* 16 rows (the panel at p of type type, nb block columns) against nt <= PANEL_T x rows:
 * y[t * ys + r]; the K-quants' kernels, else panel_b32's. */
INLINE void panel(const int type, const uint8_t *p, const si_xq *x, const int nt, const int nb,
                  float *y, const int64_t ys) {
    if (type == SI_Q4_KP || type == SI_Q5_KP) {
        panel_k45(type == SI_Q5_KP, p, x, nt, nb / 8, y, ys);
        return;
    }
    if (type == SI_Q6_KP) {
        panel_q6k(p, x, nt, nb / 8, y, ys);
        return;
    }
    if (type == SI_Q6_KB) {
        panel_q6kb(p, x, nt, nb / 8, y, ys);
        return;
    }
    if (type == SI_Q5_KB) {
        panel_k5b(p, x, nt, nb / 8, y, ys);
        return;
    }
    panel_b32(type, p, x, nt, nb, y, ys);
}

/* nrows (a multiple of 16) panel rows at w against x rows x[0..T): y[t * ys + r]; x rows
 * PANEL_T at a time (the count a constant, so the accumulators stay in registers). AVX-512
 * takes each panel against every group of x rows while the panel is in L1, so that a GEMM of
 * more than PANEL_T rows reads its weights once; the 256-bit builds, slower at the arithmetic,
 * ran faster taking each group of x rows against the whole chunk (benchmarks/RESULTS.md). */
static void panel_rows(const int type, const uint8_t *w, const int nrows, const si_xq *x,
                       const int T, const int nb, float *y, const int64_t ys) {
    const size_t pb = (size_t)nb * panel_bytes(type);
#if SI_AVX512
    for (int r0 = 0; r0 < nrows; r0 += SI_PANEL) {
        const int r1 = r0 + SI_PANEL;
#else
    {
        const int r0 = 0, r1 = nrows;
#endif
    for (int t0 = 0; t0 < T; t0 += PANEL_T) {
        const int nt = T - t0 < PANEL_T ? T - t0 : PANEL_T;
#define PR(TY, N)                                                                              \
    for (int r = r0; r < r1; r += SI_PANEL)                                                    \
        panel(TY, w + (size_t)(r / SI_PANEL) * pb, x + t0, N, nb, y + t0 * ys + r, ys)
#define PRN(N)                                                                                 \
    case N:                                                                                    \
        if (type == SI_Q4_0P) PR(SI_Q4_0P, N);                                                 \
        else if (type == SI_Q4_1P) PR(SI_Q4_1P, N);                                            \
        else if (type == SI_Q5_0P) PR(SI_Q5_0P, N);                                            \
        else if (type == SI_Q5_1P) PR(SI_Q5_1P, N);                                            \
        else if (type == SI_Q4_KP) PR(SI_Q4_KP, N);                                            \
        else if (type == SI_Q5_KP) PR(SI_Q5_KP, N);                                            \
        else if (type == SI_Q6_KP) PR(SI_Q6_KP, N);                                            \
        else if (type == SI_Q6_KB) PR(SI_Q6_KB, N);                                            \
        else if (type == SI_Q5_KB) PR(SI_Q5_KB, N);                                            \
        else PR(SI_Q8_0P, N);                                                                  \
        break
        switch (nt) {
            PRN(1); PRN(2); PRN(3); PRN(4); PRN(5); PRN(6); PRN(7); PRN(8);
        default: break; /* nt <= PANEL_T = 8 */
        }
#undef PRN
#undef PR
    }
    }
}

#define PANEL_TWO_NB 64 /* blocks a row from which the GEMV reads two panels at once: the two
                         * streams read faster from memory, the pair computes slower (more
                         * registers than AVX2 has); SmolLM2's short rows lost (benchmarks/RESULTS.md) */
/* The GEMV's panels: panel_rows' pass for one x row, each type's kernel inlined on its own. On
 * the 256-bit builds (16 vector registers) GCC's default instruction order spilled the one-row
 * kernels' accumulators and x's broadcast words to the stack in every block; its first scheduling
 * pass, made to weigh register pressure, keeps them in registers (the same operations: the same
 * bits). Measured in benchmarks/RESULTS.md; the GEMM's kernels ran slower with it, so only here.
 * Other compilers take the function as it is. */
#if !SI_AVX512 && defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("schedule-insns", "sched-pressure")))
#endif
static void panel_gemv(const int type, const uint8_t *w, const int nrows, const si_xq *x,
                       const int nb, float *y) {
    const size_t pb = (size_t)nb * panel_bytes(type);
#define PG(TY)                                                                                 \
    case TY:                                                                                   \
        for (int r = 0; r < nrows; r += SI_PANEL)                                              \
            panel(TY, w + (size_t)(r / SI_PANEL) * pb, x, 1, nb, y + r, 0);                    \
        break
/* Rows of PANEL_TWO_NB blocks or more: panel i beside panel i + np / 2 (two streams in flight),
 * CALL with S = 2 panels at pp[0..1] (outputs yy[0..1]); the others and shorter rows one panel
 * at a time, S = 1. */
#define PGS(TY, CALL)                                                                          \
    case TY: {                                                                                 \
        const int np = nrows / SI_PANEL, half = nb >= PANEL_TWO_NB ? np / 2 : 0;               \
        for (int i = 0; i < half; i++) {                                                       \
            const uint8_t *pp[2] = {w + (size_t)i * pb, w + (size_t)(i + half) * pb};          \
            float *yy[2] = {y + SI_PANEL * i, y + SI_PANEL * (i + half)};                      \
            const int S = 2;                                                                   \
            CALL;                                                                              \
        }                                                                                      \
        for (int i = 2 * half; i < np; i++) {                                                  \
            const uint8_t *pp[1] = {w + (size_t)i * pb};                                       \
            float *yy[1] = {y + SI_PANEL * i};                                                 \
            const int S = 1;                                                                   \
            CALL;                                                                              \
        }                                                                                      \
    } break
    switch (type) {
#if SI_AVX512
        PG(SI_Q4_0P); PG(SI_Q4_1P); PG(SI_Q5_0P); PG(SI_Q5_1P); PG(SI_Q8_0P);
#else /* (panel_q4_1s: the pair's kernel; panel_q4_1, one panel's) */
#define PG_Q4(TY) \
    PGS(TY, if (S == 2) panel_q4_1s(TY, pp, 2, x, nb, yy); else panel_q4_1(TY, pp[0], x, nb, yy[0]))
        PG_Q4(SI_Q4_0P); PG_Q4(SI_Q4_1P); PG_Q4(SI_Q5_0P); PG_Q4(SI_Q5_1P);
#undef PG_Q4
        PGS(SI_Q8_0P, panel_q8_1s(S, pp, x, nb, yy));
#endif
        PG(SI_Q4_KP); PG(SI_Q5_KP); PG(SI_Q6_KP); PG(SI_Q5_KB);
        PGS(SI_Q6_KB, panel_q6kb_1s(S, pp, x, nb / 8, yy)); /* every build */
    default: break; /* si_is_panel: one of these */
    }
#undef PGS
#undef PG
}

/* ------------------------------------------------------------------ entry points */

#define WALK(call4, call1)                                                                     \
    do {                                                                                       \
        int r = 0;                                                                             \
        for (; r + 4 <= nrows; r += 4) call4;                                                  \
        for (; r < nrows; r++) call1;                                                          \
    } while (0)

void FN(si_rows)(int type, const uint8_t *w, size_t rb, int nrows, const si_xq *x, int cols,
                 float *y) {
    const int nb = cols / 32, nsb = cols / 256;
    const int far = 4 * rb > PF_NEAR_BYTES;
#if !SI_AVX512 && !SI_NARROW /* plain AVX2's rows of 4- and 5-bit blocks ran faster with their
                              * 9-10 KiB groups (4096 wide) in L2 as well (benchmarks/RESULTS.md) */
    const int far4 = 4 * rb > 8192;
#else
    const int far4 = far;
#endif
    if (si_is_panel(type)) {
        panel_gemv(type, w, nrows, x, nb, y);
        return;
    }
#define NEXT (w + (r + 4) * rb)
#define B32(T, S, F)                                                                           \
    WALK(rows_b32(T, S, w + r * rb, rb, 4, x, nb, y + r, NEXT, F),                             \
         rows_b32(T, S, w + r * rb, rb, 1, x, nb, y + r, NULL, F))
#if SI_AVX512
#define Q4G(T)                                                                                 \
    WALK(rows_q4g(T, w + r * rb, rb, 4, x, nb, y + r, NEXT, far),                              \
         rows_q4g(T, w + r * rb, rb, 1, x, nb, y + r, NULL, far))
    if (x->g && (type == SI_Q4_0 || type == SI_Q4_1 || type == SI_Q5_0 || type == SI_Q5_1)) {
        /* groups of 4 blocks */
        if (type == SI_Q4_0) Q4G(SI_Q4_0);
        else if (type == SI_Q4_1) Q4G(SI_Q4_1);
        else if (type == SI_Q5_0)
            WALK(rows_q5g(SI_Q5_0, w + r * rb, rb, 4, x, nb, y + r, NEXT, far),
                 rows_q5g(SI_Q5_0, w + r * rb, rb, 1, x, nb, y + r, NULL, far));
        else
            WALK(rows_q5g(SI_Q5_1, w + r * rb, rb, 4, x, nb, y + r, NEXT, far),
                 rows_q5g(SI_Q5_1, w + r * rb, rb, 1, x, nb, y + r, NULL, far));
        return;
    }
#undef Q4G
#endif
    switch (type) {
    case SI_Q4_0: B32(SI_Q4_0, 18, far4); break;
    case SI_Q4_1: B32(SI_Q4_1, 20, far4); break;
    case SI_Q5_0: B32(SI_Q5_0, 22, far4); break;
    case SI_Q5_1: B32(SI_Q5_1, 24, far4); break;
    case SI_Q8_0:
#if SI_AVX512
        /* rows of at most 1024 columns (Gemma's and SmolLM2's heads, SmolLM2's layers) go in
         * pairs; longer ones streamed from memory by one thread ran 4-9% faster through the
         * 256-bit loop (benchmarks/RESULTS.md, Zen 5) */
        if (nb <= 32) {
            WALK(rows_q8_512(w + r * rb, rb, 4, x, nb, y + r, NEXT, far),
                 rows_q8_512(w + r * rb, rb, 1, x, nb, y + r, NULL, far));
            break;
        }
#endif
        B32(SI_Q8_0, 34, far);
        break;
#if SI_AVX512
#define K45 rows_k45_512
#else
#define K45 rows_k45
#endif
    case SI_Q4_K:
        WALK(K45(0, w + r * rb, rb, 4, x, nsb, y + r, NEXT, far),
             K45(0, w + r * rb, rb, 1, x, nsb, y + r, NULL, far));
        break;
    case SI_Q5_K:
        WALK(K45(1, w + r * rb, rb, 4, x, nsb, y + r, NEXT, far),
             K45(1, w + r * rb, rb, 1, x, nsb, y + r, NULL, far));
        break;
#undef K45
    case SI_Q6_K:
#if SI_AVX512
        WALK(rows_q6k_512(w + r * rb, rb, 4, x, nsb, y + r, NEXT, far),
             rows_q6k_512(w + r * rb, rb, 1, x, nsb, y + r, NULL, far));
#else
        WALK(rows_q6k(w + r * rb, rb, 4, x, nsb, y + r, NEXT, far),
             rows_q6k(w + r * rb, rb, 1, x, nsb, y + r, NULL, far));
#endif
        break;
    case SI_F16:
        WALK(rows_f16(w + r * rb, rb, 4, x, cols, y + r, NEXT, far),
             rows_f16(w + r * rb, rb, 1, x, cols, y + r, NULL, far));
        break;
    case SI_BF16:
        WALK(rows_bf16(w + r * rb, rb, 4, x, cols, y + r, NEXT, far),
             rows_bf16(w + r * rb, rb, 1, x, cols, y + r, NULL, far));
        break;
    case SI_F32:
        WALK(rows_f32(w + r * rb, rb, 4, x, cols, y + r, NEXT, far),
             rows_f32(w + r * rb, rb, 1, x, cols, y + r, NULL, far));
        break;
    default: break;
    }
#undef B32
#undef NEXT
}

#define MULTI_T 8 /* x rows per pass over a weight row (the GEMM kernels below) */
#ifndef KT_MIN_T
#define KT_MIN_T 6 /* K-quant GEMM: x rows in lanes (multi_k45t) from this many rows of a pass */
#endif

#if SI_AVX512
/* One Q4_0/Q4_1 row against nt <= MULTI_T x rows (each with x.g) in groups of 4 blocks: each
 * group gathered and unpacked once for every x row; every x row's result is its GEMV's
 * (rows_q4g) bit for bit: the same integer sums and the same float operations in the same order.
 * y[t * ys] for t < nt. */
INLINE void multi_q4g(const int type, const uint8_t *p, const si_xq *x, const int nt, const int nb,
                      float *y, const int64_t ys) {
    const int bsize = type == SI_Q4_0 ? 18 : 20, G = nb / 4, rem = nb % 4;
    const __m512i qidx = q4g_qidx(bsize), didx = q4g_didx(bsize, 0), midx = q4g_didx(bsize, 1);
    const __m512i lb = lane_block();
    __m512 acc[MULTI_T], accm[MULTI_T];
    for (int t = 0; t < nt; t++) acc[t] = accm[t] = _mm512_setzero_ps();
    for (int g = 0; g < G + (rem > 0); g++) {
        __m512i a;
        const uint8_t *pg = p + (size_t)g * 4 * bsize;
        const __m512i q = g < G ? q4g_quants(pg, bsize, qidx, &a)
                                : q4g_quants_part(pg, bsize, rem, qidx, &a);
        const __m512i lo = nib_lo(q), hi = nib_hi(q);
        const __m512 dw = q4g_halfs(a, didx);
        const __m512 mw = type == SI_Q4_1 ? q4g_halfs(a, midx) : _mm512_setzero_ps();
        for (int t = 0; t < nt; t++) {
            const uint8_t *xg = xg_at(&x[t], g);
            const __m512i z = type == SI_Q4_0 ? xg_z(xg) : _mm512_setzero_si512();
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q4g_dot(lo, hi, z, xg)),
                                     _mm512_mul_ps(dw, xg_f4(xg, XG_D, lb)), acc[t]);
            if (type == SI_Q4_1) accm[t] = _mm512_fmadd_ps(mw, xg_f4(xg, XG_S4, lb), accm[t]);
        }
    }
    for (int t = 0; t < nt; t++)
        y[t * ys] = _mm512_reduce_add_ps(type == SI_Q4_1 ? _mm512_add_ps(acc[t], accm[t]) : acc[t]);
}
#endif

#if SI_AVX512
/* One Q4_K/Q5_K row against nt <= MULTI_T x rows: each super-block's weights and scales decoded
 * once (as rows_k45_512 decodes them) for every x row, every x row's result its GEMV's bit for
 * bit (the same operations in the same order). y[t * ys] for t < nt. */
INLINE void multi_k45_512(const int five, const uint8_t *p, const si_xq *x, const int nt,
                          const int nsb, float *y, const int64_t ys) {
    const int bsize = five ? 176 : 144;
    __m512 acc[MULTI_T];
    __m256 accm[MULTI_T];
    for (int t = 0; t < nt; t++) {
        acc[t] = _mm512_setzero_ps();
        accm[t] = _mm256_setzero_ps();
    }
    __m512i sidx[4];
    k45_idx(sidx);
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t *pb = p + (size_t)sb * bsize;
        uint64_t sc8, m8;
        scales_k(pb + 4, &sc8, &m8);
        const float dw = f16(pb);
        const __m256 bm = _mm256_mul_ps(bytes8_ps(m8), _mm256_set1_ps(f16(pb + 2)));
        __m512i q[4], scl[4];
        k45_quants_512(five, pb, q);
        if (five) k45_scales(sc8, sidx, scl);
        const __m256 bsc = five ? _mm256_setzero_ps() : bytes8_ps(sc8); /* Q4_K's scales as floats */
        for (int t = 0; t < nt; t++) {
            const size_t o = 8 * (size_t)sb;
            accm[t] = _mm256_fmadd_ps(bm, _mm256_loadu_ps((five ? x[t].ks : x[t].s) + o), accm[t]);
            if (five)
                acc[t] = xk_fold(q, scl, x[t].kq + 256 * (size_t)sb, dw, x[t].kd + 2 * (size_t)sb,
                                     acc[t]);
            else
                acc[t] = k4_fold(q, sidx, x[t].q + 256 * (size_t)sb,
                                 _mm256_mul_ps(_mm256_mul_ps(bsc, _mm256_loadu_ps(x[t].d + o)),
                                               _mm256_set1_ps(dw)),
                                 acc[t]);
        }
    }
    for (int t = 0; t < nt; t++) y[t * ys] = _mm512_reduce_add_ps(acc[t]) - hsum(accm[t]);
}

/* One Q6_K row against nt <= MULTI_T x rows: each super-block's weights and scales decoded once
 * (as rows_q6k_512) for every x row, every x row's result its GEMV's bit for bit (the same fold).
 * y[t * ys] for t < nt. */
INLINE void multi_q6k_512(const uint8_t *p, const si_xq *x, const int nt, const int nsb, float *y,
                          const int64_t ys) {
    __m512 acc[MULTI_T];
    __m256 accm[MULTI_T];
    for (int t = 0; t < nt; t++) acc[t] = _mm512_setzero_ps(), accm[t] = _mm256_setzero_ps();
    __m512i didx[4];
    q6k_didx(didx);
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t *pb = p + (size_t)sb * 210;
        const float d = f16(pb + 208);
        __m512i q[4], scl[4];
        __m256i sc16;
        q6k_quants_512(pb, q);
        q6k_scales(pb, didx, scl, &sc16);
        for (int t = 0; t < nt; t++)
            acc[t] = q6k_xk_fold(q, scl, sc16, x[t].kq + 256 * (size_t)sb, x[t].kbs + 16 * (size_t)sb,
                                 d, x[t].kd + 2 * (size_t)sb, acc[t], &accm[t]);
    }
    for (int t = 0; t < nt; t++) y[t * ys] = _mm512_reduce_add_ps(acc[t]) - hsum(accm[t]);
}
#endif

#if SI_AVX512
/* One Q8_0 row of at most 1024 columns against nt <= MULTI_T x rows: each pair of blocks gathered
 * once (as rows_q8_512) for every x row, every x row's result its GEMV's bit for bit (the same
 * operations in the same order). y[t * ys] for t < nt. */
INLINE void multi_q8(const uint8_t *p, const si_xq *x, const int nt, const int nb, float *y,
                     const int64_t ys) {
    const __m512i qidx = q8p_qidx(), didx = q8p_didx();
    __m512 acc[MULTI_T];
    __m256 acc8[MULTI_T];
    for (int t = 0; t < nt; t++) {
        acc[t] = _mm512_setzero_ps();
        acc8[t] = _mm256_setzero_ps();
    }
    int b = 0;
    for (; b + 2 <= nb; b += 2) {
        __m512 dw;
        const __m512i q = q8p_quants(p + (size_t)b * 34, qidx, didx, &dw);
        for (int t = 0; t < nt; t++) acc[t] = q8p_fma(q, dw, q8p_xpair(&x[t], b), acc[t]);
    }
    if (b < nb)
        for (int t = 0; t < nt; t++) acc8[t] = q8_last(p, &x[t], b, acc8[t]);
    for (int t = 0; t < nt; t++) y[t * ys] = _mm512_reduce_add_ps(acc[t]) + hsum(acc8[t]);
}
#endif

#if !SI_AVX512
/* The end of a Q4_0..Q5_1 GEMM row (multi_b32_128, multi_b32_256), as rows_b32 ends: the last
 * nb % 8 blocks one at a time into acc[t], then y[t * ys] from acc[t] and the zero-point sums
 * accm[t]. */
INLINE void multi_b32_end(const int type, const int bsize, const uint8_t *p, const si_xq *x,
                          const int nt, const int nb, __m256 *acc, const __m256 *accm, float *y,
                          const int64_t ys) {
    const int has_min = type == SI_Q4_1 || type == SI_Q5_1;
    float cs[MULTI_T];
    for (int t = 0; t < nt; t++) cs[t] = 0.0f;
    for (int b = nb - nb % 8; b < nb; b++) {
        const uint8_t *pb = p + (size_t)b * bsize;
        const float dwb = f16(pb), mwb = has_min ? f16(pb + 2) : dwb;
        for (int t = 0; t < nt; t++) {
            cs[t] += mwb * x[t].s[b];
            const __m256i dot = dot_b32(type, pb, loadx(&x[t], b));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dwb * x[t].d[b]),
                                     acc[t]);
        }
    }
    const float zk = type == SI_Q4_0 ? -8.0f : type == SI_Q5_0 ? -16.0f : 1.0f;
    for (int t = 0; t < nt; t++) y[t * ys] = hsum(acc[t]) + zk * (hsum(accm[t]) + cs[t]);
}
#endif

#if SI_NARROW
/* One Q4_0/Q4_1/Q5_0/Q5_1 row against nt <= MULTI_T quantized x rows (nb blocks): each group
 * of 8 blocks unpacked once and multiplied with every x row. Every x row's result is its GEMV's
 * (rows_b32 on this variant) bit for bit: the same products summed in the same order.
 * y[t * ys] for t < nt. */
INLINE void multi_b32_128(const int type, const int bsize, const uint8_t *p, const si_xq *x,
                          const int nt, const int nb, float *y, const int64_t ys) {
    const int has_min = type == SI_Q4_1 || type == SI_Q5_1;
    __m128 n0[MULTI_T], n1[MULTI_T];
    __m256 accm[MULTI_T];
    for (int t = 0; t < nt; t++) {
        n0[t] = n1[t] = _mm_setzero_ps();
        accm[t] = _mm256_setzero_ps();
    }
    for (int b = 0; b + 8 <= nb; b += 8) {
        const uint8_t *pb = p + (size_t)b * bsize;
        const __m256 dw = f16x8(pb, bsize, 0);
        const __m256 mw = has_min ? f16x8(pb, bsize, 2) : dw;
        __m128i lo[8], hi[8];
        for (int k = 0; k < 8; k++) unpack_b32_128(type, pb + (size_t)k * bsize, &lo[k], &hi[k]);
        for (int t = 0; t < nt; t++) {
            const __m256 scale = _mm256_mul_ps(dw, _mm256_loadu_ps(x[t].d + b));
            accm[t] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(x[t].s + b), accm[t]);
            const __m128 s0 = _mm256_castps256_ps128(scale), s1 = _mm256_extractf128_ps(scale, 1);
            const int8_t *xb = x[t].q + 32 * (size_t)b;
            if (type == SI_Q4_0 || type == SI_Q4_1) { /* as rows_b32: 4 blocks per FMA */
                n0[t] = _mm_fmadd_ps(_mm_cvtepi32_ps(sums4_q4(lo, hi, xb)), s0, n0[t]);
                n1[t] = _mm_fmadd_ps(_mm_cvtepi32_ps(sums4_q4(lo + 4, hi + 4, xb + 128)), s1, n1[t]);
                continue;
            }
#define MNARROW(k, S, i, A)                                                                    \
    A[t] = _mm_fmadd_ps(_mm_cvtepi32_ps(dot_unpacked_128(lo[k], hi[k], xb + 32 * (k))),        \
                        _mm_shuffle_ps(S, S, _MM_SHUFFLE(i, i, i, i)), A[t])
            MNARROW(0, s0, 0, n0); MNARROW(1, s0, 1, n1); MNARROW(2, s0, 2, n0);
            MNARROW(3, s0, 3, n1); MNARROW(4, s1, 0, n0); MNARROW(5, s1, 1, n1);
            MNARROW(6, s1, 2, n0); MNARROW(7, s1, 3, n1);
#undef MNARROW
        }
    }
    __m256 acc[MULTI_T];
    for (int t = 0; t < nt; t++)
        acc[t] = _mm256_add_ps(_mm256_setzero_ps(),
                               _mm256_setr_m128(_mm_add_ps(n0[t], n1[t]), _mm_setzero_ps()));
    multi_b32_end(type, bsize, p, x, nt, nb, acc, accm, y, ys);
}
#endif

#if !SI_AVX512 && !SI_NARROW
/* The plain AVX2 build (Zen 2/3, Intel without AVX-512): one Q4_0/Q4_1/Q5_0/Q5_1 row against
 * nt <= MULTI_T quantized x rows (nb blocks), each group of 8 blocks unpacked once and
 * multiplied with every x row. The products are summed in rows_b32's order, so every x row's
 * result is its GEMV's bit for bit. y[t * ys] for t < nt. */
INLINE void multi_b32_256(const int type, const int bsize, const uint8_t *p, const si_xq *x,
                          const int nt, const int nb, float *y, const int64_t ys) {
    const int has_min = type == SI_Q4_1 || type == SI_Q5_1;
    __m256 acc[MULTI_T], accm[MULTI_T];
    for (int t = 0; t < nt; t++) acc[t] = accm[t] = _mm256_setzero_ps();
    for (int b = 0; b + 8 <= nb; b += 8) {
        const uint8_t *pb = p + (size_t)b * bsize;
        const __m256 dw = f16x8(pb, bsize, 0);
        const __m256 mw = has_min ? f16x8(pb, bsize, 2) : dw;
        if ((type == SI_Q4_0 || type == SI_Q4_1) && x[0].g) { /* as rows_b32: pairs */
            const int off = type == SI_Q4_0 ? 2 : 4;
            __m256i lo[4], hi[4];
            for (int k = 0; k < 8; k += 2)
                pair_unpack(pb + off + (size_t)k * bsize, bsize, &lo[k / 2], &hi[k / 2]);
            for (int t = 0; t < nt; t++) {
                const __m256 scale = _mm256_mul_ps(dw, _mm256_loadu_ps(x[t].d + b));
                accm[t] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(x[t].s + b), accm[t]);
                for (int k = 0; k < 8; k += 2) {
                    const __m256i dot = pair_dot(lo[k / 2], hi[k / 2],
                                                 (const int8_t *)x[t].g + 32 * (size_t)(b + k));
                    const __m256 sk = _mm256_permutevar8x32_ps(scale, pair_idx(k));
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), sk, acc[t]);
                }
            }
            continue;
        }
        __m256i wv[8];
        for (int k = 0; k < 8; k++) wv[k] = unpack_b32(type, pb + (size_t)k * bsize);
        for (int t = 0; t < nt; t++) {
            const __m256 scale = _mm256_mul_ps(dw, _mm256_loadu_ps(x[t].d + b));
            accm[t] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(x[t].s + b), accm[t]);
            for (int k = 0; k < 8; k++) {
                const __m256i dot = dot_us(wv[k], loadx(&x[t], b + k));
                const __m256 sk = _mm256_permutevar8x32_ps(scale, _mm256_set1_epi32(k));
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), sk, acc[t]);
            }
        }
    }
    multi_b32_end(type, bsize, p, x, nt, nb, acc, accm, y, ys);
}
#endif

#if !SI_AVX512 && !SI_NARROW
/* The 8 sub-blocks of Q4_K/Q5_K super-block pb as unsigned bytes (wq[j]: sub-block j's 32
 * weights, Q5_K's fifth bits included), for the GEMM kernels below
 * (multi_k45, multi_k45t). */
INLINE void k45_unpack(const int five, const uint8_t *pb, __m256i *wq) {
    const __m256i lo4 = _mm256_set1_epi8(0x0F), b5 = _mm256_set1_epi8(0x10);
    const uint8_t *qs = pb + (five ? 48 : 16);
    const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(pb + 16)) : _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        wq[2 * c] = _mm256_and_si256(v, lo4);
        wq[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
        if (five) {
            wq[2 * c] = _mm256_or_si256(wq[2 * c], _mm256_and_si256(shift16(qh, 4 - 2 * c), b5));
            wq[2 * c + 1] = _mm256_or_si256(wq[2 * c + 1], _mm256_and_si256(shift16(qh, 3 - 2 * c), b5));
        }
    }
}

/* Plain AVX2 GEMM rows of Q4_K/Q5_K (multi_k45) and Q6_K (multi_q6k): one row against nt <=
 * MULTI_T x rows, each super-block's weights unpacked (and its scales decoded) once for all of
 * them; per x row the same operations as rows_k45 / rows_q6k, so each is its GEMV bit for bit.
 * The unpacking repeats the GEMV's on purpose: helpers shared by both, with the GEMV unpacking
 * ahead of its products, made the GEMV slower on a Zen 3 (benchmarks/RESULTS.md). y[t * ys]
 * for t < nt. */
INLINE void multi_k45(const int five, const uint8_t *p, const si_xq *x, const int nt, const int nsb,
                      float *y, const int64_t ys) {
    const int bsize = five ? 176 : 144;
    __m256 acc[MULTI_T], accm[MULTI_T];
    for (int t = 0; t < nt; t++) acc[t] = accm[t] = _mm256_setzero_ps();
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t *pb = p + (size_t)sb * bsize;
        uint64_t sc8, m8;
        scales_k(pb + 4, &sc8, &m8);
        const __m256 scf = bytes8_ps(sc8), dv = _mm256_set1_ps(f16(pb));
        const __m256 mdm = _mm256_mul_ps(bytes8_ps(m8), _mm256_set1_ps(f16(pb + 2)));
        __m256i wq[8];
        k45_unpack(five, pb, wq);
        for (int t = 0; t < nt; t++) {
            const __m256 scale = _mm256_mul_ps(_mm256_mul_ps(scf, _mm256_loadu_ps(x[t].d + 8 * (size_t)sb)), dv);
            accm[t] = _mm256_fmadd_ps(mdm, _mm256_loadu_ps(x[t].s + 8 * (size_t)sb), accm[t]);
            __m256i ps[8];
            for (int j = 0; j < 8; j++) ps[j] = _mm256_maddubs_epi16(wq[j], loadx(&x[t], 8 * sb + j));
            const __m256i sums = sums8_16(ps); /* as rows_k45 */
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[t]);
        }
    }
    for (int t = 0; t < nt; t++) y[t * ys] = hsum(_mm256_sub_ps(acc[t], accm[t]));
}
/* Q6_K against nt rows of x in blocks of 128 (x[t].kq): the weights unpacked once, each
 * row's sums as rows_q6k's (q6k_isum), so each row is its GEMV bit for bit. */
INLINE void multi_q6k(const uint8_t *p, const si_xq *x, const int nt, const int nsb, float *y,
                      const int64_t ys) {
    __m256i sidx[4];
    for (int s = 0; s < 4; s++) sidx[s] = q6k_sidx(s);
    __m256 acc[MULTI_T];
    for (int t = 0; t < nt; t++) acc[t] = _mm256_setzero_ps();
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t *pb = p + (size_t)sb * 210;
        const float d = f16(pb + 208);
        __m256i wq[8];
        for (int h = 0; h < 2; h++) q6k_half_256(pb, h, wq + 4 * h);
        for (int t = 0; t < nt; t++) {
            for (int h = 0; h < 2; h++) {
                const __m128i bs = _mm_loadu_si128((const __m128i *)(x[t].kbs + 16 * (size_t)sb + 8 * h));
                const __m256i isum = q6k_isum(pb, h, wq + 4 * h, x[t].kq + 256 * (size_t)sb + 128 * h,
                                              bs, sidx);
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum),
                                         _mm256_set1_ps(d * x[t].kd[2 * sb + h]), acc[t]);
            }
        }
    }
    for (int t = 0; t < nt; t++) y[t * ys] = hsum(acc[t]);
}

/* x rows in lanes for the K-quant GEMM below (kt_x): for MULTI_T rows of x (zeros past nt),
 * per sub-block j of 32 and word c (4 bytes) the 8 rows' words side by side (one vector, lane t
 * = row t), and x's block scales and sums (d, s) likewise, 8 rows to a vector per sub-block. */
typedef struct {
    __m256i *q; /* [nsb * 8 sub-blocks][8 words] */
    __m256 *d, *s; /* [nsb * 8] */
} kt_x;

static int kt_x_make(const si_xq *x, const int nt, const int nsb, kt_x *xt) {
    const size_t nj = (size_t)nsb * 8;
    void *mem = NULL;
    if (posix_memalign(&mem, 64, nj * (8 * 32 + 2 * 32))) return -1;
    xt->q = (__m256i *)mem;
    xt->d = (__m256 *)((uint8_t *)mem + nj * 8 * 32);
    xt->s = xt->d + nj;
    for (size_t j = 0; j < nj; j++) {
        /* the 8 rows' 32 bytes as an 8 x 8 matrix of words, transposed in registers */
        __m256i r[8], u[8];
        float d[8] = {0}, sm[8] = {0};
        for (int t = 0; t < 8; t++)
            r[t] = t < nt ? _mm256_loadu_si256((const __m256i *)(x[t].q + 32 * j)) : _mm256_setzero_si256();
        for (int t = 0; t < nt; t++) d[t] = x[t].d[j], sm[t] = x[t].s[j];
        for (int h = 0; h < 2; h++) { /* rows 4h .. 4h + 3: words c and c + 4 of each 4 rows */
            const __m256i *q = r + 4 * h;
            const __m256i t0 = _mm256_unpacklo_epi32(q[0], q[1]), t1 = _mm256_unpackhi_epi32(q[0], q[1]);
            const __m256i t2 = _mm256_unpacklo_epi32(q[2], q[3]), t3 = _mm256_unpackhi_epi32(q[2], q[3]);
            u[4 * h] = _mm256_unpacklo_epi64(t0, t2), u[4 * h + 1] = _mm256_unpackhi_epi64(t0, t2);
            u[4 * h + 2] = _mm256_unpacklo_epi64(t1, t3), u[4 * h + 3] = _mm256_unpackhi_epi64(t1, t3);
        }
        for (int c = 0; c < 4; c++) {
            xt->q[8 * j + c] = _mm256_permute2x128_si256(u[c], u[4 + c], 0x20);
            xt->q[8 * j + 4 + c] = _mm256_permute2x128_si256(u[c], u[4 + c], 0x31);
        }
        xt->d[j] = _mm256_loadu_ps(d);
        xt->s[j] = _mm256_loadu_ps(sm);
    }
    return 0;
}

/* One Q4_K/Q5_K row against MULTI_T x rows in lanes (kt_x): per sub-block j, each of its 8
 * weight words (4 unpacked bytes, broadcast) times the 8 rows' words in one maddubs, so one
 * vector holds sub-block j's integer sum for every row, without the horizontal adds of
 * multi_k45; then one convert and one FMA per sub-block for all rows. Lane t computes what
 * multi_k45 / rows_k45 compute in lane j of row t (the same integer sums, the same scale
 * product and FMA chain per sub-block, the minima's FMA chain, then the same subtraction and
 * horizontal sum), so each row is still its GEMV bit for bit. y[t * ys] for t < nt. */
INLINE void multi_k45t(const int five, const uint8_t *p, const kt_x *xt, const int nt, const int nsb,
                       float *y, const int64_t ys) {
    const int bsize = five ? 176 : 144;
    __m256 acc[8], accm[8];
    for (int j = 0; j < 8; j++) acc[j] = accm[j] = _mm256_setzero_ps();
    uint8_t wb[256] __attribute__((aligned(32)));
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t *pb = p + (size_t)sb * bsize;
        uint64_t sc8, m8;
        scales_k(pb + 4, &sc8, &m8);
        float scf[8], mdm[8];
        _mm256_storeu_ps(scf, bytes8_ps(sc8));
        _mm256_storeu_ps(mdm, _mm256_mul_ps(bytes8_ps(m8), _mm256_set1_ps(f16(pb + 2))));
        const __m256 dv = _mm256_set1_ps(f16(pb));
        __m256i wq[8];
        k45_unpack(five, pb, wq);
        for (int j = 0; j < 8; j++) _mm256_store_si256((__m256i *)(wb + 32 * j), wq[j]);
        const __m256i *xq = xt->q + 64 * (size_t)sb;
        for (int j = 0; j < 8; j++) {
            const uint8_t *wj = wb + 32 * j;
            __m256i s32;
            if (five) { /* two products of 5-bit weights reach 7874: 4 words in int16, then widen */
                __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();
                for (int c = 0; c < 4; c++) {
                    int32_t wa, wc;
                    memcpy(&wa, wj + 4 * c, 4);
                    memcpy(&wc, wj + 16 + 4 * c, 4);
                    a = chain_add(a, _mm256_set1_epi32(wa), xq[8 * j + c]);
                    b = chain_add(b, _mm256_set1_epi32(wc), xq[8 * j + 4 + c]);
                }
                s32 = _mm256_add_epi32(chain_sum(a), chain_sum(b));
            } else { /* 8 words in int16: at most 8 x 3810 (sums8_16) */
                __m256i a = _mm256_setzero_si256();
                for (int c = 0; c < 8; c++) {
                    int32_t wa;
                    memcpy(&wa, wj + 4 * c, 4);
                    a = chain_add(a, _mm256_set1_epi32(wa), xq[8 * j + c]);
                }
                s32 = chain_sum(a);
            }
            const __m256 scale = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(scf[j]), xt->d[8 * (size_t)sb + j]), dv);
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), scale, acc[j]);
            accm[j] = _mm256_fmadd_ps(_mm256_set1_ps(mdm[j]), xt->s[8 * (size_t)sb + j], accm[j]);
        }
    }
    float a[8][8], m[8][8];
    for (int j = 0; j < 8; j++) _mm256_storeu_ps(a[j], acc[j]), _mm256_storeu_ps(m[j], accm[j]);
    for (int t = 0; t < nt; t++) {
        float v[8];
        for (int j = 0; j < 8; j++) v[j] = a[j][t] - m[j][t];
        y[t * ys] = hsum(_mm256_loadu_ps(v));
    }
}
#endif

/* GEMM rows (si_rows_multi) are walked one at a time, each against up to MULTI_T x rows: row
 * r + GEMM_PF_ROWS of the chunk is fetched while row r is multiplied (a chunk is too short a run
 * for the hardware prefetcher to ramp up); into L2 only when those rows are long. */
#define GEMM_PF_ROWS 4
INLINE void prefetch_row(const uint8_t *w, const size_t rb, const int r, const int nrows) {
    if (r + GEMM_PF_ROWS < nrows)
        prefetch(w + (size_t)(r + GEMM_PF_ROWS) * rb, (int)rb, GEMM_PF_ROWS * rb > PF_NEAR_BYTES);
}

/* y[t * y_stride + r] = row r of w times x[t], for t < T: the rows decoded once per MULTI_T x
 * rows where a GEMM kernel exists (AVX-512: Q4_0/Q4_1 groups of 4, short Q8_0 rows, Q4_K/Q5_K/
 * Q6_K super-blocks when T > 1; avx2_128
 * and plain AVX2: Q4_0..Q5_1 8 blocks at a time; plain AVX2: Q4_K/Q5_K/Q6_K super-blocks, and
 * Q4_K/Q5_K passes of KT_MIN_T or more x rows with the rows in lanes, whose fixed cost of 8 lanes
 * only pays from there; every build: panels, F16 and BF16 rows), else si_rows for each x row. */
void FN(si_rows_multi)(int type, const uint8_t *w, size_t rb, int nrows, const si_xq *x, int T,
                       int cols, float *y, int64_t ys) {
    if (si_is_panel(type)) {
        panel_rows(type, w, nrows, x, T, cols / 32, y, ys);
        return;
    }
    if ((type == SI_F16 || type == SI_BF16) && T > 1) {
        /* tiles of 4 rows x F16_XT x rows, the type and both counts as constants (as
         * multi_q4g's MQN): the accumulators stay in registers; F16_RB rows at a time */
#define TF(BF, R, NT) tile_f16(BF, w + (size_t)r * rb, rb, R, x + t0, NT, cols, y + t0 * ys + r, ys)
#define TR(BF, R)                                                                              \
    do {                                                                                       \
        if (nt == 3) TF(BF, R, 3);                                                             \
        else if (nt == 2) TF(BF, R, 2);                                                        \
        else TF(BF, R, 1);                                                                     \
    } while (0)
        for (int r0 = 0; r0 < nrows; r0 += F16_RB) {
            const int r1 = nrows - r0 < F16_RB ? nrows : r0 + F16_RB;
            for (int t0 = 0; t0 < T; t0 += F16_XT) {
                const int nt = T - t0 < F16_XT ? T - t0 : F16_XT;
                int r = r0;
                if (type == SI_BF16) {
                    for (; r + 4 <= r1; r += 4) TR(1, 4);
                    for (; r < r1; r++) TR(1, 1);
                } else {
                    for (; r + 4 <= r1; r += 4) TR(0, 4);
                    for (; r < r1; r++) TR(0, 1);
                }
            }
        }
#undef TR
#undef TF
        return;
    }
#if SI_AVX512
    if ((type == SI_Q4_0 || type == SI_Q4_1) && x[0].g) {
        for (int t0 = 0; t0 < T; t0 += MULTI_T) {
            const int nt = T - t0 < MULTI_T ? T - t0 : MULTI_T;
            /* the row count and the type as constants: a run-time count left the x-row loop
             * rolled up with its accumulators on the stack (1.8x slower, benchmarks/RESULTS.md) */
#define MQ(TY, N)                                                                              \
    do {                                                                                       \
        for (int r = 0; r < nrows; r++) {                                                      \
            prefetch_row(w, rb, r, nrows);                                                     \
            multi_q4g(TY, w + (size_t)r * rb, x + t0, N, cols / 32, y + t0 * ys + r, ys);      \
        }                                                                                      \
    } while (0)
#define MQN(N)                                                                                 \
    case N:                                                                                    \
        if (type == SI_Q4_0) MQ(SI_Q4_0, N);                                                   \
        else MQ(SI_Q4_1, N);                                                                   \
        break
            switch (nt) {
                MQN(1); MQN(2); MQN(3); MQN(4); MQN(5); MQN(6); MQN(7); MQN(8);
            default: MQ(type, nt); /* not reached: nt <= MULTI_T = 8 */
            }
#undef MQN
#undef MQ
        }
        return;
    }
    if ((type == SI_Q4_K || type == SI_Q5_K || type == SI_Q6_K) && T > 1) {
        const int nsb = cols / 256;
        for (int t0 = 0; t0 < T; t0 += MULTI_T) {
            const int nt = T - t0 < MULTI_T ? T - t0 : MULTI_T;
            /* the row count as a constant, as multi_q4g's (MQN) */
#define MK(N)                                                                                  \
    case N:                                                                                    \
        for (int r = 0; r < nrows; r++) {                                                      \
            prefetch_row(w, rb, r, nrows);                                                     \
            if (type == SI_Q6_K)                                                               \
                multi_q6k_512(w + (size_t)r * rb, x + t0, N, nsb, y + t0 * ys + r, ys);        \
            else                                                                               \
                multi_k45_512(type == SI_Q5_K, w + (size_t)r * rb, x + t0, N, nsb,             \
                              y + t0 * ys + r, ys);                                            \
        }                                                                                      \
        break
            switch (nt) {
                MK(1); MK(2); MK(3); MK(4); MK(5); MK(6); MK(7); MK(8);
            default: break; /* nt <= MULTI_T = 8 */
            }
#undef MK
        }
        return;
    }
    if (type == SI_Q8_0 && cols <= 1024) { /* the rows si_rows takes two blocks at a time */
        for (int t0 = 0; t0 < T; t0 += MULTI_T) {
            const int nt = T - t0 < MULTI_T ? T - t0 : MULTI_T;
#define M8(N)                                                                                  \
    case N:                                                                                    \
        for (int r = 0; r < nrows; r++) { /* at most 4 x rows a call: 8 ran slower per row */ \
            prefetch_row(w, rb, r, nrows);                                                     \
            multi_q8(w + (size_t)r * rb, x + t0, N < 4 ? N : 4, cols / 32, y + t0 * ys + r, ys); \
            if (N > 4)                                                                         \
                multi_q8(w + (size_t)r * rb, x + t0 + 4, N - 4, cols / 32,                     \
                         y + (t0 + 4) * ys + r, ys);                                           \
        }                                                                                      \
        break
            switch (nt) {
                M8(1); M8(2); M8(3); M8(4); M8(5); M8(6); M8(7); M8(8);
            default: break; /* nt <= MULTI_T = 8 */
            }
#undef M8
        }
        return;
    }
#endif
#if !SI_AVX512
    if (type == SI_Q4_0 || type == SI_Q4_1 || type == SI_Q5_0 || type == SI_Q5_1) {
        const int bsize = (int)(rb / (size_t)(cols / 32)); /* bytes per block of 32 */
        for (int t0 = 0; t0 < T; t0 += MULTI_T) {
            const int nt = T - t0 < MULTI_T ? T - t0 : MULTI_T;
            for (int r = 0; r < nrows; r++) {
                prefetch_row(w, rb, r, nrows);
#if SI_NARROW
                multi_b32_128(type, bsize, w + (size_t)r * rb, x + t0, nt, cols / 32,
                              y + t0 * ys + r, ys);
#else
                multi_b32_256(type, bsize, w + (size_t)r * rb, x + t0, nt, cols / 32,
                              y + t0 * ys + r, ys);
#endif
            }
        }
        return;
    }
#if !SI_NARROW
    if (type == SI_Q4_K || type == SI_Q5_K || type == SI_Q6_K) {
        for (int t0 = 0; t0 < T; t0 += MULTI_T) {
            const int nt = T - t0 < MULTI_T ? T - t0 : MULTI_T;
            kt_x xt;
            if (type != SI_Q6_K && nt >= KT_MIN_T && !kt_x_make(x + t0, nt, cols / 256, &xt)) {
                for (int r = 0; r < nrows; r++) {
                    prefetch_row(w, rb, r, nrows);
                    multi_k45t(type == SI_Q5_K, w + (size_t)r * rb, &xt, nt, cols / 256, y + t0 * ys + r, ys);
                }
                free(xt.q);
                continue;
            }
            for (int r = 0; r < nrows; r++) {
                prefetch_row(w, rb, r, nrows);
                if (type == SI_Q6_K) multi_q6k(w + (size_t)r * rb, x + t0, nt, cols / 256, y + t0 * ys + r, ys);
                else multi_k45(type == SI_Q5_K, w + (size_t)r * rb, x + t0, nt, cols / 256, y + t0 * ys + r, ys);
            }
        }
        return;
    }
#endif
#endif
    for (int t = 0; t < T; t++) FN(si_rows)(type, w, rb, nrows, &x[t], cols, y + t * ys);
}

/* 32 values v times vid rounded to int8 (the current rounding mode: to even) into q, in order;
 * their int32 values in iv. */
INLINE void round32(const __m256 *v, const __m256 vid, int8_t *q, __m256i *iv) {
    for (int i = 0; i < 4; i++) iv[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vid));
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]), _mm256_packs_epi32(iv[2], iv[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

/* x (cols, a multiple of 32) -> blocks of 32: d = max|x|/127, q = round-to-even(x/d) as
 * x * (1/d), s = d * sum(q). */
void FN(si_quantize_x)(const float *x, int cols, int8_t *q, float *d, float *s) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int b = 0; b < cols / 32; b++) {
        const float *xb = x + 32 * (size_t)b;
        __m256 v[4], m = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(xb + 8 * i);
            m = _mm256_max_ps(m, _mm256_and_ps(v[i], absmask));
        }
        const float db = hmax(m) / 127.0f;
        const float id = db != 0.0f ? 1.0f / db : 0.0f;
        __m256i iv[4];
        round32(v, _mm256_set1_ps(id), q + 32 * (size_t)b, iv);
        d[b] = db;
        s[b] = db * (float)hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(iv[0], iv[1]),
                                                       _mm256_add_epi32(iv[2], iv[3])));
    }
}

/* x (cols, a multiple of 128) -> blocks of 128, as llama.cpp's Q8_K per 256 (si_quantize_xk):
 * d = max|x|/127, q = round-to-even(x * (1/d)) (0 where d = 0), bs = sums of q per 16, and
 * ks (unless NULL) = d times the sums of q per 32 (the K-quant kernels' minima terms). The
 * rounding is the current mode's (round to even), as lrintf's. */
void FN(si_quantize_xk)(const float *x, int cols, int8_t *q, float *d, int16_t *bs, float *ks) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int b = 0; b < cols / 128; b++) {
        const float *xb = x + 128 * (size_t)b;
        __m256 m = _mm256_setzero_ps();
        for (int i = 0; i < 16; i++) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(xb + 8 * i), absmask));
        const float db = hmax(m) / 127.0f;
        const float id = db != 0.0f ? 1.0f / db : 0.0f;
        const __m256 vid = _mm256_set1_ps(id);
        for (int k = 0; k < 4; k++) { /* 32 values: 2 sums of 16, one of 32 */
            __m256 v[4];
            __m256i iv[4];
            for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(xb + 32 * k + 8 * i);
            round32(v, vid, q + 128 * (size_t)b + 32 * k, iv);
            const int s0 = hsum_epi32(_mm256_add_epi32(iv[0], iv[1]));
            const int s1 = hsum_epi32(_mm256_add_epi32(iv[2], iv[3]));
            bs[8 * (size_t)b + 2 * k] = (int16_t)s0;
            bs[8 * (size_t)b + 2 * k + 1] = (int16_t)s1;
            if (ks) ks[4 * (size_t)b + k] = db * (float)(s0 + s1);
        }
        d[b] = db;
    }
}

/* ------------------------------------------------------------------ sparse FFN, q4 rows */

/* A q4 row (PackedFFN dtype "q4") of nb = d_model / 32 blocks is Q4_0's numbers split by kind:
 * the nb fp16 scales first (block b's at byte 2b), then the nb x 16 quant bytes (block b's at
 * 2nb + 16b; byte j = q[j] | q[j + 16] << 4, w = d (q - 8)): nb * 18 bytes as Q4_0's blocks. A
 * pass over several rows loads 8 blocks' scales of a row at once, and a block's 16 quant bytes
 * are on a 16-byte boundary of the row when nb is a multiple of 8 (Q4_0's 18-byte blocks cross
 * cache lines). */
INLINE const uint8_t *q4r_q(const uint8_t *row, const int nb, const int b) {
    return row + 2 * (size_t)nb + 16 * (size_t)b;
}
/* The scales of blocks b..b+7 of a row as 8 floats */
INLINE __m256 q4r_d8(const uint8_t *row, const int b) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * (size_t)b)));
}

/* The next neurons' bundles (pf[0..npf), pf_bytes each) are fetched a slice per step while the
 * current rows are walked in `parts` steps: slice_bytes is a slice's size (whole cache lines),
 * prefetch_slice fetches slice i of each. As prefetch's groups (above), more than PF_NEAR_BYTES
 * in all go into L2 only: into L1 (32 KiB on Zen 3/4) the next 4 bundles of a 7B layer (27 KiB)
 * evicted x and the output rows the down axpy adds into (measured in benchmarks/RESULTS.md). */
#define PF_BLOCKS 4 /* the block-by-block kernels fetch ahead in bursts, every PF_BLOCKS blocks
                     * (faster than a line a bundle every block: benchmarks/RESULTS.md) */
INLINE size_t slice_bytes(const size_t pf_bytes, const int parts) {
    return ((pf_bytes + (size_t)parts - 1) / (size_t)parts + 63) / 64 * 64;
}
/* Lines [o, end) of each of pf[0..n), side by side (n a constant where called: unrolled) */
INLINE void prefetch_lines(const uint8_t *const *pf, const int n, const size_t o,
                           const size_t end, const int far) {
    for (size_t q = o; q < end; q += 64)
        for (int r = 0; r < n; r++) prefetch(pf[r] + q, 64, far);
}
INLINE void prefetch_slice(const uint8_t *const *pf, const int npf, const size_t pf_bytes,
                           const size_t slice, const int i) {
    const size_t o = slice * (size_t)i, end = o + slice < pf_bytes ? o + slice : pf_bytes;
    if (o >= end) return;
    const int far = (size_t)npf * pf_bytes > PF_NEAR_BYTES;
    /* the usual 4 bundles (a group's) or 8 gate rows (a q4 gate pass's) with a constant count
     * (the 8 through the loop below made the gate pass slower: benchmarks/RESULTS.md, session 49) */
    if (npf == 4) prefetch_lines(pf, 4, o, end, far);
    else if (npf == 8) prefetch_lines(pf, 8, o, end, far);
    else
        for (int n = 0; n < npf; n++) prefetch(pf[n] + o, (int)(end - o), far);
}

#if !SI_AVX512 && !SI_NARROW
/* 8 rows' 8 words each (s[r]: words of row r) -> c[j]: word j of each row (an 8 x 8 transpose
 * of 16-bit words) */
INLINE void transpose8x16(const __m128i *s, __m128i *c) {
    __m128i a[8], t[8];
    for (int k = 0; k < 4; k++) {
        a[2 * k] = _mm_unpacklo_epi16(s[2 * k], s[2 * k + 1]);
        a[2 * k + 1] = _mm_unpackhi_epi16(s[2 * k], s[2 * k + 1]);
    }
    for (int k = 0; k < 2; k++)
        for (int h = 0; h < 2; h++) {
            t[4 * k + 2 * h] = _mm_unpacklo_epi32(a[4 * k + h], a[4 * k + 2 + h]);
            t[4 * k + 2 * h + 1] = _mm_unpackhi_epi32(a[4 * k + h], a[4 * k + 2 + h]);
        }
    for (int j = 0; j < 4; j++) {
        c[2 * j] = _mm_unpacklo_epi64(t[j], t[4 + j]);
        c[2 * j + 1] = _mm_unpackhi_epi64(t[j], t[4 + j]);
    }
}
/* q4_dots (below) for 8 rows in plain AVX2, each lane a row as in the panels: per block the 8
 * rows' quant words are transposed in registers (rows r and r + 4 in one load, then 32- and
 * 64-bit unpacks), so lane r of vector c holds word c of row r; one maddubs per word and nibble
 * half against x's word broadcast, the int16 sums widened once, one FMA per block for all 8
 * rows with their scales (h: block b's 8 scales, fp16, lane r row r). */
INLINE void q4_dots8_block(const uint8_t *const *rp, const int nb, const si_xq *x, const int b,
                           const __m128i h, __m256 *acc, __m256 *accm) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256i a[4];
    for (int r = 0; r < 4; r++)
        a[r] = _mm256_loadu2_m128i((const __m128i *)q4r_q(rp[r + 4], nb, b),
                                   (const __m128i *)q4r_q(rp[r], nb, b));
    const __m256i t0 = _mm256_unpacklo_epi32(a[0], a[1]), t1 = _mm256_unpackhi_epi32(a[0], a[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(a[2], a[3]), t3 = _mm256_unpackhi_epi32(a[2], a[3]);
    const __m256i w[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),
                          _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)};
    __m256i s16 = _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
        s16 = chain_add(s16, _mm256_and_si256(w[c], m4), _mm256_set1_epi32(x_word(x, b, c)));
        s16 = chain_add(s16, _mm256_and_si256(_mm256_srli_epi16(w[c], 4), m4),
                        _mm256_set1_epi32(x_word(x, b, 4 + c)));
    }
    const __m256 d = _mm256_cvtph_ps(h);
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(chain_sum(s16)),
                           _mm256_mul_ps(d, _mm256_set1_ps(x->d[b])), *acc);
    *accm = _mm256_fmadd_ps(d, _mm256_set1_ps(x->s[b]), *accm);
}
/* The 8 rows' scales 8 blocks at a time: 8 loads and a transpose (the last nb % 8 blocks' one
 * by one). */
INLINE void q4_dots8(const uint8_t *const *rp, const si_xq *x, int nb, float *y,
                     const uint8_t *const *pf, const int npf, size_t pf_bytes) {
    const size_t slice = slice_bytes(pf_bytes, (nb + PF_BLOCKS - 1) / PF_BLOCKS);
    __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
    int b = 0;
    for (; b + 8 <= nb; b += 8) {
        __m128i s[8], h[8];
        for (int r = 0; r < 8; r++) s[r] = _mm_loadu_si128((const __m128i *)(rp[r] + 2 * (size_t)b));
        transpose8x16(s, h);
        for (int j = 0; j < 8; j++) {
            if ((b + j) % PF_BLOCKS == 0) prefetch_slice(pf, npf, pf_bytes, slice, (b + j) / PF_BLOCKS);
            q4_dots8_block(rp, nb, x, b + j, h[j], &acc, &accm);
        }
    }
    for (; b < nb; b++) {
        if (b % PF_BLOCKS == 0) prefetch_slice(pf, npf, pf_bytes, slice, b / PF_BLOCKS);
        uint16_t h[8];
        for (int r = 0; r < 8; r++) h[r] = (uint16_t)ld16(rp[r] + 2 * (size_t)b);
        q4_dots8_block(rp, nb, x, b, _mm_loadu_si128((const __m128i *)h), &acc, &accm);
    }
    /* w = d (q - 8): the zero point through x's block sums */
    _mm256_storeu_ps(y, _mm256_fmadd_ps(accm, _mm256_set1_ps(-8.0f), acc));
}
#endif

/* Dot products of R q4 rows (pointers; nb blocks each) with x over blocks b0..nb-1: y[r] =
 * row_r . x there. The next neurons' bundles (pf[0..npf), pf_bytes each) are fetched a slice per
 * PF_BLOCKS blocks while these rows are walked: a bundle is a few KB, over before the hardware
 * prefetcher ramps up. */
INLINE void q4_dots_from(const uint8_t *const *rp, const int R, const si_xq *x, const int b0,
                         int nb, float *y, const uint8_t *const *pf, const int npf,
                         size_t pf_bytes) {
    const size_t slice = slice_bytes(pf_bytes, (nb - b0 + PF_BLOCKS - 1) / PF_BLOCKS);
    __m256 acc[8];
    float cs[8];
#if SI_NARROW
    __m128 accn[8];
    for (int r = 0; r < R; r++) accn[r] = _mm_setzero_ps();
#endif
    for (int r = 0; r < R; r++) {
        acc[r] = _mm256_setzero_ps();
        cs[r] = 0.0f;
    }
    for (int b = b0; b < nb; b++) {
        const __m256i xv = loadx(x, b);
        const float xd = x->d[b], xs = x->s[b];
        if ((b - b0) % PF_BLOCKS == 0) prefetch_slice(pf, npf, pf_bytes, slice, (b - b0) / PF_BLOCKS);
        for (int r = 0; r < R; r++) {
            const uint8_t *q = q4r_q(rp[r], nb, b);
            const float dw = f16(rp[r] + 2 * (size_t)b);
            cs[r] -= 8.0f * dw * xs;
#if SI_NARROW
            (void)xv;
            const __m128i v = load128(q), m4 = _mm_set1_epi8(0x0F);
            const __m128i d4 = dot_unpacked_128(_mm_and_si128(v, m4),
                                                _mm_and_si128(_mm_srli_epi16(v, 4), m4),
                                                x->q + 32 * (size_t)b);
            accn[r] = _mm_fmadd_ps(_mm_cvtepi32_ps(d4), _mm_set1_ps(dw * xd), accn[r]);
#else
            const __m256i dot = dot_us(nib32(q), xv);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dw * xd), acc[r]);
#endif
        }
    }
#if SI_NARROW
    for (int r = 0; r < R; r++)
        acc[r] = _mm256_add_ps(acc[r], _mm256_setr_m128(accn[r], _mm_setzero_ps()));
#endif
    for (int r = 0; r < R; r++) y[r] = hsum(acc[r]) + cs[r];
}
INLINE void q4_dots(const uint8_t *const *rp, const int R, const si_xq *x, int nb, float *y,
                    const uint8_t *const *pf, const int npf, size_t pf_bytes) {
    q4_dots_from(rp, R, x, 0, nb, y, pf, npf, pf_bytes);
}

#if !SI_NARROW
/* o[0..3] (a block's 32 outputs) += s * (the block's quants q: nibbles, unsigned): q4_axpy's
 * per row and block work; the -8 is added once per block by the caller (through the scales'
 * sum). */
INLINE void q4_axpy_block(const uint8_t *q, const __m256 s, const __m256i m4, __m256 *o) {
    const __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
    const __m256i v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8)));
    o[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v0, m4)), s, o[0]);
    o[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v1, m4)), s, o[1]);
    o[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4)), s, o[2]);
    o[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4)), s, o[3]);
}
/* out[0..32) = o[0..3] + z */
INLINE void q4_axpy_store(float *out, const __m256 *o, const __m256 z) {
    for (int i = 0; i < 4; i++) _mm256_storeu_ps(out + 8 * i, _mm256_add_ps(o[i], z));
}
#endif

/* out += sum_r h[r] * row_r over blocks b0..nb-1 of R q4 rows (out: the whole row's outputs).
 * AVX2: a block's bytes 0..7 and 8..15 widened to int32 straight from memory, their low nibbles
 * (elements 0..15) and high ones (16..31) a mask or a shift away; w = d*(q - 8): the -8 applied
 * once per block through the sum of the rows' scales.
 * pf[0..npf) (pf_bytes each) are fetched a slice per PF_BLOCKS blocks meanwhile, as q4_dots
 * does. */
INLINE void q4_axpy_from(const uint8_t *const *rp, const float *h, const int R, const int b0,
                         int nb, float *out, const uint8_t *const *pf, const int npf,
                         size_t pf_bytes) {
    const size_t slice = slice_bytes(pf_bytes, (nb - b0 + PF_BLOCKS - 1) / PF_BLOCKS);
#if SI_NARROW
    const __m256i k8 = _mm256_set1_epi8(8);
#else
    const __m256i m4 = _mm256_set1_epi32(0x0F);
#endif
    int b = b0;
#if !SI_NARROW
    /* 8 blocks at a time: each row's 8 scales (one load) times its h in one multiply, the
     * blocks' sums of them (the -8 term) in three adds; per block a broadcast from c. The same
     * products and sums, in the same order, as the block-by-block loop below (the same bits). */
    float c[4][8], z8[8];
    for (; R <= 4 && b + 8 <= nb; b += 8) {
        __m256 ssum = _mm256_setzero_ps();
        for (int r = 0; r < R; r++) {
            const __m256 cr = _mm256_mul_ps(_mm256_set1_ps(h[r]), q4r_d8(rp[r], b));
            _mm256_storeu_ps(c[r], cr);
            ssum = _mm256_add_ps(ssum, cr);
        }
        _mm256_storeu_ps(z8, _mm256_mul_ps(_mm256_set1_ps(-8.0f), ssum));
        for (int j = 0; j < 8; j++) {
            float *o = out + 32 * (size_t)(b + j);
            if ((b + j - b0) % PF_BLOCKS == 0)
                prefetch_slice(pf, npf, pf_bytes, slice, (b + j - b0) / PF_BLOCKS);
            __m256 acc[4] = {_mm256_loadu_ps(o), _mm256_loadu_ps(o + 8), _mm256_loadu_ps(o + 16),
                             _mm256_loadu_ps(o + 24)};
            for (int r = 0; r < R; r++)
                q4_axpy_block(q4r_q(rp[r], nb, b + j), _mm256_broadcast_ss(&c[r][j]), m4, acc);
            q4_axpy_store(o, acc, _mm256_broadcast_ss(&z8[j]));
        }
    }
#endif
    for (; b < nb; b++) {
        float *o = out + 32 * (size_t)b;
        if ((b - b0) % PF_BLOCKS == 0) prefetch_slice(pf, npf, pf_bytes, slice, (b - b0) / PF_BLOCKS);
        __m256 o0 = _mm256_loadu_ps(o), o1 = _mm256_loadu_ps(o + 8);
        __m256 o2 = _mm256_loadu_ps(o + 16), o3 = _mm256_loadu_ps(o + 24);
#if !SI_NARROW
        float ssum = 0.0f;
#endif
        for (int r = 0; r < R; r++) {
            const uint8_t *q = q4r_q(rp[r], nb, b);
            const float sr = h[r] * f16(rp[r] + 2 * (size_t)b);
            const __m256 s = _mm256_set1_ps(sr);
#if SI_NARROW /* the two nibble halves straight into 128-bit registers */
            const __m128i v = load128(q), m4 = _mm_set1_epi8(0x0F);
            const __m128i lo = _mm_sub_epi8(_mm_and_si128(v, m4), _mm256_castsi256_si128(k8));
            const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(v, 4), m4),
                                            _mm256_castsi256_si128(k8));
            o0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), s, o0);
            o1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), s, o1);
            o2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), s, o2);
            o3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), s, o3);
#else
            ssum += sr;
            __m256 acc[4] = {o0, o1, o2, o3};
            q4_axpy_block(q, s, m4, acc);
            o0 = acc[0], o1 = acc[1], o2 = acc[2], o3 = acc[3];
#endif
        }
#if !SI_NARROW
        const __m256 z = _mm256_set1_ps(-8.0f * ssum);
        o0 = _mm256_add_ps(o0, z), o1 = _mm256_add_ps(o1, z), o2 = _mm256_add_ps(o2, z), o3 = _mm256_add_ps(o3, z);
#endif
        _mm256_storeu_ps(o, o0);
        _mm256_storeu_ps(o + 8, o1);
        _mm256_storeu_ps(o + 16, o2);
        _mm256_storeu_ps(o + 24, o3);
    }
}
INLINE void q4_axpy(const uint8_t *const *rp, const float *h, const int R, int nb, float *out,
                    const uint8_t *const *pf, const int npf, size_t pf_bytes) {
    q4_axpy_from(rp, h, R, 0, nb, out, pf, npf, pf_bytes);
}

#if SI_AVX512
/* A q4 row's 16 scales from block 4g (g a multiple of 4) as floats, in block order (past the
 * row's last block they are its quant bytes, unused: a row has 18 nb >= 8 g + 32 bytes). The
 * AVX-512 loops take them 4 groups at a time, multiplied by x's scales (dots) or the neuron's
 * coefficient (axpy) in one operation, and then each group's 4 on their lanes by one permute;
 * loaded with each group (8 bytes from the row's start while its quants stream from further on)
 * they slowed the loops from memory (benchmarks/RESULTS.md). */
INLINE __m512 q4r_d16x4(const uint8_t *row, const int g) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row + 8 * (size_t)g)));
}

/* y[r] = row_r . x for R q4 rows (pointers), the first G groups (4 blocks: the row's 64 quant
 * bytes from 64g, in the order q4g_dot takes) from xg, the rest block by block (q4_dots_from);
 * the next bundles fetched as q4_dots does, a slice per group. */
INLINE void q4_dots_g(const uint8_t *const *rp, const int R, const si_xq *x, int nb, float *y,
                      const uint8_t *const *pf, const int npf, size_t pf_bytes) {
    const int G = nb / 4;
    const size_t slice = slice_bytes(pf_bytes, G);
    const __m512i lb = lane_block();
    __m512 pr[8]; /* row r's scales times x's for the 16 blocks from 4 (g - g % 4) */
    __m512 acc[8];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        const uint8_t *xg = xg_at(x, g);
        const __m512i z = xg_z(xg);
        prefetch_slice(pf, npf, pf_bytes, slice, g);
        if (g % 4 == 0) {
            const int left = 4 * (G - g); /* blocks of whole groups from here */
            const __m512 xd = _mm512_maskz_loadu_ps(left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1),
                                                    x->d + 4 * (size_t)g);
            for (int r = 0; r < R; r++) /* past the last group: quant bytes, lanes unused */
                pr[r] = _mm512_mul_ps(q4r_d16x4(rp[r], g), xd);
        }
        const __m512i pi = _mm512_add_epi32(lb, _mm512_set1_epi32(4 * (g % 4)));
        for (int r = 0; r < R; r++) {
            const __m512i q = _mm512_loadu_si512((const void *)q4r_q(rp[r], nb, 4 * g));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q4g_dot(nib_lo(q), nib_hi(q), z, xg)),
                                     _mm512_permutexvar_ps(pi, pr[r]), acc[r]);
        }
    }
    float tail[8] = {0};
    if (nb > 4 * G) q4_dots_from(rp, R, x, 4 * G, nb, tail, NULL, 0, 0);
    for (int r = 0; r < R; r++) y[r] = _mm512_reduce_add_ps(acc[r]) + tail[r];
}

/* The grouped axpy keeps each group's 128 outputs in a lane order of its own: its 64 quant bytes
 * are 16 dwords, and nibble n (0..7) of dword l is a shift away (a permute reads only a dword's
 * low 4 bits), with no byte shuffle, so register n accumulates nibble n of every dword. Element 128g + 16n + l of that
 * order is weight 32k + i + 16(n % 2) of the group (k = l / 4, i = 4(l % 4) + n / 2): natural
 * index NAT(n, l) below. si_sparse_q4 puts `out` in this order before the neurons and back
 * after. */
#define NAT(n, l) (32 * ((l) / 4) + 4 * ((l) % 4) + (n) / 2 + 16 * ((n) % 2))
static void q4g_order(float *out, int G, int back) {
    float tmp[128];
    for (int g = 0; g < G; g++) {
        float *o = out + 128 * (size_t)g;
        memcpy(tmp, o, sizeof tmp);
        for (int n = 0; n < 8; n++)
            for (int l = 0; l < 16; l++) {
                if (back) o[NAT(n, l)] = tmp[16 * n + l];
                else o[16 * n + l] = tmp[NAT(n, l)];
            }
    }
}
#undef NAT

/* out += sum_r h[r] * row_r for R q4 rows of nb blocks: the first G = nb / 4 groups into out
 * in q4g_order's lane order, 128 outputs in 8 registers at a time; the last nb % 4 blocks through
 * q4_axpy_from (natural order). w = d*(q - 8), q - 8 looked up as a float by a permute: a
 * shift, a permute and an FMA per 16 weights (a mask and a convert in the permute's place cost
 * one operation more). pf[0..npf) (pf_bytes each) are fetched a slice per group meanwhile. */
INLINE void q4_axpy_g(const uint8_t *const *rp, const float *h, const int R, int nb, float *out,
                      const uint8_t *const *pf, const int npf, size_t pf_bytes) {
    const int G = nb / 4;
    const size_t slice = slice_bytes(pf_bytes, G);
    const __m512i lb = lane_block();
    /* q - 8 for every nibble value q: a permute picks a lane by the low 4 bits of each dword,
     * so a nibble needs only its shift (none for the first) instead of a mask and a convert */
    const __m512 lut = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    __m512 hd[4]; /* row r's scales times its h for the 16 blocks from 4 (g - g % 4) */
    for (int g = 0; g < G; g++) {
        float *o = out + 128 * (size_t)g;
        prefetch_slice(pf, npf, pf_bytes, slice, g);
        if (g % 4 == 0)
            for (int r = 0; r < R; r++) hd[r] = _mm512_mul_ps(q4r_d16x4(rp[r], g), _mm512_set1_ps(h[r]));
        const __m512i pi = _mm512_add_epi32(lb, _mm512_set1_epi32(4 * (g % 4)));
        __m512 acc[8];
        for (int n = 0; n < 8; n++) acc[n] = _mm512_loadu_ps(o + 16 * n);
        for (int r = 0; r < R; r++) {
            const __m512i q = _mm512_loadu_si512((const void *)q4r_q(rp[r], nb, 4 * g));
            const __m512 s = _mm512_permutexvar_ps(pi, hd[r]);
            acc[0] = _mm512_fmadd_ps(_mm512_permutexvar_ps(q, lut), s, acc[0]);
#define NIB(n)                                                                                 \
    acc[n] = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(q, 4 * (n)), lut), s, acc[n])
            NIB(1); NIB(2); NIB(3); NIB(4); NIB(5); NIB(6); NIB(7);
#undef NIB
        }
        for (int n = 0; n < 8; n++) _mm512_storeu_ps(o + 16 * n, acc[n]);
    }
    if (nb > 4 * G) q4_axpy_from(rp, h, R, 4 * G, nb, out, NULL, 0, 0);
}
#endif

/* y[r] = row_r . x for R <= 8 q4 rows (pointers), each row's sum by the same arithmetic
 * whatever R and whichever rows share its pass: si_sparse_q4's ReLU gates and up rows (gates
 * first) and si_sparse_q4_gates, so that a neuron's gate is the same bits in a call over any set
 * that holds it, wherever it falls in the passes. Plain AVX2's q4_dots8 works 8 rows, one per
 * lane: a shorter pass is padded to 8 with its first row (the extra lanes dropped) rather than
 * going through q4_dots, whose sums go in another order. q4_dots (avx2_128, and AVX-512 rows
 * under 4 blocks) and q4_dots_g (AVX-512, `grouped`) work each row on its own for any R. */
INLINE void q4_dots_fixed(const uint8_t *const *rp, const int R, const si_xq *x, int nb,
                          const int grouped, float *y, const uint8_t *const *pf, const int npf,
                          size_t pf_bytes) {
#if SI_AVX512
    if (grouped) q4_dots_g(rp, R, x, nb, y, pf, npf, pf_bytes);
    else q4_dots(rp, R, x, nb, y, pf, npf, pf_bytes);
#elif !SI_NARROW
    (void)grouped;
    if (R == 8) {
        q4_dots8(rp, x, nb, y, pf, npf, pf_bytes);
        return;
    }
    const uint8_t *p8[8];
    float y8[8];
    for (int r = 0; r < 8; r++) p8[r] = rp[r < R ? r : 0];
    q4_dots8(p8, x, nb, y8, pf, npf, pf_bytes);
    for (int r = 0; r < R; r++) y[r] = y8[r];
#else
    (void)grouped;
    q4_dots(rp, R, x, nb, y, pf, npf, pf_bytes);
#endif
}

/* exp(x) for 8 floats (Cephes' expf: range reduction by ln 2, degree-5 polynomial; relative
 * error about 1e-7; inputs clamped to +-88.38). */
INLINE __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)),
                      _mm256_set1_ps(88.3762626647949f));
    const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* act(code, z) for 8 floats; erf-GELU (code 3) has no vector form here: the caller goes scalar. */
INLINE __m256 act8(const int code, __m256 z) {
    const __m256 one = _mm256_set1_ps(1.0f);
    if (code == SI_ACT_RELU) return _mm256_max_ps(z, _mm256_setzero_ps());
    if (code == SI_ACT_SILU)
        return _mm256_div_ps(z, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), z))));
    if (code == SI_ACT_GELU_TANH) { /* 0.5 z (1 + tanh(u)) = z * sigmoid(2u) */
        const __m256 z3 = _mm256_mul_ps(_mm256_mul_ps(z, z), z);
        const __m256 u = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                       _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), z3, z));
        const __m256 e = exp8(_mm256_mul_ps(_mm256_set1_ps(-2.0f), u));
        return _mm256_div_ps(z, _mm256_add_ps(one, e));
    }
    return z;
}

/* exp8's steps on one float, the same operations in the same order: every lane of exp8 and
 * exp1 agree bit for bit, so a neuron's SiLU is the same whether its token is computed alone
 * (act) or beside others (act8). */
INLINE float exp1(float x) {
    x = fminf(fmaxf(x, -88.3762626647949f), 88.3762626647949f);
    const float fx = _mm_cvtss_f32(_mm_round_ss(_mm_setzero_ps(), _mm_set_ss(x * 1.44269504088896341f),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    x = fmaf(-fx, 0.693359375f, x);
    x = fmaf(-fx, -2.12194440e-4f, x);
    float y = 1.9875691500e-4f;
    y = fmaf(y, x, 1.3981999507e-3f);
    y = fmaf(y, x, 8.3334519073e-3f);
    y = fmaf(y, x, 4.1665795894e-2f);
    y = fmaf(y, x, 1.6666665459e-1f);
    y = fmaf(y, x, 5.0000001201e-1f);
    y = fmaf(y, x * x, x + 1.0f);
    const int32_t e = ((int32_t)fx + 127) << 23;
    float p2;
    memcpy(&p2, &e, 4);
    return y * p2;
}

/* Activation codes as sparse/kernels.py ACT_CODES: 0 identity, 1 relu, 2 silu, 3 gelu (erf),
 * 4 gelu (tanh approximation, Gemma's). Codes 0-2 give act8's lanes bit for bit. */
static inline float act(int code, float z) {
    if (code == 1) return z > 0.0f ? z : 0.0f;
    if (code == 2) return z / (1.0f + exp1(0.0f - z)); /* as act8's lanes */
    if (code == 3) return 0.5f * z * (1.0f + erff(z * 0.70710678118654752f));
    if (code == 4) return 0.5f * z * (1.0f + tanhf(0.7978845608028654f * (z + 0.044715f * z * z * z)));
    return z;
}

/* Neurons idx[0..k) of bundles (bundle_bytes apart; each: [gate row,] up row, down column, all
 * q4 rows of d_model), for T tokens: out[t] += sum_i h_i(x_t) * down_i. Neurons are walked 4 at
 * a time (gate and up of 4 neurons: 8 streams; then their 4 down rows in one pass over out), each
 * group reused from cache for every token (SPARSE_TOKENS tokens at a time). Each token skips
 * the down rows of its neurons whose h comes out 0 (ReLU-family neurons selected that did not
 * fire): the others are queued and added 4 at a time (the same groups as without skipping when
 * none is 0), so a token's operations are those of a call for it alone, whatever the other
 * tokens. With ReLU gates the gate rows go first and a neuron's up row is read only if its
 * gate fired (gate_first below).
 * mask (NULL: every token every neuron): token t computes neuron idx[i] only where
 * mask[t * mstride + i] is not 0 (its own set within the union idx). */
#define SPARSE_TOKENS 16 /* both sparse kernels: tokens a pass holds queues for */
void FN(si_sparse_q4)(const uint8_t *bundles, size_t bundle_bytes, int gated, const int32_t *idx,
                      int k, const uint8_t *mask, size_t mstride, const si_xq *x, int T,
                      int d_model, int ga, int ua, const float *bias, float *out) {
    const size_t rb = (size_t)d_model / 32 * 18;
    const int nb = d_model / 32;
#if SI_AVX512
    const int G = nb / 4;
    const int grouped = G && x[0].g; /* else (rows under 4 blocks) block by block */
    if (grouped)
        for (int t = 0; t < T; t++) q4g_order(out + (size_t)t * d_model, G, 0);
#define DOTS(rp, R, t, y)                                                                      \
    (grouped ? q4_dots_g(rp, R, &x[t], nb, y, pf, t ? 0 : npf, pfb)                              \
             : q4_dots(rp, R, &x[t], nb, y, pf, t ? 0 : npf, pfb))
#define AXPY(rp, h, R, o, t)                                                                   \
    (grouped ? q4_axpy_g(rp, h, R, nb, o, pfd, (t) ? 0 : npf, pfdb)                             \
             : q4_axpy(rp, h, R, nb, o, pfd, (t) ? 0 : npf, pfdb))
#define FIXED_DOTS(rp, R, t, y) q4_dots_fixed(rp, R, &x[t], nb, grouped, y, pf, t ? 0 : npf, pfb)
#else
#if !SI_NARROW
#define DOTS(rp, R, t, y)                                                                      \
    ((R) == 8 ? q4_dots8(rp, &x[t], nb, y, pf, t ? 0 : npf, pfb)                                \
              : q4_dots(rp, R, &x[t], nb, y, pf, t ? 0 : npf, pfb))
#else
#define DOTS(rp, R, t, y) q4_dots(rp, R, &x[t], nb, y, pf, t ? 0 : npf, pfb)
#endif
#define AXPY(rp, h, R, o, t) q4_axpy(rp, h, R, nb, o, pfd, (t) ? 0 : npf, pfdb)
#endif
#ifndef FIXED_DOTS /* each row's sum the same whatever R (ReLU gates first: see q4_dots_fixed) */
#define FIXED_DOTS(rp, R, t, y) q4_dots_fixed(rp, R, &x[t], nb, 0, y, pf, t ? 0 : npf, pfb)
#endif
    /* token slot q_'s down row with its h queued; its 4 added to token t's out when full */
#define QUEUE_DOWN(q_, row, hv, t)                                                             \
    do {                                                                                       \
        qd[q_][nq[q_]] = (row), qh[q_][nq[q_]] = (hv);                                         \
        if (++nq[q_] == 4) AXPY(qd[q_], qh[q_], 4, out + (size_t)(t) * d_model, t), nq[q_] = 0; \
    } while (0)
    /* R neurons of token t at positions pos[0..R) of idx (R a constant: 4, or 1): their dot
     * products, h, and their down rows whose h is not 0 queued in the token's queue */
#define NEURONS(R, pos, t)                                                                     \
    do {                                                                                       \
        const uint8_t *in[8], *down[4];                                                        \
        float z[8];                                                                            \
        const int q_ = (t) - t0;                                                               \
        for (int n_ = 0; n_ < (R); n_++) {                                                     \
            const uint8_t *base = bundles + (size_t)idx[(pos)[n_]] * bundle_bytes;             \
            in[n_] = base; /* gate, or up when ungated */                                      \
            in[4 + n_] = base + rb;                                                            \
            down[n_] = base + (gated ? 2 : 1) * rb;                                            \
        }                                                                                      \
        if ((R) == 4) {                                                                        \
            if (gated) DOTS(in, 8, t, z);                                                      \
            else DOTS(in, 4, t, z);                                                            \
        } else {                                                                               \
            DOTS(&in[0], 1, t, &z[0]);                                                         \
            if (gated) DOTS(&in[4], 1, t, &z[4]);                                              \
        }                                                                                      \
        for (int n_ = 0; n_ < (R); n_++) {                                                     \
            const float h = gated ? act(ga, z[n_]) * act(ua, z[4 + n_])                        \
                                  : act(ua, z[n_] + (bias ? bias[idx[(pos)[n_]]] : 0.0f));     \
            if (h != 0.0f) QUEUE_DOWN(q_, down[n_], h, t);                                     \
        }                                                                                      \
    } while (0)
    /* ReLU gates (ReGLU, dReLU): a neuron whose gate comes out <= 0 has h = 0 whatever its up
     * row holds, so that row is not read. The gate rows go first, 8 neurons a pass (the next 8
     * gate rows fetched meanwhile); the neurons whose gate fired queue (their up and down rows
     * fetched into L2 as they join) and take their up rows 8 at a time; their down rows whose h
     * is not 0 queue as above. Per token, so a token's operations are still those of a call
     * for it alone. The gate and up passes (FIXED_DOTS) give each row the same bits whatever
     * rows share its pass, so a neuron's g (si_sparse_q4_gates' z) does not depend on the
     * neurons around it: this call over idx, and over idx with the neurons not fired masked out,
     * sum the same down rows in the same groups. */
    const int gate_first = gated && ga == SI_ACT_RELU;
#define UPS(R, t)                                                                              \
    do {                                                                                       \
        const int q_ = (t) - t0, npf = 0; /* no look-ahead: the rows were fetched on joining */ \
        const uint8_t *in[8];                                                                  \
        float z[8];                                                                            \
        for (int n_ = 0; n_ < (R); n_++) in[n_] = uq[q_][n_] + rb;                             \
        FIXED_DOTS(in, (R), t, z);                                                             \
        for (int n_ = 0; n_ < (R); n_++) {                                                     \
            const float h = ug[q_][n_] * act(ua, z[n_]);                                       \
            if (h != 0.0f) QUEUE_DOWN(q_, uq[q_][n_] + 2 * rb, h, t);                           \
        }                                                                                      \
        nuq[q_] = 0;                                                                           \
    } while (0)
#define GATES(R, pos, t)                                                                       \
    do {                                                                                       \
        const int q_ = (t) - t0;                                                               \
        const uint8_t *in[8];                                                                  \
        float z[8];                                                                            \
        for (int n_ = 0; n_ < (R); n_++) in[n_] = bundles + (size_t)idx[(pos)[n_]] * bundle_bytes; \
        FIXED_DOTS(in, (R), t, z);                                                             \
        for (int n_ = 0; n_ < (R); n_++) {                                                     \
            const float g_ = act(ga, z[n_]);                                                   \
            if (g_ == 0.0f) continue;                                                          \
            for (size_t o_ = 0; o_ < 2 * rb; o_ += 64)                                         \
                _mm_prefetch((const char *)(in[n_] + rb + o_), _MM_HINT_T1);                   \
            uq[q_][nuq[q_]] = in[n_], ug[q_][nuq[q_]] = g_;                                    \
            if (++nuq[q_] == 8) UPS(8, t);                                                     \
        }                                                                                      \
    } while (0)
    for (int t0 = 0; t0 < T; t0 += SPARSE_TOKENS) {
        const int t1 = T - t0 < SPARSE_TOKENS ? T : t0 + SPARSE_TOKENS;
        /* per token: its neurons waiting for their dot products (positions in idx, 4 at a time,
         * 8 for gates first: a mask's scattered neurons still go 4 or 8 to a pass), the
         * neurons whose gate fired waiting for their up rows (gates first), and its down rows
         * queued with h */
        int dq[SPARSE_TOKENS][8], ndq[SPARSE_TOKENS] = {0};
        const uint8_t *uq[SPARSE_TOKENS][8];
        float ug[SPARSE_TOKENS][8];
        int nuq[SPARSE_TOKENS] = {0};
        const uint8_t *qd[SPARSE_TOKENS][4];
        float qh[SPARSE_TOKENS][4];
        int nq[SPARSE_TOKENS] = {0};
        const int W = gate_first ? 8 : 4; /* neurons a pass */
        for (int i = 0; i < k; i += W) {
            const int R = k - i < W ? k - i : W;
            /* the next W neurons' gate rows (gates first) or bundles, fetched while these are
             * walked (two groups ahead was no faster: benchmarks/RESULTS.md): bundles' first
             * half during the dot products, the rest (pfd) during the down rows' axpy, so the
             * reads stay in flight through both (all during the dot products left the memory
             * idle half the time) */
            const uint8_t *pf[8], *pfd[8];
            const int npf = k - i - R < W ? k - i - R : W;
            const size_t pfb = gate_first ? rb : bundle_bytes / 2 / 64 * 64;
            const size_t pfdb = gate_first ? 0 : bundle_bytes - pfb;
            for (int n = 0; n < npf; n++) {
                pf[n] = bundles + (size_t)idx[i + R + n] * bundle_bytes;
                pfd[n] = pf[n] + pfb;
            }
            for (int t = t0; t < t1; t++) {
                const uint8_t *mt = mask ? mask + (size_t)t * mstride + i : NULL;
                const int q = t - t0;
                for (int n = 0; n < R; n++) {
                    if (mt && !mt[n]) continue; /* not in this token's own set */
                    dq[q][ndq[q]++] = i + n;
                    if (ndq[q] == W) {
                        if (gate_first) GATES(8, dq[q], t);
                        else NEURONS(4, dq[q], t);
                        ndq[q] = 0;
                    }
                }
            }
        }
        const uint8_t *pf[8], *pfd[8];
        const int npf = 0;
        const size_t pfb = 0, pfdb = 0;
        for (int t = t0; t < t1; t++) {
            const int q = t - t0;
            if (gate_first) {
                if (ndq[q]) GATES(ndq[q], dq[q], t);
                if (nuq[q]) UPS(nuq[q], t);
            } else {
                for (int n = 0; n < ndq[q]; n++) NEURONS(1, &dq[q][n], t);
            }
            for (int n = 0; n < nq[q]; n++) AXPY(&qd[q][n], &qh[q][n], 1, out + (size_t)t * d_model, t);
        }
    }
#undef NEURONS
#undef GATES
#undef UPS
#undef QUEUE_DOWN
#undef DOTS
#undef FIXED_DOTS
#undef AXPY
#if SI_AVX512
    if (grouped)
        for (int t = 0; t < T; t++) q4g_order(out + (size_t)t * d_model, G, 1);
#endif
}

/* The raw gate dot products z[i] = gate_i . x (before the activation) of neurons idx[0..k) of
 * q4 bundles, for one token x: the gate row is the first d_model / 32 * 18 bytes at bundles +
 * idx[i] * bundle_bytes, and nothing else of a bundle is read (bundle_bytes may be the stride of
 * an array of gate rows alone). 8 neurons a pass, the next 8 gate rows fetched meanwhile, by the
 * arithmetic of si_sparse_q4's ReLU gates (q4_dots_fixed, on the same x: quantized, and grouped
 * where it is there): z[i] > 0 exactly where that kernel's gate fires, and relu(z[i]) is its g,
 * in a call over any set holding the neuron. */
void FN(si_sparse_q4_gates)(const uint8_t *bundles, size_t bundle_bytes, const int32_t *idx,
                            int k, const si_xq *x, int d_model, float *z) {
    const size_t rb = (size_t)d_model / 32 * 18;
    const int nb = d_model / 32;
#if SI_AVX512
    const int grouped = nb / 4 && x->g; /* as si_sparse_q4's */
#else
    const int grouped = 0;
#endif
    for (int i = 0; i < k; i += 8) {
        const int R = k - i < 8 ? k - i : 8, npf = k - i - R < 8 ? k - i - R : 8;
        const uint8_t *in[8], *pf[8];
        for (int n = 0; n < R; n++) in[n] = bundles + (size_t)idx[i + n] * bundle_bytes;
        for (int n = 0; n < npf; n++) pf[n] = bundles + (size_t)idx[i + R + n] * bundle_bytes;
        q4_dots_fixed(in, R, x, nb, grouped, z + i, pf, npf, rb);
    }
}

/* ------------------------------------------------------------------ sparse FFN, int8 bundles */

/* int8 rows with float32 scales per block of `block` weights (PackedFFN dtype "int8"; block and
 * d_model multiples of 8, so is a short last block). The gate/up dot products take x rounded to
 * int8 per 32 where blocks and rows are multiples of 32 (i8_dots_q); else x stays float32 and
 * the weights are widened from memory 8 at a time and converted (i8_dots: the arithmetic of the
 * numba kernel, sparse/kernels.py, in another summation order). The down rows always take the
 * float coefficients (i8_axpy). */

/* 8 int8 weights at p as floats */
INLINE __m256 i8_ps(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* y[r] = sum_b s_r[b] (row_r . x over block b) for R <= 4 rows. */
INLINE void i8_dots(const int8_t *const *rp, const float *const *sp, const int R, const float *x,
                    const int d, const int block, float *y) {
    __m256 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const int nbk = (d + block - 1) / block;
    for (int b = 0; b < nbk; b++) {
        const int j1 = (b + 1) * block < d ? (b + 1) * block : d;
        __m256 p[4], q[4]; /* two partial sums per row (even and odd steps of 8): shorter chains */
        for (int r = 0; r < R; r++) p[r] = q[r] = _mm256_setzero_ps();
        int j = b * block;
        for (; j + 16 <= j1; j += 16) {
            const __m256 x0 = _mm256_loadu_ps(x + j), x1 = _mm256_loadu_ps(x + j + 8);
            for (int r = 0; r < R; r++) {
                p[r] = _mm256_fmadd_ps(i8_ps(rp[r] + j), x0, p[r]);
                q[r] = _mm256_fmadd_ps(i8_ps(rp[r] + j + 8), x1, q[r]);
            }
        }
        if (j < j1) { /* a block of 8 (mod 16) */
            const __m256 x0 = _mm256_loadu_ps(x + j);
            for (int r = 0; r < R; r++) p[r] = _mm256_fmadd_ps(i8_ps(rp[r] + j), x0, p[r]);
        }
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_add_ps(p[r], q[r]), _mm256_set1_ps(sp[r][b]), acc[r]);
    }
    for (int r = 0; r < R; r++) y[r] = hsum(acc[r]);
}

/* i8_dots with x rounded to int8 per 32 (xq: si_quantize_x's blocks; block a multiple of 32):
 * each 32 weights times x's 32 in one integer dot product (|w| times x with w's sign, maddubs:
 * at most 2 x 127 x 127 per int16, no saturation), y[r] = sum_b s_r[b] sum_c d_x[c] (w . q)_c
 * over the 32-blocks c of block b. Four times the multiplies per instruction of the float
 * path, and no conversion of the weights. */
INLINE void i8_dots_q(const int8_t *const *rp, const float *const *sp, const int R,
                      const si_xq *xq, const int d, const int block, float *y) {
    __m256 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const int nbk = (d + block - 1) / block;
    for (int b = 0; b < nbk; b++) {
        const int j1 = (b + 1) * block < d ? (b + 1) * block : d;
        __m256 p[4];
        for (int r = 0; r < R; r++) p[r] = _mm256_setzero_ps();
        for (int j = b * block; j < j1; j += 32) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq->q + j));
            const __m256 xd = _mm256_set1_ps(xq->d[j / 32]);
            for (int r = 0; r < R; r++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(rp[r] + j));
                const __m256i dot = dot_us(_mm256_abs_epi8(w), _mm256_sign_epi8(xv, w));
                p[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), xd, p[r]);
            }
        }
        for (int r = 0; r < R; r++) acc[r] = _mm256_fmadd_ps(p[r], _mm256_set1_ps(sp[r][b]), acc[r]);
    }
    for (int r = 0; r < R; r++) y[r] = hsum(acc[r]);
}

/* out += sum_r h[r] s_r[b] row_r over each block b, for R <= 8 rows. */
INLINE void i8_axpy(const int8_t *const *rp, const float *const *sp, const float *h, const int R,
                    const int d, const int block, float *out) {
    const int nbk = (d + block - 1) / block;
    for (int b = 0; b < nbk; b++) {
        __m256 c[8];
        for (int r = 0; r < R; r++) c[r] = _mm256_set1_ps(h[r] * sp[r][b]);
        const int j1 = (b + 1) * block < d ? (b + 1) * block : d;
        int j = b * block;
        for (; j + 16 <= j1; j += 16) {
            __m256 o0 = _mm256_loadu_ps(out + j), o1 = _mm256_loadu_ps(out + j + 8);
            for (int r = 0; r < R; r++) {
                o0 = _mm256_fmadd_ps(i8_ps(rp[r] + j), c[r], o0);
                o1 = _mm256_fmadd_ps(i8_ps(rp[r] + j + 8), c[r], o1);
            }
            _mm256_storeu_ps(out + j, o0);
            _mm256_storeu_ps(out + j + 8, o1);
        }
        if (j < j1) {
            __m256 o = _mm256_loadu_ps(out + j);
            for (int r = 0; r < R; r++) o = _mm256_fmadd_ps(i8_ps(rp[r] + j), c[r], o);
            _mm256_storeu_ps(out + j, o);
        }
    }
}

/* Neurons idx[0..k) of int8 bundles (bundle_bytes apart; each: [gate row,] up row, down column
 * of d_model) with their scales (nbk per row, [gate,] up, down per neuron), for T tokens x
 * [T, d_model]: out[t] += sum_i h_i(x_t) * down_i. 4 neurons at a time, as si_sparse_q4. Each
 * token queues the down rows of its neurons whose h is not 0 (ReLU-family neurons selected that
 * did not fire add nothing) and adds them a few at a time (I8_DOWN_QUEUE): a token's operations
 * are those of a call for it alone (the same bits), whatever the other tokens. Tokens are taken
 * SPARSE_TOKENS at a time (each group of rows read once for them); mask as si_sparse_q4's.
 * Bundles of long rows (a 7B model's) are left to the hardware's prefetcher (prefetching the
 * next bundles as si_sparse_q4 does was slower there, from memory and from cache:
 * benchmarks/RESULTS.md); short ones, up to I8_PF_BUNDLE bytes (SmolLM2's 1,728), end before
 * it ramps up, so the next group's bundles and scales are fetched while a group is worked
 * (benchmarks/RESULTS.md, session 39). */
#define I8_PF_BUNDLE 4096
/* A token's down rows queued, then added in one pass over out: 8 behind q4 ups (i8_ups' passes
 * of 8; 4 were slower, benchmarks/RESULTS.md, session 50), else 4 (8 were not faster there).
 * Either way each output's sum takes the rows in order: the same bits. */
#define I8_DOWN_QUEUE 8
/* A token's down row with its scales and h queued (qd, qs, qh, *nq), the Q added to o when full
 * (Q <= I8_DOWN_QUEUE, a constant at each call). */
INLINE void i8_queue_down(const int8_t *row, const float *sc, float h, const int8_t **qd,
                          const float **qs, float *qh, int *nq, int d_model, int block, float *o,
                          const int Q) {
    qd[*nq] = row, qs[*nq] = sc, qh[*nq] = h;
    if (++*nq == Q) i8_axpy(qd, qs, qh, Q, d_model, block, o), *nq = 0;
}

/* R neurons of one token (their positions pos[0..R) in idx; R a constant at each call, so the
 * rows' accumulators stay in registers): gate/up dot products, h, and the down rows whose h is
 * not 0 queued in the token's queue (qd, qs, qh, *nq), added to o 4 at a time. */
INLINE void i8_neurons(const int R, const int *pos, const int32_t *idx, const int8_t *rows,
                       size_t bundle_bytes, const float *scales, int nbk, int block, int gated,
                       int ga, int ua, const float *bias, const float *xt, const si_xq *xqt,
                       int d_model, const int8_t **qd, const float **qs, float *qh, int *nq,
                       float *o) {
    const int nm = gated ? 3 : 2;
    const int8_t *gr[4], *ur[4], *dr[4];
    const float *gs[4], *us[4], *ds[4];
    for (int n = 0; n < R; n++) {
        const int8_t *base = rows + (size_t)idx[pos[n]] * bundle_bytes;
        const float *sb = scales + (size_t)idx[pos[n]] * nm * nbk;
        gr[n] = base, gs[n] = sb; /* (not read when ungated) */
        ur[n] = base + (gated ? d_model : 0), us[n] = sb + (gated ? nbk : 0);
        dr[n] = ur[n] + d_model, ds[n] = us[n] + nbk;
    }
    float zg[4], zu[4];
    if (xqt) {
        if (gated) i8_dots_q(gr, gs, R, xqt, d_model, block, zg);
        i8_dots_q(ur, us, R, xqt, d_model, block, zu);
    } else {
        if (gated) i8_dots(gr, gs, R, xt, d_model, block, zg);
        i8_dots(ur, us, R, xt, d_model, block, zu);
    }
    for (int n = 0; n < R; n++) {
        const float h = gated ? act(ga, zg[n]) * act(ua, zu[n])
                              : act(ua, zu[n] + (bias ? bias[idx[pos[n]]] : 0.0f));
        if (h != 0.0f) i8_queue_down(dr[n], ds[n], h, qd, qs, qh, nq, d_model, block, o, 4);
    }
}

/* y[r] = row_r . x for R <= 8 q4 rows kept apart from int8 bundles (a ReLU gate's, q4 ups), x
 * rounded (xqt): si_sparse_q4_gates' arithmetic (q4_dots_fixed, grouped where AVX-512's kernels
 * have x's rearranged copies), each row's sum the same bits in any pass. */
INLINE void q4_apart_dots(const uint8_t *const *in, const int R, const si_xq *xqt, const int nb,
                          float *y) {
#if SI_AVX512
    const int grouped = nb / 4 && xqt->g; /* as si_sparse_q4_gates' */
#else
    const int grouped = 0;
#endif
    q4_dots_fixed(in, R, xqt, nb, grouped, y, NULL, 0, 0);
}

/* ReLU gates first (as si_sparse_q4): the up dot products, h and the down queue of R <= 8
 * neurons whose gates fired (ids nid[0..R), relu(gate) g[0..R)). int8 bundles: a bundle's up and
 * down rows are its last two (bundle_bytes / d_model rows: 3, or 2 when the gates are apart),
 * their scales in `scales`, the up products by i8_dots(_q) 4 rows at a time. q4 ups (q4u, x
 * rounded: xqt): a bundle holds its down row's nbk float32 scales, its up row as a q4 row (the
 * file's Q4_0 numbers), then its int8 down row (si_q4u_bytes), and the up products are
 * q4_apart_dots' — the q4 gates' arithmetic. */
INLINE void i8_ups(const int R, const int32_t *nid, const float *g, const int8_t *rows,
                   size_t bundle_bytes, const float *scales, int nbk, int block, int ua, int q4u,
                   const float *xt, const si_xq *xqt, int d_model, const int8_t **qd,
                   const float **qs, float *qh, int *nq, float *o) {
    const int8_t *dr[8];
    const float *ds[8];
    float zu[8];
    if (q4u) {
        const uint8_t *in[8];
        const int nb = d_model / 32;
        for (int n = 0; n < R; n++) {
            const uint8_t *b = (const uint8_t *)rows + (size_t)nid[n] * bundle_bytes;
            ds[n] = (const float *)b;
            in[n] = b + 4 * (size_t)nbk;
            dr[n] = (const int8_t *)(in[n] + 18 * (size_t)nb);
        }
        q4_apart_dots(in, R, xqt, nb, zu);
    } else {
        const int8_t *ur[8];
        const float *us[8];
        const size_t nm = bundle_bytes / (size_t)d_model;
        for (int n = 0; n < R; n++) {
            ur[n] = rows + (size_t)nid[n] * bundle_bytes + (nm - 2) * (size_t)d_model;
            us[n] = scales + (size_t)nid[n] * nm * nbk + (nm - 2) * nbk;
            dr[n] = ur[n] + d_model, ds[n] = us[n] + nbk;
        }
        /* (R <= 4 here: UPS_QUEUE(0)) */
        if (xqt) i8_dots_q(ur, us, R, xqt, d_model, block, zu);
        else i8_dots(ur, us, R, xt, d_model, block, zu);
    }
    for (int n = 0; n < R; n++) {
        const float h = g[n] * act(ua, zu[n]);
        if (h != 0.0f)
            i8_queue_down(dr[n], ds[n], h, qd, qs, qh, nq, d_model, block, o,
                          q4u ? I8_DOWN_QUEUE : 4);
    }
}

/* Fired neurons i8_gates queues for i8_ups: 4 int8 up rows a pass, 8 q4 ones (plain AVX2's
 * q4_dots_fixed works 8 rows, one a lane). */
#define UPS_QUEUE(q4u) ((q4u) ? 8 : 4)

/* The gate dot products of R neurons (positions pos[0..R) in idx); those that fire join the
 * token's queue of up rows (un[0..*nu), ug), whose UPS_QUEUE go through i8_ups together. With gq
 * (q4 gate rows apart, gstride bytes apart; x rounded, xqt with its rearranged copies) the gates
 * are those rows' products, by si_sparse_q4_gates' arithmetic (q4_dots_fixed: each neuron's z
 * the same bits in any pass), and the bundles' int8 gate rows are not read; q4u as i8_ups'. */
INLINE void i8_gates(const int R, const int *pos, const int32_t *idx, const int8_t *rows,
                     size_t bundle_bytes, const float *scales, int nbk, int block, int ga, int ua,
                     int q4u, const float *xt, const si_xq *xqt, int d_model, const uint8_t *gq,
                     size_t gstride, int32_t *un, float *ug, int *nu, const int8_t **qd,
                     const float **qs, float *qh, int *nq, float *o) {
    float zg[4];
    if (gq) {
        const uint8_t *in[4];
        for (int n = 0; n < R; n++) in[n] = gq + (size_t)idx[pos[n]] * gstride;
        q4_apart_dots(in, R, xqt, d_model / 32, zg);
    } else {
        const int8_t *gr[4];
        const float *gs[4];
        for (int n = 0; n < R; n++) {
            gr[n] = rows + (size_t)idx[pos[n]] * bundle_bytes;
            gs[n] = scales + (size_t)idx[pos[n]] * 3 * nbk;
        }
        if (xqt) i8_dots_q(gr, gs, R, xqt, d_model, block, zg);
        else i8_dots(gr, gs, R, xt, d_model, block, zg);
    }
    for (int n = 0; n < R; n++) {
        const float g = act(ga, zg[n]);
        if (g == 0.0f) continue;
        un[*nu] = idx[pos[n]], ug[*nu] = g;
        if (++*nu < UPS_QUEUE(q4u)) continue;
        if (q4u)
            i8_ups(8, un, ug, rows, bundle_bytes, scales, nbk, block, ua, 1, xt, xqt, d_model, qd,
                   qs, qh, nq, o);
        else
            i8_ups(4, un, ug, rows, bundle_bytes, scales, nbk, block, ua, 0, xt, xqt, d_model, qd,
                   qs, qh, nq, o);
        *nu = 0;
    }
}

/* Gated int8 bundles with their gates given (computed elsewhere, e.g. from the file's 4-bit gate
 * rows: si_sparse_i8_q4g): out[d_model] += sum_i g[i] * act(ua, up_{nid[i]} . x) * down_{nid[i]}
 * for one token, g[i] the activated gate of neuron nid[i] (not 0: the neurons that fired). Only
 * the up and down rows are read (a bundle's last two rows, or with q4u its q4 up row and int8
 * down row: i8_ups), UPS_QUEUE neurons at a time and their down rows queued as si_sparse_i8's
 * gates-first path does. */
void FN(si_sparse_i8_ups)(const int8_t *rows, size_t bundle_bytes, const float *scales, int nbk,
                          int block, int q4u, const int32_t *nid, const float *g, int k,
                          const float *x, const si_xq *xq, int d_model, int ua, float *out) {
    const int8_t *qd[I8_DOWN_QUEUE];
    const float *qs[I8_DOWN_QUEUE];
    float qh[I8_DOWN_QUEUE];
    int nq = 0, i = 0;
    if (q4u) {
        for (; i + 8 <= k; i += 8)
            i8_ups(8, nid + i, g + i, rows, bundle_bytes, scales, nbk, block, ua, 1, x, xq,
                   d_model, qd, qs, qh, &nq, out);
        if (i < k) /* (q4_dots_fixed: each row's sum the same bits in a shorter pass) */
            i8_ups(k - i, nid + i, g + i, rows, bundle_bytes, scales, nbk, block, ua, 1, x, xq,
                   d_model, qd, qs, qh, &nq, out);
    } else {
        for (; i + 4 <= k; i += 4)
            i8_ups(4, nid + i, g + i, rows, bundle_bytes, scales, nbk, block, ua, 0, x, xq,
                   d_model, qd, qs, qh, &nq, out);
        for (; i < k; i++)
            i8_ups(1, nid + i, g + i, rows, bundle_bytes, scales, nbk, block, ua, 0, x, xq,
                   d_model, qd, qs, qh, &nq, out);
    }
    for (int n = 0; n < nq; n++) i8_axpy(&qd[n], &qs[n], &qh[n], 1, d_model, block, out);
}

#if SI_AVX512
/* Several tokens, each with its own set (a mask within the union idx), over gated int8 bundles
 * with x rounded (xq) and a gate that is not ReLU (no gates first): the neurons go I8B_GROUP at
 * a time, each group's gate and up rows read once for up to I8B_TOKENS tokens and its down rows
 * converted to float once and added to every token's out.
 * - the dots (i8p_dots): the group's 8 gate rows (then its 8 up rows) rearranged 32 columns at
 *   a time so that one vector holds 8 columns of all 8 rows, row r's two 4-byte words in lanes
 *   2r and 2r + 1; one vpdpbusd with 8 of a token's x bytes broadcast works for every row, and a
 *   block's scales are applied once per token and 8 rows (an earlier pass that kept a row's
 *   columns across the lanes applied them per token and row: slower, RESULTS.md session 42);
 *   x's bytes go unsigned (x ^ 0x80 = x + 128) from a start of -128 times each lane's w bytes,
 *   made once per chunk of the rows for every token;
 * - h: the tokens' activations in one act8 where it has act's bits (ReLU, SiLU, identity: exp1);
 * - the down rows: every column of a token's out is a chain of fmas over its neurons in idx
 *   order; a neuron the token does not take (masked, or h 0) adds w * 0, which leaves the sum as
 *   it is (out starts at +0 and never becomes -0).
 * A token's numbers depend on its own x and neurons only, not on the other tokens of the call
 * (on one thread: several threads cut the neurons by the masks' work and add their partial sums),
 * but its sums run in another order than a one-token call's (i8_neurons'): within rounding of
 * them, not their bits (tests/cpu/test_sparse_tokens.py). */
#define I8B_TOKENS 8
#define I8B_GROUP 8 /* neurons a group: i8p_rows rearranges 8 rows */
#define I8B_MAX_D 16384 /* widest x: a pass's records (below) on the stack, at most 384 KiB */

/* A token's x for the batched pass, per chunk of 32: its 32 bytes made unsigned (x ^ 0x80) and
 * the chunk's scale, in one record (one pointer per token in the inner loop). */
typedef struct {
    uint8_t u[32];
    float d;
    float pad[7];
} i8b_x;

/* out[j] += sum_r h[r][j] s_r[b] down_r over each block b, for the N tokens tk[0..N) of a pass
 * (out: the pass's first token's row; d_model apart), R <= I8B_GROUP down rows (N, R constants
 * at each call); 32 columns at a time (blocks are multiples of 32): their R rows converted once,
 * then up to 4 tokens at a time with their 32 sums in registers, each row added to the 4 tokens
 * in turn — 8 independent fma chains rather than one token's R-long pair of chains (a column's
 * sum still takes its rows in order, as i8_axpy). */
INLINE void i8b_down(const int N, const int R, const int8_t *const *dr, const float *const *ds,
                     const float (*h)[I8B_TOKENS], const int *tk, const int d_model,
                     const int block, float *out) {
    float cs[I8B_GROUP][I8B_TOKENS];
    for (int col = 0; col < d_model; col += 32) {
        if (col % block == 0) {
            const int b = col / block;
            for (int r = 0; r < R; r++)
                _mm256_storeu_ps(cs[r], _mm256_mul_ps(_mm256_loadu_ps(h[r]), _mm256_set1_ps(ds[r][b])));
        }
        __m512 w0[I8B_GROUP], w1[I8B_GROUP];
        for (int r = 0; r < R; r++) {
            w0[r] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load128(dr[r] + col)));
            w1[r] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load128(dr[r] + col + 16)));
        }
        for (int q0 = 0; q0 < N; q0 += 4) {
            const int G = N - q0 < 4 ? N - q0 : 4;
            __m512 v0[4], v1[4];
            for (int q = 0; q < G; q++) {
                const float *o = out + (size_t)tk[q0 + q] * d_model + col;
                v0[q] = _mm512_loadu_ps(o), v1[q] = _mm512_loadu_ps(o + 16);
            }
            for (int r = 0; r < R; r++)
                for (int q = 0; q < G; q++) {
                    const __m512 c = _mm512_set1_ps(cs[r][tk[q0 + q]]);
                    v0[q] = _mm512_fmadd_ps(w0[r], c, v0[q]);
                    v1[q] = _mm512_fmadd_ps(w1[r], c, v1[q]);
                }
            for (int q = 0; q < G; q++) {
                float *o = out + (size_t)tk[q0 + q] * d_model + col;
                _mm512_storeu_ps(o, v0[q]), _mm512_storeu_ps(o + 16, v1[q]);
            }
        }
    }
}

/* 32 columns from c0 of the 8 rows r[0..8): z[q] holds each row's bytes 8q..8q+7, row r's in
 * lanes 2r and 2r + 1 (its 64-bit word q). */
INLINE void i8p_rows(const int8_t *const *r, const int c0, __m512i *z) {
#define I8P_PAIR(a, b)                                                                         \
    _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(r[a] + c0))), \
                       _mm256_loadu_si256((const __m256i *)(r[b] + c0)), 1)
    const __m512i a0 = I8P_PAIR(0, 1), a1 = I8P_PAIR(2, 3), a2 = I8P_PAIR(4, 5), a3 = I8P_PAIR(6, 7);
#undef I8P_PAIR
    /* a_p: [row 2p's words 0-3, row 2p+1's words 0-3]; c: words 0,1 (lo) or 2,3 (hi) of 4 rows */
    const __m512i lo = _mm512_set_epi64(13, 9, 5, 1, 12, 8, 4, 0);
    const __m512i hi = _mm512_set_epi64(15, 11, 7, 3, 14, 10, 6, 2);
    const __m512i c0l = _mm512_permutex2var_epi64(a0, lo, a1), c0h = _mm512_permutex2var_epi64(a0, hi, a1);
    const __m512i c1l = _mm512_permutex2var_epi64(a2, lo, a3), c1h = _mm512_permutex2var_epi64(a2, hi, a3);
    z[0] = _mm512_shuffle_i64x2(c0l, c1l, 0x44), z[1] = _mm512_shuffle_i64x2(c0l, c1l, 0xEE);
    z[2] = _mm512_shuffle_i64x2(c0h, c1h, 0x44), z[3] = _mm512_shuffle_i64x2(c0h, c1h, 0xEE);
}

/* -128 times each lane's sum of w bytes over z[0..4): vpdpbusd's start for x made unsigned */
INLINE __m512i i8p_start(const __m512i *z) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), flip, z[0]);
    for (int q = 1; q < 4; q++) s = _mm512_dpbusd_epi32(s, flip, z[q]);
    return _mm512_sub_epi32(_mm512_setzero_si512(), s);
}

/* The 8 rows' scales of block b, each in its row's 2 lanes. */
INLINE __m512 i8p_scales(const float *const *s, const int off) {
    const __m256 v = _mm256_set_ps(s[7][off], s[6][off], s[5][off], s[4][off], s[3][off],
                                   s[2][off], s[1][off], s[0][off]);
    return _mm512_permutexvar_ps(_mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0),
                                 _mm512_castps256_ps512(v));
}

/* Row r's sum (lanes 2r + 2r+1) in lane r of 8. */
INLINE __m256 i8p_rowsums(const __m512 a) {
    const __m512 s = _mm512_add_ps(a, _mm512_permute_ps(a, 0xB1));
    return _mm512_castps512_ps256(_mm512_permutexvar_ps(
        _mm512_set_epi32(15, 13, 11, 9, 7, 5, 3, 1, 14, 12, 10, 8, 6, 4, 2, 0), s));
}

/* z[j] (lane r: row r): the 8 rows w[0..8) (scales s[r] per block) times token tk[j]'s x, for
 * N tokens and blocks of B columns (N, B constants at each call: the accumulators stay in
 * registers; gate and up rows in two calls: both in one spilled its 16 accumulators). */
INLINE void i8p_dots(const int N, const int B, const int8_t *const *w, const float *const *s,
                     const i8b_x *const *xs, const int *tk, const int d_model, __m256 *z) {
    __m512 acc[I8B_TOKENS], p[I8B_TOKENS];
    const i8b_x *x[I8B_TOKENS];
    for (int j = 0; j < N; j++) acc[j] = _mm512_setzero_ps(), x[j] = xs[tk[j]];
    const int nbk = (d_model + B - 1) / B;
    for (int b = 0; b < nbk; b++) {
        const int j1 = (b + 1) * B < d_model ? (b + 1) * B : d_model;
        const __m512 sv = i8p_scales(s, b);
        for (int c0 = b * B; c0 < j1; c0 += 32) {
            __m512i wv[4];
            i8p_rows(w, c0, wv);
            const __m512i s0 = i8p_start(wv);
            const int c = c0 / 32;
            __m512i d[I8B_TOKENS]; /* the tokens' sums side by side: no chain waits on another */
            for (int j = 0; j < N; j++) d[j] = s0;
            for (int q = 0; q < 4; q++)
                for (int j = 0; j < N; j++)
                    d[j] = _mm512_dpbusd_epi32(
                        d[j], _mm512_set1_epi64(((const int64_t *)x[j][c].u)[q]), wv[q]);
            for (int j = 0; j < N; j++) {
                const __m512 f = _mm512_cvtepi32_ps(d[j]), xd = _mm512_set1_ps(x[j][c].d);
                if (B == 32) /* one chunk a block: its scales at once */
                    acc[j] = _mm512_fmadd_ps(_mm512_mul_ps(f, xd), sv, acc[j]);
                else /* fmas from 0, not mul + add, which the compiler may fuse in some N's */
                    p[j] = _mm512_fmadd_ps(f, xd, c0 == b * B ? _mm512_setzero_ps() : p[j]);
            }
        }
        if (B != 32)
            for (int j = 0; j < N; j++) acc[j] = _mm512_fmadd_ps(p[j], sv, acc[j]);
    }
    for (int j = 0; j < N; j++) z[j] = i8p_rowsums(acc[j]);
}

/* F(N) with N the constant equal to n, for n from 1 to I8B_TOKENS (the passes' per-token
 * accumulators then stay in registers) */
#define I8B_BY_N(n, F)                                                                         \
    switch (n) {                                                                               \
    case 1: F(1); break;                                                                       \
    case 2: F(2); break;                                                                       \
    case 3: F(3); break;                                                                       \
    case 4: F(4); break;                                                                       \
    case 5: F(5); break;                                                                       \
    case 6: F(6); break;                                                                       \
    case 7: F(7); break;                                                                       \
    default: F(8); break;                                                                      \
    }

/* i8p_dots for n tokens (1..I8B_TOKENS) and any block (32 a constant) */
INLINE void i8p_dots_any(const int n, const int block, const int8_t *const *w,
                         const float *const *s, const i8b_x *const *xs, const int *tk,
                         const int d_model, __m256 *z) {
#define I8P_DOTS(N)                                                                            \
    (block == 32 ? i8p_dots(N, 32, w, s, xs, tk, d_model, z)                                   \
                 : i8p_dots(N, block, w, s, xs, tk, d_model, z))
    I8B_BY_N(n, I8P_DOTS)
#undef I8P_DOTS
}

/* i8b_down with N a constant (and R = I8B_GROUP a constant too) */
INLINE void i8b_down_any(const int n, const int R, const int8_t *const *dr, const float *const *ds,
                         const float (*h)[I8B_TOKENS], const int *tk, const int d_model,
                         const int block, float *out) {
#define I8B_DOWN(N)                                                                            \
    (R == I8B_GROUP ? i8b_down(N, I8B_GROUP, dr, ds, h, tk, d_model, block, out)               \
                    : i8b_down(N, R, dr, ds, h, tk, d_model, block, out))
    I8B_BY_N(n, I8B_DOWN)
#undef I8B_DOWN
}

/* The batched pass described above: T tokens (passes of I8B_TOKENS), neurons idx[0..k) in
 * groups of I8B_GROUP; short bundles (up to I8_PF_BUNDLE bytes, as the one-token path's) have
 * the next group's bundles and scales fetched while a group is worked — from memory the reads
 * and the arithmetic did not overlap without it (benchmarks/RESULTS.md, session 41). */
static void i8_batch(const int8_t *rows, size_t bundle_bytes, const float *scales, int nbk,
                     int block, const int32_t *idx, int k, const uint8_t *mask, size_t mstride,
                     const si_xq *xq, int T, int d_model, int ga, int ua, float *out) {
    const int nc = d_model / 32;
    i8b_x recs[I8B_TOKENS * nc] __attribute__((aligned(64)));
    for (int t0 = 0; t0 < T; t0 += I8B_TOKENS) {
        const int nt = T - t0 < I8B_TOKENS ? T - t0 : I8B_TOKENS;
        const i8b_x *xs[I8B_TOKENS];
        for (int j = 0; j < nt; j++) {
            const int8_t *q = xq[t0 + j].q;
            i8b_x *rj = recs + (size_t)j * nc;
            for (int c = 0; c < nc; c++) {
                for (int l = 0; l < 32; l++) rj[c].u[l] = (uint8_t)(q[32 * c + l] ^ 0x80);
                rj[c].d = xq[t0 + j].d[c];
            }
            xs[j] = rj;
        }
        float *o = out + (size_t)t0 * d_model;
        for (int i = 0; i < k; i += I8B_GROUP) {
            const int R = k - i < I8B_GROUP ? k - i : I8B_GROUP;
            if (bundle_bytes <= I8_PF_BUNDLE) /* short rows: the next group's bundles ahead
                                                * into L1, the one after into L2 */
                for (int n = i + I8B_GROUP; n < i + 3 * I8B_GROUP && n < k; n++) {
                    const int far = n >= i + 2 * I8B_GROUP;
                    prefetch((const uint8_t *)rows + (size_t)idx[n] * bundle_bytes,
                             (int)bundle_bytes, far);
                    prefetch((const uint8_t *)(scales + (size_t)idx[n] * 3 * nbk),
                             (int)(3 * nbk * sizeof(float)), far);
                }
            float h[I8B_GROUP][I8B_TOKENS] = {{0}};
            const int8_t *dr[I8B_GROUP];
            const float *ds[I8B_GROUP];
            unsigned fired = 0; /* tokens with some h not 0 among the R neurons */
            int gt[I8B_TOKENS], ng = 0; /* the tokens taking some of the R neurons */
            for (int j = 0; j < nt; j++) {
                int any = !mask;
                for (int r = 0; r < R && !any; r++) any = mask[(size_t)(t0 + j) * mstride + i + r];
                if (any) gt[ng++] = j;
            }
            if (!ng) continue;
            const int8_t *gr[I8B_GROUP], *ur[I8B_GROUP];
            const float *gsc[I8B_GROUP], *usc[I8B_GROUP];
            for (int r = 0; r < I8B_GROUP; r++) { /* past R: row 0 again, its h left 0 */
                const int n = idx[i + (r < R ? r : 0)];
                const int8_t *base = rows + (size_t)n * bundle_bytes;
                const float *sb = scales + (size_t)n * 3 * nbk;
                gr[r] = base, ur[r] = base + d_model, dr[r] = base + 2 * (size_t)d_model;
                gsc[r] = sb, usc[r] = sb + nbk, ds[r] = sb + 2 * nbk;
            }
            __m256 zg[I8B_TOKENS], zu[I8B_TOKENS]; /* lane r: neuron i + r */
            i8p_dots_any(ng, block, gr, gsc, xs, gt, d_model, zg);
            i8p_dots_any(ng, block, ur, usc, xs, gt, d_model, zu);
            for (int q = 0; q < ng; q++) {
                float hv[I8B_GROUP], zgs[I8B_GROUP], zus[I8B_GROUP];
                if (ga <= SI_ACT_SILU && ua <= SI_ACT_SILU) { /* act8's lanes: act's bits */
                    _mm256_storeu_ps(hv, _mm256_mul_ps(act8(ga, zg[q]), act8(ua, zu[q])));
                } else {
                    _mm256_storeu_ps(zgs, zg[q]), _mm256_storeu_ps(zus, zu[q]);
                    for (int r = 0; r < R; r++) hv[r] = act(ga, zgs[r]) * act(ua, zus[r]);
                }
                const int j = gt[q];
                for (int r = 0; r < R; r++) {
                    h[r][j] = !mask || mask[(size_t)(t0 + j) * mstride + i + r] ? hv[r] : 0.0f;
                    if (h[r][j] != 0.0f) fired |= 1u << j;
                }
            }
            int tk[I8B_TOKENS], n = 0;
            for (int j = 0; j < nt; j++)
                if (fired >> j & 1) tk[n++] = j;
            const float(*hc)[I8B_TOKENS] = (const float(*)[I8B_TOKENS])h;
            if (n) i8b_down_any(n, R, dr, ds, hc, tk, d_model, block, o);
        }
    }
}
#endif

void FN(si_sparse_i8)(const int8_t *rows, size_t bundle_bytes, const float *scales, int nbk,
                      int block, int gated, const int32_t *idx, int k, const uint8_t *mask,
                      size_t mstride, const float *x, const si_xq *xq, int T, int d_model, int ga,
                      int ua, const float *bias, float *out, const uint8_t *gq, size_t gstride,
                      int q4u) {
    const int gate_first = gated && ga == SI_ACT_RELU; /* as si_sparse_q4 */
#if SI_AVX512
    if (T > 1 && xq && gated && !gate_first && block % 32 == 0 && d_model % 32 == 0 &&
        d_model <= I8B_MAX_D) {
        i8_batch(rows, bundle_bytes, scales, nbk, block, idx, k, mask, mstride, xq, T, d_model, ga,
                 ua, out);
        return;
    }
#endif
    for (int t0 = 0; t0 < T; t0 += SPARSE_TOKENS) {
        const int t1 = T - t0 < SPARSE_TOKENS ? T : t0 + SPARSE_TOKENS;
        /* per token: its neurons waiting for their dot products (positions in idx, 4 computed
         * at a time: a mask's scattered neurons still go 4 rows to a pass), and its down rows
         * queued with their scales and h */
        int dq[SPARSE_TOKENS][4], ndq[SPARSE_TOKENS] = {0};
        const int8_t *qd[SPARSE_TOKENS][I8_DOWN_QUEUE];
        const float *qs[SPARSE_TOKENS][I8_DOWN_QUEUE];
        float qh[SPARSE_TOKENS][I8_DOWN_QUEUE];
        int nq[SPARSE_TOKENS] = {0};
        /* gates first (ReLU gates: see si_sparse_q4): the neurons whose gate fired, waiting for
         * their up rows */
        int32_t un[SPARSE_TOKENS][UPS_QUEUE(1)];
        float ug[SPARSE_TOKENS][UPS_QUEUE(1)];
        int nu[SPARSE_TOKENS] = {0};
#define NEURONS(R, pos, t)                                                                     \
    (gate_first                                                                                \
         ? i8_gates(R, pos, idx, rows, bundle_bytes, scales, nbk, block, ga, ua, q4u,            \
                    x + (size_t)(t) * d_model, xq ? &xq[t] : NULL, d_model, gq, gstride,        \
                    un[(t) - t0], ug[(t) - t0], &nu[(t) - t0], qd[(t) - t0], qs[(t) - t0],      \
                    qh[(t) - t0], &nq[(t) - t0], out + (size_t)(t) * d_model)                   \
         : i8_neurons(R, pos, idx, rows, bundle_bytes, scales, nbk, block, gated, ga, ua, bias,  \
                      x + (size_t)(t) * d_model, xq ? &xq[t] : NULL, d_model, qd[(t) - t0],     \
                      qs[(t) - t0], qh[(t) - t0], &nq[(t) - t0], out + (size_t)(t) * d_model))
        for (int i = 0; i < k; i += 4) {
            const int R = k - i < 4 ? k - i : 4;
            if (bundle_bytes <= I8_PF_BUNDLE) /* short rows: the next group's bundles ahead */
                for (int n = i + 4; n < i + 8 && n < k; n++) {
                    prefetch((const uint8_t *)rows + (size_t)idx[n] * bundle_bytes,
                             (int)bundle_bytes, 0);
                    if (q4u) continue; /* (its scales in the bundle) */
                    const size_t ns = bundle_bytes / d_model * nbk; /* a bundle's scales */
                    prefetch((const uint8_t *)(scales + (size_t)idx[n] * ns),
                             (int)(ns * sizeof(float)), 0);
                }
            for (int t = t0; t < t1; t++) {
                const uint8_t *mt = mask ? mask + (size_t)t * mstride + i : NULL;
                const int q = t - t0;
                for (int n = 0; n < R; n++) {
                    if (mt && !mt[n]) continue; /* not in this token's own set */
                    dq[q][ndq[q]++] = i + n;
                    if (ndq[q] == 4) NEURONS(4, dq[q], t), ndq[q] = 0;
                }
            }
        }
        for (int t = t0; t < t1; t++) {
            const int q = t - t0;
            for (int n = 0; n < ndq[q]; n++) NEURONS(1, &dq[q][n], t);
            if (q4u && nu[q]) /* (each row's sum the same bits in a shorter pass) */
                i8_ups(nu[q], un[q], ug[q], rows, bundle_bytes, scales, nbk, block, ua, 1,
                       x + (size_t)t * d_model, &xq[t], d_model, qd[q], qs[q], qh[q], &nq[q],
                       out + (size_t)t * d_model);
            for (int n = 0; n < nu[q] && !q4u; n++)
                i8_ups(1, &un[q][n], &ug[q][n], rows, bundle_bytes, scales, nbk, block, ua, 0,
                       x + (size_t)t * d_model, xq ? &xq[t] : NULL, d_model, qd[q], qs[q], qh[q],
                       &nq[q], out + (size_t)t * d_model);
            for (int n = 0; n < nq[q]; n++)
                i8_axpy(&qd[q][n], &qs[q][n], &qh[q][n], 1, d_model, block, out + (size_t)t * d_model);
        }
#undef NEURONS
    }
}

/* ------------------------------------------------------------------ one-token block helpers */

/* The FFN's neuron coefficients from its input projection `in`: gated, in = [gate (n), up (n)]
 * and out = act_g(gate) * act_u(up); else out = act_u(in + bias). */
void FN(si_glu)(int gated, int ga, int ua, const float *in, const float *bias, int n, float *out) {
    int i = 0;
    if (ga != SI_ACT_GELU && ua != SI_ACT_GELU) {
        for (; i + 8 <= n; i += 8) {
            __m256 u = _mm256_loadu_ps(in + (gated ? n : 0) + i);
            if (!gated && bias) u = _mm256_add_ps(u, _mm256_loadu_ps(bias + i));
#define ACTS(code, v) (code == SI_ACT_SILU ? act8(SI_ACT_SILU, v) : code == SI_ACT_RELU ? act8(SI_ACT_RELU, v) : code == SI_ACT_GELU_TANH ? act8(SI_ACT_GELU_TANH, v) : v)
            u = ACTS(ua, u);
            if (gated) u = _mm256_mul_ps(u, ACTS(ga, _mm256_loadu_ps(in + i)));
#undef ACTS
            _mm256_storeu_ps(out + i, u);
        }
    }
    for (; i < n; i++) {
        const float u = act(ua, in[(gated ? n : 0) + i] + (!gated && bias ? bias[i] : 0.0f));
        out[i] = gated ? act(ga, in[i]) * u : u;
    }
}

/* The 8 sums of a[0..7]'s lanes: [sum a[0], ..., sum a[7]]. */
INLINE __m256 hsum8x8(const __m256 *a) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* Element i of a K/V cache of float32 (f16 = 0) or float16 (f16 = 1) values: 8 at once, or one. */
INLINE __m256 kv8(const int f16, const void *p, const size_t i) {
    return f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)))
               : _mm256_loadu_ps((const float *)p + i);
}
INLINE float kv1(const int f16, const void *p, const size_t i) {
    if (!f16) return ((const float *)p)[i];
    uint16_t h;
    memcpy(&h, (const uint16_t *)p + i, 2);
    return _cvtsh_ss(h);
}
/* scores[0..n) = softmax(scores) in place, m their maximum. */
INLINE void softmax_row(float *scores, const int n, float m, const float cap) {
    int s = 0;
    if (cap > 0.0f) { /* soft-capped scores, cap tanh(score / cap) (Gemma 2): the max stays the
                       * max, the map being increasing */
        for (; s < n; s++) scores[s] = cap * tanhf(scores[s] / cap);
        m = cap * tanhf(m / cap);
        s = 0;
    }
    __m256 tv = _mm256_setzero_ps();
    for (; s + 8 <= n; s += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + s), _mm256_set1_ps(m)));
        _mm256_storeu_ps(scores + s, e);
        tv = _mm256_add_ps(tv, e);
    }
    float tot = hsum(tv);
    for (; s < n; s++) {
        const float e = expf(scores[s] - m);
        scores[s] = e;
        tot += e;
    }
    const float inv = 1.0f / tot;
    for (s = 0; s < n; s++) scores[s] *= inv;
}

/* Attention's look-ahead, called as keys s..s+7 are scored: the key rows ATTEND_AHEAD positions on
 * and the value rows of s..s+7 (their weighted sum follows the scores). One sequence's keys and
 * values of one head are short runs (a few KB to a few hundred KB) that the hardware prefetchers
 * alone leave waiting on memory. Rows of hd values, float16 when f16 (else float32). */
#define ATTEND_AHEAD 16
INLINE void attend_fetch(const int f16, const void *kc, const void *vc, const int s, const int n,
                         const int hd) {
    const size_t rowb = (size_t)hd * (f16 ? 2 : 4);
    const char *k = (const char *)kc + (size_t)(s + ATTEND_AHEAD) * rowb;
    const char *v = (const char *)vc + (size_t)s * rowb;
    const int ks = n - s - ATTEND_AHEAD; /* key rows left to fetch there */
    if (ks > 0) prefetch((const uint8_t *)k, (int)((ks < 8 ? ks : 8) * rowb), 0);
    prefetch((const uint8_t *)v, (int)(8 * rowb), 0);
}

/* One head's attention for one token over positions 0..n-1: out = softmax(scale · K q) · V (the
 * scores soft-capped first when cap > 0: softmax_row), with
 * kc/vc this head's K/V rows (hd values apart: float32, or float16 when f16); scores: n floats
 * of scratch. Scores 8 keys at a time (8 independent dot products, one transposing sum); the
 * weighted sum of V in registers, 64 columns at a time. `fetch`: look ahead (attend_fetch), for
 * the first of the heads that share these keys and values. */
INLINE void attend_impl(const int f16, const float *q, const void *kc, const void *vc, int n, int hd,
                        float scale, float cap, float *scores, float *out, const int fetch) {
    const int hd8 = hd & ~7;
    const __m256 sc = _mm256_set1_ps(scale);
    __m256 mv = _mm256_set1_ps(-INFINITY);
    int s = 0;
    for (; s + 8 <= n; s += 8) {
        const size_t k = (size_t)s * hd;
        if (fetch) attend_fetch(f16, kc, vc, s, n, hd);
        __m256 a[8];
        for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
        for (int j = 0; j < hd8; j += 8) {
            const __m256 qv = _mm256_loadu_ps(q + j);
            for (int i = 0; i < 8; i++)
                a[i] = _mm256_fmadd_ps(qv, kv8(f16, kc, k + (size_t)i * hd + j), a[i]);
        }
        __m256 r = hsum8x8(a);
        if (hd8 < hd) {
            float t[8];
            for (int i = 0; i < 8; i++) {
                t[i] = 0.0f;
                for (int j = hd8; j < hd; j++) t[i] += q[j] * kv1(f16, kc, k + (size_t)i * hd + j);
            }
            r = _mm256_add_ps(r, _mm256_loadu_ps(t));
        }
        r = _mm256_mul_ps(r, sc);
        _mm256_storeu_ps(scores + s, r);
        mv = _mm256_max_ps(mv, r);
    }
    float m = hmax(mv);
    for (; s < n; s++) {
        const size_t k = (size_t)s * hd;
        float acc = 0.0f;
        for (int j = 0; j < hd; j++) acc += q[j] * kv1(f16, kc, k + j);
        acc *= scale;
        scores[s] = acc;
        m = acc > m ? acc : m;
    }
    softmax_row(scores, n, m, cap);
    int j0 = 0;
    for (; j0 + 64 <= hd; j0 += 64) { /* out[j0, j0 + 64) = sum_s p_s v_s, in 8 registers */
        __m256 o[8];
        for (int i = 0; i < 8; i++) o[i] = _mm256_setzero_ps();
        for (s = 0; s < n; s++) {
            const size_t v = (size_t)s * hd + j0;
            const __m256 p = _mm256_set1_ps(scores[s]);
            for (int i = 0; i < 8; i++) o[i] = _mm256_fmadd_ps(p, kv8(f16, vc, v + 8 * i), o[i]);
        }
        for (int i = 0; i < 8; i++) _mm256_storeu_ps(out + j0 + 8 * i, o[i]);
    }
    if (j0 < hd) { /* the last hd % 64 columns, row by row (V is read in order) */
        for (int j = j0; j < hd; j++) out[j] = 0.0f;
        for (s = 0; s < n; s++) {
            const size_t v = (size_t)s * hd;
            const __m256 p = _mm256_set1_ps(scores[s]);
            int j = j0;
            for (; j + 8 <= hd; j += 8)
                _mm256_storeu_ps(out + j, _mm256_fmadd_ps(p, kv8(f16, vc, v + j), _mm256_loadu_ps(out + j)));
            for (; j < hd; j++) out[j] += scores[s] * kv1(f16, vc, v + j);
        }
    }
}

#if SI_AVX512
INLINE __m512 kv16f(const int f16, const void *p, const size_t i) {
    return f16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)))
               : _mm512_loadu_ps((const float *)p + i);
}

/* H <= 3 query heads (q + h hd) that share one K/V head, hd a multiple of 16, in 512-bit
 * registers: each key and value row is loaded (and converted from float16) once for the H
 * heads. Scores 8 keys at a time (8 x H accumulators of 16 columns, one transposing sum per
 * head); the weighted sum of V 64 columns at a time (4 x H accumulators), then 16 at a time.
 * Head h's scores in scores + h sstride, its output at out + h hd; `fetch`: look ahead
 * (attend_fetch) — the first pass over a K/V head, not the next ones that find it in cache. */
INLINE void attend_heads_512(const int f16, const float *q, const void *kc, const void *vc,
                             const int n, const int hd, const float scale, const float cap,
                             const int H, float *scores, const size_t sstride, float *out,
                             const int fetch) {
    const __m256 sc = _mm256_set1_ps(scale);
    __m256 mv[3];
    for (int h = 0; h < H; h++) mv[h] = _mm256_set1_ps(-INFINITY);
    int s = 0;
    for (; s + 8 <= n; s += 8) {
        const size_t k = (size_t)s * hd;
        if (fetch) attend_fetch(f16, kc, vc, s, n, hd);
        __m512 a[3][8];
        for (int h = 0; h < H; h++)
            for (int i = 0; i < 8; i++) a[h][i] = _mm512_setzero_ps();
        for (int j = 0; j < hd; j += 16) {
            __m512 qv[3];
            for (int h = 0; h < H; h++) qv[h] = _mm512_loadu_ps(q + (size_t)h * hd + j);
            for (int i = 0; i < 8; i++) {
                const __m512 kv = kv16f(f16, kc, k + (size_t)i * hd + j);
                for (int h = 0; h < H; h++) a[h][i] = _mm512_fmadd_ps(qv[h], kv, a[h][i]);
            }
        }
        for (int h = 0; h < H; h++) {
            __m256 t[8];
            for (int i = 0; i < 8; i++)
                t[i] = _mm256_add_ps(_mm512_castps512_ps256(a[h][i]),
                                     _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[h][i]), 1)));
            const __m256 r = _mm256_mul_ps(hsum8x8(t), sc);
            _mm256_storeu_ps(scores + h * sstride + s, r);
            mv[h] = _mm256_max_ps(mv[h], r);
        }
    }
    float m[3];
    for (int h = 0; h < H; h++) m[h] = hmax(mv[h]);
    for (; s < n; s++) {
        const size_t k = (size_t)s * hd;
        for (int h = 0; h < H; h++) {
            __m512 a = _mm512_setzero_ps();
            for (int j = 0; j < hd; j += 16)
                a = _mm512_fmadd_ps(_mm512_loadu_ps(q + (size_t)h * hd + j), kv16f(f16, kc, k + j), a);
            const float v = _mm512_reduce_add_ps(a) * scale;
            scores[h * sstride + s] = v;
            m[h] = v > m[h] ? v : m[h];
        }
    }
    for (int h = 0; h < H; h++) softmax_row(scores + h * sstride, n, m[h], cap);
    int j0 = 0;
    for (; j0 + 64 <= hd; j0 += 64) {
        __m512 o[3][4];
        for (int h = 0; h < H; h++)
            for (int c = 0; c < 4; c++) o[h][c] = _mm512_setzero_ps();
        for (s = 0; s < n; s++) {
            const size_t v = (size_t)s * hd + j0;
            __m512 vv[4];
            for (int c = 0; c < 4; c++) vv[c] = kv16f(f16, vc, v + 16 * c);
            for (int h = 0; h < H; h++) {
                const __m512 p = _mm512_set1_ps(scores[h * sstride + s]);
                for (int c = 0; c < 4; c++) o[h][c] = _mm512_fmadd_ps(p, vv[c], o[h][c]);
            }
        }
        for (int h = 0; h < H; h++)
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(out + (size_t)h * hd + j0 + 16 * c, o[h][c]);
    }
    for (; j0 < hd; j0 += 16) {
        __m512 o[3];
        for (int h = 0; h < H; h++) o[h] = _mm512_setzero_ps();
        for (s = 0; s < n; s++) {
            const __m512 vv = kv16f(f16, vc, (size_t)s * hd + j0);
            for (int h = 0; h < H; h++)
                o[h] = _mm512_fmadd_ps(_mm512_set1_ps(scores[h * sstride + s]), vv, o[h]);
        }
        for (int h = 0; h < H; h++) _mm512_storeu_ps(out + (size_t)h * hd + j0, o[h]);
    }
}
#endif

/* G query heads (q + h hd, h < G) sharing one K/V head: out + h hd = that head's attention over
 * positions 0..n-1 (as attend_impl), scratch scores + h sstride (n floats each). The AVX-512
 * build takes up to 3 heads a pass where hd is a multiple of 16 (attend_heads_512); the others
 * one head at a time. */
INLINE void attend_group_impl(const int f16, const float *q, const void *kc, const void *vc,
                              int n, int hd, float scale, float cap, int G, float *scores,
                              size_t sstride, float *out) {
#if SI_AVX512
    if (hd % 16 == 0) {
        for (int h0 = 0; h0 < G; h0 += 3) {
            const float *qh = q + (size_t)h0 * hd;
            float *sh = scores + h0 * sstride, *oh = out + (size_t)h0 * hd;
            switch (G - h0 < 3 ? G - h0 : 3) {
            case 1:
                attend_heads_512(f16, qh, kc, vc, n, hd, scale, cap, 1, sh, sstride, oh, !h0);
                break;
            case 2:
                attend_heads_512(f16, qh, kc, vc, n, hd, scale, cap, 2, sh, sstride, oh, !h0);
                break;
            default:
                attend_heads_512(f16, qh, kc, vc, n, hd, scale, cap, 3, sh, sstride, oh, !h0);
                break;
            }
        }
        return;
    }
#endif
    for (int h = 0; h < G; h++)
        attend_impl(f16, q + (size_t)h * hd, kc, vc, n, hd, scale, cap, scores + h * sstride,
                    out + (size_t)h * hd, !h);
}
void FN(si_attend_group)(const float *q, const float *kc, const float *vc, int n, int hd,
                         float scale, float cap, int G, float *scores, size_t sstride, float *out) {
    attend_group_impl(0, q, kc, vc, n, hd, scale, cap, G, scores, sstride, out);
}
void FN(si_attend_group16)(const float *q, const uint16_t *kc, const uint16_t *vc, int n, int hd,
                           float scale, float cap, int G, float *scores, size_t sstride,
                           float *out) {
    attend_group_impl(1, q, kc, vc, n, hd, scale, cap, G, scores, sstride, out);
}
