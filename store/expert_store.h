/* The shared-memory expert store: one copy of the model's weights in RAM for every worker.
 *
 * The daemon creates it from a described GGUF: a memfd that holds a header, a layer table, a dense
 * table, a dense region (every tensor that is not a routed expert) and an expert region (one blob
 * per (layer, expert): gate, up and down slices back to back, each blob 4 KiB aligned). The memfd
 * is sealed against growing and shrinking, then passed to workers (SCM_RIGHTS), which map it
 * read-only and point their moe_model's views into it. docs/store.md describes the layout.
 *
 * Errors: 0 on success, a negative errno for system failures (memfd_create, mmap, ...), or
 * MOE_EFORMAT (a store that is not ours or is damaged), MOE_ERANGE (a store for another model,
 * an index out of range), MOE_ETOOBIG (not enough RAM), MOE_ECANCELED (the progress callback
 * asked to stop), MOE_EINTERNAL. The message buffer names the field and the values involved. */
#ifndef MOE_EXPERT_STORE_H
#define MOE_EXPERT_STORE_H

#include <stddef.h>
#include <stdint.h>

#include "store/model.h"
#include "store/pool.h"

#define MOE_STORE_MAGIC "MOESTORE" /* 8 bytes, no NUL in the file */
#define MOE_STORE_VERSION 1u
#define MOE_STORE_BLOB_ALIGN 4096u       /* every blob starts on a 4 KiB boundary */
#define MOE_STORE_SLICE_ALIGN 64u        /* gate/up/down inside a blob: cache-line aligned */
#define MOE_STORE_DENSE_ALIGN 256u       /* each dense tensor (CUDA likes 256) */
#define MOE_STORE_REGION_ALIGN (2u << 20) /* regions and the total size: huge-page aligned */

/* ---- on-memory layout (little-endian, fixed-size fields; shared by daemon and workers) ----- */

struct moe_store_header {
    char magic[8];             /* MOE_STORE_MAGIC */
    uint32_t version;          /* MOE_STORE_VERSION */
    uint32_t header_size;      /* sizeof(struct moe_store_header) */
    uint64_t total_size;       /* bytes of the memfd */
    uint64_t fingerprint;      /* gguf_fingerprint() of the source file */
    uint32_t n_layer;
    uint32_t n_expert;
    uint64_t layer_table_off;  /* n_layer x struct moe_store_layer */
    uint64_t dense_table_off;  /* n_dense x struct moe_store_dense, sorted by src_off */
    uint64_t n_dense;
    uint64_t dense_off;        /* dense region [dense_off, dense_off + dense_size) */
    uint64_t dense_size;
    uint64_t experts_off;      /* expert region [experts_off, experts_off + experts_size) */
    uint64_t experts_size;
    uint64_t tables_hash;      /* XXH3-64 of both tables, as written */
    /* Tiered store (0 in a full store): the expert region is pool_slots slots of
     * pool_slot_bytes, and the slot table (store/pool.h) is at pool_table_off. */
    uint64_t pool_table_off;   /* page aligned */
    uint64_t pool_table_size;  /* page multiple */
    uint64_t pool_slots;
    uint64_t pool_slot_bytes;
};

struct moe_store_layer {
    uint64_t blobs_off;        /* store offset of expert 0's blob in this layer */
    uint64_t blob_stride;      /* bytes from one expert's blob to the next (4 KiB multiple) */
    uint64_t blob_bytes;       /* bytes used in each blob (end of the down slice) */
    uint64_t off[3];           /* gate, up, down: offset inside the blob */
    uint64_t size[3];          /* gate, up, down: bytes */
    uint32_t type[3];          /* gate, up, down: enum moe_type */
    uint32_t reserved;
};

struct moe_store_dense {
    char name[64];             /* GGUF tensor name, NUL-terminated */
    uint64_t src_off;          /* offset of the tensor's data in the GGUF file */
    uint64_t off;              /* offset in the store */
    uint64_t size;             /* bytes */
    uint32_t type;             /* enum moe_type */
    uint32_t reserved;
};

/* ---- API ---------------------------------------------------------------------------------- */

struct moe_store;

/* Called by moe_store_create from the calling thread about ten times a second and once at the
 * end with done == total. Return non-zero to cancel (create then returns MOE_ECANCELED). */
typedef int (*moe_store_progress_fn)(uint64_t done, uint64_t total, void *user);

/* Formats a progress line for a terminal or sd_notify STATUS=, e.g.
 * "loading experts: 3.20/17.21 GiB (18%), 5.1 GiB/s, ETA 3s" (elapsed: seconds since the start).
 * Returns the snprintf result. */
int moe_store_progress_format(char *buf, size_t n, uint64_t done, uint64_t total, double elapsed);

struct moe_store_info {
    uint64_t size;             /* bytes of the memfd */
    uint64_t dense_bytes;      /* payload bytes of dense tensors */
    uint64_t expert_bytes;     /* payload bytes of all blobs (without padding) */
    uint64_t fingerprint;
    uint32_t n_layer, n_expert, n_dense;
    int threads;               /* copy threads used (create), 0 for an attached store */
    double seconds;            /* wall time of the copy (create) */
    int thp_advised;           /* 1 if madvise(MADV_HUGEPAGE) on the mapping succeeded */
    char thp_shmem_mode[16];   /* /sys/kernel/mm/transparent_hugepage/shmem_enabled, or "" */
    uint64_t huge_bytes;       /* bytes of our mapping on huge pages, measured after the copy */
    uint32_t pool_slots;       /* tiered store: expert slots (0: every expert is in the store) */
    uint64_t pool_slot_bytes;  /* bytes per slot */
};

/* Daemon side. Copies every routed expert and dense tensor of `m` (which must come from
 * moe_model_from_gguf, m->gguf set) into a new sealed memfd using n_threads threads (<= 0: all
 * online CPUs). Refuses with MOE_ETOOBIG when the store is larger than MemAvailable. The creator's
 * mapping is read-only once the copy is done. */
int moe_store_create(struct moe_store **out, const struct moe_model *m, int n_threads,
                     moe_store_progress_fn progress, void *user, char *err, size_t errlen);

/* The same with a bounded expert pool (a tiered store): n_slots slots of the largest blob's
 * size, filled with the blobs fill[0..n_fill) (layer * n_expert + expert, distinct), and a slot
 * table with room for n_workers workers' pins (store/pool.h). The pool's slots and table stay
 * writable in the creator's mapping. */
int moe_store_create_pool(struct moe_store **out, const struct moe_model *m, int n_threads,
                          uint32_t n_slots, uint32_t n_workers, const uint32_t *fill,
                          uint32_t n_fill, moe_store_progress_fn progress, void *user, char *err,
                          size_t errlen);

/* Bytes of one pool slot for model m (the largest blob, 4 KiB aligned). */
uint64_t moe_store_slot_bytes(const struct moe_model *m);

/* A RAM budget for the experts as moed --ram-budget takes it: "SIZE" (units.h), "P%" of the
 * model's expert bytes, or "auto" (3/4 of MemAvailable less the dense weights), to pool slots.
 * *slots = 0 when every expert fits (a full store). A pool below one step's experts (n_layer x
 * top-k slots, and top-k for each of n_workers) is MOE_ERANGE with the minimum in the message;
 * a value that is none of the three is MOE_EFORMAT. */
int moe_store_budget_slots(const struct moe_model *m, const char *budget, uint32_t n_workers,
                           uint64_t *slots, char *err, size_t errlen);

/* The pool of a tiered store (NULL for a full store). Workers may pin through it; the daemon
 * also writes blobs into its slots. */
struct moe_pool *moe_store_pool(struct moe_store *s);

/* Worker side. Maps `fd` (not taken over: the store keeps its own dup, the caller may close its
 * fd) read-only and checks it against `m` (the worker's own moe_model_from_gguf of the same
 * file): seals (grow and shrink), magic, version, size equal to the fd's, fingerprint, table
 * hash, every table entry inside its region, the layer table equal to the model's expert shapes
 * and types, and (when m->gguf is set) every dense entry equal to the GGUF tensor of that name. */
int moe_store_attach(struct moe_store **out, int fd, const struct moe_model *m, char *err,
                     size_t errlen);

/* Rewrites every tensor view of `m` (dense views and every expert's gate/up/down) to point into
 * the store. Dense views are found through the GGUF offset they point at, so `m` must still point
 * into m->gguf (views already inside this store are left as they are). On success m->gguf is set
 * to NULL, as model.h says of a model built from the store: its views no longer point into the
 * file, so moe_model_expert_slice() on it fails (MOE_EINTERNAL) instead of giving wrong offsets;
 * the caller keeps its gguf_file open for metadata (tokenizer). On error `m` may be partly
 * rewritten; free it. Returns 0, MOE_ERANGE (another model) or MOE_ENOTFOUND (a view points at
 * bytes the store does not hold). */
int moe_store_apply(const struct moe_store *s, struct moe_model *m, char *err, size_t errlen);

/* moe_store_attach followed by moe_store_apply: what a daemon-spawned worker calls. */
int moe_store_open_model(struct moe_store **out, int fd, struct moe_model *m, char *err,
                         size_t errlen);

/* The memfd (owned by the store; dup it to keep it past moe_store_close). */
int moe_store_fd(const struct moe_store *s);
uint64_t moe_store_size(const struct moe_store *s);
/* Start of the mapping (read-only), e.g. for cudaHostRegister(..., cudaHostRegisterReadOnly). */
const void *moe_store_base(const struct moe_store *s);

/* Blob of (layer, expert): *ptr and *size (bytes used, without padding). MOE_ERANGE if out of
 * range, MOE_ENOTFOUND in a tiered store (blobs move; use the pool). The layer's entry gives the gate/up/down offsets inside every blob of that layer. */
int moe_store_blob(const struct moe_store *s, uint32_t layer, uint32_t expert, const void **ptr,
                   uint64_t *size);
const struct moe_store_layer *moe_store_layer(const struct moe_store *s, uint32_t layer);

/* A dense tensor by its GGUF name: *ptr and *size. MOE_ENOTFOUND when the store has no such dense
 * tensor (routed experts are never dense). Linear in the number of dense tensors. */
int moe_store_dense(const struct moe_store *s, const char *name, const void **ptr,
                    uint64_t *size);

void moe_store_get_info(const struct moe_store *s, struct moe_store_info *out);

/* Bytes of [addr, addr+len) of this process's mappings that sit on huge pages, from
 * /proc/self/smaps (ShmemPmdMapped + FilePmdMapped + AnonHugePages). 0 or -errno. */
int moe_store_huge_bytes(const void *addr, uint64_t len, uint64_t *out);

/* Unmaps and closes the store's fd. The memfd lives on while any process holds it. NULL is ok. */
void moe_store_close(struct moe_store *s);

#endif
