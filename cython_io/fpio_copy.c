/* fpio_copy.c: copies between memory, with bounds already checked by the
 * Cython layer: many pieces at once (optionally checksummed in the same
 * pass), and runs pulled from a peer process (process_vm_readv). */
#define _GNU_SOURCE
#include "fpio_crc.h"

#include <errno.h>
#include <string.h>
#include <sys/uio.h>

void fpio_copy_many(char *const *dst, char *const *src, const int64_t *len, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        memcpy(dst[i], src[i], (size_t)len[i]);
}

void fpio_copy_crc_many(char *const *dst, char *const *src, const int64_t *len, int64_t n, int64_t block,
                        const int64_t *first, uint32_t *out)
{
    fpio_crc_ready();
    for (int64_t i = 0; i < n; i++) {
        uint32_t *o = out + first[i];
        if (len[i] == 0) {
            *o = 0;
            continue;
        }
        for (int64_t at = 0; at < len[i]; at += block) {
            size_t k = (size_t)(len[i] - at < block ? len[i] - at : block);
            *o++ = fpio_crc_reg_copy(0xffffffffu, dst[i] + at, src[i] + at, k) ^ 0xffffffffu;
        }
    }
}

/* Pulling from a peer process: process_vm_readv, FPIO_PULL_IOV iovecs a call
 * (the kernel's UIO_MAXIOV).  The kernel stops at the first iovec it cannot
 * read and returns what it copied; the rest is retried from there, and a
 * retry that copies nothing is EFAULT. */
#define FPIO_PULL_IOV 1024

int fpio_pull(int pid, char *dst, uint64_t remote, const int64_t *starts, int64_t nruns, int64_t run_len)
{
    struct iovec rv[FPIO_PULL_IOV];
    int64_t i = 0, skip = 0; /* run i, skip bytes of it already copied */
    int64_t total, end;
    if (nruns < 0 || run_len < 0 || fpio_mul_i64(nruns, run_len, &total) < 0)
        return -EOVERFLOW;
    for (int64_t j = 0; j < nruns; j++)
        if (starts[j] < 0 || fpio_add_i64(starts[j], run_len, &end) < 0 || (uint64_t)end > UINT64_MAX - remote)
            return -EOVERFLOW;
    while (i < nruns && run_len > 0) {
        int k = 0;
        for (int64_t j = i; j < nruns && k < FPIO_PULL_IOV; j++, k++) {
            int64_t off = j == i ? skip : 0;
            rv[k].iov_base = (void *)(uintptr_t)(remote + (uint64_t)starts[j] + (uint64_t)off);
            rv[k].iov_len = (size_t)(run_len - off);
        }
        size_t want = (size_t)k * (size_t)run_len - (size_t)skip;
        struct iovec lv = {dst + i * run_len + skip, want};
        ssize_t got = process_vm_readv(pid, &lv, 1, rv, (unsigned long)k, 0);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (got == 0)
            return -EFAULT;
        int64_t at = skip + (int64_t)got; /* bytes from the start of run i */
        i += at / run_len;
        skip = at % run_len;
    }
    return 0;
}
