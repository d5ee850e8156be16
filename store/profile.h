/* Routing profiles: how often each (layer, expert) was chosen, per model, persisted in LMDB.
 *
 * One LMDB environment per state directory: the file <state_dir>/profiles.mdb (MDB_NOSUBDIR, its
 * lock file next to it as profiles.mdb-lock), one unnamed database, key = the model fingerprint
 * (8 bytes, little-endian), value = a versioned record (docs/store.md). Writes are single LMDB
 * write transactions with the default durable sync, so a process killed at any moment leaves
 * either the previous record or the new one, never a torn one.
 *
 * Errors: 0, a negative errno, an LMDB error mapped to MOE_EINTERNAL/MOE_ETOOBIG (with the LMDB
 * message in err), MOE_ENOTFOUND (no profile for that fingerprint), MOE_EFORMAT (a damaged record
 * or malformed JSON), MOE_ERANGE (dimensions or fingerprint that do not match the model, negative
 * or out-of-range numbers), MOE_ETYPE (a JSON field of the wrong type). */
#ifndef MOE_PROFILE_H
#define MOE_PROFILE_H

#include <stddef.h>
#include <stdint.h>

#define MOE_PROFILE_VERSION 1u
#define MOE_PROFILE_MAX_LAYERS 4096u
#define MOE_PROFILE_MAX_EXPERTS 4096u

struct moe_profile {
    uint64_t fingerprint;   /* gguf_fingerprint() of the model */
    uint32_t n_layer;
    uint32_t n_expert;
    uint64_t tokens;        /* tokens whose routing was counted */
    int64_t created;        /* unix seconds */
    int64_t updated;        /* unix seconds */
    uint64_t *counts;       /* [n_layer][n_expert], owned (malloc) */
};

struct moe_profile_db;

/* Opens (creating when missing) <state_dir>/profiles.mdb. state_dir must exist. Returns
 * MOE_EFORMAT when the file's contents are damaged (not an LMDB file, a corrupted or missing page,
 * truncated); a negative errno for system errors (EACCES, ENOSPC, ...). */
int moe_profile_db_open(struct moe_profile_db **out, const char *state_dir, char *err,
                        size_t errlen);

/* Renames <state_dir>/profiles.mdb to profiles.mdb.corrupt-<UTC timestamp> (and its -lock file
 * alongside), so that the next moe_profile_db_open starts an empty database. Only for a closed
 * environment that no other process has open. moved gets the new name of the data file. */
int moe_profile_db_move_aside(const char *state_dir, char *moved, size_t movedlen, char *err,
                              size_t errlen);
void moe_profile_db_close(struct moe_profile_db *db);

/* A zeroed profile for a model; created = updated = now. 0, MOE_ERANGE (bad dims) or -ENOMEM. */
int moe_profile_init(struct moe_profile *p, uint64_t fingerprint, uint32_t n_layer,
                     uint32_t n_expert);
void moe_profile_free(struct moe_profile *p);

/* Loads the profile of `fingerprint` into *p (initialised by this call; free it). n_layer and
 * n_expert are the model's: a stored record with other dimensions is refused with MOE_ERANGE
 * (pass 0 and 0 to accept any). MOE_ENOTFOUND when there is none. */
int moe_profile_load(struct moe_profile_db *db, uint64_t fingerprint, uint32_t n_layer,
                     uint32_t n_expert, struct moe_profile *p, char *err, size_t errlen);

/* Stores *p under p->fingerprint as it is (timestamps included) in one durable write txn. */
int moe_profile_save(struct moe_profile_db *db, const struct moe_profile *p, char *err,
                     size_t errlen);

/* Removes the profile of `fingerprint` (reset). 0 or MOE_ENOTFOUND. */
int moe_profile_delete(struct moe_profile_db *db, uint64_t fingerprint, char *err, size_t errlen);

/* Adds delta[n_layer * n_expert] (same layout as counts) and `tokens` to *p, saturating at
 * UINT64_MAX, and sets updated = now. n must equal n_layer * n_expert, else MOE_ERANGE. */
int moe_profile_merge(struct moe_profile *p, const uint64_t *delta, size_t n, uint64_t tokens);

/* Ages the history: while the profile holds at least 2 x half_life tokens, every count and the
 * token total are halved (rounding down), so that traffic k half-lives old weighs 2^-k and the
 * profile follows a change of workload without one burst erasing it. half_life 0: never.
 * Returns how many halvings were applied. */
unsigned moe_profile_decay(struct moe_profile *p, uint64_t half_life);

/* JSON: {"fingerprint": "16 hex digits", "n_layer": L, "n_expert": E, "tokens": T,
 * "created": S, "updated": S, "counts": [[E numbers] x L]}. Export gives a malloc'd,
 * NUL-terminated string (counts above INT64_MAX are clamped: JSON integers are signed 64-bit). */
int moe_profile_export_json(const struct moe_profile *p, char **out, char *err, size_t errlen);

/* Parses and validates JSON text into *p (initialised by this call). fingerprint, n_layer and
 * n_expert are the model's (0 to accept any); a mismatch is MOE_ERANGE, a wrong type MOE_ETYPE,
 * a negative or fractional count MOE_ERANGE, malformed JSON MOE_EFORMAT, each with a message
 * naming the field ("counts[2][7]: -1 is negative"). */
int moe_profile_import_json(struct moe_profile *p, const char *text, size_t len,
                            uint64_t fingerprint, uint32_t n_layer, uint32_t n_expert, char *err,
                            size_t errlen);

#endif
