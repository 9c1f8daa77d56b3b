/* fpio_crc.h: the CRC-32C register-level functions (fpio_crc.c) that the
 * pipelines and the copies share (C only; fpio.h has the standard CRC). The
 * register is raw: no pre- or post-inversion, so the standard CRC-32C of a
 * message is fpio_crc_reg(0xffffffff, msg) ^ 0xffffffff, and the parts of a
 * message may be summed in any order with fpio_crc_shift. */
#ifndef FPIO_CRC_H
#define FPIO_CRC_H

#include "fpio.h"

/* The tables and the CPU check, once per process: call before the others. */
void fpio_crc_ready(void);
/* The register after running over n bytes at p; _copy also copies them to d
 * in the same pass (streaming stores for large copies, see fpio_crc.c). */
uint32_t fpio_crc_reg(uint32_t reg, const void *p, size_t n);
uint32_t fpio_crc_reg_copy(uint32_t reg, void *d, const void *p, size_t n);
/* The register after running over n zero bytes. */
uint32_t fpio_crc_shift(uint32_t reg, uint64_t nbytes);

#endif
