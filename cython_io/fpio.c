/* fpio.c: engines and pipelines of fp_dcp._aio. See fpio.h. */
#define _GNU_SOURCE
#include "fpio.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/aio_abi.h>
#include <linux/io_uring.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#ifndef STATX_DIOALIGN
#define STATX_DIOALIGN 0x00002000U
#endif

/* ------------------------------------------------------------------ */
/* Process-wide counters and fault injection                           */
/* ------------------------------------------------------------------ */

static long g_inflight;
static int64_t g_crc_nt_bytes; /* bytes copied with streaming stores (tests) */
static int g_fault_err;
static long g_fault_after;
static long g_fault_short;
static int g_fault_kill_sig;
static long g_fault_kill_after;

long fpio_inflight(void) { return __atomic_load_n(&g_inflight, __ATOMIC_RELAXED); }

void fpio_fault_set(int err, long after)
{
    __atomic_store_n(&g_fault_after, after, __ATOMIC_RELAXED);
    __atomic_store_n(&g_fault_err, err, __ATOMIC_RELEASE);
}

void fpio_fault_short(long count)
{
    __atomic_store_n(&g_fault_short, count, __ATOMIC_RELEASE);
}

void fpio_fault_kill(int sig, long after)
{
    __atomic_store_n(&g_fault_kill_after, after, __ATOMIC_RELAXED);
    __atomic_store_n(&g_fault_kill_sig, sig, __ATOMIC_RELEASE);
}

/* A process killed in the middle of a pipeline (crash-consistency tests). */
static void fault_kill(void)
{
    int sig = __atomic_load_n(&g_fault_kill_sig, __ATOMIC_ACQUIRE);
    if (sig == 0 || __atomic_fetch_sub(&g_fault_kill_after, 1, __ATOMIC_ACQ_REL) > 0)
        return;
    kill(getpid(), sig);
}

/* The errno to report for this completion instead of its result, or 0. */
static int fault_take(void)
{
    if (__atomic_load_n(&g_fault_err, __ATOMIC_ACQUIRE) == 0)
        return 0;
    if (__atomic_fetch_sub(&g_fault_after, 1, __ATOMIC_ACQ_REL) > 0)
        return 0;
    return __atomic_exchange_n(&g_fault_err, 0, __ATOMIC_ACQ_REL);
}

/* ------------------------------------------------------------------ */
/* CRC-32C (Castagnoli)                                                */
/* ------------------------------------------------------------------ */

/* The register-level functions (crc_reg*) take and return the raw CRC
 * register: no pre- or post-inversion. The standard CRC-32C of a message is
 * crc_reg(0xffffffff, msg) ^ 0xffffffff. Because the register update is
 * linear, parts of a message may be summed in any order:
 *     reg(i, A || B) = shift(reg(i, A), |B|) ^ reg(0, B)
 * where shift(r, n) runs r over n zero bytes (r * x^(8n) mod P). */

#define CRC32C_POLY 0x82f63b78u /* bit-reflected Castagnoli polynomial */
#define CRC_LONG 8192           /* the three interleaved streams, long and short */
#define CRC_SHORT 256

static uint32_t crc_sw_tab[8][256]; /* slice-by-8 */
static uint32_t crc_x2n[64];        /* x^(2^k) mod P */
static uint32_t crc_long_tab[4][256];
static uint32_t crc_short_tab[4][256];
static int crc_use_hw;
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

/* a(x) * b(x) mod P(x), bit-reflected (bit 31 is x^0); a != 0. */
static uint32_t multmodp(uint32_t a, uint32_t b)
{
    uint32_t m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0)
                break;
        }
        m >>= 1;
        b = b & 1 ? (b >> 1) ^ CRC32C_POLY : b >> 1;
    }
    return p;
}

/* x^(n * 2^k) mod P */
static uint32_t x2nmodp(uint64_t n, unsigned k)
{
    uint32_t p = 1u << 31; /* x^0 */
    while (n) {
        if (n & 1)
            p = multmodp(crc_x2n[k & 63], p);
        n >>= 1;
        k++;
    }
    return p;
}

/* The register after running over n zero bytes. */
static uint32_t crc_shift(uint32_t reg, uint64_t nbytes)
{
    return nbytes && reg ? multmodp(x2nmodp(nbytes, 3), reg) : reg;
}

static inline uint32_t crc_shift_tab(uint32_t tab[4][256], uint32_t c)
{
    return tab[0][c & 0xff] ^ tab[1][(c >> 8) & 0xff] ^ tab[2][(c >> 16) & 0xff] ^ tab[3][c >> 24];
}

static inline uint64_t ld64(const unsigned char *q)
{
    uint64_t w;
    memcpy(&w, q, 8);
    return w;
}

static inline void st64(unsigned char *q, uint64_t w) { memcpy(q, &w, 8); }

static uint32_t crc_sw(uint32_t c, const unsigned char *p, size_t n)
{
    while (n && ((uintptr_t)p & 7)) {
        c = crc_sw_tab[0][(c ^ *p++) & 0xff] ^ (c >> 8);
        n--;
    }
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    while (n >= 8) {
        uint64_t w = ld64(p) ^ c;
        c = crc_sw_tab[7][w & 0xff] ^ crc_sw_tab[6][(w >> 8) & 0xff] ^
            crc_sw_tab[5][(w >> 16) & 0xff] ^ crc_sw_tab[4][(w >> 24) & 0xff] ^
            crc_sw_tab[3][(w >> 32) & 0xff] ^ crc_sw_tab[2][(w >> 40) & 0xff] ^
            crc_sw_tab[1][(w >> 48) & 0xff] ^ crc_sw_tab[0][w >> 56];
        p += 8;
        n -= 8;
    }
#endif
    while (n--)
        c = crc_sw_tab[0][(c ^ *p++) & 0xff] ^ (c >> 8);
    return c;
}

/* Copy while the bytes are hot: memcpy a cache-sized piece, then run the CRC over it. */
static uint32_t crc_sw_copy(uint32_t c, unsigned char *d, const unsigned char *p, size_t n)
{
    while (n) {
        size_t k = n < 16384 ? n : 16384;
        memcpy(d, p, k);
        c = crc_sw(c, d, k);
        d += k;
        p += k;
        n -= k;
    }
    return c;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define FPIO_CRC_HW 1
/* The SSE4.2 crc32 instruction over three interleaved streams (its latency
 * is three times its throughput), merged with the shift tables; with copy,
 * every 8-byte word is stored to d as it is loaded: one pass over memory.
 * COPY: 0 none, 1 plain stores, 2 non-temporal stores (movnti, fenced at the
 * end). A copy of at least CRC_NT_MIN bytes is not read back soon (a bounce
 * buffer the device reads, a staging arena, a tensor larger than the cache),
 * and ordinary stores first read every destination line into the cache:
 * measured on the 2-core EPYC VM, 600 MiB from DRAM, one thread: plain
 * stores 10.3 GB/s, non-temporal 14.5 GB/s (memcpy 17-18 GB/s). */
#define CRC_NT_MIN (256 << 10)
/* ... but only where the destination is not a little ahead of the source
 * modulo 4 KiB.  The loop loads p, p + LEN, p + 2 LEN and streams to d, d +
 * LEN, d + 2 LEN; when d - p mod 4096 is below ~128 bytes, every load
 * 4K-aliases a line still in a write-combining buffer and flushes it half
 * full.  Measured on the 2-core EPYC VM (32 MiB, one thread, best of 3):
 * d - p = 32..96 mod 4096: 0.14-0.21 GB/s streaming against 4.7-5.9 plain;
 * 0: 2.8 against 6.7; 128: 4.2 / 5.7; from 224 on streaming is level with or
 * faster than plain stores (6-9 GB/s).  A tensor from torch's allocator
 * starts 64 bytes past a page, the bounce buffers on a page: the scatter of
 * every verified read sat at 0.13 GB/s (issue 15).  A destination not 8-byte
 * aligned relative to the source would split every streaming store: plain
 * stores there too. */
#define CRC_NT_MIN_DELTA 256

static inline int crc_copy_streams(const unsigned char *d, const unsigned char *p, size_t n)
{
    uintptr_t delta = ((uintptr_t)d - (uintptr_t)p) & 4095;
    return n >= CRC_NT_MIN && (delta & 7) == 0 && delta >= CRC_NT_MIN_DELTA;
}
#define CRC_STORE(COPY, q, w)                                                          \
    do {                                                                               \
        if ((COPY) == 2)                                                               \
            _mm_stream_si64((long long *)(void *)(q), (long long)(w));                 \
        else                                                                           \
            st64(q, w);                                                                \
    } while (0)
#define CRC_HW_BODY(COPY)                                                              \
    while (n && ((uintptr_t)p & 7)) {                                                  \
        if (COPY)                                                                      \
            *d++ = *p;                                                                 \
        c0 = __builtin_ia32_crc32qi(c0, *p++);                                         \
        n--;                                                                           \
    }                                                                                  \
    CRC_HW_3WAY(COPY, CRC_LONG, crc_long_tab)                                          \
    CRC_HW_3WAY(COPY, CRC_SHORT, crc_short_tab)                                        \
    while (n >= 8) {                                                                   \
        uint64_t w = ld64(p);                                                          \
        if (COPY) {                                                                    \
            CRC_STORE(COPY, d, w);                                                     \
            d += 8;                                                                    \
        }                                                                              \
        c0 = (uint32_t)__builtin_ia32_crc32di(c0, w);                                  \
        p += 8;                                                                        \
        n -= 8;                                                                        \
    }                                                                                  \
    while (n) {                                                                        \
        if (COPY)                                                                      \
            *d++ = *p;                                                                 \
        c0 = __builtin_ia32_crc32qi(c0, *p++);                                         \
        n--;                                                                           \
    }                                                                                  \
    if ((COPY) == 2)                                                                   \
        _mm_sfence();                                                                  \
    return c0;

#define CRC_HW_3WAY(COPY, LEN, TAB)                                                    \
    while (n >= 3 * (LEN)) {                                                           \
        uint32_t c1 = 0, c2 = 0;                                                       \
        const unsigned char *end = p + (LEN);                                          \
        do {                                                                           \
            uint64_t w0 = ld64(p), w1 = ld64(p + (LEN)), w2 = ld64(p + 2 * (LEN));     \
            if (COPY) {                                                                \
                CRC_STORE(COPY, d, w0);                                                \
                CRC_STORE(COPY, d + (LEN), w1);                                        \
                CRC_STORE(COPY, d + 2 * (LEN), w2);                                    \
                d += 8;                                                                \
            }                                                                          \
            c0 = (uint32_t)__builtin_ia32_crc32di(c0, w0);                             \
            c1 = (uint32_t)__builtin_ia32_crc32di(c1, w1);                             \
            c2 = (uint32_t)__builtin_ia32_crc32di(c2, w2);                             \
            p += 8;                                                                    \
        } while (p < end);                                                             \
        c0 = crc_shift_tab(TAB, c0) ^ c1;                                              \
        c0 = crc_shift_tab(TAB, c0) ^ c2;                                              \
        p += 2 * (LEN);                                                                \
        if (COPY)                                                                      \
            d += 2 * (LEN);                                                            \
        n -= 3 * (LEN);                                                                \
    }

__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t c0, const unsigned char *p, size_t n)
{
    unsigned char *d = NULL;
    (void)d;
    CRC_HW_BODY(0)
}

__attribute__((target("sse4.2"))) static uint32_t crc_hw_copy_nt(uint32_t c0, unsigned char *d,
                                                                 const unsigned char *p, size_t n)
{
    CRC_HW_BODY(2)
}

__attribute__((target("sse4.2"))) static uint32_t crc_hw_copy_plain(uint32_t c0, unsigned char *d,
                                                                    const unsigned char *p, size_t n)
{
    CRC_HW_BODY(1)
}

__attribute__((target("sse4.2"))) static uint32_t crc_hw_copy(uint32_t c0, unsigned char *d,
                                                              const unsigned char *p, size_t n)
{
    if (crc_copy_streams(d, p, n)) {
        __atomic_fetch_add(&g_crc_nt_bytes, (int64_t)n, __ATOMIC_RELAXED);
        return crc_hw_copy_nt(c0, d, p, n);
    }
    return crc_hw_copy_plain(c0, d, p, n);
}
#endif

static void crc_init(void)
{
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? (c >> 1) ^ CRC32C_POLY : c >> 1;
        crc_sw_tab[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++)
        for (int k = 1; k < 8; k++)
            crc_sw_tab[k][n] = (crc_sw_tab[k - 1][n] >> 8) ^ crc_sw_tab[0][crc_sw_tab[k - 1][n] & 0xff];
    uint32_t p = 1u << 30; /* x^1 */
    crc_x2n[0] = p;
    for (int k = 1; k < 64; k++)
        crc_x2n[k] = p = multmodp(p, p);
    uint32_t opl = x2nmodp(CRC_LONG, 3), ops = x2nmodp(CRC_SHORT, 3);
    for (uint32_t n = 0; n < 256; n++)
        for (int k = 0; k < 4; k++) {
            crc_long_tab[k][n] = multmodp(opl, n << (8 * k));
            crc_short_tab[k][n] = multmodp(ops, n << (8 * k));
        }
#ifdef FPIO_CRC_HW
    __builtin_cpu_init();
    crc_use_hw = __builtin_cpu_supports("sse4.2") ? 1 : 0;
#endif
}

static inline void crc_ready(void) { pthread_once(&crc_once, crc_init); }

static uint32_t crc_reg(uint32_t c, const void *p, size_t n)
{
#ifdef FPIO_CRC_HW
    if (crc_use_hw)
        return crc_hw(c, p, n);
#endif
    return crc_sw(c, p, n);
}

static uint32_t crc_reg_copy(uint32_t c, void *d, const void *p, size_t n)
{
#ifdef FPIO_CRC_HW
    if (crc_use_hw)
        return crc_hw_copy(c, d, p, n);
#endif
    return crc_sw_copy(c, d, p, n);
}

uint32_t fpio_crc32c(uint32_t crc, const void *buf, size_t len)
{
    crc_ready();
    return crc_reg(crc ^ 0xffffffffu, buf, len) ^ 0xffffffffu;
}

uint32_t fpio_crc32c_copy(uint32_t crc, void *dst, const void *src, size_t len)
{
    crc_ready();
    return crc_reg_copy(crc ^ 0xffffffffu, dst, src, len) ^ 0xffffffffu;
}

uint32_t fpio_crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2)
{
    crc_ready();
    return crc_shift(crc1, len2) ^ crc2;
}

int fpio_crc_copy_streams(uintptr_t dst, uintptr_t src, size_t len)
{
#ifdef FPIO_CRC_HW
    return crc_copy_streams((const unsigned char *)dst, (const unsigned char *)src, len);
#else
    (void)dst, (void)src, (void)len;
    return 0;
#endif
}

int64_t fpio_crc_nt_bytes(void) { return __atomic_load_n(&g_crc_nt_bytes, __ATOMIC_RELAXED); }

int fpio_crc32c_impl(int want)
{
    crc_ready();
#ifdef FPIO_CRC_HW
    if (want == 0)
        crc_use_hw = 0;
    else if (want == 1 && __builtin_cpu_supports("sse4.2"))
        crc_use_hw = 1;
    return crc_use_hw;
#else
    (void)want;
    return 0;
#endif
}

/* ------------------------------------------------------------------ */
/* Requests and engines                                                */
/* ------------------------------------------------------------------ */

typedef struct fpio_req {
    struct iocb iocb;          /* aio: must stay put while in flight */
    struct fpio_req *next;     /* free list / thread-pool queues */
    int write;
    int fd;
    char *buf;                 /* current attempt */
    int64_t off;
    int64_t len;
    int64_t res;               /* result of the last attempt: bytes or -errno */
    /* pipeline bookkeeping */
    char *base;                /* first attempt */
    int64_t start;
    int64_t full;
    int64_t need_end;          /* file offset up to which the bytes matter */
    int64_t reached;           /* file offset reached so far */
    int slot;                  /* bounce slot, -1 when zero-copy */
    int file;
    int64_t piece;             /* zero-copy read: the piece it fills (-1: none) ... */
    int64_t ppos;              /* ... from this byte of the piece */
    int stalls;                /* attempts in a row that moved nothing new */
} fpio_req;

/* Short transfers in a row that end no further than the attempt before (an
 * O_DIRECT retry restarts at an aligned offset) before giving up: at the end
 * of a file a read stops moving forward. */
#define FPIO_MAX_STALLS 16

typedef struct {
    char *dst;
    int64_t woff;
    int64_t len;
    int64_t piece;             /* the piece and the byte of it that dst is */
    int64_t ppos;
} fpio_seg;

typedef struct {
    fpio_seg *v;
    int64_t n, cap;
} fpio_segs;

struct fpio_engine {
    int kind;
    int qd_max;
    int broken;
    fpio_req *reqs;
    fpio_req **done;           /* reap output, qd_max entries */
    char **slots;
    int nslots;
    int64_t slot_size;
    fpio_segs *segs;           /* per slot, for reads */
    /* aio */
    aio_context_t aio_ctx;
    struct io_event *events;
    /* io_uring */
    int ring_fd;
    void *sq_ptr, *cq_ptr;
    size_t sq_sz, cq_sz;
    struct io_uring_sqe *sqes;
    size_t sqes_sz;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array;
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_cqe *cqes;
    unsigned sq_pending;       /* sqes in the ring the kernel has not consumed */
    /* threads */
    pthread_t *threads;
    int nthreads;
    pthread_mutex_t mu;
    pthread_cond_t cv_work, cv_done;
    fpio_req *sq_first, *sq_last, *cq_first, *cq_last;
    int stop;
};

/* ---------------- kernel AIO ---------------- */

static int aio_open(fpio_engine *e, const char **why)
{
    e->aio_ctx = 0;
    if (syscall(SYS_io_setup, e->qd_max, &e->aio_ctx) < 0) {
        *why = "io_setup";
        return -errno;
    }
    e->events = calloc((size_t)e->qd_max, sizeof(struct io_event));
    if (!e->events) {
        syscall(SYS_io_destroy, e->aio_ctx);
        *why = "calloc";
        return -ENOMEM;
    }
    return 0;
}

static void *aio_destroy_main(void *ctx)
{
    syscall(SYS_io_destroy, (aio_context_t)(uintptr_t)ctx);
    return NULL;
}

/* io_destroy waits for an RCU grace period even when nothing is in flight:
 * 30 ms here, paid by every load and save that closes its engine.  When
 * nothing is in flight (the pipelines reap every request before they return,
 * unless the engine broke) a detached thread, with every signal blocked,
 * pays it instead; otherwise io_destroy runs here, because it also waits for
 * the requests still in flight, which DMA into the slots freed next. */
static void aio_close(fpio_engine *e)
{
    if (e->aio_ctx) {
        int deferred = 0;
        if (!e->broken) {
            pthread_attr_t attr;
            sigset_t all, old;
            pthread_t t;
            sigfillset(&all);
            if (pthread_attr_init(&attr) == 0) {
                pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
                pthread_attr_setstacksize(&attr, 64 * 1024);
                pthread_sigmask(SIG_BLOCK, &all, &old);
                deferred = pthread_create(&t, &attr, aio_destroy_main, (void *)(uintptr_t)e->aio_ctx) == 0;
                pthread_sigmask(SIG_SETMASK, &old, NULL);
                pthread_attr_destroy(&attr);
            }
        }
        if (!deferred)
            syscall(SYS_io_destroy, e->aio_ctx);
    }
    e->aio_ctx = 0;
    free(e->events);
}

static int aio_submit(fpio_engine *e, fpio_req *r)
{
    struct iocb *cb = &r->iocb;
    memset(cb, 0, sizeof(*cb));
    cb->aio_data = (uint64_t)(uintptr_t)r;
    cb->aio_lio_opcode = r->write ? IOCB_CMD_PWRITE : IOCB_CMD_PREAD;
    cb->aio_fildes = (uint32_t)r->fd;
    cb->aio_buf = (uint64_t)(uintptr_t)r->buf;
    cb->aio_nbytes = (uint64_t)r->len;
    cb->aio_offset = r->off;
    for (;;) {
        long n = syscall(SYS_io_submit, e->aio_ctx, 1L, &cb);
        if (n == 1)
            return 0;
        if (n < 0 && errno == EINTR)
            continue;
        if (n == 0)
            return -EAGAIN;
        return -errno;
    }
}

static int aio_reap(fpio_engine *e, int min_nr, int max_nr)
{
    long n;
    for (;;) {
        n = syscall(SYS_io_getevents, e->aio_ctx, (long)min_nr, (long)max_nr, e->events, NULL);
        if (n >= 0)
            break;
        if (errno != EINTR)
            return -errno;
    }
    for (long i = 0; i < n; i++) {
        fpio_req *r = (fpio_req *)(uintptr_t)e->events[i].data;
        r->res = e->events[i].res;
        e->done[i] = r;
    }
    return (int)n;
}

/* ---------------- io_uring ---------------- */

static int uring_enter(fpio_engine *e, unsigned to_submit, unsigned min_complete, unsigned flags)
{
    long n = syscall(__NR_io_uring_enter, e->ring_fd, to_submit, min_complete, flags, NULL, 0);
    return n < 0 ? -errno : (int)n;
}

static void uring_close(fpio_engine *e)
{
    if (e->sqes)
        munmap(e->sqes, e->sqes_sz);
    if (e->cq_ptr && e->cq_ptr != e->sq_ptr)
        munmap(e->cq_ptr, e->cq_sz);
    if (e->sq_ptr)
        munmap(e->sq_ptr, e->sq_sz);
    if (e->ring_fd >= 0)
        close(e->ring_fd);
    e->sqes = NULL;
    e->sq_ptr = e->cq_ptr = NULL;
    e->ring_fd = -1;
}

static int uring_open(fpio_engine *e, const char **why)
{
    struct io_uring_params p;
    memset(&p, 0, sizeof(p));
    e->ring_fd = -1;
    long fd = syscall(__NR_io_uring_setup, (unsigned)e->qd_max, &p);
    if (fd < 0) {
        *why = "io_uring_setup";
        return -errno;
    }
    e->ring_fd = (int)fd;
    e->sq_sz = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    e->cq_sz = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    int single = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
    if (single) {
        if (e->cq_sz > e->sq_sz)
            e->sq_sz = e->cq_sz;
        e->cq_sz = e->sq_sz;
    }
    void *sq = mmap(NULL, e->sq_sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
                    e->ring_fd, IORING_OFF_SQ_RING);
    if (sq == MAP_FAILED) {
        int err = errno;
        uring_close(e);
        *why = "mmap(io_uring SQ ring)";
        return -err;
    }
    e->sq_ptr = sq;
    if (single) {
        e->cq_ptr = sq;
    } else {
        void *cq = mmap(NULL, e->cq_sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
                        e->ring_fd, IORING_OFF_CQ_RING);
        if (cq == MAP_FAILED) {
            int err = errno;
            uring_close(e);
            *why = "mmap(io_uring CQ ring)";
            return -err;
        }
        e->cq_ptr = cq;
    }
    e->sqes_sz = p.sq_entries * sizeof(struct io_uring_sqe);
    void *sqes = mmap(NULL, e->sqes_sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
                      e->ring_fd, IORING_OFF_SQES);
    if (sqes == MAP_FAILED) {
        int err = errno;
        uring_close(e);
        *why = "mmap(io_uring SQEs)";
        return -err;
    }
    e->sqes = sqes;
    char *s = e->sq_ptr, *c = e->cq_ptr;
    e->sq_head = (unsigned *)(s + p.sq_off.head);
    e->sq_tail = (unsigned *)(s + p.sq_off.tail);
    e->sq_mask = (unsigned *)(s + p.sq_off.ring_mask);
    e->sq_array = (unsigned *)(s + p.sq_off.array);
    e->cq_head = (unsigned *)(c + p.cq_off.head);
    e->cq_tail = (unsigned *)(c + p.cq_off.tail);
    e->cq_mask = (unsigned *)(c + p.cq_off.ring_mask);
    e->cqes = (struct io_uring_cqe *)(c + p.cq_off.cqes);
    e->sq_pending = 0;
    return 0;
}

/* Hand the kernel the sqes it has not consumed yet; EINTR/EAGAIN/EBUSY leave
 * them in the ring for the next call. */
static int uring_flush(fpio_engine *e, unsigned min_complete)
{
    for (;;) {
        unsigned flags = min_complete ? IORING_ENTER_GETEVENTS : 0;
        if (e->sq_pending == 0 && min_complete == 0)
            return 0;
        int n = uring_enter(e, e->sq_pending, min_complete, flags);
        if (n >= 0) {
            e->sq_pending -= (unsigned)n < e->sq_pending ? (unsigned)n : e->sq_pending;
            return 0;
        }
        if (n == -EINTR)
            continue;
        if (n == -EAGAIN || n == -EBUSY)
            return min_complete ? n : 0;
        return n;
    }
}

static int uring_submit(fpio_engine *e, fpio_req *r)
{
    unsigned tail = *e->sq_tail;  /* only this thread writes the tail */
    unsigned head = __atomic_load_n(e->sq_head, __ATOMIC_ACQUIRE);
    if (tail - head > *e->sq_mask)  /* ring full: cannot happen while in flight <= entries */
        return -EAGAIN;
    unsigned idx = tail & *e->sq_mask;
    struct io_uring_sqe *sqe = &e->sqes[idx];
    memset(sqe, 0, sizeof(*sqe));
    sqe->opcode = r->write ? IORING_OP_WRITE : IORING_OP_READ;
    sqe->fd = r->fd;
    sqe->addr = (uint64_t)(uintptr_t)r->buf;
    sqe->len = (uint32_t)r->len;
    sqe->off = (uint64_t)r->off;
    sqe->user_data = (uint64_t)(uintptr_t)r;
    e->sq_array[idx] = idx;
    __atomic_store_n(e->sq_tail, tail + 1, __ATOMIC_RELEASE);
    e->sq_pending++;
    int rc = uring_flush(e, 0);
    if (rc < 0 && e->sq_pending > 0 && __atomic_load_n(e->sq_head, __ATOMIC_ACQUIRE) == tail) {
        /* the kernel did not take it: take it back */
        __atomic_store_n(e->sq_tail, tail, __ATOMIC_RELEASE);
        e->sq_pending--;
        return rc;
    }
    return 0;
}

static int uring_reap(fpio_engine *e, int min_nr, int max_nr)
{
    for (;;) {
        unsigned head = *e->cq_head;
        unsigned tail = __atomic_load_n(e->cq_tail, __ATOMIC_ACQUIRE);
        int n = 0;
        while (head != tail && n < max_nr) {
            struct io_uring_cqe *cqe = &e->cqes[head & *e->cq_mask];
            fpio_req *r = (fpio_req *)(uintptr_t)cqe->user_data;
            r->res = cqe->res;
            e->done[n++] = r;
            head++;
        }
        __atomic_store_n(e->cq_head, head, __ATOMIC_RELEASE);
        if (n > 0 || min_nr == 0) {
            int rc = uring_flush(e, 0);
            return rc < 0 ? rc : n;
        }
        int rc = uring_flush(e, 1);
        if (rc < 0 && rc != -EAGAIN && rc != -EBUSY)
            return rc;
    }
}

/* ---------------- thread pool ---------------- */

static void *worker_main(void *arg)
{
    fpio_engine *e = arg;
    for (;;) {
        pthread_mutex_lock(&e->mu);
        while (!e->sq_first && !e->stop)
            pthread_cond_wait(&e->cv_work, &e->mu);
        fpio_req *r = e->sq_first;
        if (!r) {
            pthread_mutex_unlock(&e->mu);
            return NULL;
        }
        e->sq_first = r->next;
        if (!e->sq_first)
            e->sq_last = NULL;
        pthread_mutex_unlock(&e->mu);

        ssize_t n;
        do {
            n = r->write ? pwrite(r->fd, r->buf, (size_t)r->len, r->off)
                         : pread(r->fd, r->buf, (size_t)r->len, r->off);
        } while (n < 0 && errno == EINTR);
        r->res = n < 0 ? -errno : n;

        pthread_mutex_lock(&e->mu);
        r->next = NULL;
        if (e->cq_last)
            e->cq_last->next = r;
        else
            e->cq_first = r;
        e->cq_last = r;
        pthread_cond_signal(&e->cv_done);
        pthread_mutex_unlock(&e->mu);
    }
}

static void threads_close(fpio_engine *e)
{
    if (!e->threads)
        return;
    pthread_mutex_lock(&e->mu);
    e->stop = 1;
    pthread_cond_broadcast(&e->cv_work);
    pthread_mutex_unlock(&e->mu);
    for (int i = 0; i < e->nthreads; i++)
        pthread_join(e->threads[i], NULL);
    free(e->threads);
    e->threads = NULL;
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->cv_work);
    pthread_cond_destroy(&e->cv_done);
}

static int threads_open(fpio_engine *e, int nthreads, const char **why)
{
    if (nthreads < 1)
        nthreads = 1;
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->cv_work, NULL);
    pthread_cond_init(&e->cv_done, NULL);
    e->threads = calloc((size_t)nthreads, sizeof(pthread_t));
    if (!e->threads) {
        *why = "calloc";
        return -ENOMEM;
    }
    e->nthreads = 0;
    for (int i = 0; i < nthreads; i++) {
        int rc = pthread_create(&e->threads[i], NULL, worker_main, e);
        if (rc != 0) {
            threads_close(e);
            *why = "pthread_create";
            return -rc;
        }
        e->nthreads++;
    }
    return 0;
}

static int threads_submit(fpio_engine *e, fpio_req *r)
{
    pthread_mutex_lock(&e->mu);
    r->next = NULL;
    if (e->sq_last)
        e->sq_last->next = r;
    else
        e->sq_first = r;
    e->sq_last = r;
    pthread_cond_signal(&e->cv_work);
    pthread_mutex_unlock(&e->mu);
    return 0;
}

static int threads_reap(fpio_engine *e, int min_nr, int max_nr)
{
    int n = 0;
    pthread_mutex_lock(&e->mu);
    while (!e->cq_first && min_nr > 0)
        pthread_cond_wait(&e->cv_done, &e->mu);
    while (e->cq_first && n < max_nr) {
        fpio_req *r = e->cq_first;
        e->cq_first = r->next;
        e->done[n++] = r;
    }
    if (!e->cq_first)
        e->cq_last = NULL;
    pthread_mutex_unlock(&e->mu);
    return n;
}

/* ---------------- the common interface ---------------- */

static int be_submit(fpio_engine *e, fpio_req *r)
{
    switch (e->kind) {
    case FPIO_AIO: return aio_submit(e, r);
    case FPIO_URING: return uring_submit(e, r);
    default: return threads_submit(e, r);
    }
}

/* At most max_nr completed requests land in e->done[0..n); returns n or -errno. */
static int be_reap(fpio_engine *e, int min_nr, int max_nr)
{
    switch (e->kind) {
    case FPIO_AIO: return aio_reap(e, min_nr, max_nr);
    case FPIO_URING: return uring_reap(e, min_nr, max_nr);
    default: return threads_reap(e, min_nr, max_nr);
    }
}

int fpio_engine_open(int kind, int qd_max, int nthreads, char **slots, int nslots,
                     int64_t slot_size, fpio_engine **out, const char **why)
{
    *why = "";
    if (qd_max < 1 || nslots < qd_max + 1) {
        *why = "queue depth";
        return -EINVAL;
    }
    fpio_engine *e = calloc(1, sizeof(*e));
    if (!e) {
        *why = "calloc";
        return -ENOMEM;
    }
    e->kind = kind;
    e->qd_max = qd_max;
    e->ring_fd = -1;
    e->slots = slots;
    e->nslots = nslots;
    e->slot_size = slot_size;
    e->reqs = calloc((size_t)qd_max, sizeof(fpio_req));
    e->done = calloc((size_t)qd_max, sizeof(fpio_req *));
    e->segs = calloc((size_t)nslots, sizeof(fpio_segs));
    if (!e->reqs || !e->done || !e->segs) {
        fpio_engine_close(e);
        *why = "calloc";
        return -ENOMEM;
    }
    int rc;
    switch (kind) {
    case FPIO_AIO: rc = aio_open(e, why); break;
    case FPIO_URING: rc = uring_open(e, why); break;
    case FPIO_THREADS: rc = threads_open(e, nthreads, why); break;
    default: *why = "engine kind"; rc = -EINVAL;
    }
    if (rc < 0) {
        e->kind = -1;  /* nothing of the backend to close */
        fpio_engine_close(e);
        return rc;
    }
    *out = e;
    return 0;
}

void fpio_engine_close(fpio_engine *e)
{
    if (!e)
        return;
    switch (e->kind) {
    case FPIO_AIO: aio_close(e); break;
    case FPIO_URING: uring_close(e); break;
    case FPIO_THREADS: threads_close(e); break;
    default: break;
    }
    if (e->segs)
        for (int i = 0; i < e->nslots; i++)
            free(e->segs[i].v);
    free(e->segs);
    free(e->reqs);
    free(e->done);
    free(e);
}

/* ------------------------------------------------------------------ */
/* The pipeline                                                        */
/* ------------------------------------------------------------------ */

typedef struct {
    int64_t piece, ppos, len;
    const char *ptr;
} fpio_todo;

typedef struct {
    fpio_engine *e;
    int write;
    const int *fds;
    int64_t A, B, gap;
    int qd;
    int inflight;
    fpio_req *free_reqs;
    int *free_slots;
    int nfree_slots;
    fpio_result *res;
    /* the open bounce window */
    int cur;                  /* slot, -1 when none */
    int wfile;
    int64_t ws, wend;
    /* checksums (NULL: off), and the CRC run being extended */
    const fpio_crc *crc;
    const fpio_piece *pieces;
    int64_t cp_idx;           /* entry of crc->out, -1 when none */
    int64_t cp_pos, cp_bend;  /* where the run stopped in its piece; its block's end */
    uint32_t cp_reg;
    /* zero-copy reads that landed and wait for their checksum (a FIFO ring) */
    fpio_todo *todo;
    int ntodo, todo_head, todo_cap;
} pctx;

/* Fold the open CRC run into its entry: shifted over the rest of its block
 * (the parts of a block may complete in any order; see the CRC section). */
static void crc_flush(pctx *c)
{
    if (c->cp_idx < 0)
        return;
    c->crc->out[c->cp_idx] ^= crc_shift(c->cp_reg, (uint64_t)(c->cp_bend - c->cp_pos));
    c->cp_idx = -1;
}

/* Checksum `len` bytes of piece `piece` from its byte `pos`, read at `src`;
 * with dst, copying them there in the same pass. */
static void crc_part(pctx *c, int64_t piece, int64_t pos, char *dst, const char *src, int64_t len)
{
    const fpio_crc *k = c->crc;
    if (k->skip && k->skip[piece]) {
        if (dst)
            memcpy(dst, src, (size_t)len);
        return;
    }
    int64_t plen = c->pieces[piece].len;
    int64_t bsz = k->block > 0 ? k->block : plen;
    int64_t org = k->block > 0 && k->origin ? k->origin[piece] : 0;
    while (len > 0) {
        /* the piece's byte pos is byte pos + org of the grid of blocks */
        int64_t gb = (pos + org) / bsz;
        int64_t bstart = gb * bsz - org, bend = bstart + bsz;
        if (bstart < 0)
            bstart = 0;
        if (bend > plen)
            bend = plen;
        int64_t n = bend - pos < len ? bend - pos : len;
        int64_t idx = k->first[piece] + gb - org / bsz;
        uint32_t reg;
        if (c->cp_idx == idx && c->cp_pos == pos) {
            reg = c->cp_reg;
        } else {
            crc_flush(c);
            reg = pos == bstart ? 0xffffffffu : 0;
        }
        reg = dst ? crc_reg_copy(reg, dst, src, (size_t)n) : crc_reg(reg, src, (size_t)n);
        c->res->crc_bytes += n;
        c->cp_idx = idx;
        c->cp_pos = pos + n;
        c->cp_bend = bend;
        c->cp_reg = reg;
        pos += n;
        src += n;
        if (dst)
            dst += n;
        len -= n;
    }
}

/* After the last part: the standard CRC-32C of each block (0 for an empty piece). */
static void crc_finish(pctx *c, int64_t npieces)
{
    crc_flush(c);
    const fpio_crc *k = c->crc;
    for (int64_t i = 0; i < npieces; i++) {
        if (c->pieces[i].len == 0 || (k->skip && k->skip[i])) {
            k->out[k->first[i]] = 0;
            continue;
        }
        for (int64_t j = k->first[i]; j < k->first[i + 1]; j++)
            k->out[j] ^= 0xffffffffu;
    }
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static inline int64_t align_down(int64_t x, int64_t a) { return x - x % a; }
static inline int64_t align_up(int64_t x, int64_t a) { return align_down(x + a - 1, a); }

/* Record the first error only. */
static void set_err(pctx *c, int err, int file, const char *op, int64_t at, int64_t len)
{
    fpio_result *r = c->res;
    if (r->err)
        return;
    r->err = err;
    r->file = file;
    r->op = op;
    r->at = at;
    r->len = len;
}

static void release(pctx *c, fpio_req *r)
{
    if (r->slot >= 0)
        c->free_slots[c->nfree_slots++] = r->slot;
    r->next = c->free_reqs;
    c->free_reqs = r;
}

static void scatter(pctx *c, fpio_req *r)
{
    fpio_segs *s = &c->e->segs[r->slot];
    char *src = c->e->slots[r->slot];
    if (c->crc) {
        for (int64_t i = 0; i < s->n; i++)
            crc_part(c, s->v[i].piece, s->v[i].ppos, s->v[i].dst, src + s->v[i].woff, s->v[i].len);
        return;
    }
    for (int64_t i = 0; i < s->n; i++)
        memcpy(s->v[i].dst, src + s->v[i].woff, (size_t)s->v[i].len);
}

/* Submit r, retrying EAGAIN a bounded number of times. 0, or -1 with the error recorded. */
static int submit_req(pctx *c, fpio_req *r);

static void on_complete(pctx *c, fpio_req *r)
{
    int64_t res = r->res;
    fault_kill();
    int ferr = fault_take();
    if (ferr)
        res = -ferr;
    if (res > 1 && __atomic_load_n(&g_fault_short, __ATOMIC_ACQUIRE) > 0
        && __atomic_fetch_sub(&g_fault_short, 1, __ATOMIC_ACQ_REL) > 0)
        res = (res + 1) / 2;  /* pretend the kernel moved only half of it */
    const char *op = r->write ? "write" : "read";
    if (res < 0) {
        set_err(c, (int)-res, r->file, op, r->off, r->len);
        release(c, r);
        return;
    }
    c->res->bytes_io += r->write ? 0 : res;
    int64_t reached = r->off + res;
    if (reached > r->reached) {
        r->reached = reached;
        r->stalls = 0;
    } else if (res > 0 && r->stalls < FPIO_MAX_STALLS) {
        r->stalls++;  /* a short transfer inside what an earlier attempt already moved */
    } else {
        if (r->write) {
            set_err(c, EIO, r->file, "write made no progress", r->off, r->len);
        } else if (!c->res->err) {  /* reads stop moving forward at the end of the file */
            set_err(c, EIO, r->file, "read", r->reached, r->len);
            c->res->eof = 1;
            c->res->need = r->need_end;
        }
        release(c, r);
        return;
    }
    if (r->reached >= r->need_end) {
        if (!r->write && !c->res->err) {
            if (r->slot >= 0)
                scatter(c, r);
            else if (c->crc && r->piece >= 0 && c->ntodo < c->todo_cap) {
                /* landed in the piece: checksum it later, while the queue is full */
                fpio_todo *t = &c->todo[(c->todo_head + c->ntodo++) % c->todo_cap];
                t->piece = r->piece;
                t->ppos = r->ppos;
                t->ptr = r->base;
                t->len = r->full;
            } else if (c->crc && r->piece >= 0) {
                crc_part(c, r->piece, r->ppos, NULL, r->base, r->full);
            }
        }
        release(c, r);
        return;
    }
    if (c->res->err) {
        release(c, r);
        return;
    }
    /* A short transfer: go on from where it stopped, or from the aligned offset
     * below that when the fd is O_DIRECT (rewriting or rereading a few bytes). */
    int64_t a = r->reached;
    if (a % c->A) {
        int fl = fcntl(r->fd, F_GETFL);
        if (fl < 0 || (fl & O_DIRECT))
            a = align_down(a, c->A);
    }
    r->buf = r->base + (a - r->start);
    r->off = a;
    r->len = r->start + r->full - a;
    submit_req(c, r);
}

static int pump(pctx *c, int min_nr);

/* The oldest pending checksum of a zero-copy read. */
static void todo_one(pctx *c)
{
    fpio_todo *t = &c->todo[c->todo_head];
    c->todo_head = (c->todo_head + 1) % c->todo_cap;
    c->ntodo--;
    if (!c->res->err)
        crc_part(c, t->piece, t->ppos, NULL, t->ptr, t->len);
}

/* Wait for a completion; pending checksums are computed first, while the
 * requests in flight keep the device busy. */
static int wait_one(pctx *c)
{
    if (c->ntodo > 0) {
        todo_one(c);
        return pump(c, 0);
    }
    return pump(c, 1);
}

/* Reap at least `min_nr` completions (when any are in flight) and handle them. */
static int pump(pctx *c, int min_nr)
{
    if (c->inflight == 0)
        return 0;
    /* A read's completion carries work (the copy out of its bounce buffer, a
     * checksum): take one at a time, so that the caller submits the next
     * request before the next copy instead of after a whole batch of them
     * (the queue would run dry while the batch is copied). */
    int n = be_reap(c->e, min_nr, c->write ? c->e->qd_max : 1);
    if (n < 0) {
        /* cannot reap: the requests in flight are lost to us */
        set_err(c, -n, -1, "reap", 0, 0);
        __atomic_fetch_sub(&g_inflight, c->inflight, __ATOMIC_RELAXED);
        c->inflight = 0;
        c->e->broken = 1;
        return -1;
    }
    c->inflight -= n;
    __atomic_fetch_sub(&g_inflight, n, __ATOMIC_RELAXED);
    /* copy out first: on_complete may resubmit, and reaping again would overwrite done[] */
    fpio_req *batch[n > 0 ? n : 1];
    memcpy(batch, c->e->done, (size_t)n * sizeof(fpio_req *));
    for (int i = 0; i < n; i++)
        on_complete(c, batch[i]);
    return 0;
}

static int submit_req(pctx *c, fpio_req *r)
{
    for (int tries = 0;; tries++) {
        int rc = be_submit(c->e, r);
        if (rc == 0) {
            c->inflight++;
            __atomic_fetch_add(&g_inflight, 1, __ATOMIC_RELAXED);
            c->res->requests++;
            return 0;
        }
        if (rc == -EAGAIN && tries < 10000) {
            struct timespec ts = {0, 100000};
            nanosleep(&ts, NULL);
            continue;
        }
        set_err(c, -rc, r->file, r->write ? "submit write" : "submit read", r->off, r->len);
        release(c, r);
        return -1;
    }
}

/* Issue one request once fewer than qd are in flight. */
static int issue(pctx *c, int file, char *buf, int64_t off, int64_t len, int64_t need_end, int slot,
                 int64_t piece, int64_t ppos)
{
    while (c->inflight >= c->qd && !c->res->err)
        if (wait_one(c) < 0)
            break;
    if (c->res->err) {
        if (slot >= 0)
            c->free_slots[c->nfree_slots++] = slot;
        return -1;
    }
    fpio_req *r = c->free_reqs;
    c->free_reqs = r->next;
    r->write = c->write;
    r->fd = c->fds[file];
    r->file = file;
    r->base = r->buf = buf;
    r->start = r->off = off;
    r->full = r->len = len;
    r->need_end = need_end;
    r->reached = off;
    r->stalls = 0;
    r->slot = slot;
    r->piece = piece;
    r->ppos = ppos;
    r->res = 0;
    if (c->write)
        c->res->bytes_io += len;
    return submit_req(c, r);
}

static int get_slot(pctx *c)
{
    while (c->nfree_slots == 0 && !c->res->err) {
        if (c->inflight == 0) {
            set_err(c, EINVAL, -1, "bounce pool exhausted", 0, 0);
            break;
        }
        if (wait_one(c) < 0)
            break;
    }
    if (c->res->err)
        return -1;
    return c->free_slots[--c->nfree_slots];
}

/* Send the open window: writes are padded with zeros to the alignment. */
static int flush_window(pctx *c)
{
    if (c->cur < 0)
        return 0;
    int slot = c->cur;
    c->cur = -1;
    char *buf = c->e->slots[slot];
    int64_t used = c->wend - c->ws;
    int64_t len = align_up(used, c->A);
    if (c->write) {
        memset(buf + used, 0, (size_t)(len - used));
        return issue(c, c->wfile, buf, c->ws, len, c->ws + len, slot, -1, 0);
    }
    return issue(c, c->wfile, buf, c->ws, len, c->wend, slot, -1, 0);
}

static int open_window(pctx *c, int file, int64_t off)
{
    int slot = get_slot(c);
    if (slot < 0)
        return -1;
    c->cur = slot;
    c->wfile = file;
    c->ws = align_down(off, c->A);
    c->wend = c->ws;
    c->e->segs[slot].n = 0;
    return 0;
}

static int add_seg(pctx *c, char *dst, int64_t woff, int64_t len, int64_t piece, int64_t ppos)
{
    fpio_segs *s = &c->e->segs[c->cur];
    if (s->n == s->cap) {
        int64_t cap = s->cap ? 2 * s->cap : 64;
        fpio_seg *v = realloc(s->v, (size_t)cap * sizeof(fpio_seg));
        if (!v) {
            set_err(c, ENOMEM, -1, "realloc", 0, 0);
            return -1;
        }
        s->v = v;
        s->cap = cap;
    }
    s->v[s->n].dst = dst;
    s->v[s->n].woff = woff;
    s->v[s->n].len = len;
    s->v[s->n].piece = piece;
    s->v[s->n].ppos = ppos;
    s->n++;
    return 0;
}

/* Pieces whose memory and offset are aligned and that span at least a block
 * go straight between the caller's memory and the file, block by block;
 * returns the number of bytes so handled (a multiple of A). */
static int64_t direct_body(pctx *c, const fpio_piece *p, int64_t i)
{
    if (p->len < c->B || (uintptr_t)p->ptr % (uintptr_t)c->A || p->off % c->A)
        return 0;
    if (flush_window(c) < 0)
        return -1;
    int64_t body = align_down(p->len, c->A);
    for (int64_t pos = 0; pos < body; pos += c->B) {
        int64_t n = body - pos < c->B ? body - pos : c->B;
        if (issue(c, p->file, p->ptr + pos, p->off + pos, n, p->off + pos + n, -1, i, pos) < 0)
            return -1;
        if (c->write && c->crc)  /* on the source, while the request is in flight */
            crc_part(c, i, pos, NULL, p->ptr + pos, n);
    }
    c->res->zc_bytes += body;
    return body;
}

static int write_piece(pctx *c, const fpio_piece *p, int64_t i)
{
    int64_t done = direct_body(c, p, i);
    if (done < 0)
        return -1;
    const char *src = p->ptr + done;
    int64_t off = p->off + done, n = p->len - done;
    while (n > 0) {
        if (c->cur >= 0 && off >= c->ws + c->B && flush_window(c) < 0)
            return -1;
        if (c->cur < 0 && open_window(c, p->file, off) < 0)
            return -1;
        char *buf = c->e->slots[c->cur];
        if (off > c->wend)  /* a gap inside the window reads back as zeros */
            memset(buf + (c->wend - c->ws), 0, (size_t)(off - c->wend));
        int64_t k = c->ws + c->B - off;
        if (k > n)
            k = n;
        if (c->crc)  /* fused with the copy: one pass over the bytes */
            crc_part(c, i, src - p->ptr, buf + (off - c->ws), src, k);
        else
            memcpy(buf + (off - c->ws), src, (size_t)k);
        c->wend = off + k;
        src += k;
        off += k;
        n -= k;
        if (c->wend == c->ws + c->B && flush_window(c) < 0)
            return -1;
    }
    return 0;
}

static int read_piece(pctx *c, const fpio_piece *p, int64_t i)
{
    int64_t done = direct_body(c, p, i);
    if (done < 0)
        return -1;
    char *dst = p->ptr + done;
    int64_t off = p->off + done, n = p->len - done;
    while (n > 0) {
        if (c->cur >= 0 && (off < c->ws || off >= c->ws + c->B || off > c->wend + c->gap)
            && flush_window(c) < 0)
            return -1;
        if (c->cur < 0 && open_window(c, p->file, off) < 0)
            return -1;
        int64_t k = c->ws + c->B - off;
        if (k > n)
            k = n;
        if (add_seg(c, dst, off - c->ws, k, i, dst - p->ptr) < 0)
            return -1;
        if (off + k > c->wend)
            c->wend = off + k;
        dst += k;
        off += k;
        n -= k;
    }
    return 0;
}

/* Before writing: every fd must be open for writing, and a regular file is
 * first extended (never shrunk) to the aligned end of its pieces, so that no
 * write extends the file: ext4 completes extending O_DIRECT writes
 * synchronously (one at a time), which halves throughput on fresh files. */
static int presize(pctx *c, int nfiles, const fpio_piece *pieces, int64_t npieces)
{
    int64_t i = 0;
    for (int f = 0; f < nfiles; f++) {
        int64_t end = 0;
        for (; i < npieces && pieces[i].file == f; i++)
            if (pieces[i].len > 0 && pieces[i].off + pieces[i].len > end)
                end = pieces[i].off + pieces[i].len;
        if (end == 0)
            continue;
        end = align_up(end, c->A);
        int fd = c->fds[f];
        int fl = fcntl(fd, F_GETFL);
        if (fl < 0) {
            set_err(c, errno, f, "fcntl(F_GETFL)", 0, 0);
            return -1;
        }
        if ((fl & O_ACCMODE) == O_RDONLY) {
            set_err(c, EBADF, f, "fd is not open for writing", 0, 0);
            return -1;
        }
        struct stat st;
        if (fstat(fd, &st) < 0) {
            set_err(c, errno, f, "fstat", 0, 0);
            return -1;
        }
        if (!S_ISREG(st.st_mode) || st.st_size >= end)
            continue;
        int rc;
        do {
            rc = ftruncate(fd, end);
        } while (rc < 0 && errno == EINTR);
        if (rc < 0) {
            set_err(c, errno, f, "ftruncate", end, 0);
            return -1;
        }
    }
    return 0;
}

static int run(fpio_engine *e, int write, const int *fds, int nfiles, const fpio_piece *pieces,
               int64_t npieces, int64_t bs, int qd, int64_t align, int64_t gap, int sync,
               const fpio_crc *crc, fpio_result *res)
{
    double t0 = now_s();
    memset(res, 0, sizeof(*res));
    res->file = -1;
    res->op = "";
    if (e->broken) {
        res->err = EIO;
        res->op = "engine unusable after an earlier failure to reap its requests";
        return -1;
    }
    if (qd < 1 || qd > e->qd_max || bs < align || bs > e->slot_size || bs % align) {
        res->err = EINVAL;
        res->op = "engine parameters";
        return -1;
    }
    int free_slots[e->nslots];
    pctx c = {
        .e = e, .write = write, .fds = fds, .A = align, .B = bs, .gap = gap, .qd = qd,
        .free_slots = free_slots, .nfree_slots = e->nslots, .res = res, .cur = -1, .wfile = -1,
        .crc = crc, .pieces = pieces, .cp_idx = -1,
    };
    fpio_todo todo_ring[64];
    if (crc) {
        crc_ready();
        if (!write) {
            c.todo = todo_ring;
            c.todo_cap = 64;
        }
    }
    for (int i = 0; i < e->nslots; i++)
        free_slots[i] = e->nslots - 1 - i;
    c.free_reqs = NULL;
    for (int i = e->qd_max - 1; i >= 0; i--) {
        e->reqs[i].next = c.free_reqs;
        c.free_reqs = &e->reqs[i];
    }

    /* Offsets and lengths must stay far from int64's end: every file offset
     * the pipeline computes (an extent's end rounded up to the alignment, a
     * window's end) must not overflow. The Python layer checks this too. */
    for (int64_t i = 0; i < npieces; i++) {
        int64_t end;
        const fpio_piece *p = &pieces[i];
        if (p->len < 0 || p->off < 0 || p->file < 0 || p->file >= nfiles ||
            fpio_add_i64(p->off, p->len, &end) < 0 || fpio_add_i64(end, 2 * bs, &end) < 0) {
            res->err = EINVAL;
            res->op = "piece offset or length out of range";
            res->file = p->file >= 0 && p->file < nfiles ? p->file : -1;
            res->at = p->off;
            res->len = p->len;
            return -1;
        }
    }
    if (write)
        presize(&c, nfiles, pieces, npieces);
    for (int64_t i = 0; i < npieces && !res->err; i++) {
        const fpio_piece *p = &pieces[i];
        res->bytes += p->len;
        if (p->len == 0)
            continue;
        if (p->file != c.wfile && flush_window(&c) < 0)
            break;
        c.wfile = p->file;
        if ((write ? write_piece(&c, p, i) : read_piece(&c, p, i)) < 0)
            break;
    }
    if (!res->err)
        flush_window(&c);
    else if (c.cur >= 0) {
        free_slots[c.nfree_slots++] = c.cur;
        c.cur = -1;
    }
    while (c.inflight > 0)
        if (wait_one(&c) < 0)
            break;
    while (c.ntodo > 0)
        todo_one(&c);

    if (write && sync && !res->err) {
        for (int f = 0; f < nfiles; f++) {
            int rc;
            do {
                rc = fdatasync(fds[f]);
            } while (rc < 0 && errno == EINTR);
            if (rc < 0) {
                set_err(&c, errno, f, "fdatasync", 0, 0);
                break;
            }
        }
    }
    if (crc && !res->err)
        crc_finish(&c, npieces);
    res->seconds = now_s() - t0;
    return res->err ? -1 : 0;
}

int fpio_write(fpio_engine *e, const int *fds, int nfiles, const fpio_piece *pieces,
               int64_t npieces, int64_t block_size, int qd, int64_t align, int sync,
               const fpio_crc *crc, fpio_result *res)
{
    return run(e, 1, fds, nfiles, pieces, npieces, block_size, qd, align, 0, sync, crc, res);
}

int fpio_read(fpio_engine *e, const int *fds, int nfiles, const fpio_piece *pieces,
              int64_t npieces, int64_t block_size, int qd, int64_t align, int64_t gap,
              const fpio_crc *crc, fpio_result *res)
{
    return run(e, 0, fds, nfiles, pieces, npieces, block_size, qd, align, gap, 0, crc, res);
}

/* ------------------------------------------------------------------ */
/* Odds and ends                                                       */
/* ------------------------------------------------------------------ */

int fpio_dioalign(const char *path, uint32_t *mem, uint32_t *off)
{
    struct statx st;
    memset(&st, 0, sizeof(st));
    *mem = *off = 0;
    if (syscall(SYS_statx, AT_FDCWD, path, 0, STATX_DIOALIGN, &st) < 0)
        return -errno;
    if (st.stx_mask & STATX_DIOALIGN) {
        *mem = st.stx_dio_mem_align;
        *off = st.stx_dio_offset_align;
    }
    return 0;
}

void fpio_copy_many(char *const *dst, char *const *src, const int64_t *len, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        memcpy(dst[i], src[i], (size_t)len[i]);
}

void fpio_copy_crc_many(char *const *dst, char *const *src, const int64_t *len, int64_t n, int64_t block,
                        const int64_t *first, uint32_t *out)
{
    crc_ready();
    for (int64_t i = 0; i < n; i++) {
        uint32_t *o = out + first[i];
        if (len[i] == 0) {
            *o = 0;
            continue;
        }
        for (int64_t at = 0; at < len[i]; at += block) {
            size_t k = (size_t)(len[i] - at < block ? len[i] - at : block);
            *o++ = crc_reg_copy(0xffffffffu, dst[i] + at, src[i] + at, k) ^ 0xffffffffu;
        }
    }
}

/* Pulling from a peer process: process_vm_readv, FPIO_PULL_IOV iovecs a call
 * (the kernel's UIO_MAXIOV).  The kernel stops at the first iovec it cannot
 * read and returns what it copied; the rest is retried from there, and a
 * retry that copies nothing is EFAULT. */
#define FPIO_PULL_IOV 1024

int fpio_pull(int pid, char *dst, uint64_t remote, const int64_t *starts, int64_t nruns, int64_t run_len)
{
    struct iovec rv[FPIO_PULL_IOV];
    int64_t i = 0, skip = 0; /* run i, skip bytes of it already copied */
    int64_t total, end;
    if (nruns < 0 || run_len < 0 || fpio_mul_i64(nruns, run_len, &total) < 0)
        return -EOVERFLOW;
    for (int64_t j = 0; j < nruns; j++)
        if (starts[j] < 0 || fpio_add_i64(starts[j], run_len, &end) < 0 || (uint64_t)end > UINT64_MAX - remote)
            return -EOVERFLOW;
    while (i < nruns && run_len > 0) {
        int k = 0;
        for (int64_t j = i; j < nruns && k < FPIO_PULL_IOV; j++, k++) {
            int64_t off = j == i ? skip : 0;
            rv[k].iov_base = (void *)(uintptr_t)(remote + (uint64_t)starts[j] + (uint64_t)off);
            rv[k].iov_len = (size_t)(run_len - off);
        }
        size_t want = (size_t)k * (size_t)run_len - (size_t)skip;
        struct iovec lv = {dst + i * run_len + skip, want};
        ssize_t got = process_vm_readv(pid, &lv, 1, rv, (unsigned long)k, 0);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (got == 0)
            return -EFAULT;
        int64_t at = skip + (int64_t)got; /* bytes from the start of run i */
        i += at / run_len;
        skip = at % run_len;
    }
    return 0;
}
