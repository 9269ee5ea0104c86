/* shardflow/runtime.h - the native part of the Shardflow runtime (libshardflow_native).
 *
 * Generated cpu kernels implement the kernel ABI below; a rank program is an ordered list of
 * steps, each a kernel call or a collective. The runtime (shardflow.runtime.executor) lays the
 * steps out as flat arrays once at load time and runs them with one sf_run_program() call; the
 * collectives are handed back to the caller through a callback.
 *
 * Everything here is plain C (usable from C and C++), and the library exports exactly the
 * functions declared in this header. Bump SHARDFLOW_NATIVE_ABI_VERSION whenever a declaration or
 * its meaning changes: the Python side refuses a library built with another version.
 */
#ifndef SHARDFLOW_RUNTIME_H
#define SHARDFLOW_RUNTIME_H

#include <stdint.h>

#define SHARDFLOW_NATIVE_ABI_VERSION 1

#if defined(_WIN32)
#define SF_API __declspec(dllexport)
#else
#define SF_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* The cpu kernel ABI: contiguous row-major arrays of the op's static shapes and dtypes, one
 * pointer per input (constants included) and per output, in the order of the program step. */
typedef void (*sf_kernel_fn)(const void* const* inputs, void* const* outputs);

/* A collective step of sf_run_program: `step` is its index in the program. Returns 0 to go on;
 * anything else stops the run, and sf_run_program returns that value. */
typedef int (*sf_collective_fn)(void* ctx, int64_t step);

/* SHARDFLOW_NATIVE_ABI_VERSION of the library (compare with the header you compiled against). */
SF_API int sf_native_abi_version(void);

/* Calls fns[i](ins[i], outs[i]) for i = 0 .. n-1: a run of kernels with no collective between. */
SF_API void sf_run_steps(int64_t n, const sf_kernel_fn* fns, const void* const* const* ins,
                         void* const* const* outs);

/* Runs a whole rank program of n steps in order: step i is the kernel fns[i](ins[i], outs[i]),
 * or, where fns[i] is NULL, the collective collective(ctx, i). Returns 0 once every step ran,
 * else the non-zero value of the collective that stopped the run (later steps do not run).
 * `collective` may be NULL when no fns[i] is. */
SF_API int sf_run_program(int64_t n, const sf_kernel_fn* fns, const void* const* const* ins,
                          void* const* const* outs, sf_collective_fn collective, void* ctx);

#ifdef __cplusplus
}
#endif

#endif /* SHARDFLOW_RUNTIME_H */
