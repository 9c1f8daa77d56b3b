/* fpio_uring.c: the io_uring backend (io_uring_setup/io_uring_enter through
 * raw system calls, the rings mmap'd). See fpio_engine.h. */
#define _GNU_SOURCE
#include "fpio_engine.h"

#include <errno.h>
#include <linux/io_uring.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    fpio_engine base;
    int ring_fd;
    void *sq_ptr, *cq_ptr;
    size_t sq_sz, cq_sz;
    struct io_uring_sqe *sqes;
    size_t sqes_sz;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array;
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_cqe *cqes;
    unsigned sq_pending;       /* sqes in the ring the kernel has not consumed */
} uring_engine;

static int uring_enter(uring_engine *e, unsigned to_submit, unsigned min_complete, unsigned flags)
{
    long n = syscall(__NR_io_uring_enter, e->ring_fd, to_submit, min_complete, flags, NULL, 0);
    return n < 0 ? -errno : (int)n;
}

static void uring_close(uring_engine *e)
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

static int uring_open(fpio_engine *base, int nthreads, const char **why)
{
    uring_engine *e = (uring_engine *)base;
    struct io_uring_params p;
    (void)nthreads;
    memset(&p, 0, sizeof(p));
    e->ring_fd = -1;
    long fd = syscall(__NR_io_uring_setup, (unsigned)base->qd_max, &p);
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
static int uring_flush(uring_engine *e, unsigned min_complete)
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

static int uring_submit(fpio_engine *base, fpio_req *r)
{
    uring_engine *e = (uring_engine *)base;
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

static int uring_reap(fpio_engine *base, int min_nr, int max_nr)
{
    uring_engine *e = (uring_engine *)base;
    for (;;) {
        unsigned head = *e->cq_head;
        unsigned tail = __atomic_load_n(e->cq_tail, __ATOMIC_ACQUIRE);
        int n = 0;
        while (head != tail && n < max_nr) {
            struct io_uring_cqe *cqe = &e->cqes[head & *e->cq_mask];
            fpio_req *r = (fpio_req *)(uintptr_t)cqe->user_data;
            r->res = cqe->res;
            base->done[n++] = r;
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

static void uring_close_be(fpio_engine *e) { uring_close((uring_engine *)e); }

const fpio_backend fpio_backend_uring = {sizeof(uring_engine), uring_open, uring_close_be, uring_submit,
                                         uring_reap};
