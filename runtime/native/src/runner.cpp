// The rank-program runner: tight loops over kernel function pointers (see shardflow/runtime.h).
#include "shardflow/runtime.h"

extern "C" {

SF_API int sf_native_abi_version(void) { return SHARDFLOW_NATIVE_ABI_VERSION; }

SF_API void sf_run_steps(int64_t n, const sf_kernel_fn* fns, const void* const* const* ins,
                         void* const* const* outs) {
    for (int64_t i = 0; i < n; ++i) fns[i](ins[i], outs[i]);
}

SF_API int sf_run_program(int64_t n, const sf_kernel_fn* fns, const void* const* const* ins,
                          void* const* const* outs, sf_collective_fn collective, void* ctx) {
    for (int64_t i = 0; i < n; ++i) {
        if (fns[i] != nullptr) {
            fns[i](ins[i], outs[i]);
        } else if (int rc = collective(ctx, i)) {
            return rc;
        }
    }
    return 0;
}

}  // extern "C"
