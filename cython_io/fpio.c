/* fpio.c: engines and pipelines of fp_dcp._aio. See fpio.h. */
#define _GNU_SOURCE
#include "fpio.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/aio_abi.h>
#include <linux/io_uring.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#ifndef STATX_DIOALIGN
#define STATX_DIOALIGN 0x00002000U
#endif

/* ------------------------------------------------------------------ */
/* Process-wide counters and fault injection                           */
/* ------------------------------------------------------------------ */

static long g_inflight;
static int g_fault_err;
static long g_fault_after;
static long g_fault_short;

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

static void aio_close(fpio_engine *e)
{
    if (e->aio_ctx)
        syscall(SYS_io_destroy, e->aio_ctx);  /* waits for anything still in flight */
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

static int aio_reap(fpio_engine *e, int min_nr)
{
    long n;
    for (;;) {
        n = syscall(SYS_io_getevents, e->aio_ctx, (long)min_nr, (long)e->qd_max, e->events, NULL);
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

static int uring_reap(fpio_engine *e, int min_nr)
{
    for (;;) {
        unsigned head = *e->cq_head;
        unsigned tail = __atomic_load_n(e->cq_tail, __ATOMIC_ACQUIRE);
        int n = 0;
        while (head != tail && n < e->qd_max) {
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

static int threads_reap(fpio_engine *e, int min_nr)
{
    int n = 0;
    pthread_mutex_lock(&e->mu);
    while (!e->cq_first && min_nr > 0)
        pthread_cond_wait(&e->cv_done, &e->mu);
    while (e->cq_first && n < e->qd_max) {
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

/* Completed requests land in e->done[0..n); returns n or -errno. */
static int be_reap(fpio_engine *e, int min_nr)
{
    switch (e->kind) {
    case FPIO_AIO: return aio_reap(e, min_nr);
    case FPIO_URING: return uring_reap(e, min_nr);
    default: return threads_reap(e, min_nr);
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
} pctx;

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
    for (int64_t i = 0; i < s->n; i++)
        memcpy(s->v[i].dst, src + s->v[i].woff, (size_t)s->v[i].len);
}

/* Submit r, retrying EAGAIN a bounded number of times. 0, or -1 with the error recorded. */
static int submit_req(pctx *c, fpio_req *r);

static void on_complete(pctx *c, fpio_req *r)
{
    int64_t res = r->res;
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
        if (!r->write && r->slot >= 0 && !c->res->err)
            scatter(c, r);
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

/* Reap at least `min_nr` completions (when any are in flight) and handle them. */
static int pump(pctx *c, int min_nr)
{
    if (c->inflight == 0)
        return 0;
    int n = be_reap(c->e, min_nr);
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
static int issue(pctx *c, int file, char *buf, int64_t off, int64_t len, int64_t need_end, int slot)
{
    while (c->inflight >= c->qd && !c->res->err)
        if (pump(c, 1) < 0)
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
        if (pump(c, 1) < 0)
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
        return issue(c, c->wfile, buf, c->ws, len, c->ws + len, slot);
    }
    return issue(c, c->wfile, buf, c->ws, len, c->wend, slot);
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

static int add_seg(pctx *c, char *dst, int64_t woff, int64_t len)
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
    s->n++;
    return 0;
}

/* Pieces whose memory and offset are aligned and that span at least a block
 * go straight between the caller's memory and the file, block by block;
 * returns the number of bytes so handled (a multiple of A). */
static int64_t direct_body(pctx *c, const fpio_piece *p)
{
    if (p->len < c->B || (uintptr_t)p->ptr % (uintptr_t)c->A || p->off % c->A)
        return 0;
    if (flush_window(c) < 0)
        return -1;
    int64_t body = align_down(p->len, c->A);
    for (int64_t pos = 0; pos < body; pos += c->B) {
        int64_t n = body - pos < c->B ? body - pos : c->B;
        if (issue(c, p->file, p->ptr + pos, p->off + pos, n, p->off + pos + n, -1) < 0)
            return -1;
    }
    c->res->zc_bytes += body;
    return body;
}

static int write_piece(pctx *c, const fpio_piece *p)
{
    int64_t done = direct_body(c, p);
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

static int read_piece(pctx *c, const fpio_piece *p)
{
    int64_t done = direct_body(c, p);
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
        if (add_seg(c, dst, off - c->ws, k) < 0)
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
               fpio_result *res)
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
    };
    for (int i = 0; i < e->nslots; i++)
        free_slots[i] = e->nslots - 1 - i;
    c.free_reqs = NULL;
    for (int i = e->qd_max - 1; i >= 0; i--) {
        e->reqs[i].next = c.free_reqs;
        c.free_reqs = &e->reqs[i];
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
        if ((write ? write_piece(&c, p) : read_piece(&c, p)) < 0)
            break;
    }
    if (!res->err)
        flush_window(&c);
    else if (c.cur >= 0) {
        free_slots[c.nfree_slots++] = c.cur;
        c.cur = -1;
    }
    while (c.inflight > 0)
        if (pump(&c, 1) < 0)
            break;

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
    res->seconds = now_s() - t0;
    return res->err ? -1 : 0;
}

int fpio_write(fpio_engine *e, const int *fds, int nfiles, const fpio_piece *pieces,
               int64_t npieces, int64_t block_size, int qd, int64_t align, int sync,
               fpio_result *res)
{
    return run(e, 1, fds, nfiles, pieces, npieces, block_size, qd, align, 0, sync, res);
}

int fpio_read(fpio_engine *e, const int *fds, int nfiles, const fpio_piece *pieces,
              int64_t npieces, int64_t block_size, int qd, int64_t align, int64_t gap,
              fpio_result *res)
{
    return run(e, 0, fds, nfiles, pieces, npieces, block_size, qd, align, gap, 0, res);
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
