/* sd_notify wrappers; see notify.h. */
#include "daemon/notify.h"

#include <stdarg.h>
#include <stdio.h>

#include <systemd/sd-daemon.h>

uint64_t notify_init(void)
{
    uint64_t usec = 0;
    /* sd_watchdog_enabled() checks WATCHDOG_PID against our pid, so a watchdog meant for a parent
     * shell is not picked up by mistake. */
    if (sd_watchdog_enabled(0, &usec) <= 0)
        return 0;
    return usec / 2;
}

void notify_ready(void)
{
    sd_notify(0, "READY=1\nSTATUS=ready");
}

void notify_stopping(void)
{
    sd_notify(0, "STOPPING=1\nSTATUS=stopping");
}

void notify_watchdog(void)
{
    sd_notify(0, "WATCHDOG=1");
}

void notify_status(const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    sd_notifyf(0, "STATUS=%s", msg);
}
