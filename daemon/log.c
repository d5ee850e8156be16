/* Daemon logging; see log.h. */
#include "daemon/log.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "store/err.h"

static enum log_level level = LOG_LEVEL_INFO;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int log_fd = -1;          /* -1: stderr */
static char log_path[4096];
static int journal = -1;         /* -1: not checked yet */

int log_level_parse(const char *s, enum log_level *out)
{
    static const struct { const char *name; enum log_level l; } names[] = {
        {"error", LOG_LEVEL_ERROR}, {"err", LOG_LEVEL_ERROR}, {"warn", LOG_LEVEL_WARN},
        {"warning", LOG_LEVEL_WARN}, {"info", LOG_LEVEL_INFO}, {"debug", LOG_LEVEL_DEBUG},
    };
    for (size_t i = 0; s && i < sizeof names / sizeof names[0]; i++)
        if (!strcasecmp(s, names[i].name)) {
            *out = names[i].l;
            return 0;
        }
    return MOE_EFORMAT;
}

void log_set_level(enum log_level l)
{
    level = l;
}

enum log_level log_get_level(void)
{
    return level;
}

/* journald sets JOURNAL_STREAM to "dev:inode" of the stream it gave us as stderr. */
static int stderr_is_journal(void)
{
    const char *js = getenv("JOURNAL_STREAM");
    unsigned long long dev, ino;
    struct stat st;
    if (!js || sscanf(js, "%llu:%llu", &dev, &ino) != 2 || fstat(2, &st) != 0)
        return 0;
    return (unsigned long long)st.st_dev == dev && (unsigned long long)st.st_ino == ino;
}

int log_open_file(const char *path, char *err, size_t errlen)
{
    int fd = -1;
    if (path) {
        fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0640);
        if (fd < 0)
            return moe_fail(err, errlen, -errno, "log file %s: %s", path, strerror(errno));
    }
    pthread_mutex_lock(&lock);
    if (log_fd >= 0)
        close(log_fd);
    log_fd = fd;
    snprintf(log_path, sizeof log_path, "%s", path ? path : "");
    pthread_mutex_unlock(&lock);
    return 0;
}

int log_reopen(void)
{
    char path[sizeof log_path];
    pthread_mutex_lock(&lock);
    snprintf(path, sizeof path, "%s", log_path);
    pthread_mutex_unlock(&lock);
    if (!path[0])
        return 0;
    return log_open_file(path, NULL, 0);
}

void log_msg(enum log_level l, const char *fmt, ...)
{
    static const char *names[] = {"ERROR", "WARN", "INFO", "DEBUG"};
    static const int prio[] = {3, 4, 6, 7};
    if (l > level)
        return;
    char line[4096];
    size_t n = 0;
    pthread_mutex_lock(&lock);
    if (journal < 0)
        journal = stderr_is_journal();
    int fd = log_fd >= 0 ? log_fd : 2;
    if (fd == 2 && journal) {
        n = (size_t)snprintf(line, sizeof line, "<%d>%s ", prio[l], names[l]);
    } else {
        struct timespec ts;
        struct tm tm;
        clock_gettime(CLOCK_REALTIME, &ts);
        gmtime_r(&ts.tv_sec, &tm);
        n = strftime(line, sizeof line, "%Y-%m-%dT%H:%M:%S", &tm);
        n += (size_t)snprintf(line + n, sizeof line - n, ".%03ldZ moed[%d] %-5s ",
                              ts.tv_nsec / 1000000, (int)getpid(), names[l]);
    }
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(line + n, sizeof line - n - 1, fmt, ap);
    va_end(ap);
    if (m < 0)
        m = 0;
    n += (size_t)m < sizeof line - n - 1 ? (size_t)m : sizeof line - n - 2;
    line[n++] = '\n';
    ssize_t w = write(fd, line, n);
    (void)w;
    pthread_mutex_unlock(&lock);
}
