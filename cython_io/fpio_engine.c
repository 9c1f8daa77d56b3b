/* fpio_engine.c: an engine's common part, set up and torn down through the
 * backend table (fpio_engine.h). */
#include "fpio_engine.h"

#include <errno.h>
#include <stdlib.h>

static const fpio_backend *const backends[] = {
    [FPIO_AIO] = &fpio_backend_aio,
    [FPIO_URING] = &fpio_backend_uring,
    [FPIO_THREADS] = &fpio_backend_threads,
};

int fpio_engine_open(int kind, int qd_max, int nthreads, char **slots, int nslots,
                     int64_t slot_size, fpio_engine **out, const char **why)
{
    *why = "";
    if (qd_max < 1 || nslots < qd_max + 1) {
        *why = "queue depth";
        return -EINVAL;
    }
    if (kind < 0 || kind >= (int)(sizeof(backends) / sizeof(backends[0]))) {
        *why = "engine kind";
        return -EINVAL;
    }
    const fpio_backend *be = backends[kind];
    fpio_engine *e = calloc(1, be->size);
    if (!e) {
        *why = "calloc";
        return -ENOMEM;
    }
    e->be = NULL;  /* set once the backend is up: close tears down only what is */
    e->qd_max = qd_max;
    e->slots = slots;
    e->nslots = nslots;
    e->slot_size = slot_size;
    e->settled = nslots;
    e->reqs = calloc((size_t)qd_max, sizeof(fpio_req));
    e->done = calloc((size_t)qd_max, sizeof(fpio_req *));
    e->segs = calloc((size_t)nslots, sizeof(fpio_segs));
    if (!e->reqs || !e->done || !e->segs) {
        fpio_engine_close(e);
        *why = "calloc";
        return -ENOMEM;
    }
    int rc = be->open(e, nthreads, why);
    if (rc < 0) {
        fpio_engine_close(e);  /* the backend undid itself */
        return rc;
    }
    e->be = be;
    *out = e;
    return 0;
}

void fpio_engine_set_settled(fpio_engine *e, int n)
{
    __atomic_store_n(&e->settled, n, __ATOMIC_RELEASE);
}

void fpio_engine_close(fpio_engine *e)
{
    if (!e)
        return;
    if (e->be)
        e->be->close(e);
    if (e->segs)
        for (int i = 0; i < e->nslots; i++)
            free(e->segs[i].v);
    free(e->segs);
    free(e->reqs);
    free(e->done);
    free(e);
}
