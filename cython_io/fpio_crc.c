/* fpio_crc.c: CRC-32C (Castagnoli) for fp_dcp._aio: the SSE4.2 instruction
 * where the CPU has it, else slice-by-8 tables; optionally fused with a copy.
 * See fpio.h (the API) and fpio_crc.h (the register-level functions the
 * pipelines and copies share). */
#define _GNU_SOURCE
#include "fpio_crc.h"

#include <pthread.h>
#include <string.h>

static int64_t g_crc_nt_bytes; /* bytes copied with streaming stores (tests) */

/* The register-level functions (fpio_crc_reg*, fpio_crc_shift) take and return the raw CRC
 * register: no pre- or post-inversion. The standard CRC-32C of a message is
 * fpio_crc_reg(0xffffffff, msg) ^ 0xffffffff. Because the register update is
 * linear, parts of a message may be summed in any order:
 *     reg(i, A || B) = shift(reg(i, A), |B|) ^ reg(0, B)
 * where shift(r, n) runs r over n zero bytes (r * x^(8n) mod P). */

#define CRC32C_POLY 0x82f63b78u /* bit-reflected Castagnoli polynomial */
#define CRC_LONG 8192           /* the three interleaved streams, long and short */
#define CRC_SHORT 256

static uint32_t crc_sw_tab[8][256]; /* slice-by-8 */
static uint32_t crc_x2n[64];        /* x^(2^k) mod P */
static uint32_t crc_long_tab[4][256];
static uint32_t crc_short_tab[4][256];
static int crc_use_hw;
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

/* a(x) * b(x) mod P(x), bit-reflected (bit 31 is x^0); a != 0. */
static uint32_t multmodp(uint32_t a, uint32_t b)
{
    uint32_t m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0)
                break;
        }
        m >>= 1;
        b = b & 1 ? (b >> 1) ^ CRC32C_POLY : b >> 1;
    }
    return p;
}

/* x^(n * 2^k) mod P */
static uint32_t x2nmodp(uint64_t n, unsigned k)
{
    uint32_t p = 1u << 31; /* x^0 */
    while (n) {
        if (n & 1)
            p = multmodp(crc_x2n[k & 63], p);
        n >>= 1;
        k++;
    }
    return p;
}

/* The register after running over n zero bytes. */
uint32_t fpio_crc_shift(uint32_t reg, uint64_t nbytes)
{
    return nbytes && reg ? multmodp(x2nmodp(nbytes, 3), reg) : reg;
}

static inline uint32_t crc_shift_tab(uint32_t tab[4][256], uint32_t c)
{
    return tab[0][c & 0xff] ^ tab[1][(c >> 8) & 0xff] ^ tab[2][(c >> 16) & 0xff] ^ tab[3][c >> 24];
}

static inline uint64_t ld64(const unsigned char *q)
{
    uint64_t w;
    memcpy(&w, q, 8);
    return w;
}

static inline void st64(unsigned char *q, uint64_t w) { memcpy(q, &w, 8); }

static uint32_t crc_sw(uint32_t c, const unsigned char *p, size_t n)
{
    while (n && ((uintptr_t)p & 7)) {
        c = crc_sw_tab[0][(c ^ *p++) & 0xff] ^ (c >> 8);
        n--;
    }
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    while (n >= 8) {
        uint64_t w = ld64(p) ^ c;
        c = crc_sw_tab[7][w & 0xff] ^ crc_sw_tab[6][(w >> 8) & 0xff] ^
            crc_sw_tab[5][(w >> 16) & 0xff] ^ crc_sw_tab[4][(w >> 24) & 0xff] ^
            crc_sw_tab[3][(w >> 32) & 0xff] ^ crc_sw_tab[2][(w >> 40) & 0xff] ^
            crc_sw_tab[1][(w >> 48) & 0xff] ^ crc_sw_tab[0][w >> 56];
        p += 8;
        n -= 8;
    }
#endif
    while (n--)
        c = crc_sw_tab[0][(c ^ *p++) & 0xff] ^ (c >> 8);
    return c;
}

/* Copy while the bytes are hot: memcpy a cache-sized piece, then run the CRC over it. */
static uint32_t crc_sw_copy(uint32_t c, unsigned char *d, const unsigned char *p, size_t n)
{
    while (n) {
        size_t k = n < 16384 ? n : 16384;
        memcpy(d, p, k);
        c = crc_sw(c, d, k);
        d += k;
        p += k;
        n -= k;
    }
    return c;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define FPIO_CRC_HW 1
/* The SSE4.2 crc32 instruction over three interleaved streams (its latency
 * is three times its throughput), merged with the shift tables; with copy,
 * every 8-byte word is stored to d as it is loaded: one pass over memory.
 * COPY: 0 none, 1 plain stores, 2 non-temporal stores (movnti, fenced at the
 * end). A copy of at least CRC_NT_MIN bytes is not read back soon (a bounce
 * buffer the device reads, a staging arena, a tensor larger than the cache),
 * and ordinary stores first read every destination line into the cache:
 * measured on the 2-core EPYC VM, 600 MiB from DRAM, one thread: plain
 * stores 10.3 GB/s, non-temporal 14.5 GB/s (memcpy 17-18 GB/s). */
#define CRC_NT_MIN (256 << 10)
/* ... but only where the destination is not a little ahead of the source
 * modulo 4 KiB.  The loop loads p, p + LEN, p + 2 LEN and streams to d, d +
 * LEN, d + 2 LEN; when d - p mod 4096 is below ~128 bytes, every load
 * 4K-aliases a line still in a write-combining buffer and flushes it half
 * full.  Measured on the 2-core EPYC VM (32 MiB, one thread, best of 3):
 * d - p = 32..96 mod 4096: 0.14-0.21 GB/s streaming against 4.7-5.9 plain;
 * 0: 2.8 against 6.7; 128: 4.2 / 5.7; from 224 on streaming is level with or
 * faster than plain stores (6-9 GB/s).  A tensor from torch's allocator
 * starts 64 bytes past a page, the bounce buffers on a page: the scatter of
 * every verified read sat far below the device.  A destination not 8-byte
 * aligned relative to the source would split every streaming store: plain
 * stores there too. */
#define CRC_NT_MIN_DELTA 256

static inline int crc_copy_streams(const unsigned char *d, const unsigned char *p, size_t n)
{
    uintptr_t delta = ((uintptr_t)d - (uintptr_t)p) & 4095;
    return n >= CRC_NT_MIN && (delta & 7) == 0 && delta >= CRC_NT_MIN_DELTA;
}
#define CRC_STORE(COPY, q, w)                                                          \
    do {                                                                               \
        if ((COPY) == 2)                                                               \
            _mm_stream_si64((long long *)(void *)(q), (long long)(w));                 \
        else                                                                           \
            st64(q, w);                                                                \
    } while (0)
#define CRC_HW_BODY(COPY)                                                              \
    while (n && ((uintptr_t)p & 7)) {                                                  \
        if (COPY)                                                                      \
            *d++ = *p;                                                                 \
        c0 = __builtin_ia32_crc32qi(c0, *p++);                                         \
        n--;                                                                           \
    }                                                                                  \
    CRC_HW_3WAY(COPY, CRC_LONG, crc_long_tab)                                          \
    CRC_HW_3WAY(COPY, CRC_SHORT, crc_short_tab)                                        \
    while (n >= 8) {                                                                   \
        uint64_t w = ld64(p);                                                          \
        if (COPY) {                                                                    \
            CRC_STORE(COPY, d, w);                                                     \
            d += 8;                                                                    \
        }                                                                              \
        c0 = (uint32_t)__builtin_ia32_crc32di(c0, w);                                  \
        p += 8;                                                                        \
        n -= 8;                                                                        \
    }                                                                                  \
    while (n) {                                                                        \
        if (COPY)                                                                      \
            *d++ = *p;                                                                 \
        c0 = __builtin_ia32_crc32qi(c0, *p++);                                         \
        n--;                                                                           \
    }                                                                                  \
    if ((COPY) == 2)                                                                   \
        _mm_sfence();                                                                  \
    return c0;

#define CRC_HW_3WAY(COPY, LEN, TAB)                                                    \
    while (n >= 3 * (LEN)) {                                                           \
        uint32_t c1 = 0, c2 = 0;                                                       \
        const unsigned char *end = p + (LEN);                                          \
        do {                                                                           \
            uint64_t w0 = ld64(p), w1 = ld64(p + (LEN)), w2 = ld64(p + 2 * (LEN));     \
            if (COPY) {                                                                \
                CRC_STORE(COPY, d, w0);                                                \
                CRC_STORE(COPY, d + (LEN), w1);                                        \
                CRC_STORE(COPY, d + 2 * (LEN), w2);                                    \
                d += 8;                                                                \
            }                                                                          \
            c0 = (uint32_t)__builtin_ia32_crc32di(c0, w0);                             \
            c1 = (uint32_t)__builtin_ia32_crc32di(c1, w1);                             \
            c2 = (uint32_t)__builtin_ia32_crc32di(c2, w2);                             \
            p += 8;                                                                    \
        } while (p < end);                                                             \
        c0 = crc_shift_tab(TAB, c0) ^ c1;                                              \
        c0 = crc_shift_tab(TAB, c0) ^ c2;                                              \
        p += 2 * (LEN);                                                                \
        if (COPY)                                                                      \
            d += 2 * (LEN);                                                            \
        n -= 3 * (LEN);                                                                \
    }

__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t c0, const unsigned char *p, size_t n)
{
    unsigned char *d = NULL;
    (void)d;
    CRC_HW_BODY(0)
}

__attribute__((target("sse4.2"))) static uint32_t crc_hw_copy_nt(uint32_t c0, unsigned char *d,
                                                                 const unsigned char *p, size_t n)
{
    CRC_HW_BODY(2)
}

__attribute__((target("sse4.2"))) static uint32_t crc_hw_copy_plain(uint32_t c0, unsigned char *d,
                                                                    const unsigned char *p, size_t n)
{
    CRC_HW_BODY(1)
}

__attribute__((target("sse4.2"))) static uint32_t crc_hw_copy(uint32_t c0, unsigned char *d,
                                                              const unsigned char *p, size_t n)
{
    if (crc_copy_streams(d, p, n)) {
        __atomic_fetch_add(&g_crc_nt_bytes, (int64_t)n, __ATOMIC_RELAXED);
        return crc_hw_copy_nt(c0, d, p, n);
    }
    return crc_hw_copy_plain(c0, d, p, n);
}
#endif

static void crc_init(void)
{
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? (c >> 1) ^ CRC32C_POLY : c >> 1;
        crc_sw_tab[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++)
        for (int k = 1; k < 8; k++)
            crc_sw_tab[k][n] = (crc_sw_tab[k - 1][n] >> 8) ^ crc_sw_tab[0][crc_sw_tab[k - 1][n] & 0xff];
    uint32_t p = 1u << 30; /* x^1 */
    crc_x2n[0] = p;
    for (int k = 1; k < 64; k++)
        crc_x2n[k] = p = multmodp(p, p);
    uint32_t opl = x2nmodp(CRC_LONG, 3), ops = x2nmodp(CRC_SHORT, 3);
    for (uint32_t n = 0; n < 256; n++)
        for (int k = 0; k < 4; k++) {
            crc_long_tab[k][n] = multmodp(opl, n << (8 * k));
            crc_short_tab[k][n] = multmodp(ops, n << (8 * k));
        }
#ifdef FPIO_CRC_HW
    __builtin_cpu_init();
    crc_use_hw = __builtin_cpu_supports("sse4.2") ? 1 : 0;
#endif
}

void fpio_crc_ready(void) { pthread_once(&crc_once, crc_init); }

uint32_t fpio_crc_reg(uint32_t c, const void *p, size_t n)
{
#ifdef FPIO_CRC_HW
    if (crc_use_hw)
        return crc_hw(c, p, n);
#endif
    return crc_sw(c, p, n);
}

uint32_t fpio_crc_reg_copy(uint32_t c, void *d, const void *p, size_t n)
{
#ifdef FPIO_CRC_HW
    if (crc_use_hw)
        return crc_hw_copy(c, d, p, n);
#endif
    return crc_sw_copy(c, d, p, n);
}

uint32_t fpio_crc32c(uint32_t crc, const void *buf, size_t len)
{
    fpio_crc_ready();
    return fpio_crc_reg(crc ^ 0xffffffffu, buf, len) ^ 0xffffffffu;
}

uint32_t fpio_crc32c_copy(uint32_t crc, void *dst, const void *src, size_t len)
{
    fpio_crc_ready();
    return fpio_crc_reg_copy(crc ^ 0xffffffffu, dst, src, len) ^ 0xffffffffu;
}

uint32_t fpio_crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2)
{
    fpio_crc_ready();
    return fpio_crc_shift(crc1, len2) ^ crc2;
}

int fpio_crc_copy_streams(uintptr_t dst, uintptr_t src, size_t len)
{
#ifdef FPIO_CRC_HW
    return crc_copy_streams((const unsigned char *)dst, (const unsigned char *)src, len);
#else
    (void)dst, (void)src, (void)len;
    return 0;
#endif
}

int64_t fpio_crc_nt_bytes(void) { return __atomic_load_n(&g_crc_nt_bytes, __ATOMIC_RELAXED); }

int fpio_crc32c_impl(int want)
{
    fpio_crc_ready();
#ifdef FPIO_CRC_HW
    if (want == 0)
        crc_use_hw = 0;
    else if (want == 1 && __builtin_cpu_supports("sse4.2"))
        crc_use_hw = 1;
    return crc_use_hw;
#else
    (void)want;
    return 0;
#endif
}
