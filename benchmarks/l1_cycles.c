/* The one-token kernels' arithmetic alone: each panel type's GEMV pass (panel_gemv, what a
 * decode step runs) over one panel of 16 rows, and plain AVX2's q4 gate pass (q4_dots8, 8 sparse
 * rows), with everything in L1, called again and again; ns and cycles (the clock from a chain of
 * dependent adds) per block column of 32 weights x 16 rows (the gate pass: x 8 rows). The library's
 * own source is compiled in, with the flags of the ISA named:
 *
 *     cc -O3 -std=gnu11 -fno-math-errno -mavx2 -mfma -mf16c -DSI_ISA=avx2 \
 *        -Isrc/sparseinfer/cpu benchmarks/l1_cycles.c -o /tmp/l1c -lm && /tmp/l1c
 *
 * (avx2_128: add -DSI_NARROW=1, no gate pass; avx512 and avx2_vnni: their -m flags as in
 * cpu/build.py.) Compare a kernel's cycles with its vector operations (`cc -S` of the same
 * command) to see whether the pipes or something else bound it. Weights and x are random bytes
 * (a scale may be inf or NaN: the time is the same). Figures: benchmarks/RESULTS.md. */
#include "kernels.c"

#include <stdio.h>
#include <time.h>

#define STR2(a) #a
#define STR(a) STR2(a)
#define COLS 1024 /* 32 blocks, 4 super-blocks: the largest panel (Q8_0, 17 KiB) fits L1 */
#ifndef CALLS
#define CALLS 20000 /* a round's calls of each kernel */
#endif
#ifndef ROUNDS
#define ROUNDS 7 /* the best round counts */
#endif

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static double clock_hz(void) {
    double best = 0;
    for (int r = 0; r < 3; r++) {
        uint64_t a = 1;
        const long n = 200000000L;
        const double t = now();
        for (long i = 0; i < n; i++)
            __asm__ volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(a));
        const double hz = 4.0 * n / (now() - t);
        if (hz > best) best = hz;
    }
    return best;
}

static uint8_t w[16 * 210 * (COLS / 256) + 16 * 34 * (COLS / 32)] __attribute__((aligned(64)));
static int8_t xq[COLS], xkq[COLS];
static float xd[COLS / 32], xs[COLS / 32], xkd[COLS / 128], xks[COLS / 32];
static int16_t xkbs[COLS / 16];
static float y[16];

static double best_ns(void (*call)(void), const double blocks) {
    double best = 1e30;
    for (int r = 0; r < ROUNDS; r++) {
        const double t = now();
        for (int i = 0; i < CALLS; i++) call();
        const double ns = (now() - t) / CALLS / blocks * 1e9;
        if (ns < best) best = ns;
    }
    return best;
}

static si_xq x;
static int cur_type;
static void call_panel(void) { panel_gemv(cur_type, w, 16, &x, COLS / 32, y); }
#if !SI_AVX512 && !SI_NARROW
static const uint8_t *rp[8];
static void call_gates(void) { q4_dots8(rp, &x, COLS / 32, y, NULL, 0, 0); }
#endif

int main(void) {
    srand(1);
    for (size_t i = 0; i < sizeof w; i++) w[i] = (uint8_t)rand();
    for (int i = 0; i < COLS; i++) xq[i] = (int8_t)(rand() % 255 - 127), xkq[i] = xq[i];
    for (int b = 0; b < COLS / 32; b++) xd[b] = 0.01f, xs[b] = 1.0f, xks[b] = 0.5f;
    for (int b = 0; b < COLS / 128; b++) xkd[b] = 0.01f;
    for (int b = 0; b < COLS / 16; b++) xkbs[b] = (int16_t)(rand() % 2000 - 1000);
    x.q = xq, x.d = xd, x.s = xs, x.kq = xkq, x.kd = xkd, x.kbs = xkbs, x.ks = xks;
    const double hz = clock_hz();
    printf("# ISA %s, clock %.2f GHz (dependent adds); %d columns, all in L1\n", STR(SI_ISA),
           hz / 1e9, COLS);
    const struct {
        const char *name;
        int type;
    } types[] = {{"Q4_0x16", SI_Q4_0P}, {"Q4_1x16", SI_Q4_1P}, {"Q5_0x16", SI_Q5_0P},
                 {"Q5_1x16", SI_Q5_1P}, {"Q8_0x16", SI_Q8_0P}, {"Q4_Kx16", SI_Q4_KP},
                 {"Q5_Kx16", SI_Q5_KP}, {"Q6_Kx16", SI_Q6_KP}, {"Q6_Kx16b", SI_Q6_KB},
                 {"Q5_Kx16b", SI_Q5_KB}};
    for (size_t k = 0; k < sizeof types / sizeof types[0]; k++) {
        cur_type = types[k].type;
        const double ns = best_ns(call_panel, COLS / 32);
        printf("%-9s GEMV, 16 rows      %6.2f ns  %5.1f cycles a block column\n", types[k].name,
               ns, ns * hz / 1e9);
    }
#if !SI_AVX512 && !SI_NARROW
    for (int r = 0; r < 8; r++) rp[r] = w + (size_t)r * (COLS / 32) * 18;
    const double ns = best_ns(call_gates, COLS / 32);
    printf("q4 gates  q4_dots8, 8 rows   %6.2f ns  %5.1f cycles a block column\n", ns, ns * hz / 1e9);
#endif
    return 0;
}
