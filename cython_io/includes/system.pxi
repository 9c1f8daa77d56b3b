# Declarations only: the few libc calls _aio.pyx and its parts make themselves.

cdef extern from "<stdlib.h>" nogil:
    int posix_memalign(void **memptr, size_t alignment, size_t size)

cdef extern from "<sys/mman.h>" nogil:
    int mlock(const void *addr, size_t len)
    int munlock(const void *addr, size_t len)
    int madvise(void *addr, size_t length, int advice)
    int MADV_HUGEPAGE

cdef extern from "<fcntl.h>" nogil:
    int c_open "open"(const char *path, int flags, int mode)
    int fcntl(int fd, int cmd)
    int O_RDONLY, O_WRONLY, O_RDWR, O_CREAT, O_TRUNC, O_EXCL, O_CLOEXEC, O_DIRECT, O_NOFOLLOW, O_NONBLOCK
    int F_GETFL

cdef extern from "<unistd.h>" nogil:
    int c_close "close"(int fd)
    int c_unlink "unlink"(const char *path)
    long sysconf(int name)
    int _SC_PAGESIZE
