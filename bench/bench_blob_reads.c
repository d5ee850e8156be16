/* Reads of expert-sized blobs at random 32-byte-aligned offsets of a file, the way the tiered
 * store's misses read the GGUF (daemon/tier.c), in its two modes: buffered pread then
 * POSIX_FADV_DONTNEED of the range, and O_DIRECT reads of the covering 4 KiB blocks into an
 * aligned buffer, then a copy of the wanted bytes.
 *
 *   build/bench/bench_blob_reads FILE [--size BYTES] [--reads N] [--threads 1,2,4]
 *
 * FILE should be larger than RAM, or at least not in the page cache (the file's pages are dropped
 * with POSIX_FADV_DONTNEED before each run). Prints GB/s and the mean time of one read per mode
 * and thread count; docs/store.md has the results. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "store/io.h"

static int fd_buf, fd_dir, direct;
static uint64_t file_size, blob, reads;

static int read_all(int fd, uint8_t *dst, uint64_t n, uint64_t off)
{
    uint64_t done = 0;
    while (done < n) {
        ssize_t got = pread(fd, dst + done, n - done, (off_t)(off + done));
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            return -1;
        done += (uint64_t)got;
    }
    return 0;
}

static void *reader(void *arg)
{
    uint64_t r = (uintptr_t)arg * 0x9e3779b97f4a7c15ull + 1;
    uint8_t *dst = aligned_alloc(4096, blob + 8192), *bounce = aligned_alloc(4096, blob + 8192);
    if (!dst || !bounce)
        exit(1);
    for (uint64_t i = 0; i < reads; i++) {
        r ^= r << 13;
        r ^= r >> 7;
        r ^= r << 17;
        const uint64_t off = (r % (file_size - blob - 8192)) & ~31ull;
        if (!direct) {
            if (read_all(fd_buf, dst + 16, blob, off))
                exit(1);
            posix_fadvise(fd_buf, (off_t)off, (off_t)blob, POSIX_FADV_DONTNEED);
        } else {
            const uint64_t a = off & ~4095ull, len = ((off + blob + 4095) & ~4095ull) - a;
            if (read_all(fd_dir, bounce, len, a))
                exit(1);
            memcpy(dst + 16, bounce + (off - a), blob);
        }
    }
    free(dst);
    free(bounce);
    return NULL;
}

int main(int argc, char **argv)
{
    const char *path = NULL, *threads = "1,2,4";
    blob = 1u << 20;
    reads = 200;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--size") && i + 1 < argc)
            blob = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--reads") && i + 1 < argc)
            reads = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc)
            threads = argv[++i];
        else if (argv[i][0] != '-' && !path)
            path = argv[i];
        else
            path = NULL, i = argc;
    }
    if (!path || blob < 4096 || reads < 1) {
        fprintf(stderr, "usage: bench_blob_reads FILE [--size BYTES] [--reads N] [--threads 1,2,4]\n");
        return 2;
    }
    fd_buf = open(path, O_RDONLY);
    fd_dir = open(path, O_RDONLY | O_DIRECT);
    struct stat st;
    if (fd_buf < 0 || fstat(fd_buf, &st) != 0) {
        fprintf(stderr, "bench_blob_reads: %s: %s\n", path, strerror(errno));
        return 1;
    }
    file_size = (uint64_t)st.st_size;
    if (file_size < 4 * blob + 16384) {
        fprintf(stderr, "bench_blob_reads: %s is too small for %llu-byte reads\n", path,
                (unsigned long long)blob);
        return 1;
    }
    printf("%s: %.2f GiB, %llu-byte reads, %llu per thread%s\n", path,
           (double)file_size / (1u << 30), (unsigned long long)blob, (unsigned long long)reads,
           fd_dir < 0 ? " (O_DIRECT refused: buffered only)" : "");
    for (const char *p = threads; *p;) {
        const int nt = atoi(p);
        for (direct = 0; direct < 2 && nt > 0 && nt <= 64; direct++) {
            if (direct && fd_dir < 0)
                break;
            posix_fadvise(fd_buf, 0, 0, POSIX_FADV_DONTNEED);
            pthread_t th[64];
            const double t0 = moe_now_s();
            for (int i = 0; i < nt; i++)
                pthread_create(&th[i], NULL, reader, (void *)(uintptr_t)(i + 1));
            for (int i = 0; i < nt; i++)
                pthread_join(th[i], NULL);
            const double dt = moe_now_s() - t0;
            printf("%-26s threads %2d: %6.2f GB/s, %6.2f ms per read\n",
                   direct ? "O_DIRECT + copy" : "buffered + DONTNEED", nt,
                   (double)blob * (double)reads * nt / dt / 1e9, dt * 1e3 / (double)reads);
        }
        p = strchr(p, ',');
        if (!p)
            break;
        p++;
    }
    return 0;
}
