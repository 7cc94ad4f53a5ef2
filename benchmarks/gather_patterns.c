/* How fast scattered neuron bundles can be read at all, however they are walked (a probe of the
 * access pattern, not of a kernel: nothing is computed but a sum of every 64-byte line).
 *
 *     cc -O2 -march=native -pthread benchmarks/gather_patterns.c -o /tmp/gather_patterns
 *     /tmp/gather_patterns [THREADS] [REPEATS]          # defaults: 2 threads, 2 repeats
 *
 * A 7B layer's q4 bundles: 32 layers x 11008 neurons x 6,912 bytes (2.4 GB, 2 MiB pages asked
 * for). Each call reads 1,101 of one layer's neurons (10%, sorted, a different layer and set each
 * call), split between the threads, and the p50 of 200 calls is printed with its GB/s:
 *
 *   seq              the same number of bytes, contiguous (the streaming ceiling of this minute)
 *   one aN hint      one bundle at a time, the bundle N ahead fetched line by line meanwhile
 *   gG hint          G bundles side by side line by line, the next G fetched line by line
 *   sideG            G bundles side by side, no software prefetch
 *
 * hints: T0, T1, T2, NTA (_mm_prefetch). Needs AVX-512 (a 64-byte load per line). */
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define LAYERS 32
#define DFF 11008
#define BUNDLE 6912
#define K 1101
#define SETS 64
#define CALLS 200

static uint8_t *buf;
static int32_t idx[SETS][K];

typedef struct {
    const char *name;
    int mode, n, hint; /* mode 0 seq, 1 one bundle a time (n ahead), 2 n side by side + next n
                        * fetched, 3 n side by side without prefetch */
} walk_t;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static inline void fetch(const uint8_t *p, int hint) {
    switch (hint) {
    case 0: _mm_prefetch((const char *)p, _MM_HINT_T0); break;
    case 1: _mm_prefetch((const char *)p, _MM_HINT_T1); break;
    case 2: _mm_prefetch((const char *)p, _MM_HINT_T2); break;
    default: _mm_prefetch((const char *)p, _MM_HINT_NTA); break;
    }
}

static uint64_t read_set(const walk_t *w, int call, int t, int nt) {
    const int32_t *id = idx[call % SETS];
    const uint8_t *base = buf + (size_t)(call % LAYERS) * DFF * BUNDLE;
    const int i0 = t * K / nt, i1 = (t + 1) * K / nt;
    __m512i acc = _mm512_setzero_si512();
    if (w->mode == 0) {
        const uint8_t *p = base + (size_t)i0 * BUNDLE;
        for (size_t o = 0; o < (size_t)(i1 - i0) * BUNDLE; o += 64)
            acc = _mm512_add_epi64(acc, _mm512_load_si512(p + o));
    } else if (w->mode == 1) {
        for (int i = i0; i < i1; i++) {
            const uint8_t *r = base + (size_t)id[i] * BUNDLE;
            const uint8_t *q = i + w->n < i1 ? base + (size_t)id[i + w->n] * BUNDLE : NULL;
            for (int o = 0; o < BUNDLE; o += 64) {
                if (q) fetch(q + o, w->hint);
                acc = _mm512_add_epi64(acc, _mm512_load_si512(r + o));
            }
        }
    } else {
        const int G = w->n;
        for (int i = i0; i < i1; i += G) {
            const int R = i1 - i < G ? i1 - i : G;
            const uint8_t *r[32], *q[32];
            int nq = 0;
            for (int n = 0; n < R; n++) r[n] = base + (size_t)id[i + n] * BUNDLE;
            if (w->mode == 2)
                for (int n = 0; n < G && i + G + n < i1; n++) q[nq++] = base + (size_t)id[i + G + n] * BUNDLE;
            for (int o = 0; o < BUNDLE; o += 64) {
                for (int n = 0; n < nq; n++) fetch(q[n] + o, w->hint);
                for (int n = 0; n < R; n++) acc = _mm512_add_epi64(acc, _mm512_load_si512(r[n] + o));
            }
        }
    }
    return _mm512_reduce_add_epi64(acc);
}

typedef struct {
    const walk_t *w;
    int t, nt;
    pthread_barrier_t *bar;
    double *times;
    uint64_t sum;
} arg_t;

static void *worker(void *p) {
    arg_t *a = p;
    for (int c = 0; c < CALLS; c++) {
        pthread_barrier_wait(a->bar);
        const double t0 = now();
        a->sum += read_set(a->w, c * 7 + 3, a->t, a->nt);
        pthread_barrier_wait(a->bar);
        if (a->t == 0) a->times[c] = now() - t0;
    }
    return NULL;
}

static int by_value(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    const int nt = argc > 1 ? atoi(argv[1]) : 2, repeats = argc > 2 ? atoi(argv[2]) : 2;
    if (nt < 1 || nt > 8 || repeats < 1) {
        fprintf(stderr, "expected THREADS in 1..8 and REPEATS >= 1, got %d %d\n", nt, repeats);
        return 2;
    }
    const size_t bytes = (size_t)LAYERS * DFF * BUNDLE;
    buf = aligned_alloc(2 << 20, bytes);
    if (!buf) return 1;
    madvise(buf, bytes, MADV_HUGEPAGE);
    memset(buf, 1, bytes);
    srand(1);
    for (int s = 0; s < SETS; s++) { /* K distinct neurons, ascending */
        char *taken = calloc(DFF, 1);
        for (int k = 0; k < K;) {
            const int r = rand() % DFF;
            if (!taken[r]) taken[r] = 1, k++;
        }
        for (int i = 0, k = 0; i < DFF; i++)
            if (taken[i]) idx[s][k++] = i;
        free(taken);
    }
    static const walk_t walks[] = {
        {"seq", 0, 0, 0},        {"one a1 T0", 1, 1, 0}, {"one a1 T1", 1, 1, 1},
        {"one a2 T1", 1, 2, 1},  {"one a4 T1", 1, 4, 1}, {"g2 T1", 2, 2, 1},
        {"g4 T0", 2, 4, 0},      {"g4 T1", 2, 4, 1},     {"g4 T2", 2, 4, 2},
        {"g4 NTA", 2, 4, 3},     {"g8 T1", 2, 8, 1},     {"g8 NTA", 2, 8, 3},
        {"side2", 3, 2, 0},      {"side4", 3, 4, 0},     {"side8", 3, 8, 0},
        {"side16", 3, 16, 0},
    };
    printf("# %d threads; %d bundles of %d bytes a call (%.1f MB), p50 of %d calls\n", nt, K,
           BUNDLE, K * (double)BUNDLE / 1e6, CALLS);
    for (int rep = 0; rep < repeats; rep++)
        for (size_t w = 0; w < sizeof walks / sizeof walks[0]; w++) {
            pthread_barrier_t bar;
            pthread_barrier_init(&bar, NULL, nt);
            double times[CALLS];
            pthread_t th[8];
            arg_t a[8];
            for (int t = 0; t < nt; t++) {
                a[t] = (arg_t){&walks[w], t, nt, &bar, times, 0};
                if (t) pthread_create(&th[t], NULL, worker, &a[t]);
            }
            worker(&a[0]);
            for (int t = 1; t < nt; t++) pthread_join(th[t], NULL);
            pthread_barrier_destroy(&bar);
            qsort(times, CALLS, sizeof times[0], by_value);
            const double p50 = times[CALLS / 2];
            printf("%-10s p50 %7.1f us  %5.1f GB/s\n", walks[w].name, p50 * 1e6,
                   K * (double)BUNDLE / p50 / 1e9);
        }
    return 0;
}
