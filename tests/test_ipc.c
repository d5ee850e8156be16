/* IPC framing and the worker's IPC mode: codec round trips, reassembly from arbitrary chunks,
 * range checks, fd passing, libuv connections, and malformed input sent to a real worker
 * process (garbage, an oversized frame, a truncated frame, out-of-range fields). */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <uv.h>

#include "proto/ipc.h"
#include "store/err.h"
#include "store/io.h"
#include "tests/engine_test.h"
#include "tests/harness.h"
#include "tests/ipc_test.h"
#include "worker/batcher.h"
#include "worker/ipc.h"

/* ---------------------------------------------------------------------------------------------
 * The test binary doubles as a worker: the supervisor tests exec it with MOE_TEST_AS_WORKER set
 * and `--ipc-fd 3`, which is what moed-worker does with the same option. */

__attribute__((constructor)) static void maybe_run_as_worker(void)
{
    const char *v = getenv("MOE_TEST_AS_WORKER");
    if (!v || !*v)
        return;
    unsetenv("MOE_TEST_AS_WORKER");
    exit(moe_worker_ipc_main(3, "moed-worker"));
}

/* ---------------------------------------------------------------------------------------------
 * Helpers shared with tests/test_supervisor.c (declared in tests/ipc_test.h). */

const char *ipc_test_model = GOLDEN "/models/tiny-qwen3moe-F16.gguf";

int ipc_test_load_ref(const char *prompt, struct ipc_test_ref *out)
{
    struct golden_ref r;
    golden_load_tokens(&r, "F16", prompt);
    int rc = -1;
    if (r.n_prompt && r.n_prompt <= IPC_TEST_MAX_TOK && r.n_greedy <= IPC_TEST_MAX_TOK) {
        out->n_vocab = r.n_vocab;
        out->n_prompt = (uint32_t)r.n_prompt;
        out->n_greedy = (uint32_t)r.n_greedy;
        memcpy(out->prompt, r.prompt, sizeof(int32_t) * r.n_prompt);
        memcpy(out->greedy, r.greedy, sizeof(int32_t) * r.n_greedy);
        rc = 0;
    }
    golden_free(&r);
    return rc;
}

const char *ipc_test_worker_bin(void)
{
    /* Use the real moed-worker once its main() calls moe_worker_ipc_main (the symbol is linked
     * in); until then, this binary. */
    static char self[512];
    const char *real = moe_test_bin("moed-worker");
    FILE *f = fopen(real, "rb");
    if (f) {
        static char buf[1 << 16];
        size_t n, keep = 0;
        bool found = false;
        while (!found && (n = fread(buf + keep, 1, sizeof buf - keep, f)) > 0) {
            n += keep;
            found = memmem(buf, n, "moe_worker_ipc_main", 19) != NULL;
            keep = n >= 19 ? 19 : n;
            memmove(buf, buf + n - keep, keep);
        }
        fclose(f);
        if (found)
            return real;
    }
    ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
    if (len <= 0)
        return NULL;
    self[len] = 0;
    setenv("MOE_TEST_AS_WORKER", "1", 1);
    return self;
}

/* ---------------------------------------------------------------------------------------------
 * Codec */

struct collected {
    int n;
    Moed__Envelope *env[64];
};

static int collect(void *user, const uint8_t *body, size_t len)
{
    struct collected *c = user;
    char err[256];
    if (c->n == 64)
        return MOE_EINTERNAL;
    int rc = moe_ipc_decode(body, len, &c->env[c->n], err, sizeof err);
    if (rc)
        return rc;
    c->n++;
    return 0;
}

static uint8_t *encode(const Moed__Envelope *env, size_t *len)
{
    uint8_t *b = NULL;
    char err[256];
    int rc = moe_ipc_encode(env, 0, &b, len, err, sizeof err);
    CHECK_MSG(rc == 0, "encode: %s", err);
    return b;
}

TEST(ipc_codec_round_trip_in_random_chunks)
{
    int32_t prompt[300], eog[2] = {4096, 4097};
    for (int i = 0; i < 300; i++)
        prompt[i] = (i * 37) % 4160;
    uint64_t counts[3 * 16];
    for (int i = 0; i < 48; i++)
        counts[i] = (uint64_t)i * 1000003u;

    Moed__Sampling sp = MOED__SAMPLING__INIT;
    sp.temperature = 0.7f;
    sp.top_p = 0.9f;
    sp.top_k = 40;
    sp.seed = 0xfeedfacecafebeefull;
    sp.has_seed = 1;
    Moed__Submit sub = MOED__SUBMIT__INIT;
    sub.id = 77;
    sub.prompt = prompt;
    sub.n_prompt = 300;
    sub.max_tokens = 12;
    sub.sampling = &sp;
    sub.eog = eog;
    sub.n_eog = 2;
    Moed__Token tok = MOED__TOKEN__INIT;
    tok.id = 77;
    tok.token = 4159;
    Moed__RoutingStats rs = MOED__ROUTING_STATS__INIT;
    rs.n_layer = 3;
    rs.n_expert = 16;
    rs.counts = counts;
    rs.n_counts = 48;
    rs.n_tokens = 12345;
    Moed__Done done = MOED__DONE__INIT;
    done.id = 77;
    done.reason = MOED__FINISH_REASON__FINISH_LENGTH;
    done.n_prompt = 300;
    done.n_gen = 12;

    Moed__Envelope e[4] = {MOED__ENVELOPE__INIT, MOED__ENVELOPE__INIT, MOED__ENVELOPE__INIT,
                           MOED__ENVELOPE__INIT};
    e[0].msg_case = MOED__ENVELOPE__MSG_SUBMIT, e[0].submit = &sub;
    e[1].msg_case = MOED__ENVELOPE__MSG_TOKEN, e[1].token = &tok;
    e[2].msg_case = MOED__ENVELOPE__MSG_ROUTING_STATS, e[2].routing_stats = &rs;
    e[3].msg_case = MOED__ENVELOPE__MSG_DONE, e[3].done = &done;

    /* Five copies of the four frames back to back: 20 frames in one stream. */
    uint8_t *stream = NULL;
    size_t slen = 0;
    for (int rep = 0; rep < 5; rep++)
        for (int k = 0; k < 4; k++) {
            size_t n;
            uint8_t *b = encode(&e[k], &n);
            stream = realloc(stream, slen + n);
            memcpy(stream + slen, b, n);
            slen += n;
            free(b);
        }

    /* Feed it in chunks of 1 byte, 3 bytes, random sizes and all at once. */
    srand(1234);
    for (int mode = 0; mode < 4; mode++) {
        struct moe_ipc_reader r;
        struct collected c = {0};
        char err[256];
        moe_ipc_reader_init(&r, 0);
        size_t off = 0;
        while (off < slen) {
            size_t n = mode == 0 ? 1 : mode == 1 ? 3 : mode == 2 ? 1 + (size_t)(rand() % 700) : slen;
            if (n > slen - off)
                n = slen - off;
            int rc = moe_ipc_reader_feed(&r, stream + off, n, collect, &c, err, sizeof err);
            CHECK_MSG(rc == 0, "mode %d: feed: %s", mode, err);
            off += n;
        }
        CHECK_EQ(moe_ipc_reader_pending(&r), 0);
        CHECK_EQ(c.n, 20);
        for (int i = 0; i < 20; i++) {
            const Moed__Envelope *d = c.env[i];
            CHECK_EQ(d->msg_case, e[i % 4].msg_case);
            char verr[256];
            struct moe_ipc_limits lim = {.n_vocab = 4160, .n_layer = 3, .n_expert = 16, .n_ctx = 512};
            CHECK_EQ(moe_ipc_validate(d, i % 4 == 0 ? MOE_IPC_FROM_DAEMON : MOE_IPC_FROM_WORKER, &lim,
                                      verr, sizeof verr), 0);
            switch (i % 4) {
            case 0:
                CHECK_EQ(d->submit->id, 77);
                CHECK_EQ(d->submit->n_prompt, 300);
                for (int t = 0; t < 300; t++)
                    CHECK_EQ(d->submit->prompt[t], prompt[t]);
                CHECK_EQ(d->submit->max_tokens, 12);
                CHECK_EQ(d->submit->n_eog, 2);
                CHECK_EQ(d->submit->eog[1], 4097);
                CHECK(d->submit->sampling);
                CHECK_NEAR(d->submit->sampling->temperature, 0.7, 1e-7);
                CHECK_NEAR(d->submit->sampling->top_p, 0.9, 1e-7);
                CHECK_EQ(d->submit->sampling->top_k, 40);
                CHECK(d->submit->sampling->seed == 0xfeedfacecafebeefull);
                CHECK(d->submit->sampling->has_seed);
                break;
            case 1:
                CHECK_EQ(d->token->id, 77);
                CHECK_EQ(d->token->token, 4159);
                break;
            case 2:
                CHECK_EQ(d->routing_stats->n_counts, 48);
                for (int t = 0; t < 48; t++)
                    CHECK(d->routing_stats->counts[t] == counts[t]);
                CHECK_EQ(d->routing_stats->n_tokens, 12345);
                break;
            case 3:
                CHECK_EQ(d->done->reason, MOED__FINISH_REASON__FINISH_LENGTH);
                CHECK_EQ(d->done->n_gen, 12);
                break;
            }
            moe_ipc_free(c.env[i]);
        }
        moe_ipc_reader_free(&r);
    }
    free(stream);
}

TEST(ipc_reader_enforces_the_frame_limit)
{
    struct moe_ipc_reader r;
    struct collected c = {0};
    char err[256];
    /* Exactly at the limit is accepted, one byte more is refused from the header alone. */
    moe_ipc_reader_init(&r, 100);
    uint8_t hdr[4] = {100, 0, 0, 0};
    CHECK_EQ(moe_ipc_reader_feed(&r, hdr, 4, collect, &c, err, sizeof err), 0);
    moe_ipc_reader_free(&r);

    moe_ipc_reader_init(&r, 100);
    uint8_t big[4] = {101, 0, 0, 0};
    CHECK_EQ(moe_ipc_reader_feed(&r, big, 4, collect, &c, err, sizeof err), MOE_ETOOBIG);
    CHECK(strstr(err, "101") && strstr(err, "limit"));
    moe_ipc_reader_free(&r);

    /* The header split over two reads, announcing 4 GiB - 1 with the default 8 MiB limit. */
    moe_ipc_reader_init(&r, 0);
    uint8_t huge[4] = {0xff, 0xff, 0xff, 0xff};
    CHECK_EQ(moe_ipc_reader_feed(&r, huge, 2, collect, &c, err, sizeof err), 0);
    CHECK_EQ(moe_ipc_reader_feed(&r, huge + 2, 2, collect, &c, err, sizeof err), MOE_ETOOBIG);
    CHECK(r.cap < 1 << 20); /* nothing of the frame was buffered */
    moe_ipc_reader_free(&r);
    CHECK_EQ(c.n, 0);

    /* An encoder refuses to build a frame over the limit too. */
    int32_t *prompt = calloc(1 << 20, sizeof *prompt);
    for (int i = 0; i < 1 << 20; i++)
        prompt[i] = 1000 + i % 3000;
    Moed__Submit sub = MOED__SUBMIT__INIT;
    sub.id = 1;
    sub.prompt = prompt;
    sub.n_prompt = 1 << 20;
    sub.max_tokens = 1;
    Moed__Envelope env = MOED__ENVELOPE__INIT;
    env.msg_case = MOED__ENVELOPE__MSG_SUBMIT;
    env.submit = &sub;
    uint8_t *out = NULL;
    size_t len = 0;
    CHECK_EQ(moe_ipc_encode(&env, 1 << 20, &out, &len, err, sizeof err), MOE_ETOOBIG);
    CHECK_EQ(moe_ipc_encode(&env, 0, &out, &len, err, sizeof err), 0);
    CHECK(len > 1 << 20 && len < MOE_IPC_MAX_FRAME);
    free(out);
    free(prompt);
}

TEST(ipc_decode_rejects_garbage_and_unknown_messages)
{
    char err[256];
    Moed__Envelope *env = NULL;
    /* Random bytes: whatever protobuf makes of them, the result is never a crash, and the ones
     * that decode must carry a known message. */
    srand(99);
    int rejected = 0;
    for (int t = 0; t < 2000; t++) {
        uint8_t b[64];
        size_t n = 1 + (size_t)(rand() % 64);
        for (size_t i = 0; i < n; i++)
            b[i] = (uint8_t)rand();
        int rc = moe_ipc_decode(b, n, &env, err, sizeof err);
        if (rc) {
            CHECK_EQ(rc, MOE_EFORMAT);
            rejected++;
        } else {
            CHECK(strcmp(moe_ipc_msg_name(env->msg_case), "unknown") != 0);
            moe_ipc_free(env);
        }
    }
    CHECK(rejected > 1500);
    /* An empty body is an Envelope with nothing in it. */
    CHECK_EQ(moe_ipc_decode((const uint8_t *)"", 0, &env, err, sizeof err), MOE_EFORMAT);
    CHECK(strstr(err, "no known message"));
    /* Every message the schema defines decodes, the last one added included: an empty Heartbeat
     * is the 2 byte frame a worker sends every second. */
    Moed__Heartbeat hb = MOED__HEARTBEAT__INIT;
    Moed__Envelope he = MOED__ENVELOPE__INIT;
    he.msg_case = MOED__ENVELOPE__MSG_HEARTBEAT;
    he.heartbeat = &hb;
    size_t hlen;
    uint8_t *hbuf = encode(&he, &hlen);
    CHECK_EQ(hlen, (size_t)6);
    CHECK_MSG(moe_ipc_decode(hbuf + 4, hlen - 4, &env, err, sizeof err) == 0, "%s", err);
    CHECK_EQ(env->msg_case, MOED__ENVELOPE__MSG_HEARTBEAT);
    moe_ipc_free(env);
    free(hbuf);
    for (int c = 1; c < 64; c++) {
        const char *name = moe_ipc_msg_name((Moed__Envelope__MsgCase)c);
        bool known = strcmp(name, "unknown") != 0;
        const ProtobufCFieldDescriptor *fd =
            protobuf_c_message_descriptor_get_field(&moed__envelope__descriptor, (unsigned)c);
        CHECK_MSG(known == (fd != NULL), "case %d: named %s, in the schema: %s", c, name,
                  fd ? "yes" : "no");
    }
    /* Field 99 (varint 5): valid protobuf, unknown to us. */
    uint8_t unknown[] = {0x98, 0x06, 0x05};
    CHECK_EQ(moe_ipc_decode(unknown, sizeof unknown, &env, err, sizeof err), MOE_EFORMAT);
    /* A length-delimited field whose length runs past the end. */
    uint8_t trunc[] = {0x1a, 0x40, 0x08, 0x01};
    CHECK_EQ(moe_ipc_decode(trunc, sizeof trunc, &env, err, sizeof err), MOE_EFORMAT);
}

static int validate_one(const Moed__Envelope *e, enum moe_ipc_from from, char *err, size_t n)
{
    /* Through the wire format, so that what is checked is what a peer would send. */
    size_t len;
    uint8_t *b = encode(e, &len);
    Moed__Envelope *d = NULL;
    int rc = moe_ipc_decode(b + 4, len - 4, &d, err, n);
    free(b);
    CHECK_MSG(rc == 0, "decode: %s", err);
    struct moe_ipc_limits lim = {.n_vocab = 4160, .n_layer = 3, .n_expert = 16, .n_ctx = 512};
    rc = moe_ipc_validate(d, from, &lim, err, n);
    moe_ipc_free(d);
    return rc;
}

/* Tiered store frames: an expert that does not exist is a bad frame, in either direction. */
TEST(ipc_expert_request_and_ready_ranges)
{
    char err[256];
    Moed__ExpertRequest q = MOED__EXPERT_REQUEST__INIT;
    q.layer = 2;
    q.expert = 15;
    q.step = 7;
    Moed__Envelope e = MOED__ENVELOPE__INIT;
    e.msg_case = MOED__ENVELOPE__MSG_EXPERT_REQUEST;
    e.expert_request = &q;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_WORKER, err, sizeof err), 0);
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_DAEMON, err, sizeof err), MOE_EFORMAT);
    q.layer = 3;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_WORKER, err, sizeof err), MOE_ERANGE);
    CHECK(strstr(err, "expert (3, 15) does not exist"));
    q.layer = 0;
    q.expert = 16;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_WORKER, err, sizeof err), MOE_ERANGE);

    Moed__ExpertReady r = MOED__EXPERT_READY__INIT;
    r.layer = 1;
    r.expert = 3;
    r.offset = 1 << 22;
    r.size = 4096;
    e.msg_case = MOED__ENVELOPE__MSG_EXPERT_READY;
    e.expert_ready = &r;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_DAEMON, err, sizeof err), 0);
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_WORKER, err, sizeof err), MOE_EFORMAT);
    r.expert = 99;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_DAEMON, err, sizeof err), MOE_ERANGE);
    r.expert = 3;
    char *big = malloc(5000);
    memset(big, 'x', 4999);
    big[4999] = 0;
    r.code = MOE_EFORMAT;
    r.error = big;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_DAEMON, err, sizeof err), MOE_ERANGE);
    free(big);
}

TEST(ipc_validate_checks_every_range)
{
    char err[256];
    int32_t prompt[4] = {1, 2, 3, 4};
    Moed__Submit s = MOED__SUBMIT__INIT;
    s.id = 5;
    s.prompt = prompt;
    s.n_prompt = 4;
    s.max_tokens = 8;
    Moed__Envelope e = MOED__ENVELOPE__INIT;
    e.msg_case = MOED__ENVELOPE__MSG_SUBMIT;
    e.submit = &s;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_DAEMON, err, sizeof err), 0);
    /* Wrong direction. */
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_WORKER, err, sizeof err), MOE_EFORMAT);
    CHECK(strstr(err, "cannot come from a worker"));
    prompt[2] = 4160;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_DAEMON, err, sizeof err), MOE_ERANGE);
    CHECK(strstr(err, "submit.prompt[2] = 4160"));
    prompt[2] = -1;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_DAEMON, err, sizeof err), MOE_ERANGE);
    prompt[2] = 3;
    s.id = 0;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_DAEMON, err, sizeof err), MOE_ERANGE);
    s.id = 5;
    s.max_tokens = 0;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_DAEMON, err, sizeof err), MOE_ERANGE);
    s.max_tokens = 8;
    int32_t *lp = calloc(513, sizeof *lp);
    s.prompt = lp;
    s.n_prompt = 513;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_DAEMON, err, sizeof err), MOE_ERANGE);
    s.n_prompt = 512;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_DAEMON, err, sizeof err), 0);
    free(lp);
    s.prompt = prompt;
    s.n_prompt = 0;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_DAEMON, err, sizeof err), MOE_ERANGE);
    s.n_prompt = 4;
    Moed__Sampling sp = MOED__SAMPLING__INIT;
    s.sampling = &sp;
    sp.temperature = NAN;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_DAEMON, err, sizeof err), MOE_ERANGE);
    sp.temperature = 1;
    sp.top_k = 5000;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_DAEMON, err, sizeof err), MOE_ERANGE);
    sp.top_k = 0;
    sp.top_p = 1.5f;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_DAEMON, err, sizeof err), MOE_ERANGE);
    sp.top_p = 1;
    int32_t eog = 9999;
    s.eog = &eog;
    s.n_eog = 1;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_DAEMON, err, sizeof err), MOE_ERANGE);
    s.n_eog = 0;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_DAEMON, err, sizeof err), 0);
    /* logit_bias: equal lengths, token ids, -100..100; top_logprobs at most 20, with logprobs */
    int32_t bt[2] = {5, 4159};
    float bv[2] = {-100, 100};
    sp.bias_token = bt;
    sp.bias_value = bv;
    sp.n_bias_token = sp.n_bias_value = 2;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_DAEMON, err, sizeof err), 0);
    sp.n_bias_value = 1;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_DAEMON, err, sizeof err), MOE_ERANGE);
    sp.n_bias_value = 2;
    bv[1] = 100.5f;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_DAEMON, err, sizeof err), MOE_ERANGE);
    CHECK(strstr(err, "bias_value[1]"));
    bv[1] = NAN;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_DAEMON, err, sizeof err), MOE_ERANGE);
    bv[1] = 1;
    bt[0] = 4160;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_DAEMON, err, sizeof err), MOE_ERANGE);
    CHECK(strstr(err, "bias_token[0]"));
    sp.n_bias_token = sp.n_bias_value = 0;
    s.top_logprobs = 3;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_DAEMON, err, sizeof err), MOE_ERANGE);
    s.logprobs = true;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_DAEMON, err, sizeof err), 0);
    s.top_logprobs = 21;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_DAEMON, err, sizeof err), MOE_ERANGE);
    s.top_logprobs = 0;
    s.prompt_logprobs = true;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_DAEMON, err, sizeof err), 0);
    s.logprobs = false;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_DAEMON, err, sizeof err), MOE_ERANGE);
    s.prompt_logprobs = false;

    uint64_t counts[48] = {0};
    Moed__RoutingStats rs = MOED__ROUTING_STATS__INIT;
    rs.n_layer = 3;
    rs.n_expert = 16;
    rs.counts = counts;
    rs.n_counts = 48;
    e.msg_case = MOED__ENVELOPE__MSG_ROUTING_STATS;
    e.routing_stats = &rs;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_WORKER, err, sizeof err), 0);
    rs.n_layer = 4;
    rs.n_counts = 48;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_WORKER, err, sizeof err), MOE_ERANGE);
    CHECK(strstr(err, "does not match"));
    rs.n_layer = 3;
    rs.n_counts = 47;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_WORKER, err, sizeof err), MOE_ERANGE);

    Moed__Token tk = MOED__TOKEN__INIT;
    tk.id = 3;
    tk.token = 4160;
    e.msg_case = MOED__ENVELOPE__MSG_TOKEN;
    e.token = &tk;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_WORKER, err, sizeof err), MOE_ERANGE);
    tk.token = 4159;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_WORKER, err, sizeof err), 0);
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_DAEMON, err, sizeof err), MOE_EFORMAT);
    int32_t tt[21] = {1, 2};
    float tl[21] = {-0.5f, -1};
    tk.top_token = tt;
    tk.top_logprob = tl;
    tk.n_top_token = tk.n_top_logprob = 2;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_WORKER, err, sizeof err), MOE_ERANGE); /* no has_logprob */
    tk.has_logprob = true;
    tk.logprob = -0.5f;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_WORKER, err, sizeof err), 0);
    tk.n_top_logprob = 1;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_WORKER, err, sizeof err), MOE_ERANGE);
    tk.n_top_token = tk.n_top_logprob = 21;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_WORKER, err, sizeof err), MOE_ERANGE);
    tk.n_top_token = tk.n_top_logprob = 2;
    tt[1] = 4160;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_WORKER, err, sizeof err), MOE_ERANGE);
    tk.n_top_token = tk.n_top_logprob = 0;
    tk.prompt = true; /* a prompt position: 1.., with its logprob */
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_WORKER, err, sizeof err), MOE_ERANGE);
    tk.prompt_pos = 5;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_WORKER, err, sizeof err), 0);
    tk.has_logprob = false;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_WORKER, err, sizeof err), MOE_ERANGE);
    tk.prompt = false;

    uint8_t hot[6] = {0};
    Moed__SetPlacement pl = MOED__SET_PLACEMENT__INIT;
    pl.n_layer = 3;
    pl.n_expert = 16;
    pl.hot.data = hot;
    pl.hot.len = 6;
    e.msg_case = MOED__ENVELOPE__MSG_SET_PLACEMENT;
    e.set_placement = &pl;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_DAEMON, err, sizeof err), 0);
    pl.hot.len = 5;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_DAEMON, err, sizeof err), MOE_ERANGE);
    pl.hot.len = 6;
    uint64_t pc[48] = {0};
    pl.counts = pc;
    pl.n_counts = 48;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_DAEMON, err, sizeof err), 0);
    pl.n_counts = 47;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_DAEMON, err, sizeof err), MOE_ERANGE);
    CHECK(strstr(err, "counts"));
    pl.counts = NULL;
    pl.n_counts = 0;

    Moed__Hello h = MOED__HELLO__INIT;
    h.protocol_version = MOE_IPC_PROTOCOL_VERSION;
    h.model_path = "m.gguf";
    h.device = "cpu";
    h.n_ctx = 256;
    h.n_seq = 2;
    e.msg_case = MOED__ENVELOPE__MSG_HELLO;
    e.hello = &h;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_DAEMON, err, sizeof err), 0);
    h.protocol_version = 99;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_DAEMON, err, sizeof err), MOE_EUNSUPPORTED);
    h.protocol_version = MOE_IPC_PROTOCOL_VERSION;
    h.n_seq = 0;
    CHECK_EQ(validate_one(&e, MOE_IPC_FROM_DAEMON, err, sizeof err), MOE_ERANGE);
}

/* Done.signature: empty, or the model's n_layer x n_expert counts, none above the prompt tokens
 * evaluated; Metrics.hot: empty, or the model's bits with the last byte's padding clear (checked
 * against a 3 x 15 model, whose 45 bits leave three). */
TEST(ipc_validate_signature_and_hot_bitmap)
{
    char err[256];
    struct moe_ipc_limits lim = {.n_vocab = 4160, .n_layer = 3, .n_expert = 15, .n_ctx = 512};
    uint32_t sig[46] = {0};
    sig[7] = 9;
    Moed__Done d = MOED__DONE__INIT;
    d.id = 4;
    d.n_prompt = 12;
    d.n_cached = 3;
    Moed__Envelope e = MOED__ENVELOPE__INIT;
    e.msg_case = MOED__ENVELOPE__MSG_DONE;
    e.done = &d;
    CHECK_EQ(moe_ipc_validate(&e, MOE_IPC_FROM_WORKER, &lim, err, sizeof err), 0);
    d.signature = sig;
    d.n_signature = 45;
    CHECK_EQ(moe_ipc_validate(&e, MOE_IPC_FROM_WORKER, &lim, err, sizeof err), 0);
    d.n_signature = 46;
    CHECK_EQ(moe_ipc_validate(&e, MOE_IPC_FROM_WORKER, &lim, err, sizeof err), MOE_ERANGE);
    CHECK(strstr(err, "done.signature has 46 counts"));
    d.n_signature = 44;
    CHECK_EQ(moe_ipc_validate(&e, MOE_IPC_FROM_WORKER, &lim, err, sizeof err), MOE_ERANGE);
    d.n_signature = 45;
    sig[7] = 10; /* 12 prompt tokens, 3 of them cached: at most 9 */
    CHECK_EQ(moe_ipc_validate(&e, MOE_IPC_FROM_WORKER, &lim, err, sizeof err), MOE_ERANGE);
    CHECK(strstr(err, "done.signature[7] = 10"));
    sig[7] = 9;
    d.n_cached = 13;
    CHECK_EQ(moe_ipc_validate(&e, MOE_IPC_FROM_WORKER, &lim, err, sizeof err), MOE_ERANGE);
    d.n_cached = 3;
    struct moe_ipc_limits none = {0}; /* the shape unknown: no signature can be checked */
    CHECK_EQ(moe_ipc_validate(&e, MOE_IPC_FROM_WORKER, &none, err, sizeof err), MOE_ERANGE);

    uint8_t hot[7] = {0xff, 0xff, 0xff, 0xff, 0xff, 0x1f, 0};
    Moed__Metrics m = MOED__METRICS__INIT;
    e.msg_case = MOED__ENVELOPE__MSG_METRICS;
    e.metrics = &m;
    CHECK_EQ(moe_ipc_validate(&e, MOE_IPC_FROM_WORKER, &lim, err, sizeof err), 0);
    m.hot.data = hot;
    m.hot.len = 6;
    CHECK_EQ(moe_ipc_validate(&e, MOE_IPC_FROM_WORKER, &lim, err, sizeof err), 0);
    hot[5] = 0x20;
    CHECK_EQ(moe_ipc_validate(&e, MOE_IPC_FROM_WORKER, &lim, err, sizeof err), MOE_ERANGE);
    CHECK(strstr(err, "past the last expert"));
    hot[5] = 0x1f;
    m.hot.len = 7;
    CHECK_EQ(moe_ipc_validate(&e, MOE_IPC_FROM_WORKER, &lim, err, sizeof err), MOE_ERANGE);
    CHECK(strstr(err, "metrics.hot has 7 bytes, 6 expected"));
    m.hot.len = 5;
    CHECK_EQ(moe_ipc_validate(&e, MOE_IPC_FROM_WORKER, &lim, err, sizeof err), MOE_ERANGE);
}

TEST(ipc_passes_a_memfd_with_the_hello)
{
    int sv[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
    int mfd = memfd_create("ipc-test", MFD_CLOEXEC);
    CHECK(mfd >= 0);
    CHECK(write(mfd, "expert-bytes", 12) == 12);
    Moed__Hello h = MOED__HELLO__INIT;
    h.protocol_version = MOE_IPC_PROTOCOL_VERSION;
    h.model_path = "/nonexistent/model.gguf";
    h.device = "cpu";
    h.n_ctx = 64;
    h.n_seq = 1;
    h.store_size = 12;
    Moed__Envelope e = MOED__ENVELOPE__INIT;
    e.msg_case = MOED__ENVELOPE__MSG_HELLO;
    e.hello = &h;
    char err[256];
    CHECK_EQ(moe_ipc_send_with_fd(sv[0], &e, mfd, 0, err, sizeof err), 0);
    /* A second frame right behind it must not be consumed by the first receive. */
    Moed__Shutdown sd = MOED__SHUTDOWN__INIT;
    Moed__Envelope e2 = MOED__ENVELOPE__INIT;
    e2.msg_case = MOED__ENVELOPE__MSG_SHUTDOWN;
    e2.shutdown = &sd;
    CHECK_EQ(moe_ipc_send_with_fd(sv[0], &e2, -1, 0, err, sizeof err), 0);

    Moed__Envelope *got = NULL;
    int fd = -1;
    CHECK_EQ(moe_ipc_recv_with_fd(sv[1], 0, 2000, &got, &fd, err, sizeof err), 0);
    CHECK_EQ(got->msg_case, MOED__ENVELOPE__MSG_HELLO);
    CHECK_STREQ(got->hello->model_path, "/nonexistent/model.gguf");
    CHECK(fd >= 0 && fd != mfd);
    struct stat a, b;
    CHECK(fstat(fd, &a) == 0 && fstat(mfd, &b) == 0);
    CHECK(a.st_ino == b.st_ino && a.st_dev == b.st_dev);
    char buf[16] = {0};
    CHECK(pread(fd, buf, 12, 0) == 12);
    CHECK(memcmp(buf, "expert-bytes", 12) == 0);
    CHECK(fcntl(fd, F_GETFD) & FD_CLOEXEC);
    moe_ipc_free(got);
    close(fd);

    got = NULL;
    fd = -1;
    CHECK_EQ(moe_ipc_recv_with_fd(sv[1], 0, 2000, &got, &fd, err, sizeof err), 0);
    CHECK_EQ(got->msg_case, MOED__ENVELOPE__MSG_SHUTDOWN);
    CHECK_EQ(fd, -1);
    moe_ipc_free(got);

    /* Nothing more: a timeout; then the peer closes: EOF. */
    CHECK_EQ(moe_ipc_recv_with_fd(sv[1], 0, 50, &got, &fd, err, sizeof err), -ETIMEDOUT);
    CHECK(write(sv[0], "\x10\x00\x00\x00" "abc", 7) == 7);
    close(sv[0]);
    CHECK_EQ(moe_ipc_recv_with_fd(sv[1], 0, 2000, &got, &fd, err, sizeof err), MOE_EFORMAT);
    CHECK(strstr(err, "truncated"));
    close(sv[1]);
    close(mfd);
}

/* ---------------------------------------------------------------------------------------------
 * libuv connections, in-process */

struct conn_test {
    int n_tokens;
    int64_t sum;
    int closed;
    int close_reason;
    char close_msg[256];
};

static int ct_on_msg(struct moe_ipc_conn *c, void *user, const Moed__Envelope *env, char *err,
                     size_t errlen)
{
    struct conn_test *t = user;
    (void)c, (void)err, (void)errlen;
    if (env->msg_case == MOED__ENVELOPE__MSG_TOKEN) {
        t->n_tokens++;
        t->sum += env->token->token;
    }
    return 0;
}

static void ct_on_close(struct moe_ipc_conn *c, void *user, int reason, const char *msg)
{
    struct conn_test *t = user;
    (void)c;
    t->closed++;
    t->close_reason = reason;
    snprintf(t->close_msg, sizeof t->close_msg, "%s", msg);
}

static void send_env(int fd, const Moed__Envelope *e);

static void run_until(uv_loop_t *loop, int *flag, int target, double secs)
{
    double t0 = moe_test_now();
    while (*flag < target) {
        uv_run(loop, UV_RUN_NOWAIT);
        if (moe_test_now() - t0 > secs)
            break;
        usleep(500);
    }
}

TEST(ipc_conn_streams_frames_and_closes_on_garbage)
{
    uv_loop_t loop;
    CHECK(uv_loop_init(&loop) == 0);
    struct moe_ipc_limits lim = {.n_vocab = 4160, .n_layer = 3, .n_expert = 16, .n_ctx = 512};
    struct moe_ipc_conn_cb cb = {.on_msg = ct_on_msg, .on_close = ct_on_close};
    char err[256];

    /* Daemon side reads a worker's frames: 5000 tokens, then garbage. */
    for (int variant = 0; variant < 5; variant++) {
        int sv[2];
        CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
        struct conn_test t = {0};
        struct moe_ipc_conn *c = NULL;
        CHECK(moe_ipc_conn_open(&c, &loop, sv[0], MOE_IPC_FROM_WORKER, &lim, 4096, "test worker", &cb,
                                &t, err, sizeof err) == 0);
        int64_t want = 0;
        for (int i = 0; i < 5000; i++) {
            Moed__Token tk = MOED__TOKEN__INIT;
            tk.id = 1;
            tk.token = i % 4160;
            want += tk.token;
            Moed__Envelope e = MOED__ENVELOPE__INIT;
            e.msg_case = MOED__ENVELOPE__MSG_TOKEN;
            e.token = &tk;
            size_t len;
            uint8_t *b = encode(&e, &len);
            size_t off = 0;
            while (off < len) {
                ssize_t w = write(sv[1], b + off, len - off);
                if (w < 0 && errno == EAGAIN) {
                    uv_run(&loop, UV_RUN_NOWAIT);
                    continue;
                }
                CHECK(w > 0);
                off += (size_t)w;
            }
            free(b);
            if (i % 256 == 0)
                uv_run(&loop, UV_RUN_NOWAIT);
        }
        run_until(&loop, &t.n_tokens, 5000, 10);
        CHECK_EQ(t.n_tokens, 5000);
        CHECK(t.sum == want);
        CHECK_EQ(t.closed, 0);
        const char *why;
        if (variant == 0) {
            CHECK(write(sv[1], "\x05\x00\x00\x00\xff\xff\xff\xff\xff", 9) == 9); /* bad varint */
            why = "not a valid protobuf";
        } else if (variant == 1) {
            CHECK(write(sv[1], "\x01\x10\x00\x00", 4) == 4); /* 4097 > the 4096 limit */
            why = "limit";
        } else if (variant == 2) {
            CHECK(write(sv[1], "\x40\x00\x00\x00\x2a\x02", 6) == 6); /* truncated, then EOF */
            close(sv[1]);
            sv[1] = -1;
            why = "truncated";
        } else if (variant == 4) {
            /* The tiered store's request for an expert the model does not have. */
            Moed__ExpertRequest q = MOED__EXPERT_REQUEST__INIT;
            q.layer = 3;
            Moed__Envelope e = MOED__ENVELOPE__INIT;
            e.msg_case = MOED__ENVELOPE__MSG_EXPERT_REQUEST;
            e.expert_request = &q;
            send_env(sv[1], &e);
            why = "expert (3, 0) does not exist";
        } else {
            /* Well-formed, in range for protobuf, but a token id past the vocabulary. */
            Moed__Token tk = MOED__TOKEN__INIT;
            tk.id = 1;
            tk.token = 4160;
            Moed__Envelope e = MOED__ENVELOPE__INIT;
            e.msg_case = MOED__ENVELOPE__MSG_TOKEN;
            e.token = &tk;
            send_env(sv[1], &e);
            why = "not a token id";
        }
        run_until(&loop, &t.closed, 1, 5);
        CHECK_EQ(t.closed, 1);
        CHECK(t.close_reason != 0 && t.close_reason != UV_EOF);
        CHECK_MSG(strstr(t.close_msg, why), "close message '%s' lacks '%s'", t.close_msg, why);
        CHECK_EQ(t.n_tokens, 5000); /* nothing after the bad frame was delivered */
        /* Our end is closed: the peer sees EOF. */
        if (sv[1] >= 0) {
            char b[16];
            ssize_t r;
            do
                r = read(sv[1], b, sizeof b);
            while (r > 0);
            CHECK_EQ(r, 0);
            close(sv[1]);
        }
    }
    /* A clean EOF at a frame boundary is reason UV_EOF. */
    int sv[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
    struct conn_test t = {0};
    struct moe_ipc_conn *c = NULL;
    CHECK(moe_ipc_conn_open(&c, &loop, sv[0], MOE_IPC_FROM_WORKER, &lim, 0, "w", &cb, &t, err,
                            sizeof err) == 0);
    close(sv[1]);
    run_until(&loop, &t.closed, 1, 5);
    CHECK_EQ(t.close_reason, UV_EOF);
    uv_run(&loop, UV_RUN_NOWAIT);
    CHECK_EQ(uv_loop_close(&loop), 0);
}

/* ---------------------------------------------------------------------------------------------
 * A real worker process, spoken to directly */

struct wproc {
    pid_t pid;
    int fd;
    char log[512];
};

static void worker_fork(struct wproc *w)
{
    int sv[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
    snprintf(w->log, sizeof w->log, "%s/worker-%d.log", moe_test_tmpdir(), rand());
    fflush(NULL);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        close(sv[0]);
        int lf = open(w->log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (lf >= 0)
            dup2(lf, 2);
        exit(moe_worker_ipc_main(sv[1], "moed-worker"));
    }
    close(sv[1]);
    w->pid = pid;
    w->fd = sv[0];
}

/* Waits for the worker to exit; fails the test if it hangs or dies from a signal. */
static int worker_wait(struct wproc *w, double secs)
{
    int status = 0;
    for (int i = 0; i < (int)(secs * 100); i++) {
        pid_t r = waitpid(w->pid, &status, WNOHANG);
        if (r == w->pid) {
            CHECK_MSG(WIFEXITED(status), "worker died from signal %d", WTERMSIG(status));
            return WEXITSTATUS(status);
        }
        usleep(10000);
    }
    kill(w->pid, SIGKILL);
    waitpid(w->pid, &status, 0);
    moe_test_fail(__FILE__, __LINE__, "worker did not exit within %.0f s", secs);
}

static void worker_log_has(struct wproc *w, const char *what)
{
    char *log = moe_test_read_file(w->log, NULL);
    CHECK_MSG(log && strstr(log, what), "worker log lacks '%s':\n%s", what, log ? log : "(none)");
    free(log);
}

static void send_raw(int fd, const void *p, size_t n)
{
    CHECK(write(fd, p, n) == (ssize_t)n);
}

static void send_env(int fd, const Moed__Envelope *e)
{
    char err[256];
    CHECK_MSG(moe_ipc_send_with_fd(fd, e, -1, 0, err, sizeof err) == 0, "send: %s", err);
}

static void send_hello(int fd, const char *model, uint32_t n_ctx, uint32_t n_seq)
{
    Moed__Hello h = MOED__HELLO__INIT;
    h.protocol_version = MOE_IPC_PROTOCOL_VERSION;
    h.model_path = (char *)model;
    h.device = "cpu";
    h.n_ctx = n_ctx;
    h.n_seq = n_seq;
    h.n_threads = 1;
    Moed__Envelope e = MOED__ENVELOPE__INIT;
    e.msg_case = MOED__ENVELOPE__MSG_HELLO;
    e.hello = &h;
    send_env(fd, &e);
}

static Moed__Envelope *recv_env(int fd, int timeout_ms)
{
    char err[256];
    Moed__Envelope *e = NULL;
    int pfd = -1;
    int rc = moe_ipc_recv_with_fd(fd, 0, timeout_ms, &e, &pfd, err, sizeof err);
    CHECK_MSG(rc == 0, "receive: %s", err);
    return e;
}

/* After a rejection the worker closes its end: reading gives EOF, not a hang. */
static void expect_eof(int fd)
{
    char err[256];
    Moed__Envelope *e = NULL;
    int pfd = -1;
    for (;;) {
        int rc = moe_ipc_recv_with_fd(fd, 0, 10000, &e, &pfd, err, sizeof err);
        if (rc == 0) {
            /* Stats or metrics may still be on the way; anything else is unexpected. */
            CHECK_MSG(e->msg_case == MOED__ENVELOPE__MSG_ROUTING_STATS ||
                          e->msg_case == MOED__ENVELOPE__MSG_METRICS,
                      "unexpected %s before EOF", moe_ipc_msg_name(e->msg_case));
            moe_ipc_free(e);
            continue;
        }
        CHECK_MSG(rc == UV_EOF, "expected EOF, got %d: %s", rc, err);
        return;
    }
}

/* The worker refused what it was sent: it closes the socket, exits with 1 and logs why. */
static void expect_rejected(struct wproc *w, const char *why)
{
    expect_eof(w->fd);
    CHECK_EQ(worker_wait(w, 10), 1);
    worker_log_has(w, why);
    close(w->fd);
}

TEST(ipc_worker_rejects_garbage_first_frame)
{
    struct wproc w;
    worker_fork(&w);
    send_raw(w.fd, "\x08\x00\x00\x00GARBAGE!", 12);
    expect_rejected(&w, "rejected the first frame");
}

TEST(ipc_worker_rejects_oversized_frame)
{
    struct wproc w;
    worker_fork(&w);
    send_raw(w.fd, "\x01\x00\x80\x00", 4); /* 8 MiB + 1 */
    expect_rejected(&w, "limit");
}

TEST(ipc_worker_rejects_truncated_frame)
{
    struct wproc w;
    worker_fork(&w);
    send_raw(w.fd, "\x64\x00\x00\x00\x0a\x05", 6); /* 100 bytes announced, 2 sent */
    shutdown(w.fd, SHUT_WR);
    CHECK_EQ(worker_wait(&w, 10), 1);
    worker_log_has(&w, "truncated");
    close(w.fd);
}

TEST(ipc_worker_reports_a_model_that_does_not_load)
{
    struct wproc w;
    worker_fork(&w);
    send_hello(w.fd, "/nonexistent/model.gguf", 64, 1);
    Moed__Envelope *e = recv_env(w.fd, 10000);
    CHECK_EQ(e->msg_case, MOED__ENVELOPE__MSG_ERROR);
    CHECK_EQ(e->error->id, 0);
    CHECK(strstr(e->error->message, "/nonexistent/model.gguf"));
    moe_ipc_free(e);
    CHECK_EQ(worker_wait(&w, 10), 1);
    close(w.fd);
}

static Moed__Envelope *hello_and_ready(struct wproc *w, uint32_t n_ctx, uint32_t n_seq)
{
    worker_fork(w);
    send_hello(w->fd, ipc_test_model, n_ctx, n_seq);
    Moed__Envelope *e = recv_env(w->fd, 30000);
    CHECK_MSG(e->msg_case == MOED__ENVELOPE__MSG_READY, "got %s instead of ready",
              moe_ipc_msg_name(e->msg_case));
    CHECK_EQ(e->ready->n_vocab, 4160);
    CHECK_EQ(e->ready->n_layer, 3);
    CHECK_EQ(e->ready->n_expert, 16);
    CHECK_EQ(e->ready->n_ctx, n_ctx);
    CHECK_EQ(e->ready->n_seq, n_seq);
    CHECK_EQ(e->ready->pid, w->pid);
    CHECK(e->ready->weights_bytes > 1000000);
    CHECK(e->ready->kv_bytes > 0 && e->ready->ram_used > 0);
    return e;
}

TEST(ipc_worker_rejects_token_id_out_of_range)
{
    struct wproc w;
    moe_ipc_free(hello_and_ready(&w, 256, 2));
    int32_t prompt[3] = {100, 4160, 200};
    Moed__Submit s = MOED__SUBMIT__INIT;
    s.id = 1;
    s.prompt = prompt;
    s.n_prompt = 3;
    s.max_tokens = 4;
    Moed__Envelope e = MOED__ENVELOPE__INIT;
    e.msg_case = MOED__ENVELOPE__MSG_SUBMIT;
    e.submit = &s;
    send_env(w.fd, &e);
    expect_rejected(&w, "submit.prompt[1] = 4160 is not a token id");
}

TEST(ipc_worker_rejects_expert_ready_without_a_pool)
{
    struct wproc w;
    moe_ipc_free(hello_and_ready(&w, 128, 1));
    Moed__ExpertReady r = MOED__EXPERT_READY__INIT;
    r.layer = 1;
    r.expert = 2;
    r.offset = 1 << 21;
    r.size = 4096;
    Moed__Envelope e = MOED__ENVELOPE__INIT;
    e.msg_case = MOED__ENVELOPE__MSG_EXPERT_READY;
    e.expert_ready = &r;
    send_env(w.fd, &e);
    expect_rejected(&w, "holds every expert");
}

TEST(ipc_worker_rejects_placement_for_another_shape)
{
    struct wproc w;
    moe_ipc_free(hello_and_ready(&w, 128, 1));
    uint8_t hot[8] = {0xff};
    Moed__SetPlacement p = MOED__SET_PLACEMENT__INIT;
    p.n_layer = 4; /* the model has 3 */
    p.n_expert = 16;
    p.hot.data = hot;
    p.hot.len = 8;
    Moed__Envelope e = MOED__ENVELOPE__INIT;
    e.msg_case = MOED__ENVELOPE__MSG_SET_PLACEMENT;
    e.set_placement = &p;
    send_env(w.fd, &e);
    expect_rejected(&w, "does not match the model");
}

TEST(ipc_worker_rejects_wrong_direction_and_second_hello)
{
    for (int k = 0; k < 2; k++) {
        struct wproc w;
        moe_ipc_free(hello_and_ready(&w, 128, 1));
        if (k == 0) {
            Moed__Token t = MOED__TOKEN__INIT;
            t.id = 1;
            t.token = 5;
            Moed__Envelope e = MOED__ENVELOPE__INIT;
            e.msg_case = MOED__ENVELOPE__MSG_TOKEN;
            e.token = &t;
            send_env(w.fd, &e);
        } else {
            send_hello(w.fd, ipc_test_model, 128, 1);
        }
        expect_rejected(&w, k == 0 ? "cannot come from the daemon" : "a second hello");
    }
}

/* Adds a RoutingStats delta of the golden model (3 layers x 16 experts) to per-layer totals. */
static void add_routing(const Moed__RoutingStats *rs, uint64_t routed[3], uint64_t *n_tokens)
{
    CHECK_EQ(rs->n_counts, 48);
    for (int l = 0; l < 3; l++)
        for (int x = 0; x < 16; x++)
            routed[l] += rs->counts[l * 16 + x];
    *n_tokens += rs->n_tokens;
}

/* Sends Shutdown, reads every frame up to EOF (adding RoutingStats to routed/n_tokens when given)
 * and checks that the worker exits 0. */
static void shutdown_to_eof(struct wproc *w, uint64_t routed[3], uint64_t *n_tokens)
{
    Moed__Shutdown sd = MOED__SHUTDOWN__INIT;
    Moed__Envelope se = MOED__ENVELOPE__INIT;
    se.msg_case = MOED__ENVELOPE__MSG_SHUTDOWN;
    se.shutdown = &sd;
    send_env(w->fd, &se);
    for (;;) {
        char err[256];
        Moed__Envelope *m = NULL;
        int pfd = -1;
        int rc = moe_ipc_recv_with_fd(w->fd, 0, 10000, &m, &pfd, err, sizeof err);
        if (rc == UV_EOF)
            break;
        CHECK_MSG(rc == 0, "%s", err);
        if (routed && m->msg_case == MOED__ENVELOPE__MSG_ROUTING_STATS)
            add_routing(m->routing_stats, routed, n_tokens);
        moe_ipc_free(m);
    }
    CHECK_EQ(worker_wait(w, 10), 0);
}

/* An idle ready worker sends a Heartbeat every second, and it decodes like every other frame
 * (a reader that refused it would drop every worker a second after it got ready). */
TEST_TIMEOUT(ipc_worker_sends_heartbeats_that_decode, 60)
{
    struct wproc w;
    moe_ipc_free(hello_and_ready(&w, 256, 1));
    int beats = 0;
    double t0 = moe_now_s();
    while (beats < 2) {
        CHECK_MSG(moe_now_s() - t0 < 10, "no Heartbeat in 10 s");
        Moed__Envelope *m = recv_env(w.fd, 5000);
        if (m->msg_case == MOED__ENVELOPE__MSG_HEARTBEAT) {
            CHECK_EQ(m->heartbeat->running, 0u);
            beats++;
        }
        moe_ipc_free(m);
    }
    shutdown_to_eof(&w, NULL, NULL);
}

/* The whole protocol by hand: two requests at once on a 2-slot worker, greedy tokens equal the
 * golden ones, a Cancel, routing stats, then Shutdown and a clean exit. */
TEST_TIMEOUT(ipc_worker_generates_golden_tokens, 120)
{
    struct ipc_test_ref ref;
    CHECK(ipc_test_load_ref("p1", &ref) == 0);
    struct wproc w;
    moe_ipc_free(hello_and_ready(&w, 256, 2));
    Moed__Submit s = MOED__SUBMIT__INIT;
    s.prompt = ref.prompt;
    s.n_prompt = ref.n_prompt;
    s.max_tokens = 16;
    Moed__Envelope e = MOED__ENVELOPE__INIT;
    e.msg_case = MOED__ENVELOPE__MSG_SUBMIT;
    e.submit = &s;
    s.id = 11;
    send_env(w.fd, &e);
    s.id = 12;
    send_env(w.fd, &e);
    s.id = 13; /* cancelled at once: it may never start, or stop early */
    s.max_tokens = 200;
    send_env(w.fd, &e);
    Moed__Cancel cn = MOED__CANCEL__INIT;
    cn.id = 13;
    Moed__Envelope ce = MOED__ENVELOPE__INIT;
    ce.msg_case = MOED__ENVELOPE__MSG_CANCEL;
    ce.cancel = &cn;
    send_env(w.fd, &ce);

    int32_t got[2][16];
    int n[2] = {0, 0}, done = 0;
    uint64_t routed[3] = {0}, stats_tokens = 0;
    while (done < 2) {
        Moed__Envelope *m = recv_env(w.fd, 30000);
        if (m->msg_case == MOED__ENVELOPE__MSG_TOKEN) {
            CHECK(m->token->id == 11 || m->token->id == 12 || m->token->id == 13);
            if (m->token->id != 13) {
                int k = (int)m->token->id - 11;
                CHECK(n[k] < 16);
                got[k][n[k]++] = m->token->token;
            }
        } else if (m->msg_case == MOED__ENVELOPE__MSG_DONE) {
            CHECK(m->done->id == 11 || m->done->id == 12);
            CHECK_EQ(m->done->reason, MOED__FINISH_REASON__FINISH_LENGTH);
            CHECK_EQ(m->done->n_gen, 16);
            CHECK_EQ(m->done->n_prompt, ref.n_prompt);
            done++;
        } else if (m->msg_case == MOED__ENVELOPE__MSG_ROUTING_STATS) {
            add_routing(m->routing_stats, routed, &stats_tokens);
        } else {
            CHECK_MSG(m->msg_case == MOED__ENVELOPE__MSG_METRICS, "unexpected %s",
                      moe_ipc_msg_name(m->msg_case));
        }
        moe_ipc_free(m);
    }
    for (int k = 0; k < 2; k++) {
        CHECK_EQ(n[k], 16);
        for (int i = 0; i < 16; i++)
            CHECK_MSG(got[k][i] == ref.greedy[i], "request %d token %d: %d, golden %d", k, i, got[k][i],
                      ref.greedy[i]);
    }
    shutdown_to_eof(&w, routed, &stats_tokens); /* the remaining stats come before EOF */
    /* Each evaluated token picks 4 experts in every layer; request 11 evaluated its prompt and
     * 15 generated tokens (the 16th is sampled, never fed back), request 12 (admitted with it,
     * the same prompt) copied all but the last prompt token from 11's slot when the prompt is
     * long enough to share, then the same. Request 13 may have evaluated some tokens before its
     * Cancel arrived. */
    const uint64_t own12 = ref.n_prompt > MOE_BATCHER_SHARE_MIN ? 1 : ref.n_prompt;
    uint64_t base = (ref.n_prompt + 15) + (own12 + 15);
    CHECK(stats_tokens >= base);
    for (int l = 0; l < 3; l++)
        CHECK_EQ(routed[l], 4 * stats_tokens);
    close(w.fd);
}
