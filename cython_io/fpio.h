/* fpio: the C core of fp_dcp._aio.
 *
 * Three I/O engines behind one submit/reap interface (kernel AIO through raw
 * system calls, io_uring through raw system calls and mmap'd rings, and a
 * pthread pool doing pwrite/pread), and one write pipeline and one read
 * pipeline that drive any of them. Nothing here touches Python: the Cython
 * layer (_aio.pyx) holds the buffers, validates the pieces, releases the GIL
 * around fpio_write/fpio_read and turns an fpio_result error into OSError.
 *
 * Links against libc (and pthread, part of libc since glibc 2.34) only.
 */
#ifndef FPIO_H
#define FPIO_H

#include <stddef.h>
#include <stdint.h>

enum { FPIO_AIO = 0, FPIO_URING = 1, FPIO_THREADS = 2 };

typedef struct fpio_engine fpio_engine;

/* One piece of a write or read: `len` bytes at `ptr` <-> file `file` at `off`. */
typedef struct {
    char *ptr;
    int64_t len;
    int64_t off;
    int32_t file;
} fpio_piece;

/* What a pipeline reports. err == 0 means success. On failure `file` is the
 * index of the file concerned (-1 when none), `op` names the failing step,
 * `at`/`len` the request, and `eof` says the read met the end of the file
 * before `need` (a file offset). */
typedef struct {
    int err;
    int file;
    int eof;
    const char *op;
    int64_t at;
    int64_t len;
    int64_t need;
    int64_t bytes;       /* payload bytes */
    int64_t bytes_io;    /* bytes written incl. padding / bytes actually read */
    int64_t requests;    /* requests submitted, resubmissions included */
    int64_t zc_bytes;    /* bytes moved straight from/to the caller's memory */
    double seconds;
} fpio_result;

/* Engines. `slots` are `nslots` bounce buffers of `slot_size` bytes each,
 * owned by the caller and kept alive until fpio_engine_close. At most
 * `qd_max` requests are in flight; nslots must be >= qd_max + 1.
 * Returns 0, or -errno with *why naming the refused call. */
int fpio_engine_open(int kind, int qd_max, int nthreads, char **slots, int nslots,
                     int64_t slot_size, fpio_engine **out, const char **why);
void fpio_engine_close(fpio_engine *e);

/* Pipelines (call without the GIL). Pieces sorted by (file, off); for writes
 * they do not overlap. block_size: multiple of align, <= slot_size;
 * qd <= qd_max. Return 0 or -1 (details in *res). */
int fpio_write(fpio_engine *e, const int *fds, int nfiles, const fpio_piece *pieces,
               int64_t npieces, int64_t block_size, int qd, int64_t align, int sync,
               fpio_result *res);
int fpio_read(fpio_engine *e, const int *fds, int nfiles, const fpio_piece *pieces,
              int64_t npieces, int64_t block_size, int qd, int64_t align, int64_t gap,
              fpio_result *res);

/* Process-wide count of requests in flight (for leak tests). */
long fpio_inflight(void);

/* Fault injection for tests: after `after` more successful completions, the
 * next completion reports -err (the I/O itself happened). err == 0 clears. */
void fpio_fault_set(int err, long after);
/* ... and the next `count` completions report only half their bytes (a short
 * write/read the pipeline must continue from). */
void fpio_fault_short(long count);

/* statx(STATX_DIOALIGN) on a path: fills mem/off with the kernel's answer
 * (0 when the kernel or file system does not report one). Returns 0 or -errno. */
int fpio_dioalign(const char *path, uint32_t *mem, uint32_t *off);

/* Copies with bounds already checked by the caller. */
void fpio_copy_many(char *const *dst, char *const *src, const int64_t *len, int64_t n);

#endif
