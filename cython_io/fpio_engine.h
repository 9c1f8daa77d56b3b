/* fpio_engine.h: inside the C core of fp_dcp._aio (C only; the Cython layer
 * sees fpio.h alone).
 *
 * An engine is one backend (kernel AIO, io_uring, a pthread pool) behind one
 * table of function pointers, fpio_backend: the pipelines (fpio_pipeline.c)
 * submit requests and reap completions through it and never ask which
 * backend they drive. Each backend's file defines its engine as a struct
 * that starts with fpio_engine (the common part) and its table:
 *
 *     fpio_engine.c    open/close through the table
 *     fpio_aio.c       kernel AIO through raw system calls
 *     fpio_uring.c     io_uring through raw system calls and mmap'd rings
 *     fpio_threads.c   a pthread pool doing pwrite/pread
 */
#ifndef FPIO_ENGINE_H
#define FPIO_ENGINE_H

#include "fpio.h"

/* One request: `len` bytes at `buf` <-> `fd` at `off`, resubmitted from
 * where it stopped after a short transfer. */
typedef struct fpio_req {
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

/* A read's bounce slot holds bytes for several pieces: where each goes. */
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

/* The table every backend fills in. `size` is the size of the backend's
 * engine struct (it starts with fpio_engine; calloc'ed by fpio_engine_open).
 * open: set the backend up, 0 or -errno with *why naming the refused call
 * (on failure it has undone itself: close is not called); close: tear it
 * down; submit: hand one request to the kernel (or the pool), 0 or -errno;
 * reap: wait for at least min_nr completions (none when 0), put at most
 * max_nr of them in e->done[0..n) with their res set; returns n or -errno. */
typedef struct fpio_backend {
    size_t size;
    int (*open)(fpio_engine *e, int nthreads, const char **why);
    void (*close)(fpio_engine *e);
    int (*submit)(fpio_engine *e, fpio_req *r);
    int (*reap)(fpio_engine *e, int min_nr, int max_nr);
} fpio_backend;

extern const fpio_backend fpio_backend_aio, fpio_backend_uring, fpio_backend_threads;

/* The common part of every engine. */
struct fpio_engine {
    const fpio_backend *be;
    int qd_max;
    int broken;                /* a reap failed: requests may still be in flight */
    fpio_req *reqs;            /* qd_max of them */
    fpio_req **done;           /* reap output, qd_max entries */
    char **slots;
    int nslots;
    int64_t slot_size;
    fpio_segs *segs;           /* per slot, for reads */
    int settled;               /* slots [0, settled) are faulted in; get_slot waits for
                                * a later one (fpio_engine_set_settled, atomic) */
};

/* Test hooks (fpio_faults.c): nonzero once fpio_test_hooks_enable() ran,
 * and then every completion's result passes through fpio_fault_completion
 * (which may replace it with an injected error or a short count, or kill
 * the process). */
extern int fpio_test_hooks;
int64_t fpio_fault_completion(int64_t res);

#endif
