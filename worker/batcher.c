/* Continuous batching on the worker's compute thread. See worker/batcher.h. */
#include "worker/batcher.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "store/err.h"
#include "store/io.h"
#include "store/tokenizer.h"

#define REPORT_INTERVAL_S 1.0

struct moe_batcher {
    struct moe_batcher_cfg cfg;
    struct moe_batcher_sink sink;
    struct moe_job **slot;    /* [n_seq] running sequences */
    uint32_t n_running;
    struct moe_job *pend_head, *pend_tail; /* admitted by the daemon, waiting for a slot */
    int32_t *tok, *pos, *seq; /* [n_batch] */
    uint32_t **sigp;          /* [n_batch] each token's signature array (cfg.signatures) */
    uint8_t *want;            /* [n_batch] */
    /* [n_seq + MOE_BATCHER_PROMPT_ROWS] per logits row of the step: its job, the prompt
     * position it predicts (-1: a row to sample from) and the token sampled from it */
    struct moe_job **owner;
    int32_t *row_pos;
    int32_t *sampled;
    uint64_t *prev_counts;    /* routing counts at the last report */
    uint64_t *delta;
    uint64_t *cur_counts;     /* scratch: the engine's counts now */
    double last_report;
    uint64_t gen_total, prompt_total, eval_total, gen_at_report, eval_at_report;
    /* Prefix reuse: per slot, the tokens at its cached positions ([n_ctx] each), how many of
     * them are valid KV, and when the slot was last given a job. */
    int32_t **hist;
    uint32_t *valid;
    uint64_t *used_at, admissions;
    uint64_t cached_total;
    /* Host sampling (jobs with logprobs or logit_bias): the step's logits rows, allocated on
     * first use ([n_seq + MOE_BATCHER_PROMPT_ROWS][n_vocab]), a row to bias ([n_vocab]), each
     * row's logprobs, and whose turn it is while both kinds run. */
    float *logits, *biased;
    uint8_t *gmask;           /* [n_vocab]: the grammar's allowed tokens (jobs with a grammar) */
    struct moe_token_lp *lp;  /* [n_seq + MOE_BATCHER_PROMPT_ROWS] */
    bool host_turn;
    /* Decode ahead (moe_engine_submit_sample): while only engine-sampled jobs decode, each step
     * is queued before the tokens of the one before it are taken, so that handing out those
     * tokens and building the next batch overlap the device's work. Queued steps, oldest at
     * q_head: each row's slot, job id (a job that ended since does not get its token) and
     * position. MOE_DECODE_AHEAD=0 turns it off. */
    bool ahead;
    int q_head, n_q;
    struct bq {
        uint32_t n;
        int32_t *slot, *pos;  /* [n_seq] */
        uint64_t *id;         /* [n_seq] */
    } q[MOE_ENGINE_AHEAD];
    bool report_due;          /* a report waits for the queue to be empty */
};

/* Jobs sampled on the host: every job of a host-sampling worker, jobs that want logprobs or a
 * grammar, and jobs whose logit bias the engine's sampler could not take. */
static bool host_job(const struct moe_batcher *b, const struct moe_job *j)
{
    return b->cfg.host_sample_all || j->logprobs || (j->n_bias && !j->bias_dev) || j->gram;
}

void moe_job_free(struct moe_job *j)
{
    if (!j)
        return;
    free(j->prompt);
    free(j->bias_tok);
    free(j->bias_val);
    moe_grammar_state_free(j->gram);
    moe_grammar_free(j->grammar);
    moe_sampler_free(j->hs);
    free(j->sig);
    free(j);
}

/* Ends a running or waiting job and frees it. The slot keeps the job's evaluated positions for
 * a later prompt with the same prefix (valid: they hold KV of hist's tokens). */
static void end_job(struct moe_batcher *b, struct moe_job *j, bool send_done,
                    enum moe_finish reason, bool keep)
{
    if (send_done)
        b->sink.done(b->sink.user, j->id, reason, j->n_prompt, j->n_gen, j->n_cached, j->sig);
    if (j->slot >= 0) {
        /* A position whose token a queued step draws is not in hist yet. */
        b->valid[j->slot] = keep ? j->n_past - (j->ahead_open ? 1 : 0) : 0;
        if (!keep)
            moe_engine_seq_clear(b->cfg.eng, j->slot);
        b->slot[j->slot] = NULL;
        b->n_running--;
    }
    moe_job_free(j);
}

static void finish(struct moe_batcher *b, struct moe_job *j, bool send_done, enum moe_finish reason)
{
    end_job(b, j, send_done, reason, true);
}

/* A failed job's cached positions are not trusted. */
static void fail_job(struct moe_batcher *b, struct moe_job *j, int code, const char *msg)
{
    b->sink.error(b->sink.user, j->id, code, msg);
    end_job(b, j, false, MOE_FINISH_STOP, false);
}

void moe_batcher_cancel(struct moe_batcher *b, uint64_t id)
{
    for (uint32_t s = 0; s < b->cfg.n_seq; s++)
        if (b->slot[s] && b->slot[s]->id == id) {
            finish(b, b->slot[s], false, MOE_FINISH_STOP);
            return;
        }
    for (struct moe_job **pp = &b->pend_head; *pp; pp = &(*pp)->next)
        if ((*pp)->id == id) {
            struct moe_job *j = *pp;
            *pp = j->next;
            if (b->pend_tail == j) {
                b->pend_tail = NULL;
                for (struct moe_job *t = b->pend_head; t; t = t->next)
                    b->pend_tail = t;
            }
            moe_job_free(j);
            return;
        }
}

void moe_batcher_fail_running(struct moe_batcher *b, int code, const char *msg)
{
    for (uint32_t s = 0; s < b->cfg.n_seq; s++)
        if (b->slot[s])
            fail_job(b, b->slot[s], code, msg);
}

void moe_batcher_add(struct moe_batcher *b, struct moe_job *j)
{
    j->next = NULL;
    if (b->pend_tail)
        b->pend_tail->next = j;
    else
        b->pend_head = j;
    b->pend_tail = j;
}

bool moe_batcher_busy(const struct moe_batcher *b)
{
    return b->n_running || b->pend_head || b->n_q;
}

static int collect(struct moe_batcher *b);

/* Takes the tokens of every queued step (stops at a failure, which empties the queue). */
static void drain(struct moe_batcher *b)
{
    while (b->n_q && collect(b) == 0)
        ;
}

void moe_batcher_report(struct moe_batcher *b, bool force)
{
    double now = moe_now_s();
    if (!force && now - b->last_report < REPORT_INTERVAL_S)
        return;
    /* Re-pinning (the sink's) and the counts want no queued step: the next steps run one at a
     * time until the queue is empty, then the report goes; a forced one takes the tokens of
     * what is queued first. */
    if (b->n_q && !force) {
        b->report_due = true;
        return;
    }
    drain(b);
    b->report_due = false;
    uint64_t *cur = b->cur_counts;
    if (moe_engine_routing_counts(b->cfg.eng, cur))
        return;
    size_t n = (size_t)b->cfg.n_layer * b->cfg.n_expert;
    uint64_t any = 0;
    for (size_t i = 0; i < n; i++) {
        b->delta[i] = cur[i] - b->prev_counts[i];
        any |= b->delta[i];
    }
    if (!any && b->gen_total == b->gen_at_report)
        return;
    double dt = now - b->last_report;
    struct moe_batcher_report r = {
        .delta = b->delta,
        .n_tokens = b->eval_total - b->eval_at_report,
        .tokens_generated = b->gen_total,
        .prompt_tokens = b->prompt_total,
        .running = b->n_running,
        .tokens_per_s = dt > 0 ? (double)(b->gen_total - b->gen_at_report) / dt : 0,
    };
    if (b->sink.report(b->sink.user, &r))
        return; /* the delta stays pending and goes out with the next one */
    memcpy(b->prev_counts, cur, n * sizeof *b->prev_counts);
    b->gen_at_report = b->gen_total;
    b->eval_at_report = b->eval_total;
    b->last_report = now;
}

static bool is_eog(const struct moe_job *j, int32_t t)
{
    for (uint32_t i = 0; i < j->n_eog; i++)
        if (j->eog[i] == t)
            return true;
    return false;
}

/* How many leading tokens of j's prompt slot c's history holds, at most lim. */
static uint32_t hist_lcp(const struct moe_batcher *b, uint32_t c, const struct moe_job *j,
                         uint32_t lim)
{
    uint32_t n = 0;
    while (n < lim && b->hist[c][n] == j->prompt[n])
        n++;
    return n;
}

/* Moves waiting jobs into free slots, each with its sampler primed with the prompt. */
static void admit(struct moe_batcher *b)
{
    while (b->pend_head && b->n_running < b->cfg.n_seq) {
        struct moe_job *j = b->pend_head;
        b->pend_head = j->next;
        if (!b->pend_head)
            b->pend_tail = NULL;
        j->next = NULL;
        /* The free slot sharing the longest prefix; on no match an empty one, else the one
         * unused longest. */
        uint32_t s = UINT32_MAX, best = 0;
        for (uint32_t c = 0; c < b->cfg.n_seq; c++) {
            if (b->slot[c])
                continue;
            const uint32_t lcp =
                hist_lcp(b, c, j, b->valid[c] < j->n_prompt ? b->valid[c] : j->n_prompt);
            bool take = s == UINT32_MAX || lcp > best;
            if (!take && lcp == 0 && best == 0) {
                const bool ce = b->valid[c] == 0, se = b->valid[s] == 0;
                take = (ce && !se) || (ce == se && b->used_at[c] < b->used_at[s]);
            }
            if (take) {
                s = c;
                best = lcp;
            }
        }
        /* The engine samples (on the GPU for a CUDA worker), or for a host job its own
         * sampler; either's penalties see the prompt. */
        int rc;
        char err[160] = "";
        if (j->n_bias && !b->cfg.host_sample_all && !j->logprobs && !j->gram &&
            moe_engine_seq_sampler(b->cfg.eng, (int32_t)s, &j->sp, j->prompt, j->n_prompt) == 0)
            /* The bias in the engine's sampler: the job decodes like any other (on the GPU for
             * a CUDA worker). Otherwise (a list the engine refuses) it is sampled here. */
            j->bias_dev =
                moe_engine_seq_bias(b->cfg.eng, (int32_t)s, j->bias_tok, j->bias_val, j->n_bias) == 0;
        if (j->bias_dev) {
            rc = 0;
        } else if (host_job(b, j)) {
            rc = moe_sampler_init(&j->hs, &j->sp, b->cfg.n_vocab, err, sizeof err);
            for (uint32_t i = 0; rc == 0 && i < j->n_prompt; i++)
                moe_sampler_accept(j->hs, j->prompt[i]);
        } else {
            rc = moe_engine_seq_sampler(b->cfg.eng, (int32_t)s, &j->sp, j->prompt, j->n_prompt);
            snprintf(err, sizeof err, "%s", moe_engine_errmsg(b->cfg.eng));
        }
        if (!rc && b->cfg.signatures && !j->sig &&
            !(j->sig = calloc((size_t)b->cfg.n_layer * b->cfg.n_expert, sizeof *j->sig))) {
            rc = -ENOMEM;
            snprintf(err, sizeof err, "out of memory for the routing signature");
        }
        if (rc) {
            b->sink.error(b->sink.user, j->id, rc, err[0] ? err : moe_strerror(rc));
            moe_job_free(j);
            continue;
        }
        /* Continue after the shared prefix; at least the last prompt token is evaluated (every
         * one when the prompt's logprobs are wanted). */
        if (best >= j->n_prompt)
            best = j->n_prompt - 1;
        if (j->prompt_logprobs)
            best = 0;
        if (best)
            moe_engine_seq_keep(b->cfg.eng, (int32_t)s, best);
        else
            moe_engine_seq_clear(b->cfg.eng, (int32_t)s);
        /* A longer prefix in a running job's slot (evaluated or still to be): copied from there
         * once it holds it. */
        j->share_slot = -1;
        for (uint32_t c = 0; c < b->cfg.n_seq && !j->prompt_logprobs; c++) {
            const struct moe_job *o = b->slot[c];
            if (!o)
                continue;
            const uint32_t known = o->n_past > o->n_prompt ? o->n_past : o->n_prompt;
            const uint32_t lim = known < j->n_prompt - 1 ? known : j->n_prompt - 1;
            const uint32_t lcp = hist_lcp(b, c, j, lim);
            if (lcp >= best + MOE_BATCHER_SHARE_MIN &&
                (j->share_slot < 0 || lcp > j->share_n)) {
                j->share_slot = (int32_t)c;
                j->share_id = o->id;
                j->share_n = lcp;
            }
        }
        memcpy(b->hist[s], j->prompt, sizeof *j->prompt * j->n_prompt);
        b->valid[s] = 0; /* until the job ends, its own n_past says */
        b->used_at[s] = ++b->admissions;
        j->n_past = best;
        j->n_cached = best;
        b->cached_total += best;
        j->slot = (int32_t)s;
        b->slot[s] = j;
        b->n_running++;
    }
}

/* A job sharing another slot's prefix: copies it when that slot holds it (its job running with
 * share_n positions evaluated), or what the slot kept of it when that job ended first, and
 * returns true; false while the other job still evaluates them. When the other slot lost them
 * (its job failed, or the slot went to another job) the job evaluates its prompt itself. A
 * failed copy fails the job. */
static bool take_shared(struct moe_batcher *b, struct moe_job *j)
{
    const uint32_t c = (uint32_t)j->share_slot;
    const struct moe_job *o = b->slot[c];
    uint32_t held;
    if (o && o->id == j->share_id) {
        if (o->n_past < j->share_n)
            return false;
        held = o->n_past;
    } else {
        /* Ended: what its slot kept, if still its tokens. */
        held = !o && hist_lcp(b, c, j, j->share_n) == j->share_n ? b->valid[c] : 0;
    }
    j->share_slot = -1;
    /* What the other slot holds of the prefix (all of it, or what an ended job had evaluated). */
    const uint32_t n = held < j->share_n ? held : j->share_n;
    if (n <= j->n_past)
        return true;
    j->share_n = n;
    int rc = moe_engine_seq_copy(b->cfg.eng, (int32_t)c, j->slot, n);
    if (rc) {
        char msg[192];
        snprintf(msg, sizeof msg, "%s", moe_engine_errmsg(b->cfg.eng));
        fail_job(b, j, rc, msg);
        return true;
    }
    b->cached_total += j->share_n - j->n_past;
    j->n_cached += j->share_n - j->n_past;
    j->n_past = j->share_n;
    return true;
}

/* Fills the step's batch: decode tokens, then prompt chunks. Returns the token count; *n_decode
 * and *n_out receive how many are decode tokens and how many rows of logits are wanted. */
static uint32_t build_batch(struct moe_batcher *b, bool host, uint32_t *n_decode, uint32_t *n_out)
{
    const struct moe_batcher_cfg *cfg = &b->cfg;
    uint32_t n = 0, no = 0;
    /* Decode tokens first, so that running sequences never wait behind a long prompt. */
    for (uint32_t s = 0; s < cfg->n_seq; s++) {
        struct moe_job *j = b->slot[s];
        if (!j || j->n_past < j->n_prompt || host_job(b, j) != host)
            continue;
        b->tok[n] = j->last;
        b->pos[n] = (int32_t)j->n_past;
        b->seq[n] = (int32_t)s;
        b->sigp[n] = NULL;
        b->want[n] = 1;
        b->row_pos[no] = -1;
        b->owner[no++] = j;
        b->hist[s][j->n_past] = j->last;
        n++;
    }
    *n_decode = n;
    bool prompt_rows = false; /* one chunk with prompt logprobs per step */
    /* While sequences are decoding, a step's time is their token latency: take prompts in
     * smaller bites then, so that one long prompt does not stall every running stream. */
    uint32_t limit = cfg->n_batch;
    if (n > 0) {
        uint32_t bite = cfg->n_batch / 4 > 64 ? cfg->n_batch / 4 : 64;
        limit = n + bite < cfg->n_batch ? n + bite : cfg->n_batch;
    }
    for (uint32_t s = 0; s < cfg->n_seq && n < limit; s++) {
        struct moe_job *j = b->slot[s];
        if (!j || j->n_past >= j->n_prompt || host_job(b, j) != host)
            continue;
        if (j->share_slot >= 0 && !take_shared(b, j))
            continue; /* its prefix is still being evaluated elsewhere */
        if (!b->slot[s])
            continue; /* the copy failed: the job is gone */
        if (j->prompt_logprobs && prompt_rows)
            continue;
        uint32_t take = j->n_prompt - j->n_past;
        if (take > limit - n)
            take = limit - n;
        if (j->prompt_logprobs && take > MOE_BATCHER_PROMPT_ROWS)
            take = MOE_BATCHER_PROMPT_ROWS;
        prompt_rows |= j->prompt_logprobs;
        for (uint32_t k = 0; k < take; k++) {
            const uint32_t p = j->n_past + k;
            b->tok[n] = j->prompt[p];
            b->pos[n] = (int32_t)p;
            b->seq[n] = (int32_t)s;
            b->sigp[n] = j->sig;
            b->want[n] = j->prompt_logprobs && p + 1 < j->n_prompt;
            if (b->want[n]) {
                b->row_pos[no] = (int32_t)(p + 1);
                b->owner[no++] = j;
            }
            n++;
        }
        if (j->n_past + take == j->n_prompt) {
            b->want[n - 1] = 1;
            b->row_pos[no] = -1;
            b->owner[no++] = j;
        }
    }
    *n_out = no;
    return n;
}

/* Takes token t sampled for job j, whose position next_pos it takes, and ends the job when it
 * is done. */
static void take_token(struct moe_batcher *b, struct moe_job *j, int32_t t, uint32_t k,
                       uint32_t next_pos)
{
    if (j->gram_fail) {
        char msg[192];
        snprintf(msg, sizeof msg, "grammar: %s",
                 j->gram_fail == 1 ? moe_grammar_state_error(j->gram)
                                   : "no token of the vocabulary can continue the text");
        fail_job(b, j, MOE_EFORMAT, msg);
        return;
    }
    if (t < 0) {
        fail_job(b, j, MOE_ERANGE, "every logit is NaN or -inf; cannot sample");
        return;
    }
    j->last = t;
    j->n_gen++;
    b->gen_total++;
    b->sink.token(b->sink.user, j->id, t, j->logprobs ? &b->lp[k] : NULL);
    if (is_eog(j, t) || (j->gram && !moe_grammar_state_can_continue(j->gram)))
        finish(b, j, true, MOE_FINISH_STOP); /* an end token, or the grammar is complete */
    else if (j->n_gen >= j->max_tokens || next_pos >= b->cfg.n_ctx)
        finish(b, j, true, MOE_FINISH_LENGTH);
}

/* Takes the token sampled for the job owning row k of a step run to its end. */
static void sample_row(struct moe_batcher *b, uint32_t k)
{
    struct moe_job *j = b->owner[k];
    take_token(b, j, b->sampled[k], k, j->n_past);
}

/* A host step: the logits of each wanted row, logprobs from them as they are, then the job's
 * logit_bias and its sampler. */
static int forward_host(struct moe_batcher *b, const struct moe_batch *batch, uint32_t n_out)
{
    const uint32_t V = b->cfg.n_vocab;
    if (!b->logits) {
        b->logits = malloc(sizeof *b->logits * ((size_t)b->cfg.n_seq + MOE_BATCHER_PROMPT_ROWS) * V);
        b->biased = malloc(sizeof *b->biased * (size_t)V);
        b->gmask = malloc(V);
        b->lp = calloc((size_t)b->cfg.n_seq + MOE_BATCHER_PROMPT_ROWS, sizeof *b->lp);
        if (!b->logits || !b->biased || !b->lp || !b->gmask) {
            free(b->logits);
            free(b->biased);
            free(b->lp);
            free(b->gmask);
            b->logits = b->biased = NULL;
            b->lp = NULL;
            b->gmask = NULL;
            return -ENOMEM;
        }
    }
    int rc = moe_engine_forward(b->cfg.eng, batch, b->logits);
    if (rc)
        return rc;
    for (uint32_t k = 0; k < n_out; k++) {
        struct moe_job *j = b->owner[k];
        const float *lg = b->logits + (size_t)k * V;
        if (b->row_pos[k] >= 0) {
            /* A prompt row: the logprobs of the prompt token it predicts. */
            struct moe_token_lp *lp = &b->lp[k];
            const int32_t t = j->prompt[b->row_pos[k]];
            lp->n_top = moe_logprobs(lg, V, t, j->n_top, &lp->logprob, lp->top_id, lp->top_lp);
            if (b->sink.prompt_lp)
                b->sink.prompt_lp(b->sink.user, j->id, (uint32_t)b->row_pos[k], t, lp);
            continue;
        }
        if (j->n_bias || j->gram)
            memcpy(b->biased, lg, sizeof *lg * V);
        for (uint32_t i = 0; i < j->n_bias; i++)
            b->biased[j->bias_tok[i]] += j->bias_val[i];
        if (j->gram) {
            /* Tokens the grammar cannot take next are out, before the sampler sees the row. */
            const long allowed = moe_grammar_mask(j->gram, j->tb->trie, b->gmask);
            if (allowed <= 0) {
                j->gram_fail = allowed < 0 ? 1 : 2;
                b->sampled[k] = -1;
                continue;
            }
            for (uint32_t v = 0; v < V; v++)
                if (!b->gmask[v])
                    b->biased[v] = -INFINITY;
        }
        int32_t t = moe_sampler_sample(j->hs, j->n_bias || j->gram ? b->biased : lg);
        if (t >= 0)
            moe_sampler_accept(j->hs, t);
        if (t >= 0 && j->gram && !is_eog(j, t) &&
            moe_grammar_state_accept_bytes(j->gram, j->tb->tok[t], j->tb->len[t]) != 1)
            j->gram_fail = 1; /* the mask allowed it, so only a limit can refuse it */
        b->sampled[k] = t;
        if (j->logprobs) {
            struct moe_token_lp *lp = &b->lp[k];
            lp->n_top = moe_logprobs(lg, V, t, j->n_top, &lp->logprob, lp->top_id, lp->top_lp);
        }
    }
    return 0;
}

/* A forward failure: every sequence in the batch is now in an unknown state, fail them all. */
static int step_failed(struct moe_batcher *b, int rc)
{
    char msg[256];
    snprintf(msg, sizeof msg, "forward failed: %s: %s", moe_strerror(rc),
             moe_engine_errmsg(b->cfg.eng));
    moe_ipc_log(MOE_LOG_ERROR, "%s", msg);
    moe_batcher_fail_running(b, rc, msg);
    return rc == MOE_EBACKEND ? rc : 0;
}

/* Queues the batch (its rows as build_batch or next_batch left them in tok/pos/seq, each a
 * decode row of a running job) as a step of its own. */
static int submit(struct moe_batcher *b, uint32_t n)
{
    struct moe_batch batch = {.n = n, .token = b->tok, .pos = b->pos, .seq = b->seq};
    int rc = moe_engine_submit_sample(b->cfg.eng, &batch);
    if (rc)
        return rc;
    struct bq *q = &b->q[(b->q_head + b->n_q) % MOE_ENGINE_AHEAD];
    q->n = n;
    for (uint32_t i = 0; i < n; i++) {
        struct moe_job *j = b->slot[b->seq[i]];
        q->slot[i] = b->seq[i];
        q->pos[i] = b->pos[i];
        q->id[i] = j->id;
        j->ahead_open = b->tok[i] == MOE_ENGINE_TOKEN_NEXT;
        j->n_past++;
    }
    b->n_q++;
    b->eval_total += n;
    return 0;
}

/* Whether the running jobs may decode ahead: only engine-sampled jobs running, nobody waiting
 * for a free slot (admitting one needs the queue empty), no report waiting for it. */
static bool may_go_ahead(const struct moe_batcher *b)
{
    if (!b->ahead || b->report_due || (b->pend_head && b->n_running < b->cfg.n_seq))
        return false;
    for (uint32_t s = 0; s < b->cfg.n_seq; s++)
        if (b->slot[s] && host_job(b, b->slot[s]))
            return false;
    return true;
}

/* The step after the newest queued one: its jobs that still run and may take another token,
 * each at its next position with the token that step draws for it. Returns the rows. */
static uint32_t next_batch(struct moe_batcher *b)
{
    const struct bq *q = &b->q[(b->q_head + b->n_q - 1) % MOE_ENGINE_AHEAD];
    uint32_t n = 0;
    for (uint32_t i = 0; i < q->n; i++) {
        struct moe_job *j = b->slot[q->slot[i]];
        /* Gone, or its tokens of the queued steps end it by length. */
        if (!j || j->id != q->id[i] || j->n_gen + (uint32_t)b->n_q >= j->max_tokens ||
            j->n_past >= b->cfg.n_ctx)
            continue;
        b->tok[n] = MOE_ENGINE_TOKEN_NEXT;
        b->pos[n] = (int32_t)j->n_past;
        b->seq[n] = q->slot[i];
        n++;
    }
    return n;
}

/* Takes the tokens of the oldest queued step: each to its job if it still runs; a job whose
 * next position a queued step evaluates gets the token into its slot's history there. */
static int collect(struct moe_batcher *b)
{
    struct bq *q = &b->q[b->q_head];
    uint32_t n_out = 0;
    int rc = moe_engine_collect(b->cfg.eng, b->sampled, &n_out);
    b->q_head = (b->q_head + 1) % MOE_ENGINE_AHEAD;
    b->n_q--;
    if (rc) {
        b->n_q = 0; /* the engine dropped whatever was queued after it */
        return step_failed(b, rc);
    }
    for (uint32_t k = 0; k < q->n && k < n_out; k++) {
        struct moe_job *j = b->slot[q->slot[k]];
        if (!j || j->id != q->id[k])
            continue;
        const uint32_t next_pos = (uint32_t)q->pos[k] + 1;
        if (j->n_past > next_pos && b->sampled[k] >= 0) {
            b->hist[q->slot[k]][next_pos] = b->sampled[k];
            j->ahead_open = false;
        }
        take_token(b, j, b->sampled[k], k, next_pos);
    }
    return 0;
}

/* With steps queued: queue the next one when the jobs may go on, then take the oldest's tokens. */
static int step_queued(struct moe_batcher *b)
{
    if (b->n_q < MOE_ENGINE_AHEAD && may_go_ahead(b)) {
        const uint32_t n = next_batch(b);
        int rc = n ? submit(b, n) : 0;
        if (rc) {
            /* What is queued stays valid; its tokens are taken, then the jobs fail. */
            drain(b);
            return step_failed(b, rc);
        }
    }
    return collect(b);
}

int moe_batcher_step(struct moe_batcher *b)
{
    if (b->n_q)
        return step_queued(b);
    admit(b);
    /* Which kind of job this step serves: host jobs and engine jobs take turns. */
    bool any_host = false, any_engine = false;
    for (uint32_t s = 0; s < b->cfg.n_seq; s++)
        if (b->slot[s]) {
            any_host |= host_job(b, b->slot[s]);
            any_engine |= !host_job(b, b->slot[s]);
        }
    bool host = any_host && any_engine ? (b->host_turn = !b->host_turn) : any_host;
    uint32_t n_decode, n_out;
    uint32_t n = build_batch(b, host, &n_decode, &n_out);
    if (n == 0)
        return 0;
    if (!host && n == n_decode && may_go_ahead(b)) {
        /* Only decode rows: the first step of a run of queued ones; its tokens come with the
         * next call, after the step after it is queued. */
        int rc = submit(b, n);
        return rc ? step_failed(b, rc) : 0;
    }
    struct moe_batch batch = {.n = n, .token = b->tok, .pos = b->pos, .seq = b->seq,
                              .logits = b->want,
                              .sig = b->cfg.signatures ? (uint32_t *const *)b->sigp : NULL};
    int rc = host ? forward_host(b, &batch, n_out)
                  : moe_engine_forward_sample(b->cfg.eng, &batch, b->sampled);
    if (rc)
        return step_failed(b, rc);
    /* Advance positions of everything evaluated. */
    b->eval_total += n;
    for (uint32_t i = 0; i < n; i++) {
        struct moe_job *j = b->slot[b->seq[i]];
        j->n_past++;
        if (i >= n_decode)
            b->prompt_total++;
    }
    for (uint32_t k = 0; k < n_out; k++)
        if (b->row_pos[k] < 0)
            sample_row(b, k);
    return 0;
}

int moe_batcher_init(struct moe_batcher **out, const struct moe_batcher_cfg *cfg,
                     const struct moe_batcher_sink *sink)
{
    *out = NULL;
    struct moe_batcher *b = calloc(1, sizeof *b);
    if (!b)
        return -ENOMEM;
    b->cfg = *cfg;
    b->sink = *sink;
    size_t ncount = (size_t)cfg->n_layer * cfg->n_expert;
    b->slot = calloc(cfg->n_seq, sizeof *b->slot);
    const size_t rows = (size_t)cfg->n_seq + MOE_BATCHER_PROMPT_ROWS;
    b->owner = calloc(rows, sizeof *b->owner);
    b->row_pos = calloc(rows, sizeof *b->row_pos);
    b->tok = calloc(cfg->n_batch, sizeof *b->tok);
    b->pos = calloc(cfg->n_batch, sizeof *b->pos);
    b->seq = calloc(cfg->n_batch, sizeof *b->seq);
    b->sigp = calloc(cfg->n_batch, sizeof *b->sigp);
    b->want = calloc(cfg->n_batch, 1);
    b->sampled = calloc(rows, sizeof *b->sampled);
    b->prev_counts = calloc(ncount, sizeof *b->prev_counts);
    b->delta = calloc(ncount, sizeof *b->delta);
    b->cur_counts = calloc(ncount, sizeof *b->cur_counts);
    b->hist = calloc(cfg->n_seq, sizeof *b->hist);
    b->valid = calloc(cfg->n_seq, sizeof *b->valid);
    b->used_at = calloc(cfg->n_seq, sizeof *b->used_at);
    b->last_report = moe_now_s();
    const char *ah = getenv("MOE_DECODE_AHEAD");
    b->ahead = !(ah && !strcmp(ah, "0"));
    bool q_ok = true;
    for (int i = 0; i < MOE_ENGINE_AHEAD; i++) {
        b->q[i].slot = calloc(cfg->n_seq, sizeof *b->q[i].slot);
        b->q[i].pos = calloc(cfg->n_seq, sizeof *b->q[i].pos);
        b->q[i].id = calloc(cfg->n_seq, sizeof *b->q[i].id);
        q_ok &= b->q[i].slot && b->q[i].pos && b->q[i].id;
    }
    if (!q_ok ||
        !b->slot || !b->owner || !b->row_pos || !b->tok || !b->pos || !b->seq || !b->sigp ||
        !b->want || !b->sampled ||
        !b->prev_counts || !b->delta || !b->cur_counts || !b->hist || !b->valid || !b->used_at) {
        moe_batcher_free(b);
        return -ENOMEM;
    }
    for (uint32_t s = 0; s < cfg->n_seq; s++)
        if (!(b->hist[s] = malloc(sizeof *b->hist[s] * ((size_t)cfg->n_ctx + 1)))) {
            moe_batcher_free(b);
            return -ENOMEM;
        }
    int rc = moe_engine_routing_counts(cfg->eng, b->prev_counts);
    if (rc) {
        moe_batcher_free(b);
        return rc;
    }
    *out = b;
    return 0;
}

void moe_batcher_free(struct moe_batcher *b)
{
    if (!b)
        return;
    while (b->n_q > 0 && b->cfg.eng) { /* the engine is left with nothing queued */
        b->n_q--;
        moe_engine_collect(b->cfg.eng, NULL, NULL);
    }
    for (uint32_t s = 0; b->slot && s < b->cfg.n_seq; s++)
        if (b->slot[s])
            finish(b, b->slot[s], false, MOE_FINISH_STOP);
    while (b->pend_head) {
        struct moe_job *j = b->pend_head;
        b->pend_head = j->next;
        moe_job_free(j);
    }
    free(b->slot);
    free(b->owner);
    free(b->row_pos);
    free(b->tok);
    free(b->pos);
    free(b->seq);
    free(b->sigp);
    free(b->want);
    free(b->sampled);
    free(b->prev_counts);
    free(b->delta);
    free(b->cur_counts);
    for (uint32_t s = 0; b->hist && s < b->cfg.n_seq; s++)
        free(b->hist[s]);
    free(b->hist);
    free(b->valid);
    free(b->used_at);
    free(b->logits);
    free(b->biased);
    free(b->gmask);
    free(b->lp);
    for (int i = 0; i < MOE_ENGINE_AHEAD; i++) {
        free(b->q[i].slot);
        free(b->q[i].pos);
        free(b->q[i].id);
    }
    free(b);
}

void moe_token_bytes_free(struct moe_token_bytes *tb)
{
    if (!tb)
        return;
    for (uint32_t i = 0; tb->tok && i < tb->n; i++)
        free(tb->tok[i]);
    free(tb->tok);
    free(tb->len);
    moe_grammar_vocab_free(tb->trie);
    free(tb);
}

struct moe_token_bytes *moe_token_bytes_new(const struct gguf_file *f, char *err, size_t errlen)
{
    struct moe_tokenizer *tok = NULL;
    if (moe_tok_load(&tok, f, err, errlen))
        return NULL;
    const uint32_t n = moe_tok_n_vocab(tok);
    struct moe_token_bytes *tb = calloc(1, sizeof *tb);
    uint8_t *eog = calloc(n ? n : 1, 1);
    size_t cap = moe_tok_max_piece(tok) + 1;
    char *buf = malloc(cap);
    int rc = tb && eog && buf ? 0 : -ENOMEM;
    if (!rc) {
        tb->n = n;
        tb->tok = calloc(n ? n : 1, sizeof *tb->tok);
        tb->len = calloc(n ? n : 1, sizeof *tb->len);
        rc = tb->tok && tb->len ? 0 : -ENOMEM;
    }
    for (uint32_t i = 0; i < n && !rc; i++) {
        eog[i] = moe_tok_is_eog(tok, (int32_t)i);
        int len = moe_tok_is_control(tok, (int32_t)i) && !eog[i]
                      ? 0
                      : moe_tok_piece(tok, (int32_t)i, buf, cap);
        if (len < 0 || (size_t)len > cap)
            len = 0;
        tb->tok[i] = malloc((size_t)len + 1);
        if (!tb->tok[i]) {
            rc = -ENOMEM;
            break;
        }
        memcpy(tb->tok[i], buf, (size_t)len);
        tb->len[i] = eog[i] ? 0 : (uint32_t)len;
    }
    if (!rc && !(tb->trie = moe_grammar_vocab_new((const char *const *)tb->tok, tb->len, n, eog,
                                                  err, errlen)))
        rc = MOE_EFORMAT;
    free(buf);
    free(eog);
    moe_tok_free(tok);
    if (rc) {
        moe_token_bytes_free(tb);
        if (rc == -ENOMEM)
            moe_fail(err, errlen, rc, "out of memory");
        return NULL;
    }
    return tb;
}
