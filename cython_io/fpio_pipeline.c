/* fpio_pipeline.c: the write pipeline and the read pipeline of fp_dcp._aio:
 * pieces -> aligned requests (straight from/to the caller's memory, or
 * through the engine's bounce slots), driven through any backend by the
 * table in fpio_engine.h; checksums computed while the bytes pass. See
 * fpio.h (fpio_write, fpio_read) and docs/NATIVE.md. */
#define _GNU_SOURCE
#include "fpio_crc.h"
#include "fpio_engine.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* Short transfers in a row that end no further than the attempt before (an
 * O_DIRECT retry restarts at an aligned offset) before giving up: at the end
 * of a file a read stops moving forward. */
#define FPIO_MAX_STALLS 16

static long g_inflight;

long fpio_inflight(void) { return __atomic_load_n(&g_inflight, __ATOMIC_RELAXED); }

typedef struct {
    int64_t piece, ppos, len;
    const char *ptr;
} fpio_todo;

typedef struct {
    fpio_engine *e;
    int write;
    const int *fds;
    int64_t A, B, gap;
    int64_t M;                /* the memory alignment of a request (divides A) */
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
 * (the parts of a block may complete in any order; see fpio_crc.h). */
static void crc_flush(pctx *c)
{
    if (c->cp_idx < 0)
        return;
    c->crc->out[c->cp_idx] ^= fpio_crc_shift(c->cp_reg, (uint64_t)(c->cp_bend - c->cp_pos));
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
        reg = dst ? fpio_crc_reg_copy(reg, dst, src, (size_t)n) : fpio_crc_reg(reg, src, (size_t)n);
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
    if (__builtin_expect(fpio_test_hooks, 0))
        res = fpio_fault_completion(res);  /* tests only: fpio_faults.c */
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
    int n = c->e->be->reap(c->e, min_nr, c->write ? c->e->qd_max : 1);
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
        int rc = c->e->be->submit(c->e, r);
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
    int slot = c->free_slots[--c->nfree_slots];
    /* slots are taken in order from a fresh pool; one still being faulted in
     * on another thread (Engine.settle_pool) is waited for */
    while (__atomic_load_n(&c->e->settled, __ATOMIC_ACQUIRE) <= slot) {
        struct timespec pause = {0, 20000};
        nanosleep(&pause, NULL);
    }
    return slot;
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

/* A write: copy bytes [from, to) of piece i into the bounce windows (each
 * sent once full, or when the next bytes lie past it), checksumming them in
 * the same pass. */
static int copy_range(pctx *c, const fpio_piece *p, int64_t i, int64_t from, int64_t to)
{
    const char *src = p->ptr + from;
    int64_t off = p->off + from, n = to - from;
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

/* A read: bytes [from, to) of piece i come from the bounce windows (a window
 * takes the bytes within the coalescing gap after its end, and may overlap
 * what it holds; it is read when the next bytes lie outside it), copied out
 * once it has landed. */
static int gather_range(pctx *c, const fpio_piece *p, int64_t i, int64_t from, int64_t to)
{
    char *dst = p->ptr + from;
    int64_t off = p->off + from, n = to - from;
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

/* Where a piece's blocks move straight from or to its memory: -1 for none,
 * else the bytes of its head that first fill the open window (a write's, when
 * the piece starts at or after the window's bytes; a read's, when it starts
 * within the window and the coalescing gap), which then goes out whole: a
 * window sent half full before the piece would be one more operation for the
 * device (a disk that charges per operation counts them). The blocks after
 * the head must start at memory aligned to M and at an offset aligned to A. */
static int64_t direct_head(const pctx *c, const fpio_piece *p)
{
    int64_t head = 0;
    if (c->cur >= 0 && c->wfile == p->file && p->off < c->ws + c->B
        && (c->write ? p->off >= c->wend : p->off >= c->ws && p->off <= c->wend + c->gap))
        head = c->ws + c->B - p->off;
    if (p->len - head < c->B || (uintptr_t)(p->ptr + head) % (uintptr_t)c->M || (p->off + head) % c->A)
        return -1;
    return head;
}

/* A piece's bytes: after its head, straight from or to its memory where
 * direct_head allows, else all of them through the bounce windows. A write
 * sends whole blocks in place and copies its last part block into the next
 * window, which the next pieces fill (no short request); a read reads all
 * its aligned bytes in place, its last request short (a window of its own
 * would cost as many requests, and a read into aligned memory, such as the
 * reader's shared reads, needs no bounce buffer at all). */
static int move_piece(pctx *c, const fpio_piece *p, int64_t i)
{
    int64_t head = direct_head(c, p), done = 0;
    if (head >= 0) {
        /* the head fills the open window, which goes out; without one, a
         * window open before the piece goes out as it is */
        if (head > 0 && (c->write ? copy_range(c, p, i, 0, head) : gather_range(c, p, i, 0, head)) < 0)
            return -1;
        if (flush_window(c) < 0)
            return -1;
        int64_t body = align_down(p->len - head, c->write ? c->B : c->A);
        for (int64_t pos = head; pos < head + body; pos += c->B) {
            int64_t n = head + body - pos < c->B ? head + body - pos : c->B;
            if (issue(c, p->file, p->ptr + pos, p->off + pos, n, p->off + pos + n, -1, i, pos) < 0)
                return -1;
            if (c->write && c->crc)  /* on the source, while the request is in flight (a read's: once landed) */
                crc_part(c, i, pos, NULL, p->ptr + pos, n);
        }
        c->res->zc_bytes += body;
        done = head + body;
    }
    return c->write ? copy_range(c, p, i, done, p->len) : gather_range(c, p, i, done, p->len);
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
               int64_t npieces, int64_t bs, int qd, int64_t align, int64_t mem_align, int64_t gap, int sync,
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
    if (qd < 1 || qd > e->qd_max || bs < align || bs > e->slot_size || bs % align
        || mem_align < 1 || align % mem_align) {
        res->err = EINVAL;
        res->op = "engine parameters";
        return -1;
    }
    int free_slots[e->nslots];
    pctx c = {
        .e = e, .write = write, .fds = fds, .A = align, .M = mem_align, .B = bs, .gap = gap, .qd = qd,
        .free_slots = free_slots, .nfree_slots = e->nslots, .res = res, .cur = -1, .wfile = -1,
        .crc = crc, .pieces = pieces, .cp_idx = -1,
    };
    fpio_todo todo_ring[64];
    if (crc) {
        fpio_crc_ready();
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
        if (move_piece(&c, p, i) < 0)
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
               int64_t npieces, int64_t block_size, int qd, int64_t align, int64_t mem_align, int sync,
               const fpio_crc *crc, fpio_result *res)
{
    return run(e, 1, fds, nfiles, pieces, npieces, block_size, qd, align, mem_align, 0, sync, crc, res);
}

int fpio_read(fpio_engine *e, const int *fds, int nfiles, const fpio_piece *pieces,
              int64_t npieces, int64_t block_size, int qd, int64_t align, int64_t mem_align, int64_t gap,
              const fpio_crc *crc, fpio_result *res)
{
    return run(e, 0, fds, nfiles, pieces, npieces, block_size, qd, align, mem_align, gap, 0, crc, res);
}

