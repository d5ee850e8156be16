/* Error codes shared by every moed module.
 *
 * Functions return int: 0 on success, a negative errno value for system errors, or one of the
 * MOE_E* codes below (a reserved negative range that no errno reaches). moe_strerror() maps both
 * to a message. Functions that fail for a reason a user must see also fill a caller-owned message
 * buffer (char *err, size_t errlen) with specifics: which field, which byte offset. */
#ifndef MOE_ERR_H
#define MOE_ERR_H

#include <stddef.h>

enum {
    MOE_EFORMAT      = -10001, /* malformed input: file, frame, request */
    MOE_EUNSUPPORTED = -10002, /* well-formed but not something we handle (arch, type, version) */
    MOE_ENOTFOUND    = -10003, /* a key, tensor or entry that must exist does not */
    MOE_ETYPE        = -10004, /* a value exists with the wrong type */
    MOE_ERANGE       = -10005, /* a value is out of its allowed range */
    MOE_ETOOBIG      = -10006, /* a size exceeds a limit */
    MOE_ECANCELED    = -10007, /* the operation was cancelled */
    MOE_EINTERNAL    = -10008, /* a bug or an unexpected state */
    MOE_EBACKEND     = -10009, /* the compute backend failed (CUDA error, out of VRAM) */
};

/* Returns a static message for a MOE_E* code or a negative errno. Never NULL. */
const char *moe_strerror(int err);

/* snprintf into err (if err && errlen) and return code; for `return moe_fail(err, n, CODE, ...)`. */
int moe_fail(char *err, size_t errlen, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Assert that stays on in release builds, for programmer errors only (never input validation). */
void moe_assert_fail(const char *expr, const char *file, int line) __attribute__((noreturn));
#define MOE_ASSERT(x) ((x) ? (void)0 : moe_assert_fail(#x, __FILE__, __LINE__))

#endif
