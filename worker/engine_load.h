/* Opening a model for the engine from a GGUF file: the mapping, the model description and
 * (optionally) the tokenizer, as one unit that the standalone runner (worker/main.c) and the
 * daemon-spawned worker (worker/ipc.c) can both use. */
#ifndef MOE_ENGINE_LOAD_H
#define MOE_ENGINE_LOAD_H

#include <stdbool.h>
#include <stddef.h>

#include "store/gguf.h"
#include "store/model.h"
#include "store/tokenizer.h"

struct moe_loaded {
    struct gguf_file *gguf;      /* owned */
    struct moe_model model;      /* views into gguf */
    struct moe_tokenizer *tok;   /* owned; NULL unless requested */
    double load_s;               /* wall time of moe_loaded_open */
};

/* Opens path, describes the model, and loads the tokenizer when with_tokenizer is set.
 * Returns 0, or the error of the failing step with a message that starts with the path.
 * On failure nothing is left open. */
int moe_loaded_open(struct moe_loaded *lm, const char *path, bool with_tokenizer, char *err,
                    size_t errlen);

/* Releases everything (a zeroed or failed struct is fine). */
void moe_loaded_close(struct moe_loaded *lm);

#endif
