/* Routing profiles in LMDB: round trips, validation, JSON, and kill -9 in the middle of writes. */
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "store/err.h"
#include "store/profile.h"
#include "tests/harness.h"

static void fill(struct moe_profile *p, uint64_t seed)
{
    for (size_t i = 0; i < (size_t)p->n_layer * p->n_expert; i++)
        p->counts[i] = seed * 1000003u + i * i * 7919u;
    p->tokens = seed * 31 + 5;
    p->created = 1700000000 + (int64_t)seed;
    p->updated = 1800000000 + (int64_t)seed;
}

static void check_same(const struct moe_profile *a, const struct moe_profile *b)
{
    CHECK_EQ(a->fingerprint, b->fingerprint);
    CHECK_EQ(a->n_layer, b->n_layer);
    CHECK_EQ(a->n_expert, b->n_expert);
    CHECK_EQ(a->tokens, b->tokens);
    CHECK_EQ(a->created, b->created);
    CHECK_EQ(a->updated, b->updated);
    CHECK(memcmp(a->counts, b->counts, (size_t)a->n_layer * a->n_expert * 8) == 0);
}

TEST(profile_save_load_roundtrip)
{
    char err[256];
    struct moe_profile_db *db;
    struct moe_profile a, b, c;
    CHECK_EQ(moe_profile_db_open(&db, moe_test_tmpdir(), err, sizeof err), 0);
    CHECK_EQ(moe_profile_load(db, 0x1234, 48, 128, &b, err, sizeof err), MOE_ENOTFOUND);
    CHECK(strstr(err, "0000000000001234") != NULL);

    CHECK_EQ(moe_profile_init(&a, 0xfeedfacecafebeefull, 48, 128), 0);
    fill(&a, 3);
    CHECK_EQ(moe_profile_save(db, &a, err, sizeof err), 0);
    CHECK_EQ(moe_profile_init(&c, 0x42, 3, 16), 0); /* a second model in the same DB */
    fill(&c, 9);
    CHECK_EQ(moe_profile_save(db, &c, err, sizeof err), 0);
    moe_profile_db_close(db);

    /* Reopened: both records are there and exact. */
    CHECK_EQ(moe_profile_db_open(&db, moe_test_tmpdir(), err, sizeof err), 0);
    CHECK_EQ(moe_profile_load(db, a.fingerprint, 48, 128, &b, err, sizeof err), 0);
    check_same(&a, &b);
    moe_profile_free(&b);
    CHECK_EQ(moe_profile_load(db, 0x42, 0, 0, &b, err, sizeof err), 0);
    check_same(&c, &b);
    moe_profile_free(&b);

    /* Merge deltas, save over the old record. */
    uint64_t *delta = calloc(48 * 128, 8);
    for (int i = 0; i < 48 * 128; i++)
        delta[i] = (uint64_t)i % 5;
    uint64_t before = a.counts[7];
    CHECK_EQ(moe_profile_merge(&a, delta, 48 * 128, 100), 0);
    CHECK_EQ(a.counts[7], before + 2);
    CHECK_EQ(a.tokens, 3 * 31 + 5 + 100);
    CHECK(a.updated >= (int64_t)time(NULL) - 5);
    CHECK_EQ(moe_profile_merge(&a, delta, 47, 1), MOE_ERANGE);
    a.counts[0] = UINT64_MAX - 1;
    delta[0] = 10;
    CHECK_EQ(moe_profile_merge(&a, delta, 48 * 128, 0), 0);
    CHECK(a.counts[0] == UINT64_MAX); /* saturates, never wraps */
    CHECK_EQ(moe_profile_save(db, &a, err, sizeof err), 0);
    CHECK_EQ(moe_profile_load(db, a.fingerprint, 48, 128, &b, err, sizeof err), 0);
    check_same(&a, &b);
    moe_profile_free(&b);

    /* Reset. */
    CHECK_EQ(moe_profile_delete(db, a.fingerprint, err, sizeof err), 0);
    CHECK_EQ(moe_profile_load(db, a.fingerprint, 48, 128, &b, err, sizeof err), MOE_ENOTFOUND);
    CHECK_EQ(moe_profile_delete(db, a.fingerprint, err, sizeof err), MOE_ENOTFOUND);
    CHECK_EQ(moe_profile_load(db, 0x42, 3, 16, &b, err, sizeof err), 0);
    moe_profile_free(&b);
    moe_profile_db_close(db);
    moe_profile_free(&a);
    moe_profile_free(&c);
    free(delta);
}

TEST(profile_wrong_dims_rejected)
{
    char err[256];
    struct moe_profile_db *db;
    struct moe_profile a, b;
    CHECK_EQ(moe_profile_db_open(&db, moe_test_tmpdir(), err, sizeof err), 0);
    CHECK_EQ(moe_profile_init(&a, 0x77, 2, 8), 0);
    fill(&a, 1);
    CHECK_EQ(moe_profile_save(db, &a, err, sizeof err), 0);
    CHECK_EQ(moe_profile_load(db, 0x77, 3, 16, &b, err, sizeof err), MOE_ERANGE);
    CHECK(strstr(err, "2 layers x 8 experts") && strstr(err, "3 x 16"));
    CHECK(b.counts == NULL);
    CHECK_EQ(moe_profile_load(db, 0x77, 2, 16, &b, err, sizeof err), MOE_ERANGE);
    CHECK_EQ(moe_profile_load(db, 0x77, 2, 8, &b, err, sizeof err), 0);
    moe_profile_free(&b);
    CHECK_EQ(moe_profile_init(&b, 1, 0, 8), MOE_ERANGE);
    moe_profile_db_close(db);
    moe_profile_free(&a);
    /* A state dir that does not exist is an error with the path, not a crash. */
    CHECK(moe_profile_db_open(&db, "/nonexistent/moe-state", err, sizeof err) < 0);
    CHECK(strstr(err, "/nonexistent/moe-state/profiles.mdb") != NULL);
}

TEST(profile_json_roundtrip)
{
    char err[256], *js = NULL;
    struct moe_profile a, b;
    CHECK_EQ(moe_profile_init(&a, 0x00ab00cd00ef0012ull, 3, 16), 0);
    fill(&a, 42);
    CHECK_EQ(moe_profile_export_json(&a, &js, err, sizeof err), 0);
    CHECK(strstr(js, "\"fingerprint\":\"00ab00cd00ef0012\"") != NULL);
    CHECK(strstr(js, "\"n_layer\":3") != NULL);
    CHECK_EQ(moe_profile_import_json(&b, js, strlen(js), a.fingerprint, 3, 16, err, sizeof err),
             0);
    check_same(&a, &b);
    moe_profile_free(&b);
    /* 0s accept any model; upper-case hex is fine. */
    CHECK_EQ(moe_profile_import_json(&b, js, strlen(js), 0, 0, 0, err, sizeof err), 0);
    check_same(&a, &b);
    moe_profile_free(&b);
    /* Wrong model: fingerprint or dims differ. */
    CHECK_EQ(moe_profile_import_json(&b, js, strlen(js), 0x99, 3, 16, err, sizeof err),
             MOE_ERANGE);
    CHECK(strstr(err, "fingerprint") != NULL);
    CHECK_EQ(moe_profile_import_json(&b, js, strlen(js), a.fingerprint, 4, 16, err, sizeof err),
             MOE_ERANGE);
    CHECK(strstr(err, "the model has 4 x 16") != NULL);
    free(js);
    moe_profile_free(&a);
}

TEST(profile_json_malformed_rejected)
{
    static const struct {
        const char *json;
        int rc;
        const char *msg;
    } cases[] = {
        {"{\"fingerprint\": \"00000000000000ab\", \"n_layer\": 2, \"n_expert\": 2, \"tokens\": 1,",
         MOE_EFORMAT, "line"},
        {"[1, 2]", MOE_ETYPE, "object"},
        {"{\"fingerprint\": 171, \"n_layer\": 2, \"n_expert\": 2, \"tokens\": 1, \"created\": 1, "
         "\"updated\": 2, \"counts\": [[1, 2], [3, 4]]}", MOE_ETYPE, "fingerprint"},
        {"{\"fingerprint\": \"00000000000000zz\", \"n_layer\": 2, \"n_expert\": 2, \"tokens\": 1, "
         "\"created\": 1, \"updated\": 2, \"counts\": [[1, 2], [3, 4]]}", MOE_EFORMAT, "hex"},
        {"{\"fingerprint\": \"00000000000000ab\", \"n_layer\": \"2\", \"n_expert\": 2, "
         "\"tokens\": 1, \"created\": 1, \"updated\": 2, \"counts\": [[1, 2], [3, 4]]}",
         MOE_ETYPE, "n_layer"},
        {"{\"fingerprint\": \"00000000000000ab\", \"n_layer\": 2, \"n_expert\": 2, "
         "\"tokens\": -1, \"created\": 1, \"updated\": 2, \"counts\": [[1, 2], [3, 4]]}",
         MOE_ERANGE, "tokens"},
        {"{\"fingerprint\": \"00000000000000ab\", \"n_layer\": 2, \"n_expert\": 2, "
         "\"tokens\": 1, \"created\": 1, \"counts\": [[1, 2], [3, 4]]}", MOE_EFORMAT, "updated"},
        {"{\"fingerprint\": \"00000000000000ab\", \"n_layer\": 2, \"n_expert\": 2, \"tokens\": 1, "
         "\"created\": 1, \"updated\": 2, \"counts\": [[1, 2], [3, -4]]}", MOE_ERANGE,
         "counts[1][1]: -4 is negative"},
        {"{\"fingerprint\": \"00000000000000ab\", \"n_layer\": 2, \"n_expert\": 2, \"tokens\": 1, "
         "\"created\": 1, \"updated\": 2, \"counts\": [[1, 2], [3, 4.5]]}", MOE_ETYPE,
         "counts[1][1]"},
        {"{\"fingerprint\": \"00000000000000ab\", \"n_layer\": 2, \"n_expert\": 2, \"tokens\": 1, "
         "\"created\": 1, \"updated\": 2, \"counts\": [[1, 2], [3, \"4\"]]}", MOE_ETYPE,
         "counts[1][1]"},
        {"{\"fingerprint\": \"00000000000000ab\", \"n_layer\": 2, \"n_expert\": 2, \"tokens\": 1, "
         "\"created\": 1, \"updated\": 2, \"counts\": [[1, 2], [3, 4, 5]]}", MOE_ERANGE,
         "counts[1]"},
        {"{\"fingerprint\": \"00000000000000ab\", \"n_layer\": 2, \"n_expert\": 2, \"tokens\": 1, "
         "\"created\": 1, \"updated\": 2, \"counts\": [[1, 2]]}", MOE_ERANGE, "2 rows"},
        {"{\"fingerprint\": \"00000000000000ab\", \"n_layer\": 2, \"n_expert\": 2, \"tokens\": 1, "
         "\"created\": 1, \"updated\": 2, \"counts\": {\"a\": 1}}", MOE_ETYPE, "counts"},
        {"{\"fingerprint\": \"00000000000000ab\", \"n_layer\": 2, \"n_expert\": 2, \"tokens\": 1, "
         "\"created\": 1, \"updated\": 2, \"counts\": [[1, 2], 7]}", MOE_ETYPE, "counts[1]"},
        {"{\"fingerprint\": \"00000000000000ab\", \"n_layer\": 0, \"n_expert\": 2, \"tokens\": 1, "
         "\"created\": 1, \"updated\": 2, \"counts\": []}", MOE_ERANGE, "shape"},
        {"{\"fingerprint\": \"00000000000000ab\", \"n_layer\": 1, \"n_layer\": 2, \"n_expert\": 2, "
         "\"tokens\": 1, \"created\": 1, \"updated\": 2, \"counts\": [[1, 2], [3, 4]]}",
         MOE_EFORMAT, "duplicate"},
    };
    char err[256];
    struct moe_profile p;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int rc = moe_profile_import_json(&p, cases[i].json, strlen(cases[i].json), 0, 0, 0, err,
                                         sizeof err);
        CHECK_MSG(rc == cases[i].rc, "case %zu: rc %d (%s), want %d", i, rc, err, cases[i].rc);
        CHECK_MSG(strstr(err, cases[i].msg) != NULL, "case %zu: message \"%s\" lacks \"%s\"", i,
                  err, cases[i].msg);
        CHECK(p.counts == NULL);
    }
    /* And the valid version of the same text is accepted. */
    const char *ok = "{\"fingerprint\": \"00000000000000AB\", \"n_layer\": 2, \"n_expert\": 2, "
                     "\"tokens\": 1, \"created\": 1, \"updated\": 2, \"counts\": [[1, 2], [3, 4]],"
                     " \"comment\": \"unknown keys are ignored\"}";
    CHECK_EQ(moe_profile_import_json(&p, ok, strlen(ok), 0xab, 2, 2, err, sizeof err), 0);
    CHECK_EQ(p.counts[3], 4);
    moe_profile_free(&p);
}

/* A child saves records whose counts all equal k (k = 1, 2, ...) as fast as it can; we SIGKILL it
 * at a random moment. The database must open, and the record must be one the child committed:
 * every count the same k, tokens == k. */
TEST_TIMEOUT(profile_survives_kill9, 120)
{
    const char *dir = moe_test_tmpdir();
    char err[256];
    srand((unsigned)time(NULL) ^ (unsigned)getpid());
    uint64_t last_k = 0;
    for (int round = 0; round < 6; round++) {
        int ready[2];
        CHECK(pipe(ready) == 0);
        pid_t pid = fork();
        CHECK(pid >= 0);
        if (pid == 0) {
            struct moe_profile_db *db;
            struct moe_profile p;
            close(ready[0]);
            if (moe_profile_db_open(&db, dir, err, sizeof err) ||
                moe_profile_init(&p, 0xabcdef, 8, 64))
                _exit(2);
            /* Continue from what is stored, so later rounds overwrite earlier records. */
            struct moe_profile old;
            uint64_t k = 0;
            if (moe_profile_load(db, 0xabcdef, 8, 64, &old, err, sizeof err) == 0) {
                k = old.tokens;
                moe_profile_free(&old);
            }
            for (;;) {
                k++;
                for (int i = 0; i < 8 * 64; i++)
                    p.counts[i] = k;
                p.tokens = k;
                if (moe_profile_save(db, &p, err, sizeof err))
                    _exit(3);
                if (k % 20 == 0 && write(ready[1], "x", 1) < 0)
                    _exit(4);
            }
        }
        close(ready[1]);
        char c;
        CHECK(read(ready[0], &c, 1) == 1); /* at least 20 commits happened */
        usleep((useconds_t)(rand() % 100000));
        kill(pid, SIGKILL);
        int st;
        CHECK(waitpid(pid, &st, 0) == pid);
        CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);
        close(ready[0]);

        struct moe_profile_db *db;
        struct moe_profile p;
        CHECK_EQ(moe_profile_db_open(&db, dir, err, sizeof err), 0);
        CHECK_EQ(moe_profile_load(db, 0xabcdef, 8, 64, &p, err, sizeof err), 0);
        uint64_t k = p.tokens;
        CHECK(k >= 20 && k > last_k);
        for (int i = 0; i < 8 * 64; i++)
            CHECK_EQ(p.counts[i], k);
        last_k = k;
        moe_profile_free(&p);
        moe_profile_db_close(db);
    }
}

static int count_prefix(const char *dir, const char *prefix)
{
    DIR *d = opendir(dir);
    int n = 0;
    for (struct dirent *e; d && (e = readdir(d)) != NULL;)
        n += strncmp(e->d_name, prefix, strlen(prefix)) == 0;
    if (d)
        closedir(d);
    return n;
}

/* A damaged profiles.mdb (random bytes; truncated to less than a header; truncated after intact
 * meta pages, whose data pages would fault through the map) opens as MOE_EFORMAT, never a crash;
 * moved aside, the next open starts empty and the damaged bytes are kept. */
TEST(profile_damaged_file_is_format_error_and_moved_aside)
{
    char err[512], dir[512], path[600], moved[1024];
    snprintf(dir, sizeof dir, "%s", moe_test_tmpdir());
    snprintf(path, sizeof path, "%s/profiles.mdb", dir);
    struct moe_profile_db *db;
    struct moe_profile a, b;
    for (int variant = 0; variant < 3; variant++) {
        CHECK_EQ(moe_profile_db_open(&db, dir, err, sizeof err), 0);
        CHECK_EQ(moe_profile_init(&a, 0x77, 48, 128), 0); /* 48 KiB: overflow pages */
        fill(&a, (uint64_t)variant + 1);
        CHECK_EQ(moe_profile_save(db, &a, err, sizeof err), 0);
        moe_profile_db_close(db);
        if (variant == 0) {
            FILE *f = fopen(path, "w");
            CHECK(f != NULL);
            srand(7);
            for (int i = 0; i < 20000; i++)
                fputc(rand() & 0xff, f);
            fclose(f);
        } else {
            CHECK_EQ(truncate(path, variant == 1 ? 100 : 8192), 0);
        }
        int rc = moe_profile_db_open(&db, dir, err, sizeof err);
        CHECK_MSG(rc == MOE_EFORMAT, "variant %d: %d (%s)", variant, rc, err);
        CHECK_MSG(strstr(err, "profiles.mdb") != NULL, "variant %d: %s", variant, err);
        CHECK_EQ(moe_profile_db_move_aside(dir, moved, sizeof moved, err, sizeof err), 0);
        CHECK(strstr(moved, "/profiles.mdb.corrupt-") != NULL);
        CHECK(access(moved, F_OK) == 0);
        CHECK(access(path, F_OK) != 0);
        CHECK_EQ(moe_profile_db_open(&db, dir, err, sizeof err), 0);
        CHECK_EQ(moe_profile_load(db, 0x77, 48, 128, &b, err, sizeof err), MOE_ENOTFOUND);
        moe_profile_db_close(db);
        moe_profile_free(&a);
    }
    /* Three moves within seconds never overwrite each other. */
    CHECK_EQ(count_prefix(dir, "profiles.mdb.corrupt-"), 6); /* + their -lock files */
}

/* A state dir that cannot be written is a system error, not damage: nothing is moved aside. */
TEST(profile_unwritable_state_dir_is_not_damage)
{
    if (geteuid() == 0)
        moe_test_skip("running as root: permissions are not enforced");
    char err[512], dir[512];
    snprintf(dir, sizeof dir, "%s/ro", moe_test_tmpdir());
    CHECK_EQ(mkdir(dir, 0500), 0);
    struct moe_profile_db *db;
    int rc = moe_profile_db_open(&db, dir, err, sizeof err);
    CHECK_MSG(rc == -EACCES, "%d (%s)", rc, err);
    chmod(dir, 0700);
}

/* Decay: at 2 x half-life tokens the counts and the total halve (as often as needed), so old
 * traffic weighs less and a new workload takes over gradually; a burst smaller than the
 * half-life moves the ranking only as much as its share. */
TEST(profile_decay_halves_old_history)
{
    struct moe_profile p;
    CHECK_EQ(moe_profile_init(&p, 0x1234, 2, 4), 0);
    uint64_t a[8] = {100, 50, 0, 0, 7, 3, 1, 1}; /* the old workload: expert 0 first */
    CHECK_EQ(moe_profile_merge(&p, a, 8, 150), 0);
    CHECK_EQ(moe_profile_decay(&p, 0), 0u);  /* never */
    CHECK_EQ(moe_profile_decay(&p, 100), 0u); /* 150 < 200 */
    CHECK_EQ(p.counts[0], 100u);
    uint64_t b[8] = {0, 0, 0, 60, 0, 0, 0, 0}; /* a burst of another workload */
    CHECK_EQ(moe_profile_merge(&p, b, 8, 60), 0);
    CHECK_EQ(moe_profile_decay(&p, 100), 1u); /* 210 -> 105 */
    CHECK_EQ(p.tokens, 105u);
    CHECK_EQ(p.counts[0], 50u);
    CHECK_EQ(p.counts[3], 30u);
    CHECK_EQ(p.counts[5], 1u);
    CHECK(p.counts[0] > p.counts[3]); /* the burst did not erase the history */
    /* The new workload, kept up: it takes over. */
    for (int i = 0; i < 10; i++) {
        uint64_t c[8] = {0, 0, 0, 100, 0, 0, 0, 0};
        CHECK_EQ(moe_profile_merge(&p, c, 8, 100), 0);
        moe_profile_decay(&p, 100);
        CHECK(p.tokens < 200);
    }
    CHECK(p.counts[3] > 10 * p.counts[0]);
    /* Several halvings at once. */
    uint64_t z[8] = {0};
    CHECK_EQ(moe_profile_merge(&p, z, 8, 10000), 0);
    CHECK(moe_profile_decay(&p, 100) >= 6);
    CHECK(p.tokens < 200 && p.tokens >= 100);
    moe_profile_free(&p);
}
