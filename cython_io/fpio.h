/* fpio: the C core of fp_dcp._aio, as the Cython layer sees it.
 *
 * Three I/O engines behind one table of function pointers (kernel AIO and
 * io_uring through raw system calls, and a pthread pool doing pwrite/pread;
 * fpio_engine.h), and one write pipeline and one read pipeline that drive
 * any of them. Nothing here touches Python: the Cython layer (_aio.pyx)
 * holds the buffers, validates the pieces, releases the GIL around
 * fpio_write/fpio_read and turns an fpio_result error into OSError.
 *
 *     fpio_engine.h/.c   engines: the backend table, open/close
 *     fpio_aio.c  fpio_uring.c  fpio_threads.c   the three backends
 *     fpio_pipeline.c    fpio_write/fpio_read
 *     fpio_crc.h/.c      CRC-32C (fused with a copy where one is made)
 *     fpio_copy.c        memory-to-memory copies, process_vm_readv pulls
 *     fpio_files.c       statx(STATX_DIOALIGN)
 *     fpio_faults.c      fault/kill injection, inert unless enabled (tests)
 *
 * Links against libc (and pthread, part of libc since glibc 2.34) only.
 */
#ifndef FPIO_H
#define FPIO_H

#include <stddef.h>
#include <stdint.h>

enum { FPIO_AIO = 0, FPIO_URING = 1, FPIO_THREADS = 2 };

/* Checked int64 arithmetic for every sum or product that guards a memory or
 * file access: 0 and the result in *out, or -1 when it overflows (a crafted
 * offset or length must fail, not wrap into a wild access). */
static inline int fpio_add_i64(int64_t a, int64_t b, int64_t *out) { return __builtin_add_overflow(a, b, out) ? -1 : 0; }
static inline int fpio_mul_i64(int64_t a, int64_t b, int64_t *out) { return __builtin_mul_overflow(a, b, out) ? -1 : 0; }

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
    int64_t crc_bytes;   /* bytes fed to the CRC (0 without checksums) */
    double seconds;
} fpio_result;

/* Engines. `slots` are `nslots` bounce buffers of `slot_size` bytes each,
 * owned by the caller and kept alive until fpio_engine_close. At most
 * `qd_max` requests are in flight; nslots must be >= qd_max + 1.
 * Returns 0, or -errno with *why naming the refused call. */
int fpio_engine_open(int kind, int qd_max, int nthreads, char **slots, int nslots,
                     int64_t slot_size, fpio_engine **out, const char **why);
void fpio_engine_close(fpio_engine *e);
/* Slots [0, n) are faulted in and may be used; a call waits for a slot past
 * them (they are being faulted in on another thread). All are at open. */
void fpio_engine_set_settled(fpio_engine *e, int n);

/* Checksums a pipeline computes while the bytes pass (NULL: none). Piece i
 * owns out[first[i] .. first[i + 1]): block 0: one CRC-32C for the whole
 * piece; block > 0: the piece's first byte is byte origin[i] (0 when origin is
 * NULL) of a grid of `block`-byte blocks, and each entry is the CRC-32C of the
 * piece's bytes in one block of the grid, in order (the first and last may be
 * partial blocks). An empty piece has one entry, 0. `out` must be zeroed; it
 * is complete when the pipeline returns 0. Writes checksum the source (fused
 * with the bounce copy, or while a zero-copy request is in flight); reads
 * checksum what landed in each piece (fused with the copy out of the bounce
 * buffer, or after a zero-copy request completes, while others are in flight). */
typedef struct {
    int64_t block;
    const int64_t *origin;
    const int64_t *first;
    uint32_t *out;
    const uint8_t *skip;  /* NULL, or per piece: nonzero = no checksum (one entry, 0) */
} fpio_crc;

/* Pipelines (call without the GIL). Pieces sorted by (file, off); for writes
 * they do not overlap. block_size: multiple of align, <= slot_size;
 * qd <= qd_max; mem_align (what O_DIRECT asks of memory) divides align. Return 0 or -1 (details in *res). */
int fpio_write(fpio_engine *e, const int *fds, int nfiles, const fpio_piece *pieces,
               int64_t npieces, int64_t block_size, int qd, int64_t align, int64_t mem_align, int sync,
               const fpio_crc *crc, fpio_result *res);
int fpio_read(fpio_engine *e, const int *fds, int nfiles, const fpio_piece *pieces,
              int64_t npieces, int64_t block_size, int qd, int64_t align, int64_t mem_align, int64_t gap,
              const fpio_crc *crc, fpio_result *res);

/* CRC-32C (Castagnoli; the SSE4.2 instruction where the CPU has it, else
 * slice-by-8 tables). `crc` is the CRC of what came before (0 to start), as
 * zlib's crc32(). _copy also copies src to dst in the same pass. */
uint32_t fpio_crc32c(uint32_t crc, const void *buf, size_t len);
uint32_t fpio_crc32c_copy(uint32_t crc, void *dst, const void *src, size_t len);
/* The CRC of A || B from crc(A), crc(B) and |B|. */
uint32_t fpio_crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2);
/* Whether a fused copy + CRC of len bytes from src to dst uses streaming stores
 * (see CRC_NT_MIN_DELTA in fpio_crc.c); the bytes so copied since the start. */
int fpio_crc_copy_streams(uintptr_t dst, uintptr_t src, size_t len);
int64_t fpio_crc_nt_bytes(void);
/* Tests: want 0 = tables, 1 = hardware (if the CPU has it), -1 = ask.
 * Returns 1 when the hardware path is in use. */
int fpio_crc32c_impl(int want);

/* Process-wide count of requests in flight (for leak tests). */
long fpio_inflight(void);

/* Test hooks (fpio_faults.c). Until fpio_test_hooks_enable() is called the
 * settings below are never read (the Cython layer calls it once, at import,
 * only when FP_DCP_TEST_HOOKS=1; see _aio.pyx). Once enabled: after `after`
 * more successful completions, the next completion reports -err (the I/O
 * itself happened); err == 0 clears. */
void fpio_test_hooks_enable(void);
void fpio_fault_set(int err, long after);
/* ... and the next `count` completions report only half their bytes (a short
 * write/read the pipeline must continue from). */
void fpio_fault_short(long count);
/* ... and after `after` more completions, send the process signal `sig`
 * (SIGKILL: a crash in the middle of a save). sig == 0 clears. */
void fpio_fault_kill(int sig, long after);

/* statx(STATX_DIOALIGN) on a path: fills mem/off with the kernel's answer
 * (0 when the kernel or file system does not report one). Returns 0 or -errno. */
int fpio_dioalign(const char *path, uint32_t *mem, uint32_t *off);

/* Copies with bounds already checked by the caller. */
void fpio_copy_many(char *const *dst, char *const *src, const int64_t *len, int64_t n);
/* fpio_copy_many that also checksums what it copies, in one pass: the CRC-32C
 * of each `block`-byte block of piece i, from the piece's start (the last one
 * shorter), goes to out[first[i] ...]; an empty piece gets one entry, 0. */
void fpio_copy_crc_many(char *const *dst, char *const *src, const int64_t *len, int64_t n, int64_t block,
                        const int64_t *first, uint32_t *out);

/* Copy `nruns` runs of `run_len` bytes from process `pid`'s memory at
 * remote + starts[i] into dst, back to back (process_vm_readv; needs the
 * right to ptrace pid).  Returns 0 or -errno (EFAULT: an address that is not
 * mapped there; EPERM/ESRCH: no such process or no right to read it). */
int fpio_pull(int pid, char *dst, uint64_t remote, const int64_t *starts, int64_t nruns, int64_t run_len);

#endif
