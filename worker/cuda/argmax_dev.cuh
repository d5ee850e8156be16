/* (value, index) argmax candidates, shared by the kernels that pick a row's largest value with
 * the lowest index on ties (ops_dev.cuh's routing and argmax, sample.cu's scan). */
#ifndef MOE_CUDA_ARGMAX_DEV_CUH
#define MOE_CUDA_ARGMAX_DEV_CUH

/* A candidate is valid when idx >= 0. better(): valid beats invalid, the larger value wins, the
 * lower index wins ties. */
struct vi {
    float v;
    int i;
};

static __device__ __forceinline__ bool better(vi a, vi b)
{
    if (a.i < 0)
        return false;
    if (b.i < 0)
        return true;
    return a.v > b.v || (a.v == b.v && a.i < b.i);
}

#endif
