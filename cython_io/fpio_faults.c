/* fpio_faults.c: fault and kill injection for tests (crash-consistency,
 * error paths). Inert unless fpio_test_hooks_enable() was called, which
 * fp_dcp._aio does only when the process started with FP_DCP_TEST_HOOKS=1
 * (see _aio.pyx, docs/NATIVE.md): with it off, a completion costs the
 * pipeline one load of fpio_test_hooks and a branch never taken. */
#define _GNU_SOURCE
#include "fpio_engine.h"

#include <signal.h>
#include <unistd.h>

int fpio_test_hooks;

static int g_fault_err;
static long g_fault_after;
static long g_fault_short;
static int g_fault_kill_sig;
static long g_fault_kill_after;

void fpio_test_hooks_enable(void) { fpio_test_hooks = 1; }

void fpio_fault_set(int err, long after)
{
    __atomic_store_n(&g_fault_after, after, __ATOMIC_RELAXED);
    __atomic_store_n(&g_fault_err, err, __ATOMIC_RELEASE);
}

void fpio_fault_short(long count)
{
    __atomic_store_n(&g_fault_short, count, __ATOMIC_RELEASE);
}

void fpio_fault_kill(int sig, long after)
{
    __atomic_store_n(&g_fault_kill_after, after, __ATOMIC_RELAXED);
    __atomic_store_n(&g_fault_kill_sig, sig, __ATOMIC_RELEASE);
}

/* A process killed in the middle of a pipeline (crash-consistency tests). */
static void fault_kill(void)
{
    int sig = __atomic_load_n(&g_fault_kill_sig, __ATOMIC_ACQUIRE);
    if (sig == 0 || __atomic_fetch_sub(&g_fault_kill_after, 1, __ATOMIC_ACQ_REL) > 0)
        return;
    kill(getpid(), sig);
}

/* The errno to report for this completion instead of its result, or 0. */
static int fault_take(void)
{
    if (__atomic_load_n(&g_fault_err, __ATOMIC_ACQUIRE) == 0)
        return 0;
    if (__atomic_fetch_sub(&g_fault_after, 1, __ATOMIC_ACQ_REL) > 0)
        return 0;
    return __atomic_exchange_n(&g_fault_err, 0, __ATOMIC_ACQ_REL);
}

int64_t fpio_fault_completion(int64_t res)
{
    fault_kill();
    int ferr = fault_take();
    if (ferr)
        res = -ferr;
    if (res > 1 && __atomic_load_n(&g_fault_short, __ATOMIC_ACQUIRE) > 0
        && __atomic_fetch_sub(&g_fault_short, 1, __ATOMIC_ACQ_REL) > 0)
        res = (res + 1) / 2;  /* pretend the kernel moved only half of it */
    return res;
}
