/* fpio_threads.c: the thread-pool backend (nthreads pthreads doing
 * pwrite/pread from a queue). See fpio_engine.h. */
#define _GNU_SOURCE
#include "fpio_engine.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>

typedef struct {
    fpio_engine base;
    pthread_t *threads;
    int nthreads;
    pthread_mutex_t mu;
    pthread_cond_t cv_work, cv_done;
    fpio_req *sq_first, *sq_last, *cq_first, *cq_last;
    int stop;
} threads_engine;

static void *worker_main(void *arg)
{
    threads_engine *e = arg;
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

static void threads_close(threads_engine *e)
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

static int threads_open(fpio_engine *base, int nthreads, const char **why)
{
    threads_engine *e = (threads_engine *)base;
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

static int threads_submit(fpio_engine *base, fpio_req *r)
{
    threads_engine *e = (threads_engine *)base;
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

static int threads_reap(fpio_engine *base, int min_nr, int max_nr)
{
    threads_engine *e = (threads_engine *)base;
    int n = 0;
    pthread_mutex_lock(&e->mu);
    while (!e->cq_first && min_nr > 0)
        pthread_cond_wait(&e->cv_done, &e->mu);
    while (e->cq_first && n < max_nr) {
        fpio_req *r = e->cq_first;
        e->cq_first = r->next;
        base->done[n++] = r;
    }
    if (!e->cq_first)
        e->cq_last = NULL;
    pthread_mutex_unlock(&e->mu);
    return n;
}

static void threads_close_be(fpio_engine *e) { threads_close((threads_engine *)e); }

const fpio_backend fpio_backend_threads = {sizeof(threads_engine), threads_open, threads_close_be,
                                           threads_submit, threads_reap};
