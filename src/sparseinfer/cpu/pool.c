/* sparseinfer CPU library: ISA selection, a persistent thread pool, and the exported calls.
 *
 * This file is compiled for baseline x86-64; the kernels (kernels.c) are compiled once per ISA
 * and chosen at run time with __builtin_cpu_supports (never AMX).
 *
 * Pool: n-1 worker threads plus the calling thread. A call publishes a job (chunks of rows),
 * bumps a generation word and wakes sleepers; everyone claims chunks with a compare-and-swap on
 * a counter tagged with the generation (a late worker can never run a chunk of a newer job
 * with an older job's arguments); the caller waits until all chunks are done. Idle workers
 * spin for a short, settable time (si_set_spin_us), then sleep on a futex: on a busy machine a
 * pool that spins forever steals the CPU from the thread it waits for.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <cpuid.h>
#include <immintrin.h>

#include "qgemv.h"

#define SI_ABI_VERSION 30
#define MAX_THREADS 256
#define MAX_MATS 16
#define GEMM_MIN_ROWS 128

/* ------------------------------------------------------------------ types */

static const int BLOCK_ELEMS[SI_N_TYPES] = {32, 32, 32, 32, 32, 256, 256, 256, 1, 1, 32, 32, 32, 32, 256, 256, 256, 32, 256, 256, 1};
static const int BLOCK_BYTES[SI_N_TYPES] = {18, 20, 22, 24, 34, 144, 176, 210, 2, 4, 18, 20, 34, 22, 144, 176, 210, 24, 210, 176, 2};

int si_abi_version(void) { return SI_ABI_VERSION; }
int si_block_elems(int type) { return type >= 0 && type < SI_N_TYPES ? BLOCK_ELEMS[type] : 0; }
int si_block_bytes(int type) { return type >= 0 && type < SI_N_TYPES ? BLOCK_BYTES[type] : 0; }

/* ------------------------------------------------------------------ ISA */

typedef void (*rows_fn)(int, const uint8_t *, size_t, int, const si_xq *, int, float *);
typedef void (*quant_fn)(const float *, int, int8_t *, float *, float *);
typedef void (*quantk_fn)(const float *, int, int8_t *, float *, int16_t *, float *);
typedef int (*xgroups_fn)(const si_xq *, int, uint8_t *);
typedef void (*sparse_fn)(const uint8_t *, size_t, int, const int32_t *, int, const uint8_t *,
                          size_t, const si_xq *, int, int, int, int, const float *, float *);

enum { ISA_AVX2 = 0, ISA_AVX512 = 1, ISA_AVX2_128 = 2, ISA_AVX2_VNNI = 3 };
static int g_isa = -1;
static rows_fn g_rows;
typedef void (*rows_multi_fn)(int, const uint8_t *, size_t, int, const si_xq *, int, int, float *,
                              int64_t);
static rows_multi_fn g_rows_multi;
static quant_fn g_quant;
static quantk_fn g_quantk;
static xgroups_fn g_xgroups;
static sparse_fn g_sparse;
typedef void (*gates_fn)(const uint8_t *, size_t, const int32_t *, int, const si_xq *, int,
                         float *);
static gates_fn g_gates;
typedef void (*sparse_i8_fn)(const int8_t *, size_t, const float *, int, int, int, const int32_t *,
                             int, const uint8_t *, size_t, const float *, const si_xq *, int, int,
                             int, int, const float *, float *, const uint8_t *, size_t, int);
static sparse_i8_fn g_sparse_i8;
typedef void (*sparse_i8_ups_fn)(const int8_t *, size_t, const float *, int, int, int,
                                 const int32_t *, const float *, int, const float *, const si_xq *,
                                 int, int, float *);
static sparse_i8_ups_fn g_sparse_i8_ups;
typedef void (*attend_fn)(const float *, const float *, const float *, int, int, float, float,
                          int, float *, size_t, float *);
typedef void (*attend16_fn)(const float *, const uint16_t *, const uint16_t *, int, int, float,
                            float, int, float *, size_t, float *);
typedef void (*glu_fn)(int, int, int, const float *, const float *, int, float *);
static attend_fn g_attend;
static attend16_fn g_attend16;
static glu_fn g_glu;

/* AVX-VNNI: CPUID leaf 7 subleaf 1, EAX bit 4 (read directly: __builtin_cpu_supports knows it
 * only from GCC 11). The OS saves the YMM state if AVX2 is usable (the caller checks that). */
static int has_avx_vnni(void) {
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 1, &a, &b, &c, &d) && ((a >> 4) & 1);
}

int si_isa_supported(int isa) {
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (isa == ISA_AVX2 || isa == ISA_AVX2_128) return avx2;
    if (isa == ISA_AVX2_VNNI) return avx2 && has_avx_vnni();
    if (isa == ISA_AVX512)
        return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    return 0;
}

/* True on CPUs whose vector units are 128 bits wide and split every 256-bit instruction: AMD
 * family 17h models 00h-2Fh (Zen, Zen+; Zen 2 starts at 30h) and Hygon family 18h. */
static int narrow_vector_units(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return 0;
    const int amd = b == 0x68747541u;   /* "Auth"enticAMD */
    const int hygon = b == 0x6f677948u; /* "Hygo"nGenuine */
    if (!(amd || hygon) || !__get_cpuid(1, &a, &b, &c, &d)) return 0;
    const unsigned base = (a >> 8) & 0xF, family = base == 0xF ? base + ((a >> 20) & 0xFF) : base;
    const unsigned model = ((a >> 4) & 0xF) | (base == 0xF ? ((a >> 16) & 0xF) << 4 : 0);
    return (family == 0x17 && model < 0x30) || family == 0x18;
}

/* The variant "auto" picks: AVX-512 (with VNNI) if present, else AVX2 in 128-bit registers on
 * CPUs with narrow vector units, else AVX2 with AVX-VNNI's 256-bit byte dot products if present
 * (Intel from Alder Lake), else AVX2. */
int si_best_isa(void) {
    if (si_isa_supported(ISA_AVX512)) return ISA_AVX512;
    if (!si_isa_supported(ISA_AVX2)) return -1;
    if (narrow_vector_units()) return ISA_AVX2_128;
    return si_isa_supported(ISA_AVX2_VNNI) ? ISA_AVX2_VNNI : ISA_AVX2;
}

int si_set_isa(int isa) {
    if (!si_isa_supported(isa)) return -1;
    g_isa = isa;
#define PICK(fn)                                                                                  \
    (isa == ISA_AVX512     ? fn##_avx512                                                         \
     : isa == ISA_AVX2_128 ? fn##_avx2_128                                                       \
     : isa == ISA_AVX2_VNNI ? fn##_avx2_vnni                                                     \
                            : fn##_avx2)
    g_rows = PICK(si_rows);
    g_rows_multi = PICK(si_rows_multi);
    g_quant = PICK(si_quantize_x);
    g_quantk = PICK(si_quantize_xk);
    g_xgroups = PICK(si_xgroups);
    g_sparse = PICK(si_sparse_q4);
    g_gates = PICK(si_sparse_q4_gates);
    g_sparse_i8 = PICK(si_sparse_i8);
    g_sparse_i8_ups = PICK(si_sparse_i8_ups);
    g_attend = PICK(si_attend_group);
    g_attend16 = PICK(si_attend_group16);
    g_glu = PICK(si_glu);
#undef PICK
    return 0;
}

int si_get_isa(void) { return g_isa; }

/* ------------------------------------------------------------------ futex helpers */

static void futex_wait(atomic_int *addr, int val) {
    syscall(SYS_futex, (int *)addr, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
}
static void futex_wake(atomic_int *addr, int n) {
    syscall(SYS_futex, (int *)addr, FUTEX_WAKE_PRIVATE, n, NULL, NULL, 0);
}
static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Spin (with pause) until *addr != val or the spin budget is used; 1 if it changed. */
static atomic_int g_spin_us = 50;
static int spin_while_eq(atomic_int *addr, int val) {
    const int64_t budget = (int64_t)atomic_load_explicit(&g_spin_us, memory_order_relaxed) * 1000;
    if (budget <= 0) return atomic_load(addr) != val;
    const int64_t t0 = now_ns();
    for (unsigned i = 1;; i++) {
        if (atomic_load_explicit(addr, memory_order_acquire) != val) return 1;
        _mm_pause();
        if ((i & 255) == 0 && now_ns() - t0 > budget) return 0;
    }
}

/* ------------------------------------------------------------------ pool */

typedef void (*chunk_fn)(const void *job, int64_t chunk);

/* The words every thread writes live on cache lines of their own, apart from the job's
 * read-only description: a chunk claim must not evict the description from the other core. */
#define LINE 64
static struct {
    _Alignas(LINE) atomic_int gen; /* futex word: bumped once per job */
    atomic_int sleepers;           /* workers inside futex_wait on gen */
    atomic_int stop;
    _Alignas(LINE) atomic_llong next; /* (gen << 32) | next chunk index */
    _Alignas(LINE) atomic_int done;   /* chunks finished in the current job (caller's futex word) */
    atomic_int caller_sleeps;
    _Alignas(LINE) chunk_fn fn;
    const void *job;
    int64_t n_chunks;
    int n_workers;
    pthread_t th[MAX_THREADS];
} P;

static pthread_mutex_t g_call_lock = PTHREAD_MUTEX_INITIALIZER;

/* Chunks run by the calling thread and by the workers since the last si_pool_stats reset. */
static atomic_llong g_chunks_caller, g_chunks_workers;

void si_pool_stats(long long *caller, long long *workers, int reset) {
    *caller = atomic_load(&g_chunks_caller);
    *workers = atomic_load(&g_chunks_workers);
    if (reset) {
        atomic_store(&g_chunks_caller, 0);
        atomic_store(&g_chunks_workers, 0);
    }
}

/* Where the decode blocks' time goes (si_set_block_timing, si_block_times): wall time of each
 * phase of block_rows summed over calls, a phase's clock read at its end (off: nothing read).
 * The phases, in ops.BLOCK_PHASES' order: the attention norm and QKV product; rope, the cache
 * and attention; the output projection; the sparse FFN's predictor (and neuron selection); its
 * q4 gate rows (int8 bundles with gates apart); the FFN's rows or products; the rest (residual
 * adds, the FFN norm). Written under g_call_lock (every block call holds it). */
enum { PH_ATTN_IN, PH_ATTEND, PH_WO, PH_PREDICT, PH_GATES, PH_FFN, PH_REST, SI_N_PHASES };
static atomic_int g_timing;
static int g_timed;         /* a block call under way is being timed */
static int64_t g_phase_t;   /* when the phase under way began (g_timed) */
static long long g_phase_ns[SI_N_PHASES];

void si_set_block_timing(int on) { atomic_store(&g_timing, on != 0); }
static void phase_begin(void) {
    g_timed = atomic_load_explicit(&g_timing, memory_order_relaxed);
    if (g_timed) g_phase_t = now_ns();
}
static void phase_end(int ph) {
    if (!g_timed) return;
    const int64_t t = now_ns();
    g_phase_ns[ph] += t - g_phase_t;
    g_phase_t = t;
}

int si_block_times(long long *ns, int n, int reset) {
    if (n != SI_N_PHASES) return EINVAL;
    pthread_mutex_lock(&g_call_lock);
    memcpy(ns, g_phase_ns, sizeof g_phase_ns);
    if (reset) memset(g_phase_ns, 0, sizeof g_phase_ns);
    pthread_mutex_unlock(&g_call_lock);
    return 0;
}

/* Claim and run chunks of job generation `gen` until none are left. The finished count is
 * published once, when this thread finds no chunk left (one atomic add per thread and job, not
 * one per chunk). */
static void run_chunks(int gen, int is_worker) {
    int ran = 0;
    int64_t n = 0; /* the job's chunk count, read while one of its chunks is unfinished */
    for (;;) {
        long long v = atomic_load(&P.next);
        if ((int)(v >> 32) != gen) break;
        const int64_t c = v & 0xffffffffLL;
        if (c >= P.n_chunks) break;
        if (!atomic_compare_exchange_weak(&P.next, &v, v + 1)) continue;
        n = P.n_chunks;
        P.fn(P.job, c); /* the job's fields are stable until all its chunks are done */
        ran++;
    }
    if (!ran) return;
    atomic_fetch_add_explicit(is_worker ? &g_chunks_workers : &g_chunks_caller, ran,
                              memory_order_relaxed);
    const int d = atomic_fetch_add(&P.done, ran) + ran;
    if (d == n && atomic_load(&P.caller_sleeps)) futex_wake(&P.done, 1);
}

static void *worker(void *arg) {
    /* the generation when this thread was created: a stop or job issued before the thread first
     * runs is still seen as new */
    int seen = (int)(intptr_t)arg;
    for (;;) {
        if (!spin_while_eq(&P.gen, seen)) {
            atomic_fetch_add(&P.sleepers, 1);
            while (atomic_load(&P.gen) == seen) futex_wait(&P.gen, seen);
            atomic_fetch_sub(&P.sleepers, 1);
        }
        seen = atomic_load(&P.gen);
        if (atomic_load(&P.stop)) return NULL;
        run_chunks(seen, 1);
    }
}

static void pool_stop(void) {
    if (P.n_workers == 0) return;
    atomic_store(&P.stop, 1);
    atomic_fetch_add(&P.gen, 1);
    futex_wake(&P.gen, INT_MAX);
    for (int i = 0; i < P.n_workers; i++) pthread_join(P.th[i], NULL);
    P.n_workers = 0;
    atomic_store(&P.stop, 0);
}

/* n threads in all (the caller is one of them). 0 on success, else an errno value. */
int si_set_threads(int n) {
    if (n < 1 || n > MAX_THREADS) return EINVAL;
    pthread_mutex_lock(&g_call_lock);
    pool_stop();
    int err = 0;
    for (int i = 0; i < n - 1; i++) {
        err = pthread_create(&P.th[i], NULL, worker, (void *)(intptr_t)atomic_load(&P.gen));
        if (err) break;
        P.n_workers++;
    }
    pthread_mutex_unlock(&g_call_lock);
    return err;
}

int si_get_threads(void) { return P.n_workers + 1; }
void si_set_spin_us(int us) { atomic_store(&g_spin_us, us < 0 ? 0 : us); }

/* Run fn(job, c) for c in [0, n_chunks) on the pool; returns when all are done. */
static void pool_run(chunk_fn fn, const void *job, int64_t n_chunks) {
    if (n_chunks <= 0) return;
    if (P.n_workers == 0 || n_chunks == 1) {
        for (int64_t c = 0; c < n_chunks; c++) fn(job, c);
        atomic_fetch_add_explicit(&g_chunks_caller, n_chunks, memory_order_relaxed);
        return;
    }
    /* The claim word moves to the new generation before the job's fields change: a worker
     * still in run_chunks of the previous job may have read the old claim word and then read
     * the new chunk count, and its claim must fail (it did not, when the fields came first:
     * that worker ran a chunk of the new job, the finished count overshot, and the caller
     * slept forever waiting for it to equal the chunk count). */
    const int gen = atomic_load(&P.gen) + 1;
    atomic_store(&P.next, (long long)gen << 32);
    P.fn = fn;
    P.job = job;
    P.n_chunks = n_chunks;
    atomic_store(&P.done, 0);
    atomic_store(&P.caller_sleeps, 0);
    atomic_store(&P.gen, gen);
    if (atomic_load(&P.sleepers) > 0) futex_wake(&P.gen, INT_MAX);
    run_chunks(gen, 0);
    const int n = (int)n_chunks;
    if (atomic_load(&P.done) != n) {
        for (;;) {
            int d = atomic_load(&P.done);
            if (d == n) break;
            if (spin_while_eq(&P.done, d)) continue;
            atomic_store(&P.caller_sleeps, 1);
            while ((d = atomic_load(&P.done)) != n) futex_wait(&P.done, d);
            break;
        }
    }
}

/* ------------------------------------------------------------------ activation scratch */

/* *p holds at least `need` bytes (64-byte aligned; its contents are not kept when it grows). */
static int grow(void **p, size_t *cap, size_t need) {
    if (need <= *cap) return 0;
    free(*p);
    *p = aligned_alloc(64, (need + 63) / 64 * 64);
    *cap = *p ? need : 0;
    return *p ? 0 : ENOMEM;
}

static struct {
    int8_t *q;
    float *d, *s;
    uint8_t *g; /* si_xgroups' rearranged copies */
    si_xq *xq;
    int8_t *kq; /* blocks of 128 (si_quantize_xk) */
    float *kd, *ks;
    int16_t *kbs;
    size_t cap_q, cap_d, cap_s, cap_t, cap_g, cap_kq, cap_kd, cap_kbs, cap_ks; /* bytes */
} S;

#define XK 128 /* x elements per scale of the blocks of 128 (x->kq) */
/* x (cols, a multiple of XK) -> blocks of XK = 128 by this ISA's si_quantize_xk (see kernels.c):
 * q, d per block, bs sums of q per 16, ks (unless NULL) the rounded x's sums per 32. */
int si_quantize_xk(const float *x, int cols, int8_t *q, float *d, int16_t *bs, float *ks) {
    if (cols <= 0 || cols % XK) return EINVAL;
    if (g_isa < 0) return ENODEV;
    g_quantk(x, cols, q, d, bs, ks);
    return 0;
}

static int scratch(size_t nq, size_t nb, size_t nt, size_t ng) {
    int err = grow((void **)&S.g, &S.cap_g, ng);
    if (!err) err = grow((void **)&S.q, &S.cap_q, nq);
    if (!err) err = grow((void **)&S.d, &S.cap_d, nb * sizeof(float));
    if (!err) err = grow((void **)&S.s, &S.cap_s, nb * sizeof(float));
    if (!err) err = grow((void **)&S.xq, &S.cap_t, nt * sizeof(si_xq));
    return err;
}

/* The weight types that read x in blocks of 128 (x->kq ...), by ISA: Q6_K on plain AVX2 and
 * AVX-512 (XK_Q6K), Q5_K on AVX-512 (XK_Q5K), Q6_K panels of either layout on every ISA
 * (XK_Q6P). A job records the kinds its matrices are (xk_kind); whether x is made in blocks of
 * 128 is decided when it runs, on the ISA then. */
enum { XK_Q6K = 1, XK_Q5K = 2, XK_Q6P = 4 };
/* float rows (F16, BF16, F32) read x as float32: nothing to quantize */
static int float_kind(int type) { return type == SI_F16 || type == SI_BF16 || type == SI_F32; }

static int xk_kind(int type) {
    if (type == SI_Q6_K) return XK_Q6K;
    if (type == SI_Q5_K) return XK_Q5K;
    return type == SI_Q6_KP || type == SI_Q6_KB ? XK_Q6P : 0;
}
static int xk_served(void) { /* the kinds this ISA's kernels take in blocks of 128 */
    return XK_Q6P | (g_isa == ISA_AVX512                              ? XK_Q6K | XK_Q5K
                     : g_isa == ISA_AVX2 || g_isa == ISA_AVX2_VNNI ? XK_Q6K
                                                                   : 0);
}

/* fn(job, t) for each of n independent rows: on the pool from ROWS_POOL_MIN rows, else on the
 * calling thread (a row's numbers are the same whichever thread computes it). */
#define ROWS_POOL_MIN 4
static void each_row(chunk_fn fn, const void *job, int64_t n) {
    if (n >= ROWS_POOL_MIN) pool_run(fn, job, n);
    else
        for (int64_t t = 0; t < n; t++) fn(job, t);
}

/* Row t of a quantize_rows call: its descriptor S.xq[t] and its blocks. */
typedef struct {
    const float *x;
    int cols, need_q, need_k;
    size_t nb, ng;
} quant_job_t;
static void quant_chunk(const void *jp, int64_t t) {
    const quant_job_t *j = jp;
    const int cols = j->cols;
    const size_t nb = j->nb, ng = j->ng;
    si_xq *xq = &S.xq[t];
    xq->f = j->x + t * (size_t)cols;
    xq->q = S.q + t * (size_t)cols;
    xq->d = S.d + t * nb;
    xq->s = S.s + t * nb;
    xq->g = NULL;
    xq->kq = NULL, xq->kd = NULL, xq->kbs = NULL, xq->ks = NULL;
    if (j->need_k) {
        int8_t *kq = S.kq + t * (size_t)cols;
        float *kd = S.kd + t * (size_t)(cols / XK), *ks = S.ks + t * (size_t)(cols / 32);
        int16_t *kbs = S.kbs + t * (size_t)(cols / 16);
        g_quantk(xq->f, cols, kq, kd, kbs, ks);
        xq->kq = kq, xq->kd = kd, xq->kbs = kbs, xq->ks = ks;
    }
    if (j->need_q) {
        g_quant(xq->f, cols, S.q + t * (size_t)cols, S.d + t * nb, S.s + t * nb);
        if (ng && g_xgroups(xq, cols, S.g + t * ng)) xq->g = S.g + t * ng;
    }
}

/* Quantize T rows of x [T, cols] into the scratch in blocks of 32 (need_q: some matrix other
 * than a K-quant's reads them), with the rearranged copies (need_g: only the row-major
 * Q4_0/Q4_1/Q5_0/Q5_1 and sparse kernels read them), and in blocks of 128 (need_k: the xk_kind
 * bits of the K-quant matrices; the kinds this ISA takes in blocks of 128 get those, the others
 * blocks of 32); S.xq[t] describes row t. */
static int quantize_rows(const float *x, int64_t T, int cols, int need_q, int need_g,
                         int need_k) {
    need_q = need_q || (need_k & ~xk_served());
    need_k = (need_k & xk_served()) && cols % XK == 0;
    /* the rearranged copies where the ISA's kernels read them (AVX-512: groups of 4 blocks,
     * SI_XG_BYTES each; plain AVX2: pairs of blocks, cols bytes, less) */
    const size_t nb = (size_t)cols / 32,
                 ng = need_g && g_isa != ISA_AVX2_128 ? SI_XG_BYTES((cols + 127) / 128) : 0;
    int err = scratch(need_q ? (size_t)T * cols : 1, need_q ? (size_t)T * nb : 1, (size_t)T,
                      need_q && ng ? (size_t)T * ng : 1);
    if (!err && need_k) err = grow((void **)&S.kq, &S.cap_kq, (size_t)T * cols);
    if (!err && need_k) err = grow((void **)&S.kd, &S.cap_kd, (size_t)T * (cols / XK) * sizeof(float));
    if (!err && need_k) err = grow((void **)&S.kbs, &S.cap_kbs, (size_t)T * (cols / 16) * sizeof(int16_t));
    if (!err && need_k) err = grow((void **)&S.ks, &S.cap_ks, (size_t)T * (cols / 32) * sizeof(float));
    if (err) return err;
    const quant_job_t j = {.x = x, .cols = cols, .nb = nb, .ng = ng, .need_q = need_q,
                           .need_k = need_k};
    each_row(quant_chunk, &j, T);
    return 0;
}

/* ------------------------------------------------------------------ GEMV / GEMM jobs */

typedef struct {
    int nmat, cols, ch, need_q, need_g, need_k;
    int64_t T;
    int type[MAX_MATS];
    const uint8_t *w[MAX_MATS];
    int64_t rows[MAX_MATS];
    size_t rb[MAX_MATS];
    float *out[MAX_MATS];
    int64_t ys[MAX_MATS];        /* T > 1: out[i] row t at t * ys[i] (rows[i] unless set apart) */
    int64_t first[MAX_MATS + 1]; /* first chunk of each matrix */
    rows_fn rows_kernel;
    const si_xq *xq;
    /* each matrix its own rows of x (si_gemv_each, si_gemm_each): matrix i against the tn[i]
     * rows from row toff[i]; else every matrix against all T rows */
    int each;
    int64_t toff[MAX_MATS], tn[MAX_MATS];
} job_t;

static void gemv_chunk(const void *jp, int64_t c) {
    const job_t *j = jp;
    int i = 0;
    while (c >= j->first[i + 1]) i++;
    const int64_t r0 = (c - j->first[i]) * j->ch;
    const int64_t r1 = r0 + j->ch < j->rows[i] ? r0 + j->ch : j->rows[i];
    const si_xq *xq = j->each ? j->xq + j->toff[i] : j->xq;
    const int64_t T = j->each ? j->tn[i] : j->T;
    if (T == 1)
        j->rows_kernel(j->type[i], j->w[i] + r0 * j->rb[i], j->rb[i], (int)(r1 - r0), xq,
                       j->cols, j->out[i] + r0);
    else /* the chunk's rows against every x row, weight blocks decoded once per few x rows */
        g_rows_multi(j->type[i], j->w[i] + r0 * j->rb[i], j->rb[i], (int)(r1 - r0), xq, (int)T,
                     j->cols, j->out[i] + r0, j->ys[i]);
}

static int check_mat(int type, int64_t rows, int cols) {
    if (type < 0 || type >= SI_N_TYPES || rows < 0 || cols <= 0 || cols % 32 ||
        cols % BLOCK_ELEMS[type] || (si_is_panel(type) && rows % SI_PANEL))
        return EINVAL;
    return 0;
}

/* Fill job j: outs[i][t * rows[i] + r] = sum_c W_i[r, c] * x[t, c] for T rows of x, all
 * matrices sharing cols. Returns 0, EINVAL (bad type/shape) or ENODEV (no ISA selected). */
static int setup_job(job_t *j, int nmat, const int *types, const void *const *w,
                     const int64_t *rows, int cols, int64_t T, float *const *outs) {
    if (nmat < 1 || nmat > MAX_MATS || T < 1) return EINVAL;
    if (g_isa < 0) return ENODEV;
    j->nmat = nmat;
    j->cols = cols;
    j->T = T;
    j->each = 0;
    j->rows_kernel = g_rows;
    j->need_q = j->need_g = j->need_k = 0;
    int64_t total_rows = 0;
    int panels = 0;
    for (int i = 0; i < nmat; i++) {
        panels |= si_is_panel(types[i]);
        int err = check_mat(types[i], rows[i], cols);
        if (err) return err;
        j->type[i] = types[i];
        j->w[i] = w[i];
        j->rows[i] = rows[i];
        j->rb[i] = (size_t)cols / BLOCK_ELEMS[types[i]] * BLOCK_BYTES[types[i]];
        j->out[i] = outs[i];
        j->ys[i] = rows[i];
        j->need_q |= !float_kind(types[i]) && !xk_kind(types[i]);
        j->need_g |= types[i] == SI_Q4_0 || types[i] == SI_Q4_1 || types[i] == SI_Q5_0 ||
                     types[i] == SI_Q5_1;
        j->need_k |= xk_kind(types[i]);
        total_rows += rows[i];
    }
    /* chunk rows: a multiple of 4, about 8 chunks per thread (enough to even out a thread that
     * runs slower) but at least 16 rows and 32 KiB of weights (a claim moves a cache line
     * between cores, ~0.1 us: small matrices get a few chunks, not dozens); a chunk is
     * contiguous rows, read front to back */
    const int nt = P.n_workers + 1;
    size_t rb_max = 1;
    for (int i = 0; i < nmat; i++) rb_max = j->rb[i] > rb_max ? j->rb[i] : rb_max;
    int64_t ch = (total_rows + 8 * nt - 1) / (8 * nt);
    const int64_t min_rows = (int64_t)((32768 + rb_max - 1) / rb_max);
    ch = ch < min_rows ? min_rows : ch;
    ch = ch < 16 ? 16 : (ch + 3) & ~3LL;
    /* a GEMM (T > 1) takes longer per row: chunks of at least GEMM_MIN_ROWS rows (16-row chunks
     * ran much slower from memory: the two threads' short interleaved runs; benchmarks/RESULTS.md) */
    if (T > 1 && ch < GEMM_MIN_ROWS) {
        /* a whole number of such chunks per thread (576 rows on 2 threads: 4 of 144, not 4 of
         * 128 and one of 64 that leaves a thread idle for a fifth of the product) */
        int64_t n = total_rows / GEMM_MIN_ROWS;
        n = n < nt ? nt : (n + nt - 1) / nt * nt;
        ch = ((total_rows + n - 1) / n + 3) & ~3LL;
    }
    if (panels) ch = (ch + SI_PANEL - 1) / SI_PANEL * SI_PANEL; /* chunks of whole panels */
    j->ch = (int)ch;
    j->first[0] = 0;
    for (int i = 0; i < nmat; i++) j->first[i + 1] = j->first[i] + (rows[i] + j->ch - 1) / j->ch;
    return 0;
}

/* Run a filled job on x [T, cols] (the caller holds g_call_lock). */
static int exec_job(job_t *j, const float *x) {
    int err = quantize_rows(x, j->T, j->cols, j->need_q, j->need_g, j->need_k);
    if (err) return err;
    j->rows_kernel = g_rows;
    j->xq = S.xq;
    pool_run(gemv_chunk, j, j->first[j->nmat]);
    return 0;
}

/* A product of T rows of x, the caller holding g_call_lock (run: taking it). */
static int run_locked(int nmat, const int *types, const void *const *w, const int64_t *rows,
                      int cols, const float *x, int64_t T, float *const *outs) {
    job_t j;
    const int err = setup_job(&j, nmat, types, w, rows, cols, T, outs);
    return err ? err : exec_job(&j, x);
}

static int run(int nmat, const int *types, const void *const *w, const int64_t *rows, int cols,
               const float *x, int64_t T, float *const *outs) {
    pthread_mutex_lock(&g_call_lock);
    const int err = run_locked(nmat, types, w, rows, cols, x, T, outs);
    pthread_mutex_unlock(&g_call_lock);
    return err;
}

int si_gemv(int nmat, const int *types, const void *const *w, const int64_t *rows, int cols,
            const float *x, float *const *outs) {
    return run(nmat, types, w, rows, cols, x, 1, outs);
}

/* outs[i] [tn[i], rows[i]] = x_i W_i^T: matrices of one width, each against its own tn[i] rows
 * of x [sum tn, cols], taken in order (a mixture of experts: each expert the rows of the tokens
 * that picked it); the rows quantized in one pass, every matrix's rows in one dispatch. */
int si_gemm_each(int nmat, const int *types, const void *const *w, const int64_t *rows, int cols,
                 const float *x, const int64_t *tn, float *const *outs) {
    if (nmat < 1 || nmat > MAX_MATS) return EINVAL;
    int64_t total = 0, most = 1;
    for (int i = 0; i < nmat; i++) {
        if (tn[i] < 1) return EINVAL;
        total += tn[i];
        most = tn[i] > most ? tn[i] : most;
    }
    pthread_mutex_lock(&g_call_lock);
    job_t j;
    int err = setup_job(&j, nmat, types, w, rows, cols, most, outs);
    if (!err) err = quantize_rows(x, total, cols, j.need_q, j.need_g, j.need_k);
    if (!err) {
        j.each = 1;
        int64_t off = 0;
        for (int i = 0; i < nmat; off += tn[i], i++) j.toff[i] = off, j.tn[i] = tn[i];
        j.rows_kernel = g_rows;
        j.xq = S.xq;
        pool_run(gemv_chunk, &j, j.first[j.nmat]);
    }
    pthread_mutex_unlock(&g_call_lock);
    return err;
}

/* outs[i] = W_i x_i: each matrix against its own row of x [nmat, cols] (si_gemm_each of one row
 * each: a mixture of experts' down products for one token). */
int si_gemv_each(int nmat, const int *types, const void *const *w, const int64_t *rows, int cols,
                 const float *x, float *const *outs) {
    if (nmat < 1 || nmat > MAX_MATS) return EINVAL;
    int64_t ones[MAX_MATS];
    for (int i = 0; i < nmat; i++) ones[i] = 1;
    return si_gemm_each(nmat, types, w, rows, cols, x, ones, outs);
}

int si_gemm(int type, const void *w, int64_t rows, int cols, const float *x, int64_t T, float *out) {
    return run(1, &type, &w, &rows, cols, x, T, &out);
}

/* ------------------------------------------------------------------ sparse FFN (Q4_0 or int8 bundles) */

typedef struct {
    const uint8_t *bundles;
    size_t bundle_bytes;
    int gated, k, T, d_model, ga, ua, n_chunks;
    const int32_t *idx;
    const uint8_t *mask; /* NULL, or [T, k]: token t computes idx[i] where mask[t * k + i] */
    const float *bias;
    float *out;  /* [T, d_model] */
    float *part; /* up to SPARSE_BY_NEURON_T tokens: [n_chunks, T, d_model] partial sums, one
                  * per neuron range */
    const float *x; /* [T, d_model]: quantized into S.xq for Q4_0 bundles (and int8 ones with
                     * round_x); int8 bundles read it as is otherwise */
    /* int8 bundles (scales != NULL): their scales, nbk per row of `block` weights; round_x:
     * x rounded to int8 per 32 into S.xq too (integer dot products; block a multiple of 32) */
    const float *scales;
    int nbk, block, round_x;
    const float *gv; /* int8 bundles, gated, one token: idx[i]'s activated gate given (not 0),
                      * only its up and down rows read (si_sparse_i8_q4g); else NULL */
    const uint8_t *gq; /* int8 bundles with a ReLU gate: the gates' q4 rows apart (gstride
                        * bytes apart), read instead of the bundles' int8 gate rows; or NULL */
    size_t gstride;
    int q4u; /* int8 bundles of q4 ups (with gq or gv; scales NULL): si_q4u_bytes' layout */
    int cut[MAX_THREADS + 1]; /* neuron ranges (positions in idx): range c is cut[c]..cut[c+1] */
} sparse_job_t;

static struct {
    float *p;
    size_t cap;
} SP;

/* neurons idx[i0..i0 + k) for tokens t0..t0 + T into o */
static void sparse_part(const sparse_job_t *j, int i0, int k, int t0, int T, float *o) {
    memset(o, 0, sizeof(float) * j->d_model * (size_t)T);
    const int32_t *idx = j->idx + i0;
    const uint8_t *mask = j->mask ? j->mask + (size_t)t0 * j->k + i0 : NULL;
    if (j->gv)
        g_sparse_i8_ups((const int8_t *)j->bundles, j->bundle_bytes, j->scales, j->nbk, j->block,
                        j->q4u, idx, j->gv + i0, k, j->x, j->round_x ? S.xq : NULL, j->d_model,
                        j->ua, o);
    else if (j->scales || j->q4u)
        g_sparse_i8((const int8_t *)j->bundles, j->bundle_bytes, j->scales, j->nbk, j->block,
                    j->gated, idx, k, mask, (size_t)j->k, j->x + (size_t)t0 * j->d_model,
                    j->round_x ? S.xq + t0 : NULL, T, j->d_model, j->ga, j->ua, j->bias, o, j->gq,
                    j->gstride, j->q4u);
    else
        g_sparse(j->bundles, j->bundle_bytes, j->gated, idx, k, mask, (size_t)j->k, S.xq + t0, T,
                 j->d_model, j->ga, j->ua, j->bias, o);
}

/* Up to this many tokens a call splits its neurons between the threads (each neuron's rows read
 * once for all the tokens, into per-chunk partial sums); more, its tokens, in ranges of whole
 * passes of the kernels (SPARSE_TOKENS in kernels.c, the batched int8 pass's 8). Split by tokens,
 * every thread reads every row: a continuous-batching step with a newcomer's prompt rows (9-64)
 * took longer that way, a prompt chunk of 64 rows about as long (benchmarks/RESULTS.md,
 * session 42). */
#define SPARSE_BY_NEURON_T 64
#define SPARSE_TOKEN_RANGE 16

/* The whole passes of SPARSE_TOKEN_RANGE tokens (the last one maybe short) in T tokens. */
static int token_passes(int T) { return (T + SPARSE_TOKEN_RANGE - 1) / SPARSE_TOKEN_RANGE; }

static void sparse_chunk(const void *jp, int64_t c) {
    const sparse_job_t *j = jp;
    if (j->T <= SPARSE_BY_NEURON_T) { /* neuron range c of every token, into its partial sums */
        const int i0 = j->cut[c], i1 = j->cut[c + 1];
        sparse_part(j, i0, i1 - i0, 0, j->T,
                    j->n_chunks == 1 ? j->out : j->part + c * (size_t)j->T * j->d_model);
    } else { /* token range c (whole passes), every neuron */
        const int64_t passes = token_passes(j->T);
        const int t0 = (int)(c * passes / j->n_chunks) * SPARSE_TOKEN_RANGE;
        const int t1 = (int)((c + 1) * passes / j->n_chunks) * SPARSE_TOKEN_RANGE;
        if (t0 < j->T)
            sparse_part(j, 0, j->k, t0, (t1 < j->T ? t1 : j->T) - t0,
                        j->out + (size_t)t0 * j->d_model);
    }
}

/* The neuron ranges a call over k neurons is split in: one per thread, at least 32 neurons each.
 * Every range starts with its first bundles not fetched ahead and adds a partial sum; four a
 * thread, for the pool's balancing, were 2-13% slower on a quiet machine and no better beside a
 * busy process (benchmarks/RESULTS.md, `ab_kernels.py`). */
static int sparse_ranges(int k) {
    const int nt = P.n_workers + 1, n = (k + 31) / 32;
    return n < 1 ? 1 : n > nt ? nt : n;
}

/* Scratch of sparse_cuts: each neuron's work in a masked call. */
static struct {
    int32_t *n;
    size_t cap;
} SC;

/* Cut job j's k neurons into its n_chunks ranges: of equal length for one token (or no mask),
 * else of about equal work — a neuron's: the tokens taking it plus two for reading its rows,
 * none when no token does (the mask counted row by row, contiguous): hot-first sets put the
 * neurons most tokens take first, and ranges of equal length left the thread with the first one
 * working while the other waited. 0, or ENOMEM. */
static int sparse_cuts(sparse_job_t *j) {
    const int n = j->n_chunks, k = j->k;
    if (!j->mask || j->T == 1 || n == 1) {
        for (int c = 0; c <= n; c++) j->cut[c] = (int)((int64_t)c * k / n);
        return 0;
    }
    if (grow((void **)&SC.n, &SC.cap, sizeof(int32_t) * (size_t)k)) return ENOMEM;
    int32_t *work = SC.n;
    memset(work, 0, sizeof(int32_t) * (size_t)k);
    for (int t = 0; t < j->T; t++) {
        const uint8_t *m = j->mask + (size_t)t * k;
        for (int i = 0; i < k; i++) work[i] += m[i] != 0;
    }
    int64_t total = 0;
    for (int i = 0; i < k; i++) total += work[i] = work[i] ? work[i] + 2 : 0;
    j->cut[0] = 0;
    int c = 1;
    int64_t run = 0;
    for (int i = 0; i < k && c < n; i++) {
        run += work[i];
        while (c < n && run * n >= total * c) j->cut[c++] = i + 1;
    }
    while (c < n) j->cut[c++] = k;
    j->cut[n] = k;
    return 0;
}

/* Split job j over the pool (up to SPARSE_BY_NEURON_T tokens: neuron ranges (sparse_ranges)
 * into partial sums, added at the end; else token ranges), after quantizing x for Q4_0 bundles;
 * the caller holds the call lock. */
static int sparse_run_locked(sparse_job_t *j) {
    const int nt = P.n_workers + 1;
    if (j->T <= SPARSE_BY_NEURON_T) {
        j->n_chunks = sparse_ranges(j->k);
        if (sparse_cuts(j)) return ENOMEM;
    } else {
        const int passes = token_passes(j->T);
        j->n_chunks = passes < 4 * nt ? passes : 4 * nt;
    }
    int err = !j->scales && !j->q4u ? quantize_rows(j->x, j->T, j->d_model, 1, 1, 0)
              : j->round_x ? quantize_rows(j->x, j->T, j->d_model, 1, j->gq || j->q4u, 0) : 0;
    const size_t dt = (size_t)j->T * j->d_model; /* one chunk's partial sums */
    if (!err && j->T <= SPARSE_BY_NEURON_T && j->n_chunks > 1) {
        const size_t need = (size_t)j->n_chunks * dt;
        if (need > SP.cap) {
            free(SP.p);
            SP.p = aligned_alloc(64, (need * sizeof(float) + 63) / 64 * 64);
            SP.cap = SP.p ? need : 0;
            if (!SP.p) err = ENOMEM;
        }
        j->part = SP.p;
    }
    if (!err) {
        pool_run(sparse_chunk, j, j->n_chunks);
        if (j->T <= SPARSE_BY_NEURON_T && j->n_chunks > 1) {
            for (size_t e = 0; e < dt; e++) {
                float acc = 0.0f;
                for (int c = 0; c < j->n_chunks; c++) acc += j->part[(size_t)c * dt + e];
                j->out[e] = acc;
            }
        }
    }
    return err;
}

/* sparse_run_locked under the call lock. */
static int sparse_run(sparse_job_t *j) {
    pthread_mutex_lock(&g_call_lock);
    const int err = sparse_run_locked(j);
    pthread_mutex_unlock(&g_call_lock);
    return err;
}

/* The arguments both sparse calls check: d_model a multiple of `mult`, activation codes, indices
 * in range. */
static int sparse_args(int d_model, int mult, int T, int k, int ga, int ua, const int32_t *idx,
                       int d_ff) {
    if (g_isa < 0) return ENODEV;
    if (d_model <= 0 || d_model % mult || T < 1 || k < 0 || ga < 0 || ga > 4 || ua < 0 || ua > 4)
        return EINVAL;
    for (int i = 0; i < k; i++)
        if (idx[i] < 0 || idx[i] >= d_ff) return ERANGE;
    return 0;
}

/* out[t] = sum_{i in idx} h_i(x[t]) * down_i for T tokens x [T, d_model] (see kernels.c); with
 * mask (uint8 [T, k], else NULL) the sum takes only the idx[i] where mask[t * k + i] != 0. */
int si_sparse_q4(const void *bundles, size_t bundle_bytes, int gated, const int32_t *idx, int k,
                 const uint8_t *mask, int d_ff, const float *x, int T, int d_model, int ga, int ua,
                 const float *bias, float *out) {
    const int err = sparse_args(d_model, 32, T, k, ga, ua, idx, d_ff);
    if (err) return err;
    sparse_job_t j = {bundles, bundle_bytes, gated ? 1 : 0, k, T, d_model, ga, ua, 1, idx, mask,
                      bias, out, NULL, x, NULL, 0, 0, 0};
    return sparse_run(&j);
}

/* z[i] = gate_{idx[i]} . x for one token x [d_model] (the raw gate dot products of Q4_0 bundles,
 * bundle_bytes apart, gate row first: see kernels.c), by si_sparse_q4's ReLU-gate arithmetic on
 * x quantized as it quantizes it. Neuron ranges over the pool (one per 64 neurons, up to 4 per
 * thread, each a multiple of 8 long): each z[i] is the same whatever the range it falls in. */
typedef struct {
    const uint8_t *bundles;
    size_t bundle_bytes;
    const int32_t *idx;
    int k, d_model, ch;
    float *z;
} gates_job_t;

static void gates_chunk(const void *jp, int64_t c) {
    const gates_job_t *j = jp;
    const int i0 = (int)c * j->ch, n = j->k - i0 < j->ch ? j->k - i0 : j->ch;
    g_gates(j->bundles, j->bundle_bytes, j->idx + i0, n, S.xq, j->d_model, j->z + i0);
}

/* The gate pass over the pool (k > 0), x already in S.xq; the caller holds the call lock. */
static void gates_pass(const void *bundles, size_t bundle_bytes, const int32_t *idx, int k,
                       int d_model, float *z) {
    const int nt = P.n_workers + 1;
    int n = (k + 63) / 64;
    n = n > 4 * nt ? 4 * nt : n;
    gates_job_t j = {bundles, bundle_bytes, idx, k, d_model, ((k + n - 1) / n + 7) / 8 * 8, z};
    pool_run(gates_chunk, &j, (k + j.ch - 1) / j.ch);
}

int si_sparse_q4_gates(const void *bundles, size_t bundle_bytes, const int32_t *idx, int k,
                       int d_ff, const float *x, int d_model, float *z) {
    const int err = sparse_args(d_model, 32, 1, k, 0, 0, idx, d_ff);
    if (err) return err;
    if (bundle_bytes < (size_t)d_model / 32 * 18) return EINVAL; /* rows would overlap */
    if (k == 0) return 0;
    pthread_mutex_lock(&g_call_lock);
    int e = quantize_rows(x, 1, d_model, 1, 1, 0); /* as sparse_run's, so the same x */
    if (!e) gates_pass(bundles, bundle_bytes, idx, k, d_model, z);
    pthread_mutex_unlock(&g_call_lock);
    return e;
}

/* Whether int8 bundles of n_mats rows with scales per block (x rounded or not), a ReLU gate's
 * rows possibly apart as q4 rows (gates, gate_stride bytes apart), the up rows possibly q4 rows
 * (q4u: one bundle a neuron, n_mats 1), are not what si_sparse_i8 takes (d_model's own multiple
 * aside: sparse_args). */
static int i8_bundles_bad(int d_model, int block, int round_x, int gated, int ga, int n_mats,
                          const void *gates, size_t gate_stride, int q4u) {
    if (block <= 0 || block % (round_x ? 32 : 8) || block > d_model) return 1;
    if ((gates || q4u) && (!gates || !gated || ga != SI_ACT_RELU || !round_x ||
                           gate_stride < (size_t)d_model / 32 * 18))
        return 1;
    if (q4u) return n_mats != 1;
    return n_mats != (gated && !gates ? 3 : 2) && !(gates && n_mats == 3);
}

/* Bytes from one neuron's int8 bundle to the next: n_mats rows, or a bundle of q4 ups. */
static size_t i8_bundle_bytes(int d_model, int block, int n_mats, int q4u) {
    return q4u ? si_q4u_bytes(d_model, block) : (size_t)n_mats * d_model;
}

/* si_sparse_q4 over int8 bundles (PackedFFN dtype "int8"): rows int8 [d_ff, n_mats, d_model],
 * scales float32 [d_ff, n_mats, nbk] per block of `block` weights (a multiple of 8, as d_model);
 * x float32 [T, d_model], as is (round_x 0) or rounded to int8 per 32 for the gate/up dot
 * products (round_x 1: block and d_model multiples of 32). gates (or NULL): a ReLU gate's rows
 * apart as q4 rows (d_ff of them, gate_stride bytes apart; needs round_x): the gates are their
 * products (as si_sparse_q4_gates computes them) and a bundle's int8 rows read are its up and
 * down rows only, its last two (n_mats 2: the bundles hold no gate row; 3: it is skipped).
 * q4_ups (with gates; PackedFFN dtype "q4i8"): scales NULL, n_mats 1, each neuron's bundle
 * si_q4u_bytes long — its down row's scales, its up row as a q4 row (products by the gates'
 * arithmetic), its int8 down row. */
int si_sparse_i8(const void *rows, const float *scales, int block, int gated, int n_mats,
                 const int32_t *idx, int k, const uint8_t *mask, int d_ff, const float *x,
                 int round_x, int T, int d_model, int ga, int ua, const float *bias, float *out,
                 const void *gates, size_t gate_stride, int q4_ups) {
    const int err = sparse_args(d_model, round_x ? 32 : 8, T, k, ga, ua, idx, d_ff);
    if (err) return err;
    if (i8_bundles_bad(d_model, block, round_x, gated, ga, n_mats, gates, gate_stride, q4_ups) ||
        !q4_ups != !!scales)
        return EINVAL;
    sparse_job_t j = {rows, i8_bundle_bytes(d_model, block, n_mats, q4_ups), gated ? 1 : 0, k, T,
                      d_model, ga, ua, 1, idx, mask, bias, out, NULL, x, scales,
                      (d_model + block - 1) / block, block, round_x ? 1 : 0, NULL, gates,
                      gate_stride, q4_ups ? 1 : 0};
    return sparse_run(&j);
}

/* Gated int8 bundles (as si_sparse_i8's, ReLU gate; n_mats 2, up and down rows, or 3 with an
 * int8 gate row first that is not read) with their gates apart in q4 rows (gates: d_ff rows of
 * Q4_0's numbers, scales first, gate_stride bytes apart; see si_sparse_q4_gates), one token:
 * the gate dot products of idx's neurons over the q4 rows (si_sparse_q4_gates' arithmetic) on
 * the pool, then the up and down int8 rows of the neurons whose gate fired only
 * (si_sparse_i8_ups), their ranges on the pool. out = sum over the fired of
 * relu(z_i) act(ua, up_i . x) down_i, x as si_sparse_i8 takes it (round_x). q4_ups: bundles of
 * q4 ups as si_sparse_i8's (n_mats 1, scales NULL, x rounded). */
static struct {
    float *z, *g;
    int32_t *nid;
    int cap;
} GQ;

/* si_sparse_i8_q4g's work (k > 0, out zeroed), the caller holding g_call_lock. */
static int i8_q4g_locked(const void *rows, const float *scales, int block, int n_mats, int q4u,
                         const void *gates, size_t gate_stride, const int32_t *idx, int k,
                         const float *x, int round_x, int d_model, int ua, float *out) {
    int e = 0;
    if (k > GQ.cap) {
        free(GQ.z), free(GQ.g), free(GQ.nid);
        GQ.z = malloc(sizeof(float) * (size_t)k), GQ.g = malloc(sizeof(float) * (size_t)k);
        GQ.nid = malloc(sizeof(int32_t) * (size_t)k);
        GQ.cap = GQ.z && GQ.g && GQ.nid ? k : 0;
        if (!GQ.cap) e = ENOMEM;
    }
    if (!e) e = quantize_rows(x, 1, d_model, 1, 1, 0); /* as si_sparse_q4_gates' */
    int m = 0;
    if (!e) {
        gates_pass(gates, gate_stride, idx, k, d_model, GQ.z);
        for (int i = 0; i < k; i++)
            if (GQ.z[i] > 0.0f) GQ.nid[m] = idx[i], GQ.g[m++] = GQ.z[i];
        phase_end(PH_GATES); /* (a block's call being timed) */
    }
    if (!e && m) {
        sparse_job_t j = {rows, i8_bundle_bytes(d_model, block, n_mats, q4u), 1, m, 1, d_model,
                          SI_ACT_RELU, ua, 1, GQ.nid, NULL, NULL, out, NULL, x, scales,
                          (d_model + block - 1) / block, block, round_x ? 1 : 0, GQ.g, NULL, 0,
                          q4u ? 1 : 0};
        e = sparse_run_locked(&j); /* (x quantized again, as si_sparse_i8 takes it) */
    }
    return e;
}

int si_sparse_i8_q4g(const void *rows, const float *scales, int block, int n_mats,
                     const void *gates, size_t gate_stride, const int32_t *idx, int k, int d_ff,
                     const float *x, int round_x, int d_model, int ua, float *out, int q4_ups) {
    const int err = sparse_args(d_model, 32, 1, k, SI_ACT_RELU, ua, idx, d_ff);
    if (err) return err;
    if (block <= 0 || block % (round_x ? 32 : 8) || block > d_model) return EINVAL;
    if (gate_stride < (size_t)d_model / 32 * 18) return EINVAL; /* rows would overlap */
    if (q4_ups ? n_mats != 1 || scales || !round_x : (n_mats != 2 && n_mats != 3) || !scales)
        return EINVAL;
    memset(out, 0, sizeof(float) * (size_t)d_model);
    if (k == 0) return 0;
    pthread_mutex_lock(&g_call_lock);
    const int e = i8_q4g_locked(rows, scales, block, n_mats, q4_ups, gates, gate_stride, idx, k,
                                x, round_x, d_model, ua, out);
    pthread_mutex_unlock(&g_call_lock);
    return e;
}

/* ------------------------------------------------------------------ predictor (F16 weights) */

/* The neurons a predictor selects: idx[0..*k) = ascending i with
 * (fc2 · relu(fc1 · x))_i >= thr[i]; fc1 F16 [r, d_model], fc2 F16 [d_ff, r] (r and d_model
 * multiples of 32), x float32 [d_model]; hidden [r] and logits [d_ff] are scratch. Two pool
 * dispatches (the same pool as the FFN rows: no second thread team to wake). */
/* logits [T, d_ff] = fc2 · relu(fc1 · x) for T rows of x (hidden [T, r] scratch; T = 1 a GEMV,
 * more a GEMM whose every row is that GEMV bit for bit); the caller holds g_call_lock. */
static int predict_logits(const void *fc1, const void *fc2, int r, int d_model, int d_ff,
                          const float *x, int T, float *hidden, float *logits) {
    const int t = SI_F16;
    int64_t rows = r;
    int err = run_locked(1, &t, &fc1, &rows, d_model, x, T, &hidden);
    if (err) return err;
    for (size_t i = 0; i < (size_t)T * r; i++) hidden[i] = hidden[i] > 0.0f ? hidden[i] : 0.0f;
    rows = d_ff;
    return run_locked(1, &t, &fc2, &rows, r, hidden, T, &logits);
}

/* idx[0..return) = ascending i with logits[i] >= thr[i] */
static int select_neurons(const float *logits, const float *thr, int d_ff, int32_t *idx) {
    int n = 0;
    for (int i = 0; i < d_ff; i++) {
        idx[n] = i;
        n += logits[i] >= thr[i];
    }
    return n;
}

/* mask[t * d_ff + i] = logits[t * d_ff + i] >= thr[i] for T rows (si_predict_f16's rule), each
 * row's neurons also set in taken (or NULL); returns how many are set over all rows. */
static int64_t select_rows(const float *logits, const float *thr, int T, int d_ff, uint8_t *mask,
                           uint8_t *taken) {
    int64_t n = 0;
    for (int t = 0; t < T; t++) {
        const float *z = logits + (size_t)t * d_ff;
        uint8_t *m = mask + (size_t)t * d_ff;
        int c = 0;
        for (int i = 0; i < d_ff; i++) {
            m[i] = z[i] >= thr[i];
            c += m[i];
        }
        n += c;
        if (taken)
            for (int i = 0; i < d_ff; i++) taken[i] |= m[i];
    }
    return n;
}

int si_predict_f16(const void *fc1, const void *fc2, int r, int d_model, int d_ff, const float *x,
                   const float *thr, float *hidden, float *logits, int32_t *idx, int *k) {
    pthread_mutex_lock(&g_call_lock);
    const int err = predict_logits(fc1, fc2, r, d_model, d_ff, x, 1, hidden, logits);
    pthread_mutex_unlock(&g_call_lock);
    if (err) return err;
    *k = select_neurons(logits, thr, d_ff, idx);
    return 0;
}

/* The same for T tokens x [T, d_model]: mask[t * d_ff + i] = 1 where token t selects neuron i
 * (hidden [T, r] and logits [T, d_ff] scratch): a token selects what si_predict_f16 selects for
 * it alone. */
int si_predict_f16_rows(const void *fc1, const void *fc2, int r, int d_model, int d_ff,
                        const float *x, int T, const float *thr, float *hidden, float *logits,
                        uint8_t *mask) {
    pthread_mutex_lock(&g_call_lock);
    const int err = predict_logits(fc1, fc2, r, d_model, d_ff, x, T, hidden, logits);
    pthread_mutex_unlock(&g_call_lock);
    if (err) return err;
    select_rows(logits, thr, T, d_ff, mask, NULL);
    return 0;
}

/* ------------------------------------------------------------------ llama block, one token per row */

/* A block decodes one token of each of B sequences per call (B = 1: si_block_decode; B > 1:
 * si_block_decode_rows, continuous batching). Each weight is read once per call: one row takes
 * the prebuilt GEMV jobs, several rows a GEMM over all of them (every GEMM row is its GEMV bit for
 * bit, so a sequence's numbers do not depend on the batch). */
typedef struct {
    si_block_desc d;
    int nt;                 /* the thread count the one-row jobs were chunked for */
    unsigned gen;           /* the scratch generation they write into */
    job_t jobs[4];          /* one row: qkv, wo, w_in, down */
    size_t nq, na, nf;      /* per-row sizes: q/k/v, attention out, w_in out */
    /* the current call's views of the shared scratch (R) */
    float *x; /* the residual streams [B, d_model] */
    float *h, *qkv, *att, *a, *f, *act, *scores;
    uint8_t **kc, **vc;     /* per row: this layer's cache of the row's sequence */
    int kv16;               /* the caches hold float16 (else float32) */
    const float **cs, **sn; /* per row: rope rows */
    int *pos, *start, *n;
    int max_seq;
    float scale;
} block_t;

/* Scratch shared by every block (calls are serialised by g_call_lock): activations of B rows,
 * per-row pointers, attention scores. gen changes when buf moves (the one-row jobs point into it). */
static struct {
    float *buf, *scores;
    void *rows;
    size_t cap, rows_cap, scores_cap;
    unsigned gen;
} R;

static int64_t linear_rows(const si_linear *l) {
    int64_t r = 0;
    for (int i = 0; i < l->n; i++) r += l->rows[i];
    return r;
}

/* weight k (0..3: qkv, wo, w_in, down) of a block and its input width */
static const si_linear *block_linear(const si_block_desc *d, int k) {
    const si_linear *ls[4] = {&d->qkv, &d->wo, &d->w_in, &d->down};
    return ls[k];
}

static int block_cols(const si_block_desc *d, int k) {
    const int cols[4] = {d->d_model, d->n_heads * d->head_dim, d->d_model, d->d_ff};
    return cols[k];
}

/* weight k's output for row 0 (row t: + t * its total rows) */
static float *block_out(const block_t *b, int k) {
    float *outs[4] = {b->qkv, b->a, b->f, b->a};
    return outs[k];
}

static int block_jobs(block_t *b) {
    /* (a sparse FFN, or attention only: no w_in, down) */
    for (int k = 0; k < (b->d.sparse.rows || !b->d.d_ff ? 2 : 4); k++) {
        const si_linear *l = block_linear(&b->d, k);
        float *o[SI_LINEAR_MATS];
        int64_t off = 0;
        for (int i = 0; i < l->n; i++) {
            o[i] = block_out(b, k) + off;
            off += l->rows[i];
        }
        int err = setup_job(&b->jobs[k], l->n, l->type, l->w, l->rows, block_cols(&b->d, k), 1, o);
        if (err) return err;
    }
    b->nt = P.n_workers + 1;
    return 0;
}

void si_block_free(void *p) {
    block_t *b = p;
    if (!b) return;
    free(b);
}

/* Point b's views into the shared scratch for B rows of max_seq positions (growing it); the
 * one-row jobs are rebuilt when the scratch moved or the thread count changed. */
static int block_scratch(block_t *b, int B, int max_seq) {
    const size_t D = (size_t)b->d.d_model;
    const size_t per_row = 3 * D + b->nq + b->na + b->nf + (size_t)b->d.d_ff;
    float *old = R.buf;
    int err = grow((void **)&R.buf, &R.cap, (size_t)B * per_row * sizeof(float));
    if (!err) err = grow(&R.rows, &R.rows_cap, (size_t)B * (4 * sizeof(void *) + 3 * sizeof(int)));
    if (!err) err = grow((void **)&R.scores, &R.scores_cap,
                         (size_t)B * b->d.n_heads * max_seq * sizeof(float));
    if (err) return err;
    if (R.buf != old) R.gen++;
    b->h = R.buf;
    b->qkv = b->h + B * D;
    b->att = b->qkv + B * b->nq;
    b->a = b->att + B * b->na;
    b->f = b->a + B * D;
    b->act = b->f + B * b->nf;
    b->scores = R.scores;
    b->kc = R.rows;
    b->vc = b->kc + B;
    b->cs = (const float **)(b->vc + B);
    b->sn = b->cs + B;
    b->pos = (int *)(b->sn + B);
    b->start = b->pos + B;
    b->n = b->start + B;
    if (B == 1 && (b->gen != R.gen || b->nt != P.n_workers + 1)) {
        if ((err = block_jobs(b))) return err;
        b->gen = R.gen;
    }
    return 0;
}

/* Whether a block's sparse FFN (d->sparse) is not one the kernels take (as si_sparse_i8 /
 * si_sparse_q4 and si_predict_f16 check their arguments). */
static int sparse_ffn_bad(const si_block_desc *d) {
    const si_sparse_ffn *s = &d->sparse;
    const int D = d->d_model;
    if (D % 32) return 1;
    if (s->scales || s->q4_ups
            ? i8_bundles_bad(D, s->block, s->round_x, d->gated, d->gate_act, s->n_mats, s->gates,
                             s->gate_stride, s->q4_ups) || (s->q4_ups && s->scales)
            : s->gates || s->n_mats != (d->gated ? 3 : 2)) /* q4 bundles */
        return 1;
    if (s->fc1 && (!s->fc2 || !s->thr || s->rank <= 0 || s->rank % 32)) return 1;
    return 0;
}

/* A block for si_block_decode(_rows) from its description (pointers are kept, not copied: the
 * weights and norms must outlive the block). Returns NULL and sets *err (EINVAL, ENOMEM, ENODEV). */
void *si_block_new(const si_block_desc *desc, int *err) {
    const si_block_desc *d = desc;
    *err = EINVAL;
    /* d_ff 0, no FFN matrices: attention only (the caller computes the FFN: a mixture of experts) */
    const int attn_only = d->d_ff == 0 && !d->sparse.rows && !d->w_in.n && !d->down.n &&
                          !d->ffn_post_norm;
    if (d->d_model <= 0 || d->n_heads <= 0 || d->n_kv_heads <= 0 || d->head_dim <= 0 ||
        d->head_dim % 2 || d->n_heads % d->n_kv_heads || (d->d_ff <= 0 && !attn_only) ||
        !d->attn_norm ||
        !d->ffn_norm || d->gate_act < 0 || d->gate_act > 4 || d->up_act < 0 || d->up_act > 4 ||
        d->window < 0 || !(d->scale >= 0.0f) || !(d->softcap >= 0.0f) || isinf(d->softcap) ||
        !(d->residual >= 0.0f) || isinf(d->residual))
        return NULL;
    const int64_t qkv_rows = (int64_t)(d->n_heads + 2 * d->n_kv_heads) * d->head_dim;
    const int sparse = d->sparse.rows != NULL;
    /* (with a sparse FFN: its dense copy) */
    const int dense = !attn_only && (!sparse || d->w_in.n || d->down.n);
    if (linear_rows(&d->qkv) != qkv_rows || linear_rows(&d->wo) != d->d_model ||
        (dense && (linear_rows(&d->w_in) != (int64_t)(d->gated ? 2 : 1) * d->d_ff ||
                   linear_rows(&d->down) != d->d_model)) ||
        (sparse && ((!dense && d->w_in.bias) || sparse_ffn_bad(d))))
        return NULL;
    for (int k = 0; k < (dense ? 4 : 2); k++) {
        const si_linear *l = block_linear(d, k);
        if (l->n < 1 || l->n > SI_LINEAR_MATS) return NULL;
        for (int i = 0; i < l->n; i++)
            if (check_mat(l->type[i], l->rows[i], block_cols(d, k))) return NULL;
    }
    if (g_isa < 0) {
        *err = ENODEV;
        return NULL;
    }
    block_t *b = calloc(1, sizeof(block_t));
    if (!b) {
        *err = ENOMEM;
        return NULL;
    }
    b->d = *d;
    b->nq = (size_t)qkv_rows;
    b->na = (size_t)d->n_heads * d->head_dim;
    b->nf = (size_t)(d->gated ? 2 : 1) * d->d_ff;
    b->nt = -1; /* jobs built on the first call */
    *err = 0;
    return b;
}

/* n floats as float16, rounded to nearest even (as torch's .half()). */
__attribute__((target("avx,f16c"))) static void to_f16(const float *x, uint16_t *out, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(out + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    for (; i < n; i++) out[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

/* Attention work (positions x query heads x head dim, summed over rows) from which the heads run
 * on the pool; less is cheaper on the calling thread than waking the pool. */
#define ATTEND_POOL_WORK 16384

/* Bytes per KV cache value: float16 (kv16) or float32. */
static inline size_t kv_size(int kv16) { return kv16 ? 2 : 4; }

/* Query heads h0 .. h0 + group - 1 of q (hd values each) against one kv head's keys/values at
 * kc/vc (n positions; float16 when kv16, else float32), by this ISA's si_attend_group(16): head
 * h's scores (n floats of scratch) at scores + h * sstride, its output at out + h * hd. */
static void attend_group(int kv16, const float *q, const uint8_t *kc, const uint8_t *vc, int n,
                         int hd, float scale, float cap, int h0, int group, float *scores,
                         size_t sstride, float *out) {
    q += (size_t)h0 * hd, scores += h0 * sstride, out += (size_t)h0 * hd;
    if (kv16)
        g_attend16(q, (const uint16_t *)kc, (const uint16_t *)vc, n, hd, scale, cap, group, scores,
                   sstride, out);
    else
        g_attend(q, (const float *)kc, (const float *)vc, n, hd, scale, cap, group, scores,
                 sstride, out);
}

/* Rope on n heads of hd values at v (rotate-half pairs, or adjacent ones when interleaved), with
 * the rope row cos/sin [hd] of the position. */
static void rope_heads(float *v, int n, int hd, int interleaved, const float *cos, const float *sin) {
    const int half = hd / 2;
    for (int h = 0; h < n; h++, v += hd)
        for (int j = 0; j < half; j++) {
            const int i0 = interleaved ? 2 * j : j, i1 = interleaved ? 2 * j + 1 : half + j;
            const float a0 = v[i0], a1 = v[i1];
            v[i0] = a0 * cos[j] - a1 * sin[j];
            v[i1] = a1 * cos[half + j] + a0 * sin[half + j];
        }
}

/* qkv's key and value heads (after nh query heads) into caches kc/vc [nkv, max_seq, hd] at pos:
 * float32, or float16 (to_f16) when kv16. */
static void write_kv(const float *qkv, int nh, int nkv, int hd, uint8_t *kc, uint8_t *vc, int kv16,
                     int pos, int max_seq) {
    for (int g = 0; g < nkv; g++) {
        const size_t at = ((size_t)g * max_seq + pos) * hd;
        const float *k = qkv + (size_t)(nh + g) * hd, *v = qkv + (size_t)(nh + nkv + g) * hd;
        if (kv16) {
            to_f16(k, (uint16_t *)kc + at, hd);
            to_f16(v, (uint16_t *)vc + at, hd);
        } else {
            memcpy((float *)kc + at, k, hd * sizeof(float));
            memcpy((float *)vc + at, v, hd * sizeof(float));
        }
    }
}

/* out = rmsnorm(x) * w (sums in double, as the torch reference's float32 mean is close to; 8
 * partial sums, so the adds do not wait on each other) */
static void rms_norm(const float *x, const float *w, int n, float eps, float *out) {
    double p[8] = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) p[j] += (double)x[i + j] * x[i + j];
    for (; i < n; i++) p[0] += (double)x[i] * x[i];
    const double ss = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
    const float r = (float)(1.0 / sqrt(ss / n + eps));
    for (i = 0; i < n; i++) out[i] = x[i] * r * w[i];
}

/* chunk c: row c / n_kv_heads, the query heads of its kv head c % n_kv_heads one after the
 * other (their keys and values stay in this core's cache for the next head) */
static void attend_chunk(const void *jp, int64_t c) {
    const block_t *b = jp;
    const int nh = b->d.n_heads, nkv = b->d.n_kv_heads, hd = b->d.head_dim, group = nh / nkv;
    const int t = (int)(c / nkv), g = (int)(c % nkv);
    const size_t kv = ((size_t)g * b->max_seq + b->start[t]) * hd * kv_size(b->kv16); /* bytes */
    attend_group(b->kv16, b->qkv + t * b->nq, b->kc[t] + kv, b->vc[t] + kv, b->n[t], hd, b->scale,
                 b->d.softcap, g * group, group, b->scores + (size_t)t * nh * b->max_seq,
                 b->max_seq, b->att + t * b->na);
}

static void add_bias(float *y, const float *bias, int64_t n) {
    if (bias)
        for (int64_t i = 0; i < n; i++) y[i] += bias[i];
}

/* x[t] += r * post_norm(b->a[t] + bias) for row t (bias, post_norm: NULL when not used; r the
 * residual multiplier, 1 unless set) */
static void add_residual(const block_t *b, int t, const float *bias, const float *post_norm) {
    const int D = b->d.d_model;
    float *a = b->a + (size_t)t * D, *xt = b->x + (size_t)t * D;
    add_bias(a, bias, D);
    if (post_norm) rms_norm(a, post_norm, D, b->d.eps, a);
    if (b->d.residual > 0.0f && b->d.residual != 1.0f) {
        const float r = b->d.residual;
        for (int i = 0; i < D; i++) xt[i] += r * a[i];
    } else {
        for (int i = 0; i < D; i++) xt[i] += a[i];
    }
}

/* The per-row steps of block_rows between its pool jobs (each_row's chunks: row t). */
static void row_attn_in(const void *jp, int64_t t) { /* h[t] = rmsnorm(x[t]) */
    const block_t *b = jp;
    const int D = b->d.d_model;
    rms_norm(b->x + (size_t)t * D, b->d.attn_norm, D, b->d.eps, b->h + (size_t)t * D);
}
static void row_qkv_out(const void *jp, int64_t t) { /* bias, q/k norms, rope, into the cache */
    block_t *b = (block_t *)jp;
    const si_block_desc *d = &b->d;
    const int nh = d->n_heads, nkv = d->n_kv_heads, hd = d->head_dim, pos = b->pos[t];
    float *qkv = b->qkv + t * b->nq;
    add_bias(qkv, d->qkv.bias, (int64_t)b->nq);
    for (int h = 0; h < nh + nkv; h++) { /* q/k heads' norms, in place, before rope */
        const float *w = h < nh ? d->q_norm : d->k_norm;
        if (w) rms_norm(qkv + (size_t)h * hd, w, hd, d->eps, qkv + (size_t)h * hd);
    }
    rope_heads(qkv, nh + nkv, hd, d->interleaved, b->cs[t], b->sn[t]);
    write_kv(qkv, nh, nkv, hd, b->kc[t], b->vc[t], b->kv16, pos, b->max_seq);
    b->start[t] = d->window > 0 && pos + 1 > d->window ? pos + 1 - d->window : 0;
    b->n[t] = pos + 1 - b->start[t];
}
static void row_ffn_in(const void *jp, int64_t t) { /* x[t] += wo's; h[t] = rmsnorm(x[t]) */
    const block_t *b = jp;
    const int D = b->d.d_model;
    add_residual(b, (int)t, b->d.wo.bias, b->d.attn_post_norm);
    rms_norm(b->x + (size_t)t * D, b->d.ffn_norm, D, b->d.eps, b->h + (size_t)t * D);
}
static void row_glu(const void *jp, int64_t t) { /* act[t] = glu(w_in's + bias) */
    const block_t *b = jp;
    const si_block_desc *d = &b->d;
    float *f = b->f + t * b->nf;
    if (d->gated) add_bias(f, d->w_in.bias, (int64_t)b->nf);
    g_glu(d->gated, d->gate_act, d->up_act, f, d->gated ? NULL : d->w_in.bias, d->d_ff,
          b->act + (size_t)t * d->d_ff);
}
static void row_ffn_out(const void *jp, int64_t t) { /* x[t] += down's */
    const block_t *b = jp;
    add_residual(b, (int)t, b->d.down.bias, b->d.ffn_post_norm);
}

/* Weight k over B rows of x (each cols wide) into its output buffer, row t at t * total rows:
 * the one-row GEMV job, or a GEMM whose matrices write their columns of each row in place. */
static int block_product(block_t *b, int k, int B, const float *x) {
    if (B == 1) return exec_job(&b->jobs[k], x);
    const si_linear *l = block_linear(&b->d, k);
    const int64_t total = linear_rows(l);
    float *dst = block_out(b, k), *o[SI_LINEAR_MATS];
    int64_t off = 0;
    for (int i = 0; i < l->n; i++) {
        o[i] = dst + off;
        off += l->rows[i];
    }
    job_t j;
    int err = setup_job(&j, l->n, l->type, l->w, l->rows, block_cols(&b->d, k), B, o);
    for (int i = 0; i < l->n; i++) j.ys[i] = total;
    return err ? err : exec_job(&j, x);
}

/* Scratch of a block's sparse FFN (calls are serialised by g_call_lock): the predictor's hidden
 * [B, rank] and logits [B, d_ff], the rows' masks [B, d_ff] and their columns of the union
 * [B, k], the union as a mask [d_ff] and as neurons [d_ff]. */
static struct {
    float *hidden, *logits;
    uint8_t *mask, *umask, *taken;
    int32_t *idx;
    size_t cap_h, cap_l, cap_m, cap_u, cap_t, cap_i;
} SF;

/* b->a[t] = the sparse FFN of row t's b->h[t] (the neurons its predictor selects; the caller
 * adds the output bias), as SparseFFN computes it one layer at a time: one row, the neurons
 * si_predict_f16 selects through si_sparse_i8 / si_sparse_q4 (sparse/kernels.py's call);
 * several rows, the mode's neurons (each row its own set as a mask over the union, as
 * si_predict_f16_rows gives them; the union for every row; or every neuron) in one call over
 * all rows. */
static int block_sparse_ffn(block_t *b, int B) {
    const si_block_desc *d = &b->d;
    const si_sparse_ffn *s = &d->sparse;
    const int D = d->d_model, F = d->d_ff, mode = B > 1 && s->mode ? *s->mode : 0;
    /* (mode 3 comes here only without a dense copy: block_rows; every neuron, as 2) */
    const size_t BF = (size_t)B * F;
    int err = grow((void **)&SF.idx, &SF.cap_i, sizeof(int32_t) * (size_t)F);
    if (!err && s->fc1 && mode < 2) {
        err = grow((void **)&SF.hidden, &SF.cap_h, sizeof(float) * (size_t)B * s->rank);
        if (!err) err = grow((void **)&SF.logits, &SF.cap_l, sizeof(float) * BF);
        if (!err && B > 1) err = grow((void **)&SF.mask, &SF.cap_m, BF);
        if (!err && B > 1) err = grow((void **)&SF.umask, &SF.cap_u, BF);
        if (!err && B > 1) err = grow((void **)&SF.taken, &SF.cap_t, (size_t)F);
    }
    if (err) return err;
    int32_t *idx = SF.idx;
    const uint8_t *mask = NULL;
    int k = F;
    int64_t active = (int64_t)B * F;
    if (s->fc1 && mode < 2) {
        err = predict_logits(s->fc1, s->fc2, s->rank, D, F, s->on_residual ? b->x : b->h, B,
                             SF.hidden, SF.logits);
        if (err) return err;
        if (B == 1) {
            k = select_neurons(SF.logits, s->thr, F, idx);
            active = k;
        } else {
            uint8_t *m = SF.mask, *taken = SF.taken;
            memset(taken, 0, (size_t)F);
            const int64_t own = select_rows(SF.logits, s->thr, B, F, m, taken);
            k = 0;
            for (int i = 0; i < F; i++) { /* the union */
                idx[k] = i;
                k += taken[i];
            }
            if (mode == 1) {
                active = (int64_t)k * B;
            } else {
                active = own;
                if (k == F) {
                    mask = m;
                } else { /* the rows' masks over the union's columns */
                    for (int t = 0; t < B; t++)
                        for (int i = 0; i < k; i++)
                            SF.umask[(size_t)t * k + i] = m[(size_t)t * F + idx[i]];
                    mask = SF.umask;
                }
            }
        }
    } else {
        for (int i = 0; i < F; i++) idx[i] = i;
    }
    if (s->fc1 && mode < 2) phase_end(PH_PREDICT);
    if (s->counts && mode < 2) s->counts[0] += B, s->counts[1] += active;
    if (k == 0) {
        memset(b->a, 0, sizeof(float) * (size_t)B * D);
        return 0;
    }
    if (s->gates && B == 1) { /* the gates over the q4 rows, then the fired neurons' rows */
        memset(b->a, 0, sizeof(float) * (size_t)D);
        return i8_q4g_locked(s->rows, s->scales, s->block, s->n_mats, s->q4_ups, s->gates,
                             s->gate_stride, idx, k, b->h, s->round_x, D, d->up_act, b->a);
    }
    const int i8 = s->scales || s->q4_ups; /* else q4 bundles */
    const int nbk = i8 ? (D + s->block - 1) / s->block : 0;
    const size_t bundle = i8 ? i8_bundle_bytes(D, s->block, s->n_mats, s->q4_ups)
                             : (size_t)s->n_mats * ((size_t)D / 32 * 18);
    sparse_job_t j = {s->rows, bundle, d->gated ? 1 : 0, k, B, D, d->gate_act, d->up_act, 1, idx,
                      mask, s->up_bias, b->a, NULL, b->h, s->scales, nbk, s->block,
                      i8 && s->round_x ? 1 : 0, NULL, s->gates, s->gate_stride,
                      s->q4_ups ? 1 : 0};
    return sparse_run_locked(&j);
}

/* One token of each of B rows through block b, x [B, d_model] the residual streams (updated in
 * place); row t at b->pos[t] with its own caches b->kc/vc[t] and rope rows b->cs/sn[t]:
 *   x += wo(attention(rope(qkv(rmsnorm(x)))));  x += down(glu(w_in(rmsnorm(x))))
 * (with the desc's optional q/k norms, post-norms, window and scale: see qgemv.h)
 * Pool dispatches: the four matrix products, the heads, and from ROWS_POOL_MIN rows (each_row)
 * the products' x rows' quantization and the per-row steps between them.
 * The caller holds g_call_lock, has called block_scratch(b, B, max_seq) and filled the rows. */
static int block_steps(block_t *b, float *x, int B, int max_seq) {
    const si_block_desc *d = &b->d;
    const int nh = d->n_heads, nkv = d->n_kv_heads, hd = d->head_dim;
    int err = 0;
    b->x = x;
    b->max_seq = max_seq;
    b->scale = d->scale > 0.0f ? d->scale : 1.0f / sqrtf((float)hd);
    /* attention */
    each_row(row_attn_in, b, B);
    if ((err = block_product(b, 0, B, b->h))) return err;
    phase_end(PH_ATTN_IN);
    each_row(row_qkv_out, b, B);
    size_t work = 0;
    for (int t = 0; t < B; t++) work += (size_t)b->n[t] * nh * hd;
    if (work >= ATTEND_POOL_WORK) {
        pool_run(attend_chunk, b, (int64_t)B * nkv); /* one kv head of one row per chunk */
    } else { /* a short context: less work than waking the pool */
        for (int c = 0; c < B * nkv; c++) attend_chunk(b, c);
    }
    phase_end(PH_ATTEND);
    if ((err = block_product(b, 1, B, b->att))) return err;
    phase_end(PH_WO);
    /* FFN */
    each_row(row_ffn_in, b, B);
    phase_end(PH_REST);
    if (!d->d_ff) return 0; /* attention only: the caller's FFN follows */
    if (d->sparse.rows && !(B > 1 && d->w_in.n && d->sparse.mode && *d->sparse.mode == 3)) {
        if ((err = block_sparse_ffn(b, B))) return err;
    } else {
        if ((err = block_product(b, 2, B, b->h))) return err;
        each_row(row_glu, b, B);
        if ((err = block_product(b, 3, B, b->act))) return err;
    }
    phase_end(PH_FFN);
    each_row(row_ffn_out, b, B);
    phase_end(PH_REST);
    return 0;
}

/* block_steps, timed by phase when si_set_block_timing asks. */
static int block_rows(block_t *b, float *x, int B, int max_seq) {
    phase_begin();
    const int err = block_steps(b, x, B, max_seq);
    g_timed = 0;
    return err;
}

/* One token through block b at position pos, x [d_model] the residual stream (updated in place).
 * kc/vc: this layer's caches [n_kv_heads, max_seq, head_dim] (the new key/value written at pos),
 * float32, or float16 when kv16; cos/sin: the rope row of pos [head_dim] (rotate-half tables;
 * adjacent pairs when interleaved). */
int si_block_decode(void *p, float *x, int pos, void *kc, void *vc, int kv16, const float *cos,
                    const float *sin, int max_seq) {
    block_t *b = p;
    if (pos < 0 || pos >= max_seq) return ERANGE;
    pthread_mutex_lock(&g_call_lock);
    int err = block_scratch(b, 1, max_seq);
    if (!err) {
        b->kv16 = kv16 != 0;
        b->pos[0] = pos;
        b->kc[0] = kc;
        b->vc[0] = vc;
        b->cs[0] = cos;
        b->sn[0] = sin;
        err = block_rows(b, x, 1, max_seq);
    }
    pthread_mutex_unlock(&g_call_lock);
    return err;
}

/* One token's query heads against one layer's caches (si_attend_token): chunk g = kv head g's
 * query heads one after the other, as attend_chunk, each with its own row of scores. */
typedef struct {
    const float *q;
    const uint8_t *kc, *vc;
    int kv16, n, hd, group, max_seq;
    float scale;
    float *scores, *out;
    size_t sstride; /* floats between the heads' rows of scores (at least n) */
} token_attend_job;

static void token_attend_chunk(const void *jp, int64_t g) {
    const token_attend_job *j = jp;
    const size_t kv = (size_t)g * j->max_seq * j->hd * kv_size(j->kv16); /* bytes */
    attend_group(j->kv16, j->q, j->kc + kv, j->vc + kv, j->n, j->hd, j->scale, 0.0f,
                 (int)g * j->group, j->group, j->scores, j->sstride, j->out);
}

/* chunk c of several rows' jobs (si_attend_rows): row c / nkv, kv head c % nkv */
typedef struct {
    const token_attend_job *rows;
    int nkv;
} rows_attend_job;

static void rows_attend_chunk(const void *jp, int64_t c) {
    const rows_attend_job *j = jp;
    token_attend_chunk(&j->rows[c / j->nkv], c % j->nkv);
}

/* ------------------------------------------------------------------ a read probe (benchmarks) */

/* What the memory gives for the sparse kernels' access pattern with no arithmetic: bytes
 * [0, nbytes) of rows idx[0..k) of buf (stride bytes apart) read the way si_sparse_q4 walks its
 * bundles (the neuron ranges of sparse_ranges over the pool, 4 rows at a time, the next 4
 * rows fetched into L2 a line per line read meanwhile), their 64-bit words summed (wrapping)
 * into *sum, which a caller can check. benchmarks/kernels.py times it beside each kernel. */
typedef struct {
    const uint8_t *buf;
    size_t stride, words;
    const int32_t *idx;
    int k, n_chunks;
    uint64_t *sums;
} gather_job_t;

static void gather_chunk(const void *jp, int64_t c) {
    const gather_job_t *j = jp;
    const int i0 = (int)(c * j->k / j->n_chunks), i1 = (int)((c + 1) * j->k / j->n_chunks);
    uint64_t acc[8] = {0};
    for (int i = i0; i < i1; i += 4) {
        const int R = i1 - i < 4 ? i1 - i : 4, npf = i1 - i - R < 4 ? i1 - i - R : 4;
        const uint64_t *r[4];
        const uint8_t *pf[4];
        for (int n = 0; n < R; n++) r[n] = (const uint64_t *)(j->buf + (size_t)j->idx[i + n] * j->stride);
        for (int n = 0; n < npf; n++) pf[n] = j->buf + (size_t)j->idx[i + R + n] * j->stride;
        size_t w = 0;
        for (; w + 8 <= j->words; w += 8) { /* one 64-byte line of each row */
            for (int n = 0; n < npf; n++) __builtin_prefetch(pf[n] + 8 * w, 0, 2);
            for (int n = 0; n < R; n++)
                for (int e = 0; e < 8; e++) acc[e] += r[n][w + e];
        }
        for (; w < j->words; w++)
            for (int n = 0; n < R; n++) acc[0] += r[n][w];
    }
    uint64_t s = 0;
    for (int e = 0; e < 8; e++) s += acc[e];
    j->sums[c] = s;
}

int si_read_gather(const void *buf, size_t buf_bytes, size_t stride, size_t nbytes,
                   const int32_t *idx, int k, uint64_t *sum) {
    if (g_isa < 0) return ENODEV;
    if (k < 0 || nbytes % 8 || stride % 8 || (uintptr_t)buf % 8 || nbytes > stride) return EINVAL;
    for (int i = 0; i < k; i++)
        if (idx[i] < 0 || (size_t)idx[i] * stride + nbytes > buf_bytes) return ERANGE;
    gather_job_t j = {buf, stride, nbytes / 8, idx, k, sparse_ranges(k), NULL};
    uint64_t sums[MAX_THREADS];
    j.sums = sums;
    pthread_mutex_lock(&g_call_lock);
    pool_run(gather_chunk, &j, j.n_chunks);
    pthread_mutex_unlock(&g_call_lock);
    *sum = 0;
    for (int c = 0; c < j.n_chunks; c++) *sum += sums[c];
    return 0;
}

/* B >= 1 rows at positions pos in [0, max_seq), cache slots slots >= 0. */
static int check_rows(int B, const int32_t *pos, const int32_t *slots, int max_seq) {
    if (B < 1) return EINVAL;
    for (int t = 0; t < B; t++)
        if (pos[t] < 0 || pos[t] >= max_seq || slots[t] < 0) return ERANGE;
    return 0;
}

/* Whether n_heads query heads share n_kv_heads kv heads of head_dim values (even) evenly. */
static int heads_ok(int n_heads, int n_kv_heads, int head_dim) {
    return n_heads >= 1 && n_kv_heads >= 1 && n_heads % n_kv_heads == 0 && head_dim >= 2 &&
           head_dim % 2 == 0;
}

/* B rows' rope, cache writes and attention (heads and positions checked by the caller): row t's
 * qkv q[t], its caches kc[t]/vc[t] written at pos[t], its rope rows cs[t]/sn[t], its output at
 * out + t * n_heads * head_dim; each row's scores scratch its positions long. Rope and cache
 * writes row by row, then every row's kv heads in one pool dispatch (or on the calling thread
 * for little work): a row's numbers are the same whatever the other rows. */
static int attend_rows_run(int B, float *const *q, uint8_t *const *kc, uint8_t *const *vc,
                           int kv16, const int32_t *pos, const float *const *cs,
                           const float *const *sn, int n_heads, int n_kv_heads, int hd,
                           int max_seq, int interleaved, float scale, float *out) {
    token_attend_job jobs[B];
    size_t work = 0; /* each row's scores: its n_heads rows of pos + 1 */
    for (int t = 0; t < B; t++) work += (size_t)(pos[t] + 1) * n_heads;
    pthread_mutex_lock(&g_call_lock);
    int err = grow((void **)&R.scores, &R.scores_cap, work * sizeof(float));
    if (!err) {
        float *scores = R.scores;
        for (int t = 0; t < B; t++) {
            rope_heads(q[t], n_heads + n_kv_heads, hd, interleaved, cs[t], sn[t]);
            write_kv(q[t], n_heads, n_kv_heads, hd, kc[t], vc[t], kv16, pos[t], max_seq);
            jobs[t] = (token_attend_job){q[t], kc[t], vc[t], kv16 != 0, pos[t] + 1, hd,
                                         n_heads / n_kv_heads, max_seq, scale, scores,
                                         out + (size_t)t * n_heads * hd, (size_t)pos[t] + 1};
            scores += (size_t)(pos[t] + 1) * n_heads;
        }
        rows_attend_job j = {jobs, n_kv_heads};
        if (work * hd >= ATTEND_POOL_WORK)
            pool_run(rows_attend_chunk, &j, (int64_t)B * n_kv_heads);
        else
            for (int c = 0; c < B * n_kv_heads; c++) rows_attend_chunk(&j, c);
    }
    pthread_mutex_unlock(&g_call_lock);
    return err;
}

/* One token's attention outside the C block (a plain llama block around a sparse FFN): rope on
 * qkv's q and k heads (in place), its key and value written into kc/vc [n_kv_heads, max_seq,
 * head_dim] at pos (float32, or float16 when kv16), then each query head's softmax(scale q K) V
 * over positions 0..pos into out [n_heads * head_dim]: the kv heads on the pool when the context
 * is long enough to pay for waking it (the C block's rule), else on the calling thread. */
int si_attend_token(float *qkv, void *kc, void *vc, int kv16, int pos, const float *cos,
                    const float *sin, int n_heads, int n_kv_heads, int head_dim, int max_seq,
                    int interleaved, float scale, float *out) {
    if (pos < 0 || pos >= max_seq) return ERANGE;
    if (!heads_ok(n_heads, n_kv_heads, head_dim)) return EINVAL;
    uint8_t *k = kc, *v = vc;
    const int32_t p = pos;
    return attend_rows_run(1, &qkv, &k, &v, kv16, &p, &cos, &sin, n_heads, n_kv_heads, head_dim,
                           max_seq, interleaved, scale, out);
}

/* si_attend_token for B rows at once: row t's qkv at qkv + t * qkv_stride floats, its caches at
 * kc/vc + slots[t] * slot_bytes, its position pos[t] (rope rows cos/sin + pos[t] * head_dim), its
 * output at out + t * n_heads * head_dim; each row's numbers are its lone call's. */
int si_attend_rows(float *qkv, int B, int64_t qkv_stride, void *kc, void *vc, int64_t slot_bytes,
                   int kv16, const int32_t *pos, const int32_t *slots, const float *cos,
                   const float *sin, int n_heads, int n_kv_heads, int head_dim, int max_seq,
                   int interleaved, float scale, float *out) {
    if (B == 0) return 0;
    if (!heads_ok(n_heads, n_kv_heads, head_dim)) return EINVAL;
    const int err = check_rows(B, pos, slots, max_seq);
    if (err) return err;
    float *q[B];
    uint8_t *k[B], *v[B];
    const float *cs[B], *sn[B];
    for (int t = 0; t < B; t++) {
        q[t] = qkv + (size_t)t * qkv_stride;
        k[t] = (uint8_t *)kc + (size_t)slots[t] * slot_bytes;
        v[t] = (uint8_t *)vc + (size_t)slots[t] * slot_bytes;
        cs[t] = cos + (size_t)pos[t] * head_dim, sn[t] = sin + (size_t)pos[t] * head_dim;
    }
    return attend_rows_run(B, q, k, v, kv16, pos, cs, sn, n_heads, n_kv_heads, head_dim, max_seq,
                           interleaved, scale, out);
}

/* One call of block b over B rows (the caller holds g_call_lock and has checked the rows). */
static int rows_call(block_t *b, float *x, int B, const int32_t *pos, const int32_t *slots,
                     uint8_t *kc, uint8_t *vc, int kv16, int64_t slot_stride, const float *cos,
                     const float *sin, int max_seq) {
    int err = block_scratch(b, B, max_seq);
    if (err) return err;
    const int hd = b->d.head_dim;
    b->kv16 = kv16 != 0;
    for (int t = 0; t < B; t++) {
        b->pos[t] = pos[t];
        b->kc[t] = kc + slots[t] * slot_stride * kv_size(kv16);
        b->vc[t] = vc + slots[t] * slot_stride * kv_size(kv16);
        b->cs[t] = cos + (size_t)pos[t] * hd;
        b->sn[t] = sin + (size_t)pos[t] * hd;
    }
    return block_rows(b, x, B, max_seq);
}

/* One token of each of B sequences, x [B, d_model]: row t at pos[t] in cache slot slots[t].
 * kc/vc: this layer's caches of slot 0, [slots, n_kv_heads, max_seq, head_dim], slot_stride
 * values apart (float32, or float16 when kv16); cos/sin: the rope tables [max_seq, head_dim]
 * (row t uses row pos[t]). */
int si_block_decode_rows(void *p, float *x, int B, const int32_t *pos, const int32_t *slots,
                         void *kc, void *vc, int kv16, int64_t slot_stride, const float *cos,
                         const float *sin, int max_seq) {
    int err = check_rows(B, pos, slots, max_seq);
    if (err) return err;
    pthread_mutex_lock(&g_call_lock);
    err = rows_call(p, x, B, pos, slots, kc, vc, kv16, slot_stride, cos, sin, max_seq);
    pthread_mutex_unlock(&g_call_lock);
    return err;
}

/* Every block of a model, in order, over the same B rows (x [B, d_model], updated in place): block
 * l's caches at kc/vc + l * layer_stride values (slot s at + s * slot_stride, as
 * si_block_decode_rows; float32, or float16 when kv16), its rope tables cos[l]/sin[l] (a model
 * may give windowed layers their own). One call, one lock, for a whole decode step. */
int si_stack_decode_rows(void *const *blocks, int n, float *x, int B, const int32_t *pos,
                         const int32_t *slots, void *kc, void *vc, int kv16, int64_t layer_stride,
                         int64_t slot_stride, const float *const *cos, const float *const *sin,
                         int max_seq) {
    int err = check_rows(B, pos, slots, max_seq);
    if (err) return err;
    if (n < 1) return EINVAL;
    for (int l = 0; l < n; l++) /* a whole block each: none attention only */
        if (!((const block_t *)blocks[l])->d.d_ff) return EINVAL;
    pthread_mutex_lock(&g_call_lock);
    for (int l = 0; l < n && !err; l++)
        err = rows_call(blocks[l], x, B, pos, slots, (uint8_t *)kc + l * layer_stride * kv_size(kv16),
                        (uint8_t *)vc + l * layer_stride * kv_size(kv16), kv16, slot_stride, cos[l],
                        sin[l], max_seq);
    pthread_mutex_unlock(&g_call_lock);
    return err;
}

/* ------------------------------------------------------------------ panels (layout) */

/* Little-endian words of the packers; BYTES8(v): v in each byte (the byte-aligned layouts work 4
 * or 8 weights a byte each in an integer: shifts, then masks that keep no bit from another byte) */
#define BYTES8(v) (0x0101010101010101ull * (uint64_t)(v))
static uint64_t ld64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}
static uint32_t ld32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}
static void st32(uint8_t *p, const uint32_t v) { memcpy(p, &v, 4); }
#define INLINE static inline __attribute__((always_inline))

typedef struct {
    const uint8_t *src;
    uint8_t *dst;
    int panel, bsize, nb; /* the panel type; a block's bytes; blocks a row */
    int64_t panels_per_chunk, n_panels;
} panel_job;

/* A Q5_0 / Q5_1 block's 32 fifth bits as SI_Q5_0P / SI_Q5_1P store them: bit 8k + s =
 * bit 4s + k (nibble s of h spread over bit s of the four bytes). */
static uint32_t bits_t(const uint32_t h) {
    static const uint32_t spread[16] = {
        0x00000000, 0x00000001, 0x00000100, 0x00000101, 0x00010000, 0x00010001, 0x00010100,
        0x00010101, 0x01000000, 0x01000001, 0x01000100, 0x01000101, 0x01010000, 0x01010001,
        0x01010100, 0x01010101};
    uint32_t o = 0;
    for (int s = 0; s < 8; s++) o |= spread[h >> (4 * s) & 15] << s;
    return o;
}

/* Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 (q: a row's block in the file; o: its panel's block column;
 * r: the row in its panel): the block's fp16 words, then its nq quant words; Q5_0 / Q5_1's first
 * (bits) transposed by bits_t. */
INLINE void block_b32(const uint8_t *q, uint8_t *o, const int r, const int words, const int nq,
                      const int bits) {
    for (int w = 0; w < words; w++) memcpy(o + 32 * w + 2 * r, q + 2 * w, 2);
    for (int k = 0; k < nq; k++) memcpy(o + 32 * words + 64 * k + 4 * r, q + 2 * words + 4 * k, 4);
    if (bits) st32(o + 32 * words + 4 * r, bits_t(ld32(q + 2 * words)));
}

/* Q4_K / Q5_K (bits: Q5_K): d and dmin, the 8 six-bit scales and minima (the 12 bytes
 * unpacked as the kernels' scales_k does) regrouped, Q5_K's 8 fifth-bit words, the 32 quant
 * words. */
static void k45_head(const uint8_t *q, uint8_t *o, int r) { /* d, dmin, scales, minima */
    const uint8_t *s = q + 4;
    uint8_t sc[8], m[8];
    for (int k = 0; k < 4; k++) {
        sc[k] = s[k] & 63;
        m[k] = s[4 + k] & 63;
        sc[4 + k] = (uint8_t)((s[8 + k] & 15) | ((s[k] >> 6) << 4));
        m[4 + k] = (uint8_t)((s[8 + k] >> 4) | ((s[4 + k] >> 6) << 4));
    }
    memcpy(o + 2 * r, q, 2);
    memcpy(o + 32 + 2 * r, q + 2, 2);
    uint16_t hs = 0, hm = 0;
    for (int k = 0; k < 8; k++) {
        if (k < 4) {
            o[64 + 16 * k + r] = (uint8_t)((sc[k] & 15) | ((sc[k + 4] & 15) << 4));
            o[128 + 16 * k + r] = (uint8_t)((m[k] & 15) | ((m[k + 4] & 15) << 4));
        }
        hs |= (uint16_t)((sc[k] >> 4) << (2 * k));
        hm |= (uint16_t)((m[k] >> 4) << (2 * k));
    }
    memcpy(o + 192 + 2 * r, &hs, 2);
    memcpy(o + 224 + 2 * r, &hm, 2);
}
INLINE void block_k45(const uint8_t *q, uint8_t *o, const int r, const int bits) {
    const int bs = bits ? 176 : 144, qo = bits ? 768 : 256;
    k45_head(q, o, r);
    for (int w = 0; bits && w < 8; w++) memcpy(o + 256 + 64 * w + 4 * r, q + 16 + 4 * w, 4);
    for (int w = 0; w < 32; w++) memcpy(o + qo + 64 * w + 4 * r, q + bs - 128 + 4 * w, 4);
}

/* Q6_K: d, the 16 scales, the 16 qh words, the 32 ql words. */
static void q6k_head(const uint8_t *q, uint8_t *o, int r) { /* d, the 16 scales */
    memcpy(o + 2 * r, q + 208, 2);
    for (int i = 0; i < 16; i++) o[32 + 16 * i + r] = q[192 + i];
}
static void block_q6k(const uint8_t *q, uint8_t *o, const int r) {
    q6k_head(q, o, r);
    for (int v = 0; v < 16; v++) memcpy(o + 288 + 64 * v + 4 * r, q + 128 + 4 * v, 4);
    for (int u = 0; u < 32; u++) memcpy(o + 1312 + 64 * u + 4 * r, q + 4 * u, 4);
}

/* Q6_K into SI_Q6_KB: d and the 16 scales as block_q6k, then each sub-block's 16 six-bit
 * weights (the file's ql nibble | qh bits << 4: weight n = 128 h + 32 g + l from ql's byte
 * 64 h + 32 (g & 1) + l, nibble g >> 1, and qh's byte 32 h + l, bits 2 g) in three words, the
 * fourth word's bits on top (bits 2 m, 2 m + 1 of weight 12 + e in word m's byte e). */
static void block_q6kb(const uint8_t *q, uint8_t *o, const int r) {
    q6k_head(q, o, r);
    for (int i = 0; i < 16; i++) { /* sub-block i: weights 16 i .. 16 i + 15 */
        const int h = i / 8, g = i % 8 / 2, l = 16 * (i % 2);
        uint64_t w[2]; /* its 16 weights, a byte each */
        for (int k = 0; k < 2; k++)
            w[k] = (ld64(q + 64 * h + 32 * (g & 1) + l + 8 * k) >> (4 * (g >> 1)) & BYTES8(15)) |
                   (ld64(q + 128 + 32 * h + l + 8 * k) >> (2 * g) & BYTES8(3)) << 4;
        const uint32_t t = (uint32_t)(w[1] >> 32); /* weights 12 .. 15 */
        const uint32_t words[3] = {(uint32_t)w[0], (uint32_t)(w[0] >> 32), (uint32_t)w[1]};
        for (int m = 0; m < 3; m++)
            st32(o + 288 + 192 * i + 64 * m + 4 * r,
                 words[m] | (t >> (2 * m) & (uint32_t)BYTES8(3)) << 6);
    }
}

/* Q5_K into SI_Q5_KB: block_k45's d, dmin, scales and minima, then each sub-block's 32 five-bit
 * weights (the file's qs nibble | qh bit << 4) in five words, the last three words' bits on top:
 * word m's byte e gets bits 3 m .. 3 m + 2 of w(20 + e) | w(24 + e) << 5 | w(28 + e) << 10. */
static void block_k5b(const uint8_t *q, uint8_t *o, const int r) {
    k45_head(q, o, r);
    const uint32_t m1 = (uint32_t)BYTES8(1), m2 = (uint32_t)BYTES8(3), m3 = (uint32_t)BYTES8(7);
    for (int s = 0; s < 8; s++) {
        uint8_t w[32]; /* sub-block s's weights 32 s .. 32 s + 31, a byte each */
        for (int k = 0; k < 4; k++) {
            const uint64_t v = (ld64(q + 48 + 32 * (s / 2) + 8 * k) >> (4 * (s % 2)) & BYTES8(15)) |
                               (ld64(q + 16 + 8 * k) >> s & BYTES8(1)) << 4;
            memcpy(w + 8 * k, &v, 8);
        }
        const uint32_t a = ld32(w + 20), b = ld32(w + 24), c = ld32(w + 28);
        const uint32_t top[5] = {a & m3, (a >> 3 & m2) | (b & m1) << 2, b >> 1 & m3,
                                 (b >> 4 & m1) | (c & m2) << 1, c >> 2 & m3};
        for (int m = 0; m < 5; m++) st32(o + 256 + 320 * s + 64 * m + 4 * r, ld32(w + 4 * m) | top[m] << 5);
    }
}

/* The blocks of panel p in the faster of two orders for the type (benchmarks/RESULTS.md), the
 * block functions inlined with their type's constants (one switch a panel, not a call a block):
 * the 32-weight blocks block column by block column (the column's 16 rows, so that its output
 * lines stay in L1 while each row writes its 2 or 4 bytes of them), the K-quants' super-blocks
 * row by row (each source row read front to back). */
static void panel_blocks(const panel_job *j, const int64_t p) {
    const size_t rb = (size_t)j->nb * j->bsize, pb = (size_t)SI_PANEL * j->bsize;
    const uint8_t *const src = j->src + (size_t)p * SI_PANEL * rb;
    uint8_t *const dst = j->dst + (size_t)p * j->nb * pb;
#define BY_COLUMN(call)                                                                        \
    for (int b = 0; b < j->nb; b++) {                                                          \
        const uint8_t *q = src + (size_t)b * j->bsize;                                         \
        uint8_t *o = dst + (size_t)b * pb;                                                     \
        for (int r = 0; r < SI_PANEL; r++, q += rb) call;                                      \
    }                                                                                          \
    break
#define BY_ROW(call)                                                                           \
    for (int r = 0; r < SI_PANEL; r++) {                                                       \
        const uint8_t *q = src + (size_t)r * rb;                                               \
        uint8_t *o = dst;                                                                      \
        for (int b = 0; b < j->nb; b++, q += j->bsize, o += pb) call;                          \
    }                                                                                          \
    break
    switch (j->panel) {
    case SI_Q4_0P: BY_COLUMN(block_b32(q, o, r, 1, 4, 0));
    case SI_Q4_1P: BY_COLUMN(block_b32(q, o, r, 2, 4, 0));
    case SI_Q5_0P: BY_COLUMN(block_b32(q, o, r, 1, 5, 1));
    case SI_Q5_1P: BY_COLUMN(block_b32(q, o, r, 2, 5, 1));
    case SI_Q8_0P: BY_COLUMN(block_b32(q, o, r, 1, 8, 0));
    case SI_Q4_KP: BY_ROW(block_k45(q, o, r, 0));
    case SI_Q5_KP: BY_ROW(block_k45(q, o, r, 1));
    case SI_Q5_KB: BY_ROW(block_k5b(q, o, r));
    case SI_Q6_KP: BY_ROW(block_q6k(q, o, r));
    case SI_Q6_KB: BY_ROW(block_q6kb(q, o, r));
    }
#undef BY_COLUMN
#undef BY_ROW
}
static void panel_chunk(const void *jp, int64_t c) {
    const panel_job *j = jp;
    for (int64_t p = c * j->panels_per_chunk; p < (c + 1) * j->panels_per_chunk && p < j->n_panels; p++)
        panel_blocks(j, p);
}

/* The file's type of a panel type's blocks; -1 for a type that is not a panel type. */
static int panel_source(int panel) {
    switch (panel) {
    case SI_Q4_0P: return SI_Q4_0;
    case SI_Q4_1P: return SI_Q4_1;
    case SI_Q5_0P: return SI_Q5_0;
    case SI_Q5_1P: return SI_Q5_1;
    case SI_Q8_0P: return SI_Q8_0;
    case SI_Q4_KP: return SI_Q4_K;
    case SI_Q5_KP: case SI_Q5_KB: return SI_Q5_K;
    case SI_Q6_KP: case SI_Q6_KB: return SI_Q6_K;
    default: return -1;
    }
}

/* Rows of Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K blocks (src: as the file stores
 * them) into panels of 16 rows of type panel (SI_Q4_0P ... SI_Q5_KB; dst, the same size; layouts
 * in qgemv.h), on the pool. */
int si_to_panels(int panel, const uint8_t *src, int64_t rows, int cols, uint8_t *dst) {
    const int type = panel_source(panel);
    if (type < 0) return EINVAL;
    const int elems = BLOCK_ELEMS[type];
    if (rows < SI_PANEL || rows % SI_PANEL || cols < elems || cols % elems) return EINVAL;
    panel_job j = {src, dst, panel, BLOCK_BYTES[type], cols / elems, 0, rows / SI_PANEL};
    j.panels_per_chunk = (j.n_panels + 31) / 32; /* 32 chunks: the threads stay even */
    pthread_mutex_lock(&g_call_lock);
    pool_run(panel_chunk, &j, (j.n_panels + j.panels_per_chunk - 1) / j.panels_per_chunk);
    pthread_mutex_unlock(&g_call_lock);
    return 0;
}

/* ------------------------------------------------------------------ neuron rows from Q4_0 or F16 */

/* A sparse model's neuron rows (PackedFFN: q4 rows, or int8 with a scale per 32) from a Q4_0 or
 * F16 matrix of the file, at load, without a float32 copy of it: gate/up rows (and a converted
 * file's F16 down_t) as they are, a down matrix's columns transposed. Q4_0 rows as they are
 * into q4 rows keep their numbers (the bytes moved); any other output row's blocks of 32 are
 * quantized as sparse/packed.py's torch references do (quantize_q4_rows, quantize_int8
 * with block 32), bit for bit: the same float operations in AVX2 vectors, no FMA (these
 * functions add avx2 and f16c to this file's baseline x86-64, not fma), fp16 scales rounded to
 * nearest even. The source weights (d (q - 8), or fp16) are exact in float32. */
typedef struct {
    const uint8_t *src;
    int64_t rows, cols, row_bytes; /* the matrix [rows, cols] */
    int f16, transpose, out_i8;     /* f16: F16 weights, else Q4_0 blocks */
    uint8_t *dst; /* output row o at dst + o * dst_stride: a q4 row (kernels.c: its scales,
                   * then its quants), or int8 values */
    int64_t dst_stride;
    float *scales; /* int8: output row o's scales at scales + o * scales_stride */
    int64_t scales_stride;
} bundle_job;

/* The four vectors of 32 weights, their absolute values, and the largest of these. */
__attribute__((target("avx2"))) static float abs32(const float *v, __m256 *x, __m256 *a) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    for (int k = 0; k < 4; k++) {
        x[k] = _mm256_loadu_ps(v + 8 * k);
        a[k] = _mm256_andnot_ps(sign, x[k]);
        m = _mm256_max_ps(m, a[k]);
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

/* Four vectors of 8 int32 (each fitting int8) as 32 bytes in order. */
__attribute__((target("avx2"))) static __m256i bytes32(const __m256i *q) {
    const __m256i c = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    return _mm256_permutevar8x32_epi32(c, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* 32 weights -> one Q4_0 block, its fp16 scale at dp and its 16 quant bytes at qp: d =
 * v[argmax |v|] / -8 (the first of equal maxima), q = min(15, trunc(v / d + 8.5)) through 1 / d,
 * as quantize_q4_0. */
__attribute__((target("avx2,f16c"))) static void q4_0_block(const float *v, uint8_t *dp, uint8_t *qp) {
    __m256 x[4], a[4];
    const float amax = abs32(v, x, a);
    uint32_t at = 0; /* bit 8k + l: |v[8k + l]| is the largest */
    for (int k = 0; k < 4; k++)
        at |= (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(a[k], _mm256_set1_ps(amax), _CMP_EQ_OQ)) << (8 * k);
    const float d = v[at ? __builtin_ctz(at) : 0] / -8.0f; /* (no bit: NaN weights) */
    const __m256 inv = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f), half = _mm256_set1_ps(8.5f);
    __m256i q[4];
    for (int k = 0; k < 4; k++) { /* |v / d| <= 8: truncation in [0, 16.5], then at most 15 */
        const __m256i t = _mm256_cvttps_epi32(_mm256_add_ps(_mm256_mul_ps(x[k], inv), half));
        q[k] = _mm256_min_epi32(_mm256_max_epi32(t, _mm256_setzero_si256()), _mm256_set1_epi32(15));
    }
    const __m256i b = bytes32(q); /* q[i] | q[i + 16] << 4 (each at most 15: no carry) */
    const __m128i packed = _mm_or_si128(_mm256_castsi256_si128(b), _mm_slli_epi16(_mm256_extracti128_si256(b, 1), 4));
    const uint16_t h = (uint16_t)_cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT);
    memcpy(dp, &h, 2);
    _mm_storeu_si128((__m128i *)qp, packed);
}

/* 32 weights -> int8 with s = max |v| / 127, q = round-half-even(v / s) (1 where s is 0),
 * clamped to +-127, as quantize_int8. */
__attribute__((target("avx2"))) static float i8_block(const float *v, int8_t *out) {
    __m256 x[4], a[4];
    const float s = abs32(v, x, a) / 127.0f, safe = s > 0.0f ? s : 1.0f;
    /* |v / safe| <= 127: adding and taking back 1.5 x 2^23 rounds half to even */
    const __m256 sv = _mm256_set1_ps(safe), magic = _mm256_set1_ps(12582912.0f);
    const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    __m256i q[4];
    for (int k = 0; k < 4; k++) {
        const __m256 z = _mm256_sub_ps(_mm256_add_ps(_mm256_div_ps(x[k], sv), magic), magic);
        q[k] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(z, lo), hi));
    }
    _mm256_storeu_si256((__m256i *)out, bytes32(q));
    return s;
}

/* Source block (r, b)'s 32 weights (exact: fp16 values, or d (q - 8)). */
__attribute__((target("avx2,f16c"))) static void src_weights(const bundle_job *j, int64_t r,
                                                             int64_t b, float *v) {
    const uint8_t *p = j->src + r * j->row_bytes + b * (j->f16 ? 64 : 18);
    if (j->f16) {
        for (int k = 0; k < 4; k++)
            _mm256_storeu_ps(v + 8 * k, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16 * k))));
        return;
    }
    uint16_t h;
    memcpy(&h, p, 2);
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(h));
    const __m128i qs = _mm_loadu_si128((const __m128i *)(p + 2)), m4 = _mm_set1_epi8(0x0F);
    const __m128i nib[2] = {_mm_and_si128(qs, m4), _mm_and_si128(_mm_srli_epi16(qs, 4), m4)};
    for (int k = 0; k < 4; k++) {
        const __m128i by = k & 1 ? _mm_srli_si128(nib[k / 2], 8) : nib[k / 2];
        const __m256i q = _mm256_sub_epi32(_mm256_cvtepu8_epi32(by), _mm256_set1_epi32(8));
        _mm256_storeu_ps(v + 8 * k, _mm256_mul_ps(d, _mm256_cvtepi32_ps(q)));
    }
}

/* Block b of output q4 row o: where its fp16 scale (*dp) and its 16 quant bytes (*qp) go (a
 * row of n = (transposed ? rows : cols) / 32 blocks: the scales, then the quants). */
static void q4_row_at(const bundle_job *j, int64_t o, int64_t b, uint8_t **dp, uint8_t **qp) {
    uint8_t *row = j->dst + o * j->dst_stride;
    const int64_t n = (j->transpose ? j->rows : j->cols) / 32;
    *dp = row + 2 * b, *qp = row + 2 * n + 16 * b;
}

__attribute__((target("avx2,f16c"))) static void bundle_out(const bundle_job *j, int64_t o, int64_t b, const float *v) {
    if (j->out_i8) {
        j->scales[o * j->scales_stride + b] = i8_block(v, (int8_t *)(j->dst + o * j->dst_stride + 32 * b));
        return;
    }
    uint8_t *dp, *qp;
    q4_row_at(j, o, b, &dp, &qp);
    q4_0_block(v, dp, qp);
}

/* Chunk c: output rows 32c .. 32c + 31 (transposed: one column of source blocks, read as 32 x 32
 * tiles; else 32 source rows). */
__attribute__((target("avx2,f16c"))) static void bundle_chunk(const void *jp, int64_t c) {
    const bundle_job *j = jp;
    float v[32], tile[32][32];
    if (!j->transpose) {
        const int64_t o1 = 32 * c + 32 < j->rows ? 32 * c + 32 : j->rows;
        const int move = !j->f16 && !j->out_i8; /* Q4_0 rows to q4 rows: the same numbers */
        for (int64_t o = 32 * c; o < o1; o++)
            for (int64_t b = 0; b < j->cols / 32; b++) {
                if (move) {
                    const uint8_t *p = j->src + o * j->row_bytes + 18 * b;
                    uint8_t *dp, *qp;
                    q4_row_at(j, o, b, &dp, &qp);
                    memcpy(dp, p, 2);
                    memcpy(qp, p + 2, 16);
                    continue;
                }
                src_weights(j, o, b, v);
                bundle_out(j, o, b, v);
            }
        return;
    }
    for (int64_t rb = 0; rb < j->rows / 32; rb++) { /* output block rb: source rows 32 rb .. */
        for (int i = 0; i < 32; i++) {
            src_weights(j, 32 * rb + i, c, v);
            for (int k = 0; k < 32; k++) tile[k][i] = v[k];
        }
        for (int k = 0; k < 32; k++) bundle_out(j, 32 * c + k, rb, tile[k]);
    }
}

int si_bundle_rows(int type, const uint8_t *src, int64_t rows, int64_t cols, int transpose,
                   int out_i8, uint8_t *dst, int64_t dst_stride, float *scales,
                   int64_t scales_stride) {
    if ((type != SI_Q4_0 && type != SI_F16) || rows < 1 || cols < 32 || cols % 32 ||
        (transpose && rows % 32) || (out_i8 && !scales))
        return EINVAL;
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("f16c")) return ENOSYS;
    const int f16 = type == SI_F16;
    bundle_job j = {src, rows, cols, f16 ? 2 * cols : cols / 32 * 18, f16, transpose, out_i8, dst,
                    dst_stride, scales, scales_stride};
    const int64_t n_out = transpose ? cols : rows;
    pthread_mutex_lock(&g_call_lock);
    pool_run(bundle_chunk, &j, (n_out + 31) / 32);
    pthread_mutex_unlock(&g_call_lock);
    return 0;
}

/* ------------------------------------------------------------------ top-k (sampling) */

/* The k largest of x[0..n) in descending order (equal values: lower index first) into vals/ids,
 * 1 <= k <= n. One pass: a sorted buffer of the best k so far and its smallest value as the
 * threshold; runs of sixteen values, then of four, are compared with it (SSE, the baseline) and
 * only those above it are inserted, so after the first few hundred values almost none are. NaN
 * never enters. */
int si_topk(const float *x, int64_t n, int k, float *vals, int64_t *ids) {
    if (k < 1 || n < k) return EINVAL;
    int m = 0; /* values in the buffer */
    float thr = -INFINITY;
    int64_t i = 0;
    for (;;) {
        if (m == k) { /* skip runs of sixteen, then of four, at or below the threshold */
            const __m128 t = _mm_set1_ps(thr);
            while (i + 16 <= n) {
                const __m128 a = _mm_or_ps(_mm_cmpgt_ps(_mm_loadu_ps(x + i), t),
                                           _mm_cmpgt_ps(_mm_loadu_ps(x + i + 4), t));
                const __m128 b = _mm_or_ps(_mm_cmpgt_ps(_mm_loadu_ps(x + i + 8), t),
                                           _mm_cmpgt_ps(_mm_loadu_ps(x + i + 12), t));
                if (_mm_movemask_ps(_mm_or_ps(a, b))) break;
                i += 16;
            }
            while (i + 4 <= n && !_mm_movemask_ps(_mm_cmpgt_ps(_mm_loadu_ps(x + i), t))) i += 4;
        }
        if (i >= n) break;
        const float v = x[i];
        if (m < k ? v == v : v > thr) { /* insert after the values >= v (earlier indices) */
            int lo = 0, hi = m;
            while (lo < hi) {
                const int mid = (lo + hi) / 2;
                if (vals[mid] >= v) lo = mid + 1;
                else hi = mid;
            }
            const int last = m < k ? m : k - 1; /* the slot freed: past the end, or the smallest */
            memmove(vals + lo + 1, vals + lo, (size_t)(last - lo) * sizeof(float));
            memmove(ids + lo + 1, ids + lo, (size_t)(last - lo) * sizeof(int64_t));
            vals[lo] = v;
            ids[lo] = i;
            if (m < k) m++;
            if (m == k) thr = vals[k - 1];
        }
        i++;
    }
    if (m < k) { /* fewer than k non-NaN values: the rest as NaN, in index order */
        for (int64_t j = 0; j < n && m < k; j++)
            if (x[j] != x[j]) {
                vals[m] = x[j];
                ids[m++] = j;
            }
    }
    return 0;
}

/* A draw after top-k (generate.sample's chain, llama.cpp's order), with u in [0, 1) drawn by the
 * caller: the k best of x (si_topk), their softmax in double; top-p keeps the shortest prefix
 * whose cumulative probability reaches top_p (top_p >= 1: all); min-p keeps those with at least
 * min_p times the best one's probability (min_p <= 0: all); over the kept ones, weights
 * exp((v - v_best) / temperature) and the first whose cumulative weight exceeds u times their
 * sum. *out = the chosen index into x. temperature > 0, 1 <= k <= n. */
int si_sample(const float *x, int64_t n, int k, double top_p, double min_p, double temperature,
              double u, int64_t *out) {
    if (k < 1 || n < k || !(temperature > 0.0) || !(u >= 0.0 && u < 1.0)) return EINVAL;
    float *vals = malloc(sizeof(float) * (size_t)k);
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)k);
    double *w = malloc(sizeof(double) * (size_t)k);
    if (!vals || !ids || !w) {
        free(vals), free(ids), free(w);
        return ENOMEM;
    }
    si_topk(x, n, k, vals, ids);
    const double best = vals[0];
    double sum = 0.0;
    for (int i = 0; i < k; i++) sum += w[i] = exp((double)vals[i] - best);
    int keep = k;
    if (top_p < 1.0) { /* the first i whose cumulative probability reaches top_p, kept with it */
        double c = 0.0;
        int i = 0;
        for (; i < k; i++) {
            c += w[i] / sum;
            if (c >= top_p) break;
        }
        if (i + 1 < keep) keep = i + 1;
    }
    if (min_p > 0.0) {
        int m = 0;
        for (int i = 0; i < k; i++) m += w[i] / sum >= min_p * (w[0] / sum);
        if (m < 1) m = 1;
        if (m < keep) keep = m;
    }
    double c = 0.0;
    for (int i = 0; i < keep; i++) c += w[i] = exp(((double)vals[i] - best) / temperature);
    const double target = u * c;
    int pick = keep - 1;
    c = 0.0;
    for (int i = 0; i < keep; i++) {
        c += w[i];
        if (c > target) {
            pick = i;
            break;
        }
    }
    *out = ids[pick];
    free(vals), free(ids), free(w);
    return 0;
}

/* ------------------------------------------------------------------ neuron bundle reads */

/* The disk tier's reads (disk/reader.py): run i is the file bytes [start[i], start[i] +
 * length[i]), read with one pread into this thread's scratch over that range widened to multiples
 * of `align` (O_DIRECT's rule; retried once at 4096 if the device refuses a smaller one: then
 * stats[2] = 4096); its wanted rows j in [first[i], first[i + 1]) are the bytes
 * [pick[j] * stride, + row_bytes) of the run, copied to out + dest[j] * row_bytes. `threads`
 * reads in flight (threads of this call, not the compute pool: reads wait, they do not spin).
 * drop: posix_fadvise(DONTNEED) over each range read (plain reads, no O_DIRECT). stats[0..1] +=
 * bytes and reads. On failure the first failing run's index, errno (0: a short read) and the
 * bytes it got go to fail[0..2] and no further run starts; returns 0, or EIO on a failed read,
 * EINVAL on bad arguments, ENOMEM. */
typedef struct {
    int fd, drop, n;
    const int64_t *start, *length, *first, *dest;
    const int32_t *pick;
    int64_t stride, row_bytes, max_span;
    uint8_t *out;
    atomic_int next, align, failed;
    atomic_llong bytes, reads;
    int64_t *fail;
} read_job;

/* The first failure of a job wins: run (-1: no buffer), errno, bytes got. fail[] is read after
 * every thread has been joined. */
static void read_failed(read_job *j, int64_t run, int err, int64_t got) {
    int expected = 0;
    if (atomic_compare_exchange_strong(&j->failed, &expected, 1))
        j->fail[0] = run, j->fail[1] = err, j->fail[2] = got;
}

static void *read_worker(void *arg) {
    read_job *j = arg;
    uint8_t *buf = NULL;
    if (posix_memalign((void **)&buf, 4096, (size_t)j->max_span + 2 * 4096)) {
        read_failed(j, -1, ENOMEM, 0);
        return NULL;
    }
    for (;;) {
        if (atomic_load(&j->failed)) break;
        const int i = atomic_fetch_add(&j->next, 1);
        if (i >= j->n) break;
        const int64_t start = j->start[i], end = start + j->length[i];
        int64_t a = atomic_load(&j->align), lo = start / a * a, hi = (end + a - 1) / a * a;
        ssize_t got = pread(j->fd, buf, (size_t)(hi - lo), lo);
        if (got < 0 && errno == EINVAL && a < 4096) { /* a device with 4 KiB sectors */
            atomic_store(&j->align, 4096);
            a = 4096, lo = start / a * a, hi = (end + a - 1) / a * a;
            got = pread(j->fd, buf, (size_t)(hi - lo), lo);
        }
        if (got < end - lo) { /* an error, or a short read (a truncated file) */
            read_failed(j, i, got < 0 ? errno : 0, got < 0 ? 0 : got);
            break;
        }
        const uint8_t *run = buf + (start - lo);
        for (int64_t r = j->first[i]; r < j->first[i + 1]; r++)
            memcpy(j->out + j->dest[r] * j->row_bytes, run + (int64_t)j->pick[r] * j->stride,
                   (size_t)j->row_bytes);
        if (j->drop) posix_fadvise(j->fd, lo, hi - lo, POSIX_FADV_DONTNEED);
        atomic_fetch_add(&j->bytes, hi - lo);
        atomic_fetch_add(&j->reads, 1);
    }
    free(buf);
    return NULL;
}

int si_read_runs(int fd, int n, const int64_t *start, const int64_t *length, const int64_t *first,
                 const int32_t *pick, const int64_t *dest, int64_t stride, int64_t row_bytes,
                 uint8_t *out, int align, int threads, int drop, int64_t *stats, int64_t *fail) {
    if (n < 0 || threads < 1 || align < 1 || align > 4096 || 4096 % align || row_bytes > stride)
        return EINVAL;
    int64_t max_span = 0;
    for (int i = 0; i < n; i++) {
        if (start[i] < 0 || length[i] < row_bytes || first[i] > first[i + 1]) return EINVAL;
        if (length[i] > max_span) max_span = length[i];
        for (int64_t r = first[i]; r < first[i + 1]; r++)
            if (pick[r] < 0 || (int64_t)pick[r] * stride + row_bytes > length[i]) return EINVAL;
    }
    read_job j = {.fd = fd, .drop = drop, .n = n, .start = start,
                  .length = length, .first = first, .dest = dest, .pick = pick, .stride = stride,
                  .row_bytes = row_bytes, .max_span = max_span, .out = out, .fail = fail};
    atomic_init(&j.next, 0);
    atomic_init(&j.align, align);
    atomic_init(&j.failed, 0);
    atomic_init(&j.bytes, 0);
    atomic_init(&j.reads, 0);
    const int nt = threads < n ? threads : n;
    pthread_t th[64];
    int started = 0;
    for (int t = 0; t < nt - 1 && t < 64; t++) { /* fewer threads if one cannot start */
        if (pthread_create(&th[t], NULL, read_worker, &j)) break;
        started++;
    }
    read_worker(&j); /* the calling thread reads too */
    for (int t = 0; t < started; t++) pthread_join(th[t], NULL);
    stats[0] += atomic_load(&j.bytes);
    stats[1] += atomic_load(&j.reads);
    stats[2] = atomic_load(&j.align);
    if (!atomic_load(&j.failed)) return 0;
    return fail[0] < 0 ? (int)fail[1] : EIO;
}

/* The activation quantization alone (for tests: x -> q, d, s as the kernels see it). */
int si_quantize_x(const float *x, int cols, int8_t *q, float *d, float *s) {
    if (g_isa < 0) return ENODEV;
    if (cols <= 0 || cols % 32) return EINVAL;
    g_quant(x, cols, q, d, s);
    return 0;
}

__attribute__((constructor)) static void si_init(void) {
    si_set_isa(si_best_isa());
}

#ifndef SI_SOURCE_HASH
#define SI_SOURCE_HASH "unknown"
#endif
const char *si_source_hash(void) { return SI_SOURCE_HASH; }
