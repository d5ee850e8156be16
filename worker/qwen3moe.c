/* The qwen3moe forward pass, written once for every backend (the contract is in backend.h; the
 * math in docs/engine.md). One call evaluates one step: n tokens that may mix sequences and
 * positions, each layer as a fixed sequence of backend ops. */
#include "worker/backend.h"

#define TRY(call)                                                                           \
    do {                                                                                    \
        int rc_ = (call);                                                                   \
        if (rc_)                                                                            \
            return rc_;                                                                     \
    } while (0)

int moe_qwen3moe_step(struct moe_backend *b, const struct moe_dims *d, const struct moe_step *st,
                      float *out, int32_t *tokens, bool submit)
{
    const struct moe_backend_vt *vt = b->vt;
    static const struct moe_mm qkv[3] = {
        {MOE_W_Q, MOE_BUF_Q}, {MOE_W_K, MOE_BUF_K}, {MOE_W_V, MOE_BUF_V}};
    static const struct moe_mm wo = {MOE_W_O, MOE_BUF_H};
    static const struct moe_mm router = {MOE_W_ROUTER, MOE_BUF_RL};

    TRY(vt->begin(b, st));
    TRY(vt->embed(b, MOE_BUF_H));
    const int fused = vt->layers ? vt->layers(b) : 0;
    if (fused < 0)
        return fused;
    for (int l = 0; !fused && l < (int)d->L; l++) {
        TRY(vt->rmsnorm(b, l, MOE_W_ATTN_NORM, MOE_BUF_H, MOE_BUF_X));
        TRY(vt->matmul(b, l, qkv, 3, MOE_BUF_X, false));
        TRY(vt->qk_rope_kv(b, l));
        TRY(vt->attention(b, l));
        TRY(vt->matmul(b, l, &wo, 1, MOE_BUF_ATT, true));
        TRY(vt->rmsnorm(b, l, MOE_W_FFN_NORM, MOE_BUF_H, MOE_BUF_X));
        TRY(vt->matmul(b, l, &router, 1, MOE_BUF_X, false));
        TRY(vt->route(b, l));
        TRY(vt->experts(b, l));
    }
    TRY(vt->head(b));
    return submit ? vt->submit(b) : vt->end(b, out, tokens);
}
