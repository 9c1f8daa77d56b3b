/* fpio_aio.c: the kernel AIO backend (io_setup/io_submit/io_getevents
 * through raw system calls). See fpio_engine.h. */
#define _GNU_SOURCE
#include "fpio_engine.h"

#include <errno.h>
#include <linux/aio_abi.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    fpio_engine base;
    aio_context_t aio_ctx;
    struct io_event *events;
    struct iocb *iocbs;        /* one per request (reqs[i] <-> iocbs[i]): must stay put while in flight */
} aio_engine;

static int aio_open(fpio_engine *base, int nthreads, const char **why)
{
    aio_engine *e = (aio_engine *)base;
    (void)nthreads;
    e->aio_ctx = 0;
    if (syscall(SYS_io_setup, base->qd_max, &e->aio_ctx) < 0) {
        *why = "io_setup";
        return -errno;
    }
    e->events = calloc((size_t)base->qd_max, sizeof(struct io_event));
    e->iocbs = calloc((size_t)base->qd_max, sizeof(struct iocb));
    if (!e->events || !e->iocbs) {
        syscall(SYS_io_destroy, e->aio_ctx);
        free(e->events);
        free(e->iocbs);
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
static void aio_close(fpio_engine *base)
{
    aio_engine *e = (aio_engine *)base;
    if (e->aio_ctx) {
        int deferred = 0;
        if (!base->broken) {
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
    free(e->iocbs);
}

static int aio_submit(fpio_engine *base, fpio_req *r)
{
    aio_engine *e = (aio_engine *)base;
    struct iocb *cb = &e->iocbs[r - base->reqs];
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

static int aio_reap(fpio_engine *base, int min_nr, int max_nr)
{
    aio_engine *e = (aio_engine *)base;
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
        base->done[i] = r;
    }
    return (int)n;
}

const fpio_backend fpio_backend_aio = {sizeof(aio_engine), aio_open, aio_close, aio_submit, aio_reap};
