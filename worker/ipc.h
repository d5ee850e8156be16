/* The worker's daemon-spawned mode: serve generation requests over an IPC socket.
 *
 * `moed-worker --ipc-fd N` calls moe_worker_ipc_main(N, argv[0]). The sequence:
 *   1. read the Hello frame (blocking, 60 s at most) with the expert store memfd attached;
 *   2. open the model (the GGUF at hello.model_path for metadata; weights from the store when a
 *      memfd came along), initialise the engine for n_seq x n_ctx, send Ready;
 *   3. run the libuv loop on this thread (it owns the socket) and the compute loop on its own
 *      thread; they meet through locked queues and a uv_async_t;
 *   4. exit on Shutdown, or when the daemon closes the socket or breaks the protocol.
 *
 * The compute thread runs continuous batching (worker/batcher.h): each forward step mixes one
 * decode token for every running sequence with prompt chunks of newly admitted ones, up to
 * n_batch tokens. */
#ifndef MOE_WORKER_IPC_H
#define MOE_WORKER_IPC_H

/* Serves the daemon on socket fd (taken over). Returns the process exit status: 0 after a
 * Shutdown or when the daemon closed the socket between frames, 1 on a protocol violation by
 * the daemon, a model that does not load, or a backend failure (an Error frame with id 0 is sent
 * first when the socket still works). Never aborts on bad input. */
int moe_worker_ipc_main(int fd, const char *argv0);

#endif
