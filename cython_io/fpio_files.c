/* fpio_files.c: what the file system asks of O_DIRECT (statx STATX_DIOALIGN). */
#define _GNU_SOURCE
#include "fpio.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef STATX_DIOALIGN
#define STATX_DIOALIGN 0x00002000U
#endif

int fpio_dioalign(const char *path, uint32_t *mem, uint32_t *off)
{
    struct statx st;
    memset(&st, 0, sizeof(st));
    *mem = *off = 0;
    if (syscall(SYS_statx, AT_FDCWD, path, 0, STATX_DIOALIGN, &st) < 0)
        return -errno;
    if (st.stx_mask & STATX_DIOALIGN) {
        *mem = st.stx_dio_mem_align;
        *off = st.stx_dio_offset_align;
    }
    return 0;
}
