/* Model opening shared by the worker's two modes (see engine_load.h). */
#include "worker/engine_load.h"

#include <string.h>
#include <time.h>

#include "store/err.h"
#include "store/io.h"

int moe_loaded_open(struct moe_loaded *lm, const char *path, bool with_tokenizer, char *err,
                    size_t errlen)
{
    char msg[512] = "";
    double t0 = moe_now_s();
    int rc;
    memset(lm, 0, sizeof *lm);
    if ((rc = gguf_open(&lm->gguf, path, msg, sizeof msg)))
        goto fail;
    if ((rc = moe_model_from_gguf(&lm->model, lm->gguf, msg, sizeof msg)))
        goto fail;
    if (with_tokenizer && (rc = moe_tok_load(&lm->tok, lm->gguf, msg, sizeof msg)))
        goto fail;
    lm->load_s = moe_now_s() - t0;
    return 0;
fail:
    moe_fail(err, errlen, rc, "%s: %s", path, msg[0] ? msg : moe_strerror(rc));
    moe_loaded_close(lm);
    return rc;
}

void moe_loaded_close(struct moe_loaded *lm)
{
    if (lm->tok)
        moe_tok_free(lm->tok);
    if (lm->gguf)
        moe_model_free(&lm->model);
    if (lm->gguf)
        gguf_close(lm->gguf);
    memset(lm, 0, sizeof *lm);
}
