/* Which 256-bit operations share the CPU's execution pipes (the AVX2 kernels' view of
 * vector_pipes.c): the throughput of independent chains of each operation the q4/Q4_K/Q6_K
 * dot products and the q4 axpy are made of, alone and in pairs (operations per ns; a pair whose
 * kinds share pipes runs at about the ops of either alone, a pair on separate pipes at their
 * sum), and the clock (a chain of dependent integer adds, one a cycle).
 *
 *     cc -O3 -mavx2 -mfma -mf16c benchmarks/vector_pipes_avx2.c -o /tmp/vp2 && /tmp/vp2
 *
 * Figures: benchmarks/RESULTS.md. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#define ITERS 20000000L /* of CHAINS independent operations (or pairs) each */
#define CHAINS 6 /* independent chains of each kind (two sets of 6, k and g: 14 registers) */
#define KEEP6(v)                                                                               \
    __asm__ volatile("" : "+x"(v##0), "+x"(v##1), "+x"(v##2), "+x"(v##3), "+x"(v##4), "+x"(v##5))

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static uint8_t mem[4096] __attribute__((aligned(64)));

/* each operation as a statement on a chain: I and Fl are the chain's value as integers and as
 * floats (each statement leaves both the same bits: the casts cost nothing) */
#define SYNC_I Fl = _mm256_castsi256_ps(I)
#define SYNC_F I = _mm256_castps_si256(Fl)
#define OP_MADDUBS I = _mm256_maddubs_epi16(I, k); SYNC_I
#define OP_ADD16 I = _mm256_add_epi16(I, k); SYNC_I
#define OP_AND I = _mm256_and_si256(I, k); SYNC_I
#define OP_SRLI I = _mm256_srli_epi16(I, 1); SYNC_I
#define OP_UNPACK I = _mm256_unpacklo_epi32(I, k); SYNC_I
#define OP_MADD I = _mm256_madd_epi16(I, k); SYNC_I
#define OP_BCAST I = _mm256_add_epi8(I, _mm256_set1_epi32(*(const int32_t *)(mem + 4 * ci))); SYNC_I
#define OP_ZX I = _mm256_add_epi32(I, _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(mem + 8 * ci)))); SYNC_I
#define OP_INS I = _mm256_inserti128_si256(I, _mm_loadu_si128((const __m128i *)(mem + 16 * ci)), 1); SYNC_I
#define OP_CVT Fl = _mm256_cvtepi32_ps(I); SYNC_F
#define OP_FMA Fl = _mm256_fmadd_ps(Fl, g, g); SYNC_F
/* chain c (0..5) of set a (integers) or f (floats) through OP */
#define ON_A(c, OP) { const int ci = c; (void)ci; __m256i I = a##c; __m256 Fl = _mm256_castsi256_ps(I); OP; a##c = I; (void)Fl; }
#define ON_F(c, OP) { const int ci = 6 + c; (void)ci; __m256 Fl = f##c; __m256i I = _mm256_castps_si256(Fl); OP; f##c = Fl; (void)I; }
#define EACH(M, OP) M(0, OP) M(1, OP) M(2, OP) M(3, OP) M(4, OP) M(5, OP)

/* ops/ns of X on 12 chains (SINGLE: 12 per step) or of X and Y on 6 chains each (PAIR: 12 per
 * step, 6 of each kind): against X alone, a pair of kinds on separate pipes runs faster. */
#define BENCH(name, X, Y)                                                                      \
    static double name(void) {                                                                 \
        const __m256i k = _mm256_set1_epi8(1);                                                 \
        const __m256 g = _mm256_set1_ps(1e-7f);                                                \
        __m256i a0 = _mm256_set1_epi32(0), a1 = _mm256_set1_epi32(1), a2 = _mm256_set1_epi32(2); \
        __m256i a3 = _mm256_set1_epi32(3), a4 = _mm256_set1_epi32(4), a5 = _mm256_set1_epi32(5); \
        __m256 f0 = _mm256_set1_ps(0), f1 = _mm256_set1_ps(1), f2 = _mm256_set1_ps(2);         \
        __m256 f3 = _mm256_set1_ps(3), f4 = _mm256_set1_ps(4), f5 = _mm256_set1_ps(5);         \
        (void)k, (void)g;                                                                      \
        const double t0 = now();                                                               \
        for (long n = 0; n < ITERS; n++) {                                                     \
            EACH(ON_A, X)                                                                      \
            EACH(ON_F, Y)                                                                      \
            KEEP6(a);                                                                          \
            KEEP6(f);                                                                          \
        }                                                                                      \
        return (double)ITERS * 2 * CHAINS / (now() - t0) / 1e9;                                \
    }

BENCH(b_maddubs, OP_MADDUBS, OP_MADDUBS)
BENCH(b_add16, OP_ADD16, OP_ADD16)
BENCH(b_and, OP_AND, OP_AND)
BENCH(b_srli, OP_SRLI, OP_SRLI)
BENCH(b_unpack, OP_UNPACK, OP_UNPACK)
BENCH(b_madd, OP_MADD, OP_MADD)
BENCH(b_bcast, OP_BCAST, OP_BCAST)
BENCH(b_zx, OP_ZX, OP_ZX)
BENCH(b_cvt, OP_CVT, OP_CVT)
BENCH(b_fma, OP_FMA, OP_FMA)
BENCH(b_ins, OP_INS, OP_INS)
BENCH(p_maddubs_srli, OP_MADDUBS, OP_SRLI)
BENCH(p_maddubs_unpack, OP_MADDUBS, OP_UNPACK)
BENCH(p_maddubs_fma, OP_MADDUBS, OP_FMA)
BENCH(p_maddubs_cvt, OP_MADDUBS, OP_CVT)
BENCH(p_maddubs_and, OP_MADDUBS, OP_AND)
BENCH(p_srli_unpack, OP_SRLI, OP_UNPACK)
BENCH(p_srli_and, OP_SRLI, OP_AND)
BENCH(p_cvt_fma, OP_CVT, OP_FMA)
BENCH(p_cvt_zx, OP_CVT, OP_ZX)
BENCH(p_zx_fma, OP_ZX, OP_FMA)
BENCH(p_bcast_unpack, OP_BCAST, OP_UNPACK)
BENCH(p_ins_unpack, OP_INS, OP_UNPACK)

/* the clock: one chain of dependent scalar adds (latency 1 on every x86 core here) */
static double clock_ghz(void) {
    uint64_t x = 0;
    const double t0 = now();
    for (long n = 0; n < 4 * ITERS; n++) __asm__ volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(x));
    return 4.0 * 4 * ITERS / (now() - t0) / 1e9;
}

int main(void) {
    memset(mem, 1, sizeof mem);
    printf("clock (dependent adds): %.2f GHz\n", clock_ghz());
    const struct {
        const char *name;
        double (*fn)(void);
    } b[] = {{"vpmaddubsw", b_maddubs}, {"vpaddw", b_add16}, {"vpand", b_and}, {"vpsrlw", b_srli},
             {"vpunpckldq", b_unpack}, {"vpmaddwd", b_madd}, {"vpbroadcastd m32 + vpaddb", b_bcast},
             {"vpmovzxbd m64 + vpaddd", b_zx}, {"vcvtdq2ps", b_cvt}, {"vfmadd", b_fma},
             {"vinserti128 m128", b_ins},
             {"pair: maddubs + srlw", p_maddubs_srli}, {"pair: maddubs + unpack", p_maddubs_unpack},
             {"pair: maddubs + fma", p_maddubs_fma}, {"pair: maddubs + cvt", p_maddubs_cvt},
             {"pair: maddubs + and", p_maddubs_and}, {"pair: srlw + unpack", p_srli_unpack},
             {"pair: srlw + and", p_srli_and}, {"pair: cvt + fma", p_cvt_fma},
             {"pair: cvt + movzx(+add)", p_cvt_zx}, {"pair: movzx(+add) + fma", p_zx_fma},
             {"pair: bcast(+add) + unpack", p_bcast_unpack}, {"pair: insert + unpack", p_ins_unpack}};
    for (size_t i = 0; i < sizeof b / sizeof b[0]; i++) printf("%-30s %6.2f ops/ns\n", b[i].name, b[i].fn());
    return 0;
}
