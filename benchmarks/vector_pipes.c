/* Which 512-bit operations share the CPU's execution pipes: the throughput of independent
 * vfmadd / vpdpbusd / vcvtdq2ps / vaddps, alone and in pairs (operations per ns; a pair whose two
 * kinds share pipes runs at about half the ops of either alone). For the batched int8 pass
 * (i8_batch in src/sparseinfer/cpu/kernels.c): its dots cost one vpdpbusd, one vcvtdq2ps and two
 * fmas per token and chunk, so how these four share pipes bounds it; from 3 tokens in a group
 * it rearranges 8 rows with two-source and 128-bit-lane shuffles first (i8p_rows).
 *
 *     cc -O3 -march=native benchmarks/vector_pipes.c -o /tmp/vector_pipes && /tmp/vector_pipes
 *
 * Needs AVX-512 F + VNNI (a compile error says so otherwise). Figures: benchmarks/RESULTS.md. */
#if !defined(__AVX512F__) || !defined(__AVX512VNNI__)
#error "vector_pipes.c measures 512-bit operations: build it with -march=native on an AVX-512 VNNI CPU"
#endif
#include <immintrin.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#define ITERS 30000000L /* of CHAINS independent operations (or pairs) each */
#define CHAINS 12      /* enough to cover each operation's latency */
#define KEEP(v)                                                                                \
    __asm__ volatile("" ::"v"(v[0]), "v"(v[1]), "v"(v[2]), "v"(v[3]), "v"(v[4]), "v"(v[5]),    \
                     "v"(v[6]), "v"(v[7]), "v"(v[8]), "v"(v[9]), "v"(v[10]), "v"(v[11]))

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void cpu_model(char *out, size_t n) {
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[256];
    snprintf(out, n, "unknown CPU");
    if (!f) return;
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, "model name", 10)) {
            const char *c = strchr(line, ':');
            snprintf(out, n, "%s", c ? c + 2 : line);
            out[strcspn(out, "\n")] = 0;
            break;
        }
    fclose(f);
}

int main(void) {
    char cpu[256];
    cpu_model(cpu, sizeof cpu);
    printf("# %s; one thread; 512-bit operations per ns (%d independent chains each)\n", cpu,
           CHAINS);
    __m512 a[CHAINS], f[CHAINS];
    __m512i q[CHAINS];
    const __m512 b = _mm512_set1_ps(1.0000001f), c = _mm512_set1_ps(1e-9f);
    __m512i w = _mm512_set1_epi8(3);
    const __m512i x = _mm512_set1_epi8(5);
    for (int i = 0; i < CHAINS; i++)
        a[i] = f[i] = _mm512_set1_ps((float)i), q[i] = _mm512_set1_epi32(i);
    double t;
    /* body: one step of chain j; keep: the chains' registers it writes */
#define RUN(name, ops, keep, body)                                                             \
    t = now();                                                                                 \
    for (long i = 0; i < ITERS; i++) {                                                         \
        for (int j = 0; j < CHAINS; j++) { body; }                                             \
        w = _mm512_add_epi32(w, x);                                                            \
        keep;                                                                                  \
    }                                                                                          \
    printf("%-22s %6.2f ops/ns\n", name, (ops) * (double)CHAINS * ITERS / (now() - t) / 1e9);
    RUN("fma", 1, KEEP(f), f[j] = _mm512_fmadd_ps(f[j], b, c))
    RUN("dpbusd", 1, KEEP(q), q[j] = _mm512_dpbusd_epi32(q[j], w, x))
    RUN("cvtdq2ps", 1, KEEP(a), a[j] = _mm512_cvtepi32_ps(_mm512_castps_si512(a[j])))
    RUN("add", 1, KEEP(a), a[j] = _mm512_add_ps(a[j], b))
    RUN("fma + dpbusd", 2, { KEEP(f); KEEP(q); },
        f[j] = _mm512_fmadd_ps(f[j], b, c); q[j] = _mm512_dpbusd_epi32(q[j], w, x))
    RUN("fma + cvtdq2ps", 2, { KEEP(f); KEEP(a); },
        f[j] = _mm512_fmadd_ps(f[j], b, c); a[j] = _mm512_cvtepi32_ps(_mm512_castps_si512(a[j])))
    RUN("fma + add", 2, { KEEP(f); KEEP(a); },
        f[j] = _mm512_fmadd_ps(f[j], b, c); a[j] = _mm512_add_ps(a[j], b))
    RUN("dpbusd + cvtdq2ps", 2, { KEEP(q); KEEP(a); },
        q[j] = _mm512_dpbusd_epi32(q[j], w, x); a[j] = _mm512_cvtepi32_ps(_mm512_castps_si512(a[j])))
    /* the batched pass's rearranging of 8 rows (i8p_rows): two-source and 128-bit-lane shuffles */
    const __m512i pidx = _mm512_set_epi64(13, 9, 5, 1, 12, 8, 4, 0);
    RUN("vpermt2q", 1, KEEP(q), q[j] = _mm512_permutex2var_epi64(q[j], pidx, w))
    RUN("vshufi64x2", 1, KEEP(q), q[j] = _mm512_shuffle_i64x2(q[j], w, 0x44))
    RUN("dpbusd + vpermt2q", 2, { KEEP(q); KEEP(f); },
        q[j] = _mm512_dpbusd_epi32(q[j], w, x);
        f[j] = _mm512_castsi512_ps(_mm512_permutex2var_epi64(_mm512_castps_si512(f[j]), pidx, w)))
    RUN("dpbusd + vshufi64x2", 2, { KEEP(q); KEEP(f); },
        q[j] = _mm512_dpbusd_epi32(q[j], w, x);
        f[j] = _mm512_castsi512_ps(_mm512_shuffle_i64x2(_mm512_castps_si512(f[j]), w, 0x44)))
    RUN("fma + vpermt2q", 2, { KEEP(f); KEEP(q); },
        f[j] = _mm512_fmadd_ps(f[j], b, c); q[j] = _mm512_permutex2var_epi64(q[j], pidx, w))
#undef RUN
    float s = 0;
    for (int i = 0; i < CHAINS; i++)
        s += _mm512_reduce_add_ps(a[i]) + _mm512_reduce_add_ps(f[i]) +
             (float)_mm512_reduce_add_epi32(q[i]);
    printf("# (checksum %g)\n", s);
    return 0;
}
