/* Scratch allocation of the decode kernels, checked: a kernel that cannot get its scratch frees
 * what it got and returns the size it failed to get, which model/native.py raises as MemoryError.
 *
 * cs_set_max_alloc(n) makes every request over n bytes fail (n < 0: none does): how the tests
 * reach those failure paths without exhausting the machine's memory. One compare per allocation,
 * a few allocations per call. */
#ifndef CACHESMITH_KERNEL_ALLOC_H
#define CACHESMITH_KERNEL_ALLOC_H
#include <stddef.h>
#include <stdint.h>

void* cs_malloc(size_t num_bytes);
void cs_set_max_alloc(int64_t max_bytes);
#endif
