/* Sizes and shares as users write them on command lines and in moed.conf. */
#ifndef MOE_UNITS_H
#define MOE_UNITS_H

#include <stdint.h>

/* "4096", "512M", "24G", "24GiB", "24GB", "1.5T", "64k": binary suffixes (K = 1024), with or
 * without "B"/"iB", surrounding blanks allowed. Returns 0, MOE_EFORMAT or MOE_ERANGE. */
int moe_parse_size(const char *s, uint64_t *out);

/* --vram-budget auto: the device's memory minus a margin, decided by the GPU worker (a budget
 * value no device has). */
#define MOE_VRAM_AUTO UINT64_MAX

/* A share in (0, 1]: "0.6" or "60%". Returns 0, MOE_EFORMAT or MOE_ERANGE. */
int moe_parse_share(const char *s, double *out);

/* bytes as "17.28 GiB", "4.5 MiB", "12.0 KiB" or "512 B" into buf; returns buf. */
char *moe_fmt_size(char *buf, unsigned long cap, uint64_t bytes);

#endif
