/* Daemon logging: one line per message on stderr (or a --log-file), with a timestamp and a level.
 * Under systemd (JOURNAL_STREAM set and stderr is that stream) lines carry a "<N>" syslog priority
 * prefix instead of a timestamp, since journald adds its own. Thread-safe: each line is one
 * write(2). */
#ifndef MOED_LOG_H
#define MOED_LOG_H

#include <stddef.h>

enum log_level { LOG_LEVEL_ERROR = 0, LOG_LEVEL_WARN = 1, LOG_LEVEL_INFO = 2, LOG_LEVEL_DEBUG = 3 };

/* "error", "warn" (or "warning"), "info", "debug" -> 0 and *out; MOE_EFORMAT otherwise. */
int log_level_parse(const char *s, enum log_level *out);
void log_set_level(enum log_level l);
enum log_level log_get_level(void);

/* Logs to path (appending, created 0640) instead of stderr. NULL goes back to stderr. Returns 0 or
 * a negative errno with a message in err. */
int log_open_file(const char *path, char *err, size_t errlen);
/* Reopens the log file (after logrotate moved it; SIGHUP). A no-op when logging to stderr. */
int log_reopen(void);

void log_msg(enum log_level l, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define log_error(...) log_msg(LOG_LEVEL_ERROR, __VA_ARGS__)
#define log_warn(...) log_msg(LOG_LEVEL_WARN, __VA_ARGS__)
#define log_info(...) log_msg(LOG_LEVEL_INFO, __VA_ARGS__)
#define log_debug(...) log_msg(LOG_LEVEL_DEBUG, __VA_ARGS__)

#endif
