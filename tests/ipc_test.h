/* Helpers shared by tests/test_ipc.c (which defines them) and tests/test_supervisor.c: the golden
 * model, its reference tokens, and the worker binary to exec. */
#ifndef MOE_TEST_IPC_TEST_H
#define MOE_TEST_IPC_TEST_H

#include <stdint.h>

#define IPC_TEST_MAX_TOK 256
struct ipc_test_ref {
    uint32_t n_vocab, n_prompt, n_greedy;
    int32_t prompt[IPC_TEST_MAX_TOK];
    int32_t greedy[IPC_TEST_MAX_TOK];
};

/* Path of the golden F16 model. */
extern const char *ipc_test_model;
/* Loads the tokens of tests/golden/refs/tiny-qwen3moe-F16.PROMPT.json (a missing file fails the
 * test). Returns 0, or -1 when the prompt is empty or a list is longer than IPC_TEST_MAX_TOK. */
int ipc_test_load_ref(const char *prompt, struct ipc_test_ref *out);
/* bin/moed-worker once it runs the IPC mode, else this test binary (as a worker); NULL when
 * neither can be found. */
const char *ipc_test_worker_bin(void);

#endif
