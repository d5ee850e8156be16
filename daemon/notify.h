/* systemd notification (sd_notify): READY=1, STATUS=..., WATCHDOG=1, STOPPING=1. Every call is
 * a no-op when the daemon was not started by systemd (no NOTIFY_SOCKET). */
#ifndef MOED_NOTIFY_H
#define MOED_NOTIFY_H

#include <stdint.h>

/* Reads the watchdog settings once (WATCHDOG_USEC for this pid). Returns the interval in
 * microseconds at which WATCHDOG=1 should be sent (half of WATCHDOG_USEC), or 0 when no watchdog
 * is configured. */
uint64_t notify_init(void);

void notify_ready(void);
void notify_stopping(void);
void notify_watchdog(void);
void notify_status(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#endif
