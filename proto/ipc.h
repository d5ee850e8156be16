/* IPC framing between moed and moed-worker, shared by both ends.
 *
 * A frame is a u32 little-endian body length followed by that many bytes of one protobuf-c
 * encoded moed.Envelope (proto/moed.proto). A frame longer than the connection's limit, a body
 * that does not decode, an Envelope with no known message, a message sent in the wrong direction
 * or with a field out of range is a protocol violation: it is logged and the connection closed.
 * Nothing here aborts on bad input. docs/protocol.md describes the messages and a request's life.
 *
 * Three layers, usable separately:
 *   codec      moe_ipc_encode / moe_ipc_decode / moe_ipc_validate (pure functions, no I/O)
 *   reader     moe_ipc_reader: incremental reassembly of frames from arbitrary byte chunks
 *   conn       moe_ipc_conn: a libuv pipe on a socketpair end, reading, validating, queueing writes
 * plus blocking helpers that send/receive one frame with a file descriptor attached (SCM_RIGHTS),
 * used for the Hello before the socket is handed to libuv. */
#ifndef MOE_IPC_H
#define MOE_IPC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "proto/moed.pb-c.h"

#define MOE_IPC_PROTOCOL_VERSION 1u
#define MOE_IPC_MAX_FRAME (8u << 20) /* default hard limit on a frame body, bytes */
#define MOE_IPC_HEADER 4u            /* u32 LE length */

/* Bounds that do not depend on the model. */
#define MOE_IPC_MAX_SEQ 1024u        /* n_seq per worker */
#define MOE_IPC_MAX_CTX (1u << 24)   /* n_ctx */
#define MOE_IPC_MAX_EOG 64u          /* eog ids per Submit */
#define MOE_IPC_MAX_TEXT 4096u       /* any string field, bytes */
#define MOE_IPC_MAX_BIAS 1024u       /* logit_bias entries per Submit */
#define MOE_IPC_MAX_GRAMMAR (1u << 20) /* GBNF bytes per Submit (MOE_GRAMMAR_MAX_TEXT) */
#define MOE_IPC_MAX_TOP_LOGPROBS 20u /* top_logprobs per Token */

/* Which end sent a message; validation rejects messages sent in the wrong direction. */
enum moe_ipc_from { MOE_IPC_FROM_DAEMON = 0, MOE_IPC_FROM_WORKER = 1 };

/* The model shape frames are checked against. A zero field is not known yet and not checked
 * (the daemon may learn the shape from the first Ready). */
struct moe_ipc_limits {
    uint32_t n_vocab;
    uint32_t n_layer;
    uint32_t n_expert;
    uint32_t n_ctx;
};

/* Name of an Envelope message case ("submit", ...), "none" or "unknown". Never NULL. */
const char *moe_ipc_msg_name(int msg_case);

/* Encodes env into a new buffer holding header + body (free() it). Returns 0, MOE_ETOOBIG when
 * the body exceeds max_frame (0: MOE_IPC_MAX_FRAME), or -ENOMEM. */
int moe_ipc_encode(const Moed__Envelope *env, uint32_t max_frame, uint8_t **out, size_t *len,
                   char *err, size_t errlen);

/* Decodes a frame body (without its header). Returns 0 and *out (free with moe_ipc_free), or
 * MOE_EFORMAT when the bytes are not an Envelope or carry no known message. */
int moe_ipc_decode(const uint8_t *body, size_t len, Moed__Envelope **out, char *err,
                   size_t errlen);
void moe_ipc_free(Moed__Envelope *env);

/* Checks direction and every field of a decoded message against lim. Returns 0, MOE_EFORMAT
 * (wrong direction, missing field) or MOE_ERANGE with a message naming the field, e.g.
 * "submit.prompt[3] = 5000 is not a token id (n_vocab 4160)". */
int moe_ipc_validate(const Moed__Envelope *env, enum moe_ipc_from from,
                     const struct moe_ipc_limits *lim, char *err, size_t errlen);

/* Incremental frame reassembly. */
struct moe_ipc_reader {
    uint8_t *buf;
    size_t len, cap;
    uint32_t max_frame;
};

void moe_ipc_reader_init(struct moe_ipc_reader *r, uint32_t max_frame);
void moe_ipc_reader_free(struct moe_ipc_reader *r);

/* Called with each complete frame body; a nonzero return stops feeding and is returned. */
typedef int (*moe_ipc_frame_fn)(void *user, const uint8_t *body, size_t len);

/* Appends n bytes and calls fn for every frame completed. Returns 0, MOE_ETOOBIG (a header
 * announces more than max_frame; nothing of that frame is buffered), -ENOMEM, or fn's nonzero
 * return. After an error the reader is in an undefined position and must only be freed. */
int moe_ipc_reader_feed(struct moe_ipc_reader *r, const void *data, size_t n, moe_ipc_frame_fn fn,
                        void *user, char *err, size_t errlen);

/* Bytes of an incomplete frame held (nonzero at EOF means the peer sent a truncated frame). */
size_t moe_ipc_reader_pending(const struct moe_ipc_reader *r);

/* A connection: owns a uv_pipe_t opened on fd (the fd is owned by the connection from then on). */
struct moe_ipc_conn;

struct moe_ipc_conn_cb {
    /* A decoded, validated message. env is freed after the call. Return 0, or an error code
     * (with a message in err) to treat the message as a protocol violation and close. */
    int (*on_msg)(struct moe_ipc_conn *c, void *user, const Moed__Envelope *env, char *err,
                  size_t errlen);
    /* The connection is closed: reason 0 after moe_ipc_conn_close(), UV_EOF when the peer closed
     * at a frame boundary, else the error (a truncated frame, a protocol violation, a read or
     * write error) described by msg. Called exactly once; c is freed right after it returns. */
    void (*on_close)(struct moe_ipc_conn *c, void *user, int reason, const char *msg);
};

/* Opens a connection on a connected socket. peer says which side the other end is (its
 * messages are validated as coming from there); name prefixes log lines ("worker 1").
 * Returns 0 or a negative errno with a message; fd is closed on failure too. */
int moe_ipc_conn_open(struct moe_ipc_conn **out, uv_loop_t *loop, int fd, enum moe_ipc_from peer,
                      const struct moe_ipc_limits *lim, uint32_t max_frame, const char *name,
                      const struct moe_ipc_conn_cb *cb, void *user, char *err, size_t errlen);

/* Replaces the limits (e.g. once the model shape is known). */
void moe_ipc_conn_set_limits(struct moe_ipc_conn *c, const struct moe_ipc_limits *lim);

/* Queues a frame. Returns 0, MOE_ETOOBIG, -EPIPE when the connection is closing, or an error
 * from libuv. */
int moe_ipc_conn_send(struct moe_ipc_conn *c, const Moed__Envelope *env);

/* Bytes queued for writing and not yet written. */
size_t moe_ipc_conn_queued(const struct moe_ipc_conn *c);

/* Closes (after queued writes are flushed, or at once when flush is false); on_close follows
 * with reason 0. Safe to call more than once and from inside on_msg. */
void moe_ipc_conn_close(struct moe_ipc_conn *c, bool flush);

/* Blocking: sends one frame on sock with fd_pass attached as SCM_RIGHTS (fd_pass < 0: none).
 * Returns 0 or a negative errno / MOE_ETOOBIG. */
int moe_ipc_send_with_fd(int sock, const Moed__Envelope *env, int fd_pass, uint32_t max_frame,
                         char *err, size_t errlen);

/* Blocking: receives exactly one frame from sock, waiting at most timeout_ms (< 0: forever),
 * and the descriptor attached to it, if any (*fd_out = -1 when none; close-on-exec). Reads no
 * byte past the frame. Returns 0, UV_EOF (closed before any byte), MOE_EFORMAT (truncated or
 * undecodable), MOE_ETOOBIG, -ETIMEDOUT or a negative errno, with a message. */
int moe_ipc_recv_with_fd(int sock, uint32_t max_frame, int timeout_ms, Moed__Envelope **out,
                         int *fd_out, char *err, size_t errlen);

/* Logging shared by the IPC code and its users: one line to stderr, "moed: LEVEL: ..." with the
 * program name set by moe_ipc_log_init ("moed-worker[123]"). */
enum moe_ipc_log_level { MOE_LOG_ERROR = 0, MOE_LOG_WARN = 1, MOE_LOG_INFO = 2, MOE_LOG_DEBUG = 3 };
void moe_ipc_log_init(const char *prog, enum moe_ipc_log_level max_level);
void moe_ipc_log(enum moe_ipc_log_level level, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* Sends every line (without the program/level prefix) to fn instead, e.g. the daemon's own log
 * (daemon/log.h). The level filter of moe_ipc_log_init does not apply then. NULL: stderr again. */
void moe_ipc_log_set_sink(void (*fn)(enum moe_ipc_log_level level, const char *msg));

#endif
