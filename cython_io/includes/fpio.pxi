# Declarations only: the C core's API (cython_io/fpio.h), as _aio.pyx and its parts call it.
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t, uintptr_t

cdef extern from "fpio.h" nogil:
    enum:
        FPIO_AIO
        FPIO_URING
        FPIO_THREADS

    ctypedef struct fpio_engine:
        pass

    ctypedef struct fpio_piece:
        char *ptr
        int64_t len
        int64_t off
        int32_t file

    ctypedef struct fpio_result:
        int err
        int file
        int eof
        const char *op
        int64_t at
        int64_t len
        int64_t need
        int64_t bytes
        int64_t bytes_io
        int64_t requests
        int64_t zc_bytes
        int64_t crc_bytes
        double seconds

    int fpio_engine_open(int kind, int qd_max, int nthreads, char **slots, int nslots,
                         int64_t slot_size, fpio_engine **out, const char **why)
    void fpio_engine_close(fpio_engine *e)
    void fpio_engine_set_settled(fpio_engine *e, int n)
    ctypedef struct fpio_crc:
        int64_t block
        const int64_t *origin
        const int64_t *first
        uint32_t *out
        const uint8_t *skip

    int fpio_write(fpio_engine *e, const int *fds, int nfiles, const fpio_piece *pieces,
                   int64_t npieces, int64_t block_size, int qd, int64_t align, int64_t mem_align, int sync,
                   const fpio_crc *crc, fpio_result *res)
    int fpio_read(fpio_engine *e, const int *fds, int nfiles, const fpio_piece *pieces,
                  int64_t npieces, int64_t block_size, int qd, int64_t align, int64_t mem_align, int64_t gap,
                  const fpio_crc *crc, fpio_result *res)
    uint32_t fpio_crc32c(uint32_t crc, const void *buf, size_t len)
    uint32_t fpio_crc32c_copy(uint32_t crc, void *dst, const void *src, size_t len)
    uint32_t fpio_crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2)
    int fpio_crc_copy_streams(uintptr_t dst, uintptr_t src, size_t len)
    int64_t fpio_crc_nt_bytes()
    int fpio_crc32c_impl(int want)
    long fpio_inflight()
    void fpio_test_hooks_enable()
    void fpio_fault_set(int err, long after)
    void fpio_fault_short(long count)
    void fpio_fault_kill(int sig, long after)
    int fpio_dioalign(const char *path, uint32_t *mem, uint32_t *off)
    void fpio_copy_many(char *const *dst, char *const *src, const int64_t *len, int64_t n)
    int fpio_pull(int pid, char *dst, uint64_t remote, const int64_t *starts, int64_t nruns, int64_t run_len)
    void fpio_copy_crc_many(char *const *dst, char *const *src, const int64_t *len, int64_t n, int64_t block,
                            const int64_t *first, uint32_t *out)

cdef extern from "fpio.h" nogil:
    int fpio_add_i64(int64_t a, int64_t b, int64_t *out)
    int fpio_mul_i64(int64_t a, int64_t b, int64_t *out)
