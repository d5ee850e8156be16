/* CUDA device discovery: which GPUs this binary can compute on (moed-worker --list-devices).
 *
 * Built only with CUDA (MOE_HAVE_CUDA). Plain C API, no CUDA types, so worker/main.c includes it
 * as it is. */
#ifndef MOE_CUDA_PROBE_H
#define MOE_CUDA_PROBE_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* CUDA devices the runtime sees (CUDA_VISIBLE_DEVICES applies). 0 when there is none or the
 * runtime cannot start (no driver, a driver older than the runtime); then why (len bytes, may
 * be NULL) receives the reason, else "". */
int moe_cuda_device_count(char *why, size_t len);

/* Whether this binary can compute on device `index`: the device exists, and a kernel built into
 * this binary launches on it, completes and writes what it should. A GPU whose compute
 * capability the binary carries no code for fails here (cudaErrorNoKernelImageForDevice).
 * Returns 1 with desc = "NVIDIA H200, 143771 MiB, compute capability 9.0", or 0 with desc =
 * the same followed by the reason (or the reason alone when the device's properties could not
 * be read). CUDA errors are also printed to stderr (MOE_CUDA_TRY). Leaves `index` the current
 * device of the calling thread. */
int moe_cuda_probe(int index, char *desc, size_t len);

#ifdef __cplusplus
}
#endif

#endif
