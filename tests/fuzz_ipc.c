/* libFuzzer target for the IPC frame path a peer controls: reassembly from arbitrary chunks,
 * protobuf decoding and range checks, from both directions. `make fuzz` builds it into
 * build/fuzz/fuzz_ipc. */
#include <stddef.h>
#include <stdint.h>

#include "proto/ipc.h"

struct fuzz_ctx {
    int frames;
};

static int on_frame(void *user, const uint8_t *body, size_t len)
{
    struct fuzz_ctx *c = user;
    char err[256];
    Moed__Envelope *env = NULL;
    c->frames++;
    if (moe_ipc_decode(body, len, &env, err, sizeof err) != 0)
        return 0;
    static const struct moe_ipc_limits lim = {.n_vocab = 4160, .n_layer = 3, .n_expert = 16,
                                              .n_ctx = 512};
    moe_ipc_validate(env, MOE_IPC_FROM_DAEMON, &lim, err, sizeof err);
    moe_ipc_validate(env, MOE_IPC_FROM_WORKER, &lim, err, sizeof err);
    moe_ipc_validate(env, MOE_IPC_FROM_WORKER, NULL, err, sizeof err);
    moe_ipc_free(env);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* The first byte picks the chunk size, so that split headers and bodies get exercised. */
    if (size < 1)
        return 0;
    size_t chunk = 1 + data[0] % 64;
    data++, size--;
    struct moe_ipc_reader r;
    struct fuzz_ctx c = {0};
    char err[256];
    moe_ipc_reader_init(&r, 1 << 16);
    for (size_t off = 0; off < size; off += chunk) {
        size_t n = size - off < chunk ? size - off : chunk;
        if (moe_ipc_reader_feed(&r, data + off, n, on_frame, &c, err, sizeof err) != 0)
            break;
    }
    moe_ipc_reader_free(&r);
    return 0;
}
