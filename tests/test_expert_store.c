/* The shared-memory expert store on the golden models: exact bytes, layout, seals, passing the fd
 * to another process, rejection of foreign or damaged stores, and one copy in RAM for two
 * workers (measured through /proc/PID/smaps, not assumed). */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "proto/ipc.h"
#include "store/err.h"
#include "store/expert_store.h"
#include "store/gguf.h"
#include "store/model.h"
#include "tests/harness.h"

#define F16_PATH "tests/golden/models/tiny-qwen3moe-F16.gguf"
#define Q4KM_PATH "tests/golden/models/tiny-qwen3moe-Q4_K_M.gguf"

struct loaded {
    struct gguf_file *f;
    struct moe_model m;
};

static void load(struct loaded *l, const char *path)
{
    char err[512];
    int rc = gguf_open(&l->f, path, err, sizeof err);
    CHECK_MSG(rc == 0, "gguf_open %s: %s", path, err);
    rc = moe_model_from_gguf(&l->m, l->f, err, sizeof err);
    CHECK_MSG(rc == 0, "moe_model_from_gguf %s: %s", path, err);
}

static void unload(struct loaded *l)
{
    moe_model_free(&l->m);
    gguf_close(l->f);
}

struct progress_log {
    int calls;
    uint64_t last, total;
    int monotonic;
};

static int on_progress(uint64_t done, uint64_t total, void *user)
{
    struct progress_log *p = user;
    if (p->calls && done < p->last)
        p->monotonic = 0;
    p->calls++;
    p->last = done;
    p->total = total;
    return 0;
}

static int is_expert_name(const char *name)
{
    return strstr(name, "_exps") != NULL;
}

/* Every view of `got` (built from the store) holds exactly the bytes the GGUF holds for `ref`
 * (the same model described from the file), and every pointer lies inside the store. */
static void compare_model(const struct moe_model *ref, const struct moe_model *got,
                          const uint8_t *file, const uint8_t *base, uint64_t size)
{
#define IN_STORE(p) ((const uint8_t *)(p) >= base && (const uint8_t *)(p) < base + size)
#define SAME_VIEW(a, b)                                                                        \
    do {                                                                                       \
        CHECK_EQ((a).nbytes, (b).nbytes);                                                      \
        CHECK_EQ((a).type, (b).type);                                                          \
        CHECK_EQ((a).ne[0], (b).ne[0]);                                                        \
        CHECK_EQ((a).ne[1], (b).ne[1]);                                                        \
        CHECK(IN_STORE((b).data));                                                             \
        CHECK(memcmp((a).data, (b).data, (a).nbytes) == 0);                                    \
    } while (0)
    CHECK(got->gguf == NULL);
    SAME_VIEW(ref->token_embd, got->token_embd);
    SAME_VIEW(ref->output_norm, got->output_norm);
    SAME_VIEW(ref->output, got->output);
    for (uint32_t l = 0; l < ref->hp.n_layer; l++) {
        const struct moe_layer *a = &ref->layers[l], *b = &got->layers[l];
        SAME_VIEW(a->attn_norm, b->attn_norm);
        SAME_VIEW(a->attn_q, b->attn_q);
        SAME_VIEW(a->attn_k, b->attn_k);
        SAME_VIEW(a->attn_v, b->attn_v);
        SAME_VIEW(a->attn_output, b->attn_output);
        SAME_VIEW(a->attn_q_norm, b->attn_q_norm);
        SAME_VIEW(a->attn_k_norm, b->attn_k_norm);
        SAME_VIEW(a->ffn_norm, b->ffn_norm);
        SAME_VIEW(a->ffn_gate_inp, b->ffn_gate_inp);
        for (uint32_t e = 0; e < ref->hp.n_expert; e++) {
            struct moe_expert_slice sl;
            CHECK_EQ(moe_model_expert_slice(ref, l, e, &sl), 0);
            const struct moe_expert *x = &b->experts[e];
            const struct moe_tensor *v[3] = {&x->gate, &x->up, &x->down};
            for (int k = 0; k < 3; k++) {
                CHECK_EQ(v[k]->nbytes, sl.size[k]);
                CHECK_EQ(v[k]->type, sl.type[k]);
                CHECK(IN_STORE(v[k]->data));
                CHECK(memcmp(v[k]->data, file + sl.off[k], sl.size[k]) == 0);
            }
        }
    }
#undef SAME_VIEW
#undef IN_STORE
}

static int count_fds(void)
{
    int n = 0;
    DIR *d = opendir("/proc/self/fd");
    CHECK(d != NULL);
    while (readdir(d))
        n++;
    closedir(d);
    return n;
}

static void store_matches_gguf(const char *path)
{
    char err[512];
    struct loaded a, b;
    struct moe_store *s, *w;
    struct progress_log pl = {0, 0, 0, 1};
    load(&a, path);
    load(&b, path);

    int rc = moe_store_create(&s, &a.m, 2, on_progress, &pl, err, sizeof err);
    CHECK_MSG(rc == 0, "moe_store_create: %s", err);
    struct moe_store_info info;
    moe_store_get_info(s, &info);
    fprintf(stderr, "%s: store %" PRIu64 " bytes (dense %" PRIu64 ", experts %" PRIu64
            "), %d threads, %.3f s; THP shmem_enabled=[%s] madvise=%d huge=%" PRIu64 " bytes\n",
            path, info.size, info.dense_bytes, info.expert_bytes, info.threads, info.seconds,
            info.thp_shmem_mode, info.thp_advised, info.huge_bytes);
    CHECK_EQ(info.expert_bytes, a.m.bytes_experts);
    CHECK_EQ(info.dense_bytes + info.expert_bytes, a.m.bytes_dense + a.m.bytes_experts);
    CHECK_EQ(info.fingerprint, a.m.fingerprint);
    CHECK_EQ(info.size, moe_store_size(s));
    CHECK_EQ(info.size % MOE_STORE_REGION_ALIGN, 0);
    CHECK(pl.calls >= 1 && pl.monotonic);
    CHECK_EQ(pl.last, pl.total);
    CHECK_EQ(pl.total, info.dense_bytes + info.expert_bytes);

    /* The header as the worker will read it. */
    const struct moe_store_header *h = moe_store_base(s);
    CHECK(memcmp(h->magic, MOE_STORE_MAGIC, 8) == 0);
    CHECK_EQ(h->version, MOE_STORE_VERSION);
    CHECK_EQ(h->total_size, info.size);
    CHECK_EQ(h->fingerprint, a.m.fingerprint);

    /* Blob table: 4 KiB aligned, gate/up/down back to back inside the blob, exact bytes. */
    const uint8_t *base = moe_store_base(s);
    for (uint32_t l = 0; l < a.m.hp.n_layer; l++) {
        const struct moe_store_layer *L = moe_store_layer(s, l);
        CHECK(L != NULL);
        CHECK_EQ(L->blob_stride % 4096, 0);
        CHECK_EQ(L->off[0], 0);
        CHECK(L->off[1] >= L->size[0] && L->off[1] - L->size[0] < MOE_STORE_SLICE_ALIGN);
        CHECK(L->off[2] >= L->off[1] + L->size[1] &&
              L->off[2] - L->off[1] - L->size[1] < MOE_STORE_SLICE_ALIGN);
        CHECK_EQ(L->blob_bytes, L->off[2] + L->size[2]);
        CHECK_EQ(L->size[0] + L->size[1] + L->size[2], moe_model_expert_bytes(&a.m, l));
        for (uint32_t e = 0; e < a.m.hp.n_expert; e++) {
            const void *p;
            uint64_t sz;
            struct moe_expert_slice sl;
            CHECK_EQ(moe_store_blob(s, l, e, &p, &sz), 0);
            CHECK_EQ((uintptr_t)p % 4096, 0);
            CHECK_EQ(sz, L->blob_bytes);
            CHECK(p >= (const void *)base && (const uint8_t *)p + sz <= base + info.size);
            CHECK_EQ(moe_model_expert_slice(&a.m, l, e, &sl), 0);
            for (int k = 0; k < 3; k++)
                CHECK(memcmp((const uint8_t *)p + L->off[k], a.f->base + sl.off[k], sl.size[k]) == 0);
        }
    }
    const void *p;
    uint64_t sz;
    CHECK_EQ(moe_store_blob(s, a.m.hp.n_layer, 0, &p, &sz), MOE_ERANGE);
    CHECK_EQ(moe_store_blob(s, 0, a.m.hp.n_expert, &p, &sz), MOE_ERANGE);
    CHECK(moe_store_layer(s, a.m.hp.n_layer) == NULL);

    /* Every tensor of the file that is not a routed expert is in the dense region, exactly. */
    uint32_t n_dense = 0;
    for (uint64_t i = 0; i < a.f->n_tensors; i++) {
        const struct gguf_tensor *t = &a.f->tensors[i];
        rc = moe_store_dense(s, t->name, &p, &sz);
        if (is_expert_name(t->name)) {
            CHECK_EQ(rc, MOE_ENOTFOUND);
            continue;
        }
        CHECK_MSG(rc == 0, "dense tensor %s missing from the store", t->name);
        CHECK_EQ(sz, t->nbytes);
        CHECK_EQ((uintptr_t)p % MOE_STORE_DENSE_ALIGN, 0);
        CHECK(memcmp(p, t->data, t->nbytes) == 0);
        n_dense++;
    }
    CHECK_EQ(n_dense, info.n_dense);

    /* A second mapping through the fd, and a model whose views all point into it. */
    rc = moe_store_open_model(&w, moe_store_fd(s), &b.m, err, sizeof err);
    CHECK_MSG(rc == 0, "moe_store_open_model: %s", err);
    compare_model(&a.m, &b.m, a.f->base, moe_store_base(w), moe_store_size(w));
    /* The expert slices of a store-backed model are gone on purpose (no file offsets). */
    struct moe_expert_slice sl;
    CHECK_EQ(moe_model_expert_slice(&b.m, 0, 0, &sl), MOE_EINTERNAL);
    moe_store_close(w);
    moe_store_close(s);
    unload(&a);
    unload(&b);
}

TEST(expert_store_matches_gguf_f16)
{
    store_matches_gguf(F16_PATH);
}

TEST(expert_store_matches_gguf_q4km)
{
    store_matches_gguf(Q4KM_PATH);
}

TEST(expert_store_sealed)
{
    char err[512];
    struct loaded a;
    struct moe_store *s;
    load(&a, Q4KM_PATH);
    CHECK_EQ(moe_store_create(&s, &a.m, 0, NULL, NULL, err, sizeof err), 0);
    int fd = moe_store_fd(s);
    int seals = fcntl(fd, F_GET_SEALS);
    CHECK(seals >= 0);
    CHECK((seals & (F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL)) ==
          (F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL));
    off_t size = (off_t)moe_store_size(s);
    errno = 0;
    CHECK(ftruncate(fd, size + 4096) == -1 && errno == EPERM);
    errno = 0;
    CHECK(ftruncate(fd, size - 4096) == -1 && errno == EPERM);
    errno = 0;
    CHECK(ftruncate(fd, 0) == -1 && errno == EPERM);
    errno = 0;
    CHECK(fallocate(fd, 0, size, 4096) == -1 && errno == EPERM);
    errno = 0;
    CHECK(fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE) == -1 && errno == EPERM); /* sealed seals */
    struct stat st;
    CHECK(fstat(fd, &st) == 0 && st.st_size == size);
    /* The creator's own mapping is read-only. */
    pid_t pid = fork();
    if (pid == 0) {
        signal(SIGSEGV, SIG_DFL);
        *(volatile uint8_t *)moe_store_base(s) = 1;
        _exit(0);
    }
    int ws;
    CHECK(waitpid(pid, &ws, 0) == pid);
    CHECK(WIFSIGNALED(ws) && WTERMSIG(ws) == SIGSEGV);
    moe_store_close(s);
    unload(&a);
}

/* The memfd travels as the daemon sends it: attached to a Hello frame (proto/ipc.c). */
static int send_fd(int sock, int fd)
{
    Moed__Hello h = MOED__HELLO__INIT;
    Moed__Envelope e = MOED__ENVELOPE__INIT;
    e.msg_case = MOED__ENVELOPE__MSG_HELLO;
    e.hello = &h;
    char err[256];
    return moe_ipc_send_with_fd(sock, &e, fd, 0, err, sizeof err);
}

static int recv_fd(int sock)
{
    Moed__Envelope *e = NULL;
    int fd = -1;
    char err[256];
    if (moe_ipc_recv_with_fd(sock, 0, -1, &e, &fd, err, sizeof err) != 0)
        return -1;
    moe_ipc_free(e);
    return fd;
}

/* The worker's real path: a process that existed before the store receives the memfd over a
 * Unix socket (SCM_RIGHTS), describes the GGUF itself and points its model into the store. */
TEST(expert_store_attach_from_child_over_scm_rights)
{
    char err[512];
    int sv[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        close(sv[0]);
        struct loaded ref, w;
        struct moe_store *s;
        int fd = recv_fd(sv[1]);
        CHECK(fd >= 0);
        load(&ref, F16_PATH);
        load(&w, F16_PATH);
        int rc = moe_store_open_model(&s, fd, &w.m, err, sizeof err);
        CHECK_MSG(rc == 0, "child attach: %s", err);
        close(fd); /* the store keeps its own descriptor */
        compare_model(&ref.m, &w.m, ref.f->base, moe_store_base(s), moe_store_size(s));
        struct moe_store_info info;
        moe_store_get_info(s, &info);
        CHECK_EQ(info.expert_bytes, ref.m.bytes_experts);
        CHECK_EQ(info.threads, 0);
        moe_store_close(s);
        unload(&ref);
        unload(&w);
        _exit(0);
    }
    close(sv[1]);
    struct loaded a;
    struct moe_store *s;
    load(&a, F16_PATH);
    CHECK_EQ(moe_store_create(&s, &a.m, 2, NULL, NULL, err, sizeof err), 0);
    CHECK_EQ(send_fd(sv[0], moe_store_fd(s)), 0);
    /* The daemon may drop its own store once workers hold theirs: the memfd lives on. */
    moe_store_close(s);
    int ws;
    CHECK(waitpid(pid, &ws, 0) == pid);
    CHECK_MSG(WIFEXITED(ws) && WEXITSTATUS(ws) == 0, "child failed (status %d)", ws);
    close(sv[0]);
    unload(&a);
}

/* A copy of the store in a new memfd with `patch` applied at `at`, then sized to `size` and
 * sealed (when `seal`). */
static int forged(const struct moe_store *s, uint64_t at, const void *patch, size_t n,
                  uint64_t size, int seal)
{
    int fd = memfd_create("forged", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    CHECK(fd >= 0);
    uint64_t copy = size < moe_store_size(s) ? size : moe_store_size(s);
    CHECK(ftruncate(fd, (off_t)size) == 0);
    CHECK(pwrite(fd, moe_store_base(s), copy, 0) == (ssize_t)copy);
    if (patch)
        CHECK(pwrite(fd, patch, n, (off_t)at) == (ssize_t)n);
    if (seal)
        CHECK(fcntl(fd, F_ADD_SEALS, F_SEAL_GROW | F_SEAL_SHRINK) == 0);
    return fd;
}

static void expect_reject(int fd, struct moe_model *m, int want_rc, const char *want_msg)
{
    char err[512];
    struct moe_store *w = NULL;
    int before = count_fds();
    int rc = moe_store_attach(&w, fd, m, err, sizeof err);
    CHECK_MSG(rc == want_rc, "attach gave %d (%s), want %d", rc, err, want_rc);
    CHECK_MSG(strstr(err, want_msg) != NULL, "message \"%s\" lacks \"%s\"", err, want_msg);
    CHECK_EQ(count_fds(), before); /* nothing leaked */
    close(fd);
}

TEST(expert_store_rejects_foreign_or_damaged)
{
    char err[512];
    struct loaded a, q;
    struct moe_store *s;
    load(&a, F16_PATH);
    load(&q, Q4KM_PATH);
    CHECK_EQ(moe_store_create(&s, &a.m, 2, NULL, NULL, err, sizeof err), 0);
    uint64_t size = moe_store_size(s);
    const struct moe_store_header *h = moe_store_base(s);

    /* Sanity: an exact sealed copy is accepted. */
    struct moe_store *w;
    int fd = forged(s, 0, NULL, 0, size, 1);
    CHECK_EQ(moe_store_attach(&w, fd, &a.m, err, sizeof err), 0);
    moe_store_close(w);
    close(fd);

    expect_reject(forged(s, 0, "NOTSTORE", 8, size, 1), &a.m, MOE_EFORMAT, "bad magic");
    uint32_t v = 99;
    expect_reject(forged(s, offsetof(struct moe_store_header, version), &v, 4, size, 1), &a.m,
                  MOE_EFORMAT, "version 99");
    expect_reject(forged(s, 0, NULL, 0, size + 4096, 1), &a.m, MOE_EFORMAT, "header says");
    expect_reject(forged(s, 0, NULL, 0, size - 4096, 1), &a.m, MOE_EFORMAT, "header says");
    expect_reject(forged(s, 0, NULL, 0, 64, 1), &a.m, MOE_EFORMAT, "smaller than a header");
    uint64_t fp = h->fingerprint ^ 1;
    expect_reject(forged(s, offsetof(struct moe_store_header, fingerprint), &fp, 8, size, 1),
                  &a.m, MOE_ERANGE, "fingerprint");
    /* A store of one model offered to a worker of another (F16 store, Q4_K_M model). */
    expect_reject(forged(s, 0, NULL, 0, size, 1), &q.m, MOE_ERANGE, "fingerprint");
    /* Not sealed: could shrink under the worker's mapping. */
    expect_reject(forged(s, 0, NULL, 0, size, 0), &a.m, MOE_EFORMAT, "not sealed");
    /* A damaged table, caught by its hash. */
    uint8_t junk = 0x5a ^ ((const uint8_t *)h)[h->layer_table_off + 3];
    expect_reject(forged(s, h->layer_table_off + 3, &junk, 1, size, 1), &a.m, MOE_EFORMAT,
                  "table hash");
    /* Table offsets pointing past the end. */
    uint64_t far = size * 4;
    expect_reject(forged(s, offsetof(struct moe_store_header, layer_table_off), &far, 8, size, 1),
                  &a.m, MOE_EFORMAT, "layer table");
    uint64_t many = UINT64_MAX / 8;
    expect_reject(forged(s, offsetof(struct moe_store_header, n_dense), &many, 8, size, 1), &a.m,
                  MOE_EFORMAT, "dense table");
    /* A regular file is not a memfd. */
    char path[512];
    snprintf(path, sizeof path, "%s/plain", moe_test_tmpdir());
    int pf = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    CHECK(pf >= 0);
    CHECK(pwrite(pf, moe_store_base(s), 8192, 0) == 8192);
    expect_reject(pf, &a.m, MOE_EFORMAT, "fd ");
    /* A model that does not come from the store's file: apply refuses it. */
    CHECK_EQ(moe_store_apply(s, &q.m, err, sizeof err), MOE_ERANGE);
    CHECK(strstr(err, "another model") != NULL);

    moe_store_close(s);
    unload(&a);
    unload(&q);
}

static int cancel_after_first(uint64_t done, uint64_t total, void *user)
{
    (void)done;
    (void)total;
    (void)user;
    return 1;
}

TEST(expert_store_cancel_leaks_nothing)
{
    char err[512];
    struct loaded a;
    struct moe_store *s = NULL;
    load(&a, F16_PATH);
    int before = count_fds();
    CHECK_EQ(moe_store_create(&s, &a.m, 2, cancel_after_first, NULL, err, sizeof err),
             MOE_ECANCELED);
    CHECK(strstr(err, "cancelled") != NULL);
    CHECK_EQ(count_fds(), before);
    /* A model that was not described from a GGUF cannot be stored. */
    struct moe_model empty;
    memset(&empty, 0, sizeof empty);
    CHECK_EQ(moe_store_create(&s, &empty, 1, NULL, NULL, err, sizeof err), MOE_EINTERNAL);
    unload(&a);
}

/* Sums the Rss and Pss (kB) of the mappings of the store's memfd in process `pid`. */
static int store_smaps(pid_t pid, long *rss, long *pss, int *n_maps)
{
    char path[64], line[512];
    snprintf(path, sizeof path, "/proc/%d/smaps", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    int in = 0;
    *rss = *pss = 0;
    *n_maps = 0;
    while (fgets(line, sizeof line, f)) {
        char *sp = strchr(line, ' '), *dash = strchr(line, '-');
        long kb;
        if (dash && sp && dash < sp && strchr(line, ':') != line + strlen(line)) {
            unsigned long long lo, hi;
            if (sscanf(line, "%llx-%llx", &lo, &hi) == 2) {
                in = strstr(line, "/memfd:moe-store") != NULL;
                *n_maps += in;
                continue;
            }
        }
        if (!in)
            continue;
        if (sscanf(line, "Rss: %ld kB", &kb) == 1)
            *rss += kb;
        else if (sscanf(line, "Pss: %ld kB", &kb) == 1)
            *pss += kb;
    }
    fclose(f);
    return 0;
}

/* Two worker processes attach the same memfd and touch every page. The kernel's proportional
 * set size then charges each of them half of every page they map: Pss = Rss / 2. With private
 * copies Pss would equal Rss. */
TEST(expert_store_ram_once_for_two_workers)
{
    char err[512];
    struct loaded a;
    struct moe_store *s;
    load(&a, F16_PATH);
    CHECK_EQ(moe_store_create(&s, &a.m, 2, NULL, NULL, err, sizeof err), 0);
    uint64_t size = moe_store_size(s);
    int fd = fcntl(moe_store_fd(s), F_DUPFD_CLOEXEC, 3);
    CHECK(fd >= 0);
    moe_store_close(s); /* only the two workers map it from here on */
    unload(&a);

    pid_t pids[2];
    int ready[2], hold[2];
    CHECK(pipe(ready) == 0 && pipe(hold) == 0);
    for (int i = 0; i < 2; i++) {
        pids[i] = fork();
        CHECK(pids[i] >= 0);
        if (pids[i] == 0) {
            struct loaded w;
            struct moe_store *ws;
            close(ready[0]);
            close(hold[1]);
            load(&w, F16_PATH);
            if (moe_store_open_model(&ws, fd, &w.m, err, sizeof err)) {
                fprintf(stderr, "child attach: %s\n", err);
                _exit(2);
            }
            const volatile uint8_t *p = moe_store_base(ws);
            uint64_t sum = 0;
            for (uint64_t off = 0; off < moe_store_size(ws); off += 4096)
                sum += p[off];
            char c = (char)(sum | 1);
            if (write(ready[1], &c, 1) != 1)
                _exit(3);
            /* Stay mapped until the parent has measured. */
            if (read(hold[0], &c, 1) < 0)
                _exit(4);
            _exit(0);
        }
    }
    close(ready[1]);
    close(hold[0]);
    char c;
    CHECK(read(ready[0], &c, 1) == 1);
    CHECK(read(ready[0], &c, 1) == 1);

    long rss[2], pss[2];
    for (int i = 0; i < 2; i++) {
        int n_maps;
        CHECK_EQ(store_smaps(pids[i], &rss[i], &pss[i], &n_maps), 0);
        fprintf(stderr, "worker %d: %d store mapping(s), Rss %ld kB, Pss %ld kB (store %" PRIu64
                " kB)\n", i, n_maps, rss[i], pss[i], size / 1024);
        CHECK_EQ(n_maps, 1);
        /* Every page was touched, so the whole store is resident in each worker... */
        long kb = (long)(size / 1024), tol = kb / 100 + 8;
        CHECK(rss[i] >= kb - tol && rss[i] <= kb);
        /* ...and each worker is charged half of it: one copy, shared by two. */
        CHECK(pss[i] * 2 >= rss[i] - tol && pss[i] * 2 <= rss[i] + tol);
    }
    CHECK(pss[0] + pss[1] <= (long)(size / 1024) + 8);
    close(hold[1]);
    for (int i = 0; i < 2; i++) {
        int ws;
        CHECK(waitpid(pids[i], &ws, 0) == pids[i]);
        CHECK(WIFEXITED(ws) && WEXITSTATUS(ws) == 0);
    }
    close(ready[0]);
    close(fd);
}

TEST(expert_store_progress_line)
{
    char buf[160];
    uint64_t g = 1ull << 30;
    moe_store_progress_format(buf, sizeof buf, g, 4 * g, 0.5);
    CHECK_STREQ(buf, "loading experts: 1.00/4.00 GiB (25%), 2.0 GiB/s, ETA 2s");
    moe_store_progress_format(buf, sizeof buf, 0, 4 * g, 0);
    CHECK_STREQ(buf, "loading experts: 0.00/4.00 GiB (0%)");
    moe_store_progress_format(buf, sizeof buf, 4 * g, 4 * g, 2.0);
    CHECK_STREQ(buf, "loading experts: 4.00 GiB done in 2.0s (2.0 GiB/s)");
}
