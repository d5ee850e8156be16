/* Routing profiles in LMDB (see profile.h and docs/store.md). */
#include "store/profile.h"

#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <lmdb.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "store/err.h"

#define PROFILE_MAGIC 0x4652504du /* "MPRF" little-endian */
#define PROFILE_MAPSIZE ((size_t)1 << 30)

/* Value layout (little-endian; the record is copied, never used in place, because LMDB does not
 * promise 8-byte alignment of values). */
struct rec_hdr {
    uint32_t magic;
    uint32_t version;
    uint32_t n_layer;
    uint32_t n_expert;
    uint64_t fingerprint;
    uint64_t tokens;
    int64_t created;
    int64_t updated;
};
_Static_assert(sizeof(struct rec_hdr) == 48, "profile record header layout changed");

struct moe_profile_db {
    MDB_env *env;
    MDB_dbi dbi;
};

static int mdb_fail(char *err, size_t errlen, int mrc, const char *what)
{
    int code = mrc > 0 ? -mrc : mrc == MDB_MAP_FULL ? MOE_ETOOBIG : MOE_EINTERNAL;
    return moe_fail(err, errlen, code, "profiles: %s: %s", what, mdb_strerror(mrc));
}

static void key_bytes(uint64_t fp, unsigned char k[8])
{
    for (int i = 0; i < 8; i++)
        k[i] = (unsigned char)(fp >> (8 * i));
}

static bool dims_ok(uint32_t n_layer, uint32_t n_expert)
{
    return n_layer > 0 && n_expert > 0 && n_layer <= MOE_PROFILE_MAX_LAYERS &&
           n_expert <= MOE_PROFILE_MAX_EXPERTS;
}

/* LMDB errors that mean the file's contents are damaged (as opposed to the file being
 * unreadable, the disk full, or a format of another LMDB version). */
static bool mdb_is_corrupt(int mrc)
{
    return mrc == MDB_INVALID || mrc == MDB_CORRUPTED || mrc == MDB_PAGE_NOTFOUND;
}

int moe_profile_db_open(struct moe_profile_db **out, const char *state_dir, char *err,
                        size_t errlen)
{
    int mrc, rc;
    char path[4096];
    MDB_txn *txn = NULL;
    struct moe_profile_db *db = calloc(1, sizeof *db);
    if (err && errlen)
        err[0] = '\0';
    if (!db)
        return moe_fail(err, errlen, -ENOMEM, "profiles: out of memory");
    if ((size_t)snprintf(path, sizeof path, "%s/profiles.mdb", state_dir) >= sizeof path) {
        rc = moe_fail(err, errlen, MOE_ERANGE, "profiles: state dir path is too long");
        goto fail;
    }
    if ((mrc = mdb_env_create(&db->env))) {
        rc = mdb_fail(err, errlen, mrc, "mdb_env_create");
        goto fail;
    }
    if ((mrc = mdb_env_set_mapsize(db->env, PROFILE_MAPSIZE))) {
        rc = mdb_fail(err, errlen, mrc, "mdb_env_set_mapsize");
        goto fail;
    }
    /* NOTLS: the daemon may read from a thread-pool thread and write from the loop thread. */
    if ((mrc = mdb_env_open(db->env, path, MDB_NOSUBDIR | MDB_NOTLS, 0600))) {
        rc = moe_fail(err, errlen,
                      mrc > 0 ? -mrc : mdb_is_corrupt(mrc) ? MOE_EFORMAT : MOE_EINTERNAL,
                      "profiles: open %s: %s", path, mdb_strerror(mrc));
        goto fail;
    }
    /* A truncated file can keep valid meta pages: its data pages past the end of the file would
     * then fault (SIGBUS) when read through the map. */
    {
        MDB_envinfo info;
        MDB_stat est;
        mdb_filehandle_t fd;
        struct stat st;
        if (mdb_env_info(db->env, &info) == 0 && mdb_env_stat(db->env, &est) == 0 &&
            mdb_env_get_fd(db->env, &fd) == 0 && fstat(fd, &st) == 0 &&
            (uint64_t)st.st_size < ((uint64_t)info.me_last_pgno + 1) * est.ms_psize) {
            rc = moe_fail(err, errlen, MOE_EFORMAT,
                          "profiles: open %s: file is truncated (%lld bytes, its pages need %llu)",
                          path, (long long)st.st_size,
                          (unsigned long long)(info.me_last_pgno + 1) * est.ms_psize);
            goto fail;
        }
    }
    /* Reader slots of processes killed mid-read would otherwise pin old pages for ever. */
    int dead = 0;
    mdb_reader_check(db->env, &dead);
    if ((mrc = mdb_txn_begin(db->env, NULL, 0, &txn)) ||
        (mrc = mdb_dbi_open(txn, NULL, 0, &db->dbi)) || (mrc = mdb_txn_commit(txn))) {
        if (txn && mrc)
            mdb_txn_abort(txn);
        txn = NULL;
        rc = mdb_is_corrupt(mrc)
                 ? moe_fail(err, errlen, MOE_EFORMAT, "profiles: opening the database in %s: %s",
                            path, mdb_strerror(mrc))
                 : mdb_fail(err, errlen, mrc, "opening the database");
        goto fail;
    }
    *out = db;
    return 0;
fail:
    moe_profile_db_close(db);
    return rc;
}

int moe_profile_db_move_aside(const char *state_dir, char *moved, size_t movedlen, char *err,
                              size_t errlen)
{
    char path[4096], lock[4096], to[4200], lock_to[4300], stamp[32];
    time_t now = time(NULL);
    struct tm tm;
    gmtime_r(&now, &tm);
    strftime(stamp, sizeof stamp, "%Y%m%dT%H%M%SZ", &tm);
    if ((size_t)snprintf(path, sizeof path, "%s/profiles.mdb", state_dir) >= sizeof path ||
        (size_t)snprintf(lock, sizeof lock, "%s-lock", path) >= sizeof lock)
        return moe_fail(err, errlen, MOE_ERANGE, "profiles: state dir path is too long");
    /* Never overwrite an earlier corrupt copy (two failures in one second). */
    snprintf(to, sizeof to, "%s.corrupt-%s", path, stamp);
    for (int i = 1; access(to, F_OK) == 0 && i < 1000; i++)
        snprintf(to, sizeof to, "%s.corrupt-%s.%d", path, stamp, i);
    if (rename(path, to) != 0)
        return moe_fail(err, errlen, -errno, "profiles: cannot rename %s to %s: %s", path, to,
                        strerror(errno));
    snprintf(lock_to, sizeof lock_to, "%s-lock", to);
    if (rename(lock, lock_to) != 0 && errno != ENOENT)
        return moe_fail(err, errlen, -errno, "profiles: cannot rename %s to %s: %s", lock,
                        lock_to, strerror(errno));
    if (moved && movedlen)
        snprintf(moved, movedlen, "%s", to);
    return 0;
}

void moe_profile_db_close(struct moe_profile_db *db)
{
    if (!db)
        return;
    if (db->env)
        mdb_env_close(db->env);
    free(db);
}

int moe_profile_init(struct moe_profile *p, uint64_t fingerprint, uint32_t n_layer,
                     uint32_t n_expert)
{
    memset(p, 0, sizeof *p);
    if (!dims_ok(n_layer, n_expert))
        return MOE_ERANGE;
    p->counts = calloc((size_t)n_layer * n_expert, sizeof *p->counts);
    if (!p->counts)
        return -ENOMEM;
    p->fingerprint = fingerprint;
    p->n_layer = n_layer;
    p->n_expert = n_expert;
    p->created = p->updated = (int64_t)time(NULL);
    return 0;
}

void moe_profile_free(struct moe_profile *p)
{
    if (!p)
        return;
    free(p->counts);
    p->counts = NULL;
}

int moe_profile_load(struct moe_profile_db *db, uint64_t fingerprint, uint32_t n_layer,
                     uint32_t n_expert, struct moe_profile *p, char *err, size_t errlen)
{
    int mrc, rc;
    unsigned char k[8];
    MDB_txn *txn = NULL;
    MDB_val key = {8, k}, val;
    struct rec_hdr h;
    memset(p, 0, sizeof *p);
    if (err && errlen)
        err[0] = '\0';
    key_bytes(fingerprint, k);
    if ((mrc = mdb_txn_begin(db->env, NULL, MDB_RDONLY, &txn)))
        return mdb_fail(err, errlen, mrc, "mdb_txn_begin");
    mrc = mdb_get(txn, db->dbi, &key, &val);
    if (mrc == MDB_NOTFOUND) {
        rc = moe_fail(err, errlen, MOE_ENOTFOUND, "profiles: no profile for model %016" PRIx64,
                      fingerprint);
        goto out;
    }
    if (mrc) {
        rc = mdb_fail(err, errlen, mrc, "mdb_get");
        goto out;
    }
    if (val.mv_size < sizeof h) {
        rc = moe_fail(err, errlen, MOE_EFORMAT, "profiles: record for %016" PRIx64
                      " is %zu bytes, shorter than its header", fingerprint, val.mv_size);
        goto out;
    }
    memcpy(&h, val.mv_data, sizeof h);
    if (h.magic != PROFILE_MAGIC || h.version != MOE_PROFILE_VERSION) {
        rc = moe_fail(err, errlen, MOE_EFORMAT, "profiles: record for %016" PRIx64
                      " has magic %08x version %u (expected %08x version %u)", fingerprint,
                      h.magic, h.version, PROFILE_MAGIC, MOE_PROFILE_VERSION);
        goto out;
    }
    if (h.fingerprint != fingerprint || !dims_ok(h.n_layer, h.n_expert) ||
        val.mv_size != sizeof h + (size_t)h.n_layer * h.n_expert * sizeof(uint64_t)) {
        rc = moe_fail(err, errlen, MOE_EFORMAT, "profiles: record for %016" PRIx64
                      " is damaged (%u x %u counts in %zu bytes, fingerprint %016" PRIx64 ")",
                      fingerprint, h.n_layer, h.n_expert, val.mv_size, h.fingerprint);
        goto out;
    }
    if ((n_layer || n_expert) && (h.n_layer != n_layer || h.n_expert != n_expert)) {
        rc = moe_fail(err, errlen, MOE_ERANGE, "profiles: stored profile for %016" PRIx64
                      " has %u layers x %u experts, the model has %u x %u", fingerprint,
                      h.n_layer, h.n_expert, n_layer, n_expert);
        goto out;
    }
    if ((rc = moe_profile_init(p, fingerprint, h.n_layer, h.n_expert))) {
        moe_fail(err, errlen, rc, "profiles: out of memory");
        goto out;
    }
    p->tokens = h.tokens;
    p->created = h.created;
    p->updated = h.updated;
    memcpy(p->counts, (const unsigned char *)val.mv_data + sizeof h,
           (size_t)h.n_layer * h.n_expert * sizeof(uint64_t));
    rc = 0;
out:
    mdb_txn_abort(txn);
    return rc;
}

int moe_profile_save(struct moe_profile_db *db, const struct moe_profile *p, char *err,
                     size_t errlen)
{
    int mrc;
    unsigned char k[8];
    MDB_txn *txn = NULL;
    if (err && errlen)
        err[0] = '\0';
    if (!dims_ok(p->n_layer, p->n_expert) || !p->counts)
        return moe_fail(err, errlen, MOE_ERANGE, "profiles: cannot save %u x %u counts",
                        p->n_layer, p->n_expert);
    size_t n = (size_t)p->n_layer * p->n_expert * sizeof(uint64_t);
    struct rec_hdr h = {PROFILE_MAGIC, MOE_PROFILE_VERSION, p->n_layer, p->n_expert,
                        p->fingerprint, p->tokens, p->created, p->updated};
    MDB_val key = {8, k}, val = {sizeof h + n, NULL};
    key_bytes(p->fingerprint, k);
    if ((mrc = mdb_txn_begin(db->env, NULL, 0, &txn)))
        return mdb_fail(err, errlen, mrc, "mdb_txn_begin");
    /* MDB_RESERVE lets us write the record straight into the page: no second copy. */
    if ((mrc = mdb_put(txn, db->dbi, &key, &val, MDB_RESERVE))) {
        mdb_txn_abort(txn);
        return mdb_fail(err, errlen, mrc, "mdb_put");
    }
    memcpy(val.mv_data, &h, sizeof h);
    memcpy((unsigned char *)val.mv_data + sizeof h, p->counts, n);
    if ((mrc = mdb_txn_commit(txn)))
        return mdb_fail(err, errlen, mrc, "mdb_txn_commit");
    return 0;
}

int moe_profile_delete(struct moe_profile_db *db, uint64_t fingerprint, char *err, size_t errlen)
{
    int mrc;
    unsigned char k[8];
    MDB_txn *txn = NULL;
    MDB_val key = {8, k};
    if (err && errlen)
        err[0] = '\0';
    key_bytes(fingerprint, k);
    if ((mrc = mdb_txn_begin(db->env, NULL, 0, &txn)))
        return mdb_fail(err, errlen, mrc, "mdb_txn_begin");
    mrc = mdb_del(txn, db->dbi, &key, NULL);
    if (mrc) {
        mdb_txn_abort(txn);
        if (mrc == MDB_NOTFOUND)
            return moe_fail(err, errlen, MOE_ENOTFOUND, "profiles: no profile for model %016"
                            PRIx64, fingerprint);
        return mdb_fail(err, errlen, mrc, "mdb_del");
    }
    if ((mrc = mdb_txn_commit(txn)))
        return mdb_fail(err, errlen, mrc, "mdb_txn_commit");
    return 0;
}

int moe_profile_merge(struct moe_profile *p, const uint64_t *delta, size_t n, uint64_t tokens)
{
    if (!p->counts || n != (size_t)p->n_layer * p->n_expert)
        return MOE_ERANGE;
    for (size_t i = 0; i < n; i++)
        p->counts[i] = delta[i] > UINT64_MAX - p->counts[i] ? UINT64_MAX : p->counts[i] + delta[i];
    p->tokens = tokens > UINT64_MAX - p->tokens ? UINT64_MAX : p->tokens + tokens;
    p->updated = (int64_t)time(NULL);
    return 0;
}

unsigned moe_profile_decay(struct moe_profile *p, uint64_t half_life)
{
    unsigned k = 0;
    if (!half_life || !p->counts)
        return 0;
    while (p->tokens / 2 >= half_life) {
        for (size_t i = 0; i < (size_t)p->n_layer * p->n_expert; i++)
            p->counts[i] >>= 1;
        p->tokens >>= 1;
        k++;
    }
    return k;
}

/* ---- JSON --------------------------------------------------------------------------------- */

static json_int_t clamp_i64(uint64_t v)
{
    return v > (uint64_t)INT64_MAX ? (json_int_t)INT64_MAX : (json_int_t)v;
}

int moe_profile_export_json(const struct moe_profile *p, char **out, char *err, size_t errlen)
{
    char fp[17];
    int rc = 0;
    json_t *root = NULL, *counts = NULL;
    *out = NULL;
    if (!dims_ok(p->n_layer, p->n_expert) || !p->counts)
        return moe_fail(err, errlen, MOE_ERANGE, "profiles: cannot export %u x %u counts",
                        p->n_layer, p->n_expert);
    snprintf(fp, sizeof fp, "%016" PRIx64, p->fingerprint);
    counts = json_array();
    for (uint32_t l = 0; counts && l < p->n_layer; l++) {
        json_t *row = json_array();
        if (!row || json_array_append_new(counts, row)) {
            rc = -ENOMEM;
            break;
        }
        for (uint32_t e = 0; e < p->n_expert; e++)
            if (json_array_append_new(row, json_integer(clamp_i64(p->counts[(size_t)l * p->n_expert + e])))) {
                rc = -ENOMEM;
                break;
            }
    }
    if (!counts || rc)
        goto nomem;
    root = json_pack("{s:s, s:I, s:I, s:I, s:I, s:I, s:O}", "fingerprint", fp, "n_layer",
                     (json_int_t)p->n_layer, "n_expert", (json_int_t)p->n_expert, "tokens",
                     clamp_i64(p->tokens), "created", (json_int_t)p->created, "updated",
                     (json_int_t)p->updated, "counts", counts);
    json_decref(counts);
    counts = NULL;
    if (!root)
        goto nomem;
    *out = json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(root);
    if (!*out)
        goto nomem;
    return 0;
nomem:
    json_decref(counts);
    return moe_fail(err, errlen, -ENOMEM, "profiles: out of memory building JSON");
}

/* A non-negative JSON integer field of obj, at most max. */
static int get_uint(const json_t *obj, const char *key, uint64_t max, uint64_t *out, char *err,
                    size_t errlen)
{
    const json_t *v = json_object_get(obj, key);
    if (!v)
        return moe_fail(err, errlen, MOE_EFORMAT, "profile JSON: \"%s\" is missing", key);
    if (!json_is_integer(v))
        return moe_fail(err, errlen, MOE_ETYPE, "profile JSON: \"%s\" must be an integer", key);
    json_int_t i = json_integer_value(v);
    if (i < 0)
        return moe_fail(err, errlen, MOE_ERANGE, "profile JSON: \"%s\": %lld is negative", key,
                        (long long)i);
    if ((uint64_t)i > max)
        return moe_fail(err, errlen, MOE_ERANGE, "profile JSON: \"%s\": %lld is above %" PRIu64,
                        key, (long long)i, max);
    *out = (uint64_t)i;
    return 0;
}

int moe_profile_import_json(struct moe_profile *p, const char *text, size_t len,
                            uint64_t fingerprint, uint32_t n_layer, uint32_t n_expert, char *err,
                            size_t errlen)
{
    int rc;
    json_error_t je;
    uint64_t nl, ne, tokens, created, updated, fp = 0;
    memset(p, 0, sizeof *p);
    if (err && errlen)
        err[0] = '\0';
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return moe_fail(err, errlen, MOE_EFORMAT, "profile JSON: line %d column %d: %s", je.line,
                        je.column, je.text);
    if (!json_is_object(root)) {
        rc = moe_fail(err, errlen, MOE_ETYPE, "profile JSON: the top level must be an object");
        goto fail;
    }
    const json_t *jfp = json_object_get(root, "fingerprint");
    if (!jfp) {
        rc = moe_fail(err, errlen, MOE_EFORMAT, "profile JSON: \"fingerprint\" is missing");
        goto fail;
    }
    if (!json_is_string(jfp)) {
        rc = moe_fail(err, errlen, MOE_ETYPE, "profile JSON: \"fingerprint\" must be a string");
        goto fail;
    }
    const char *s = json_string_value(jfp);
    size_t sl = json_string_length(jfp);
    if (sl != 16 || strspn(s, "0123456789abcdefABCDEF") != 16) {
        rc = moe_fail(err, errlen, MOE_EFORMAT, "profile JSON: \"fingerprint\" must be 16 hex "
                      "digits, got \"%.40s\"", s);
        goto fail;
    }
    for (int i = 0; i < 16; i++) {
        char c = s[i];
        unsigned d = c <= '9' ? (unsigned)(c - '0') : (unsigned)((c | 32) - 'a' + 10);
        fp = fp << 4 | d;
    }
    if ((rc = get_uint(root, "n_layer", MOE_PROFILE_MAX_LAYERS, &nl, err, errlen)) ||
        (rc = get_uint(root, "n_expert", MOE_PROFILE_MAX_EXPERTS, &ne, err, errlen)) ||
        (rc = get_uint(root, "tokens", INT64_MAX, &tokens, err, errlen)) ||
        (rc = get_uint(root, "created", INT64_MAX, &created, err, errlen)) ||
        (rc = get_uint(root, "updated", INT64_MAX, &updated, err, errlen)))
        goto fail;
    if (fingerprint && fp != fingerprint) {
        rc = moe_fail(err, errlen, MOE_ERANGE, "profile JSON: fingerprint %016" PRIx64
                      " is not the model's (%016" PRIx64 ")", fp, fingerprint);
        goto fail;
    }
    if (!dims_ok((uint32_t)nl, (uint32_t)ne)) {
        rc = moe_fail(err, errlen, MOE_ERANGE, "profile JSON: %" PRIu64 " layers x %" PRIu64
                      " experts is not a valid shape", nl, ne);
        goto fail;
    }
    if ((n_layer || n_expert) && (nl != n_layer || ne != n_expert)) {
        rc = moe_fail(err, errlen, MOE_ERANGE, "profile JSON: %" PRIu64 " layers x %" PRIu64
                      " experts, the model has %u x %u", nl, ne, n_layer, n_expert);
        goto fail;
    }
    const json_t *counts = json_object_get(root, "counts");
    if (!counts) {
        rc = moe_fail(err, errlen, MOE_EFORMAT, "profile JSON: \"counts\" is missing");
        goto fail;
    }
    if (!json_is_array(counts) || json_array_size(counts) != nl) {
        rc = moe_fail(err, errlen, json_is_array(counts) ? MOE_ERANGE : MOE_ETYPE,
                      "profile JSON: \"counts\" must be an array of %" PRIu64 " rows", nl);
        goto fail;
    }
    if ((rc = moe_profile_init(p, fp, (uint32_t)nl, (uint32_t)ne))) {
        moe_fail(err, errlen, rc, "profile JSON: out of memory");
        goto fail;
    }
    for (size_t l = 0; l < nl; l++) {
        const json_t *row = json_array_get(counts, l);
        if (!json_is_array(row) || json_array_size(row) != ne) {
            rc = moe_fail(err, errlen, json_is_array(row) ? MOE_ERANGE : MOE_ETYPE,
                          "profile JSON: counts[%zu] must be an array of %" PRIu64 " counts", l,
                          ne);
            goto fail;
        }
        for (size_t e = 0; e < ne; e++) {
            const json_t *c = json_array_get(row, e);
            if (!json_is_integer(c)) {
                rc = moe_fail(err, errlen, MOE_ETYPE, "profile JSON: counts[%zu][%zu] must be "
                              "an integer", l, e);
                goto fail;
            }
            json_int_t v = json_integer_value(c);
            if (v < 0) {
                rc = moe_fail(err, errlen, MOE_ERANGE, "profile JSON: counts[%zu][%zu]: %lld "
                              "is negative", l, e, (long long)v);
                goto fail;
            }
            p->counts[l * ne + e] = (uint64_t)v;
        }
    }
    p->tokens = tokens;
    p->created = (int64_t)created;
    p->updated = (int64_t)updated;
    json_decref(root);
    return 0;
fail:
    moe_profile_free(p);
    json_decref(root);
    return rc;
}
