/* The daemon's pure pieces: config parsing (defaults < file < command line), the ChatML
 * renderer, stop-string search and hold-back, the admin peer check, and the API's chat
 * tokenization against the real golden tokenizer. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/api.h"
#include "daemon/chat.h"
#include "daemon/config.h"
#include "store/err.h"
#include "store/gguf.h"
#include "store/tokenizer.h"
#include "store/units.h"
#include "tests/harness.h"

TEST(config_sizes)
{
    uint64_t v;
    CHECK(config_parse_size("4096", &v) == 0 && v == 4096);
    CHECK(config_parse_size("24G", &v) == 0 && v == 24ull << 30);
    CHECK(config_parse_size("24GiB", &v) == 0 && v == 24ull << 30);
    CHECK(config_parse_size("512m", &v) == 0 && v == 512ull << 20);
    CHECK(config_parse_size("1.5G", &v) == 0 && v == 3ull << 29);
    CHECK(config_parse_size("8K", &v) == 0 && v == 8192);
    CHECK(config_parse_size("", &v) != 0);
    CHECK(config_parse_size("-1G", &v) != 0);
    CHECK(config_parse_size("12X", &v) != 0);
    CHECK(config_parse_size("G", &v) != 0);
    CHECK(config_parse_size("1e30T", &v) == MOE_ERANGE);
}

TEST(config_file_and_command_line)
{
    char path[512], key[512];
    snprintf(path, sizeof path, "%s/moed.conf", moe_test_tmpdir());
    snprintf(key, sizeof key, "%s/api.key", moe_test_tmpdir());
    moe_test_write_file(key, "  0123456789abcdef-key \nignored\n", 33);
    FILE *f = fopen(path, "w");
    CHECK(f);
    fprintf(f, "# example\n[moed]\nmodel = /models/a.gguf\nsocket = /tmp/a.sock\n"
               "workers = 3  # three\nvram_budget = 20G ; twenty\nlog-level = debug\nstate-dir = \"/var/x y\"\n"
               "; comment\nlisten = 127.0.0.1:8080\napi-key-file = %s\n", key);
    fclose(f);
    struct moed_config c;
    CHECK(config_init(&c) == 0);
    CHECK_STREQ(c.socket, MOED_DEFAULT_SOCKET);
    char *argv[] = {"moed", "--config", path, "--workers", "2", "--socket=/tmp/b.sock", NULL};
    bool help;
    char err[512];
    int rc = config_parse_args(&c, 6, argv, &help, err, sizeof err);
    CHECK_MSG(rc == 0, "%s", err);
    CHECK(!help);
    CHECK_STREQ(c.model, "/models/a.gguf");
    CHECK_STREQ(c.socket, "/tmp/b.sock");   /* the command line wins */
    CHECK_EQ(c.workers, 2);
    CHECK_EQ(c.vram_budget, 20ull << 30);
    CHECK_EQ(c.log_level, LOG_LEVEL_DEBUG);
    CHECK_STREQ(c.state_dir, "/var/x y");
    CHECK_STREQ(c.listen, "127.0.0.1:8080");
    CHECK_STREQ(c.api_key, "0123456789abcdef-key");
    CHECK_STREQ(c.config_file, path);
    config_free(&c);

    /* Errors name the file and line, or the option. */
    f = fopen(path, "w");
    fprintf(f, "model = m\nworkers = many\n");
    fclose(f);
    CHECK(config_init(&c) == 0);
    char *argv2[] = {"moed", "--config", path, NULL};
    rc = config_parse_args(&c, 3, argv2, &help, err, sizeof err);
    CHECK(rc == MOE_EFORMAT);
    CHECK_MSG(strstr(err, ":2:") && strstr(err, "workers"), "%s", err);
    config_free(&c);

    CHECK(config_init(&c) == 0);
    char *argv3[] = {"moed", "--model", "m", "--listen", "0.0.0.0:80", NULL};
    rc = config_parse_args(&c, 5, argv3, &help, err, sizeof err);
    CHECK(rc == MOE_ERANGE);
    CHECK_MSG(strstr(err, "loopback"), "%s", err);
    config_free(&c);

    CHECK(config_init(&c) == 0);
    char *argv4[] = {"moed", "--modle", "m", NULL};
    rc = config_parse_args(&c, 3, argv4, &help, err, sizeof err);
    CHECK(rc == MOE_ENOTFOUND);
    CHECK_MSG(strstr(err, "--modle"), "%s", err);
    config_free(&c);

    CHECK(config_init(&c) == 0);
    char *argv5[] = {"moed", "--workers", "2", NULL};
    rc = config_parse_args(&c, 3, argv5, &help, err, sizeof err);
    CHECK(rc == MOE_ENOTFOUND);
    CHECK_MSG(strstr(err, "--model"), "%s", err);
    config_free(&c);

    CHECK(config_init(&c) == 0);
    char *argv6[] = {"moed", "--config", "/nonexistent/moed.conf", NULL};
    rc = config_parse_args(&c, 3, argv6, &help, err, sizeof err);
    CHECK(rc == -ENOENT);
    CHECK_MSG(strstr(err, "/nonexistent/moed.conf"), "%s", err);
    config_free(&c);
}

static char *joined(const struct chat_rendered *r, bool mark)
{
    static char buf[4096];
    size_t n = 0;
    for (size_t i = 0; i < r->n_spans; i++) {
        const struct chat_span *s = &r->spans[i];
        n += (size_t)snprintf(buf + n, sizeof buf - n, "%s%.*s%s", mark && s->id >= 0 ? "[" : "",
                              (int)s->len, r->text + s->off, mark && s->id >= 0 ? "]" : "");
    }
    return buf;
}

static struct moe_tokenizer *golden_tokenizer(struct gguf_file **g)
{
    char err[512];
    int rc = gguf_open(g, "tests/golden/models/tiny-qwen3moe-Q8_0.gguf", err, sizeof err);
    CHECK_MSG(rc == 0, "%s", err);
    struct moe_tokenizer *t;
    rc = moe_tok_load(&t, *g, err, sizeof err);
    CHECK_MSG(rc == 0, "%s", err);
    return t;
}

/* Built-in ChatML with the golden vocabulary: the template's markers become their tokens, the
 * same text in a message stays text. */
TEST(chat_chatml_render)
{
    struct gguf_file *g;
    struct moe_tokenizer *tok = golden_tokenizer(&g);
    struct chat_template *t;
    char err[512];
    CHECK(chat_template_new(&t, chat_chatml_template, strlen(chat_chatml_template), CHAT_SRC_BUILTIN,
                            err, sizeof err) == 0);
    CHECK_STREQ(chat_source_name(chat_template_source(t)), "chatml");
    json_t *vars = json_pack("{s:[{s:s,s:s},{s:s,s:s},{s:s,s:s},{s:s,s:s}],s:b}", "messages",
                             "role", "system", "content", "Be brief.", "role", "user", "content",
                             "Hi <|im_start|>", "role", "assistant", "content", "Hello!", "role",
                             "developer", "content", "x", "add_generation_prompt", 1);
    struct chat_rendered r;
    CHECK(chat_render(t, tok, vars, 0, &r, err, sizeof err) == 0);
    CHECK_STREQ(r.text, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi <|im_start|><|im_end|>\n"
                        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>system\nx<|im_end|>\n"
                        "<|im_start|>assistant\n");
    CHECK_STREQ(joined(&r, true),
                "[<|im_start|>]system\nBe brief.[<|im_end|>]\n[<|im_start|>]user\nHi <|im_start|>[<|im_end|>]\n"
                "[<|im_start|>]assistant\nHello![<|im_end|>]\n[<|im_start|>]system\nx[<|im_end|>]\n"
                "[<|im_start|>]assistant\n");
    CHECK_EQ(r.spans[0].id, moe_tok_lookup(tok, "<|im_start|>"));
    chat_rendered_free(&r);
    json_decref(vars);
    chat_template_ref(t);
    chat_template_free(t); /* one reference left */
    chat_template_free(t);
    /* a template error names the line */
    CHECK(chat_template_new(&t, "a\n{% if %}", 11, CHAT_SRC_FILE, err, sizeof err) == MOE_EFORMAT);
    CHECK_MSG(strstr(err, "line 2"), "%s", err);
    moe_tok_free(tok);
    gguf_close(g);
}

struct collect {
    char text[3][1024];
    size_t n[3];
    char calls[1024];
    int events;
};

static int collect_ev(void *user, enum chat_ev ev, const char *s, size_t n, const struct chat_tool_call *tc)
{
    struct collect *c = user;
    c->events++;
    if (ev == CHAT_EV_TOOL_CALL) {
        size_t l = strlen(c->calls);
        snprintf(c->calls + l, sizeof c->calls - l, "%d:%s:%s(%s);", tc->index, tc->id, tc->name, tc->arguments);
        return 0;
    }
    memcpy(c->text[ev] + c->n[ev], s, n);
    c->n[ev] += n;
    c->text[ev][c->n[ev]] = 0;
    return 0;
}

/* The output parser on fixed model outputs, fed whole, one byte at a time (as a stream) and in
 * two pieces split at every byte: all give the same reasoning, content and tool calls. */
static void check_fmt(enum chat_fmt fmt, const char *out, bool think_open, bool tools,
                      const char *reasoning, const char *content, const char *calls)
{
    size_t len = strlen(out);
    for (size_t stream = 0; stream < len + 2; stream++) {
        struct chat_out p;
        chat_out_init(&p, think_open, tools, "call_x", fmt);
        struct collect c = {0};
        if (stream == 1)
            for (size_t i = 0; i <= len; i++)
                CHECK(chat_out_feed(&p, out, i, false, collect_ev, &c) == 0);
        else if (stream > 1)
            CHECK(chat_out_feed(&p, out, stream - 2, false, collect_ev, &c) == 0);
        CHECK(chat_out_feed(&p, out, len, true, collect_ev, &c) == 0);
        CHECK_MSG(!strcmp(c.text[CHAT_EV_REASONING], reasoning), "%s (stream %zu): reasoning [%s]", out,
                  stream, c.text[CHAT_EV_REASONING]);
        CHECK_MSG(!strcmp(c.text[CHAT_EV_CONTENT], content), "%s (stream %zu): content [%s]", out, stream,
                  c.text[CHAT_EV_CONTENT]);
        CHECK_MSG(!strcmp(c.calls, calls), "%s (stream %zu): calls [%s]", out, stream, c.calls);
        if (strcmp(c.calls, calls) || strcmp(c.text[CHAT_EV_CONTENT], content))
            break;
    }
}

static void check_out(const char *out, bool think_open, bool tools, const char *reasoning,
                      const char *content, const char *calls)
{
    check_fmt(CHAT_FMT_HERMES, out, think_open, tools, reasoning, content, calls);
}

TEST(chat_output_reasoning_and_tool_calls)
{
    check_out("Hello there.", false, false, "", "Hello there.", "");
    check_out("<think>\nLet me see.\n</think>\n\nIt is 4.", false, false, "Let me see.", "It is 4.", "");
    check_out("Let me see.\n</think>\n\nIt is 4.", true, false, "Let me see.", "It is 4.", "");
    check_out("<think>\nunfinished", false, false, "unfinished", "", "");
    check_out("<thin", false, false, "", "<thin", "");
    check_out("a <think> b", false, false, "", "a <think> b", "");
    check_out("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
              false, true, "", "", "0:call_x_0:get_weather({\"city\":\"Paris\"});");
    check_out("<think>\nhmm\n</think>\n\nChecking.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n"
              "<tool_call>\n{\"name\": \"b\", \"arguments\": \"{\\\"q\\\": 1}\"}\n</tool_call>",
              false, true, "hmm", "Checking.", "0:call_x_0:a({});1:call_x_1:b({\"q\": 1});");
    /* malformed JSON stays content; an unterminated call at the end is still parsed */
    check_out("<tool_call>{\"name\": \"a\", \"arguments\": {oops}</tool_call>", false, true, "",
              "<tool_call>{\"name\": \"a\", \"arguments\": {oops}</tool_call>", "");
    check_out("<tool_call>{\"name\": \"a\", \"arguments\": {\"x\": [1, 2]}}", false, true, "", "",
              "0:call_x_0:a({\"x\":[1,2]});");
    /* without tools, a tool call is only text */
    check_out("<tool_call>{\"name\": \"a\"}</tool_call>", false, false, "",
              "<tool_call>{\"name\": \"a\"}</tool_call>", "");
    check_out("Sure.  <tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call> and more", false, true, "",
              "Sure.and more", "0:call_x_0:a({});");
}

/* A generation that ends before any text (its first token ends it) has no buffer yet: the
 * parser takes NULL with length 0, streamed or not, in every format. */
TEST(chat_output_of_nothing)
{
    for (int fmt = CHAT_FMT_HERMES; fmt <= CHAT_FMT_SEED; fmt++)
        for (int think_open = 0; think_open < 2; think_open++) {
            struct chat_out p;
            chat_out_init(&p, think_open, true, "call_x", (enum chat_fmt)fmt);
            struct collect c = {0};
            CHECK(chat_out_feed(&p, NULL, 0, false, collect_ev, &c) == 0);
            CHECK(chat_out_feed(&p, NULL, 0, true, collect_ev, &c) == 0);
            CHECK_MSG(!c.n[CHAT_EV_CONTENT] && !c.n[CHAT_EV_REASONING] && !c.calls[0],
                      "format %d: [%s] [%s] [%s]", fmt, c.text[CHAT_EV_CONTENT],
                      c.text[CHAT_EV_REASONING], c.calls);
        }
}

/* Each family's template is told by its markers. */
TEST(chat_format_detected_from_templates)
{
    static const struct { const char *file; enum chat_fmt fmt; } cases[] = {
        {"Qwen-Qwen3-0.6B", CHAT_FMT_HERMES},
        {"Qwen-Qwen2.5-7B-Instruct", CHAT_FMT_HERMES},
        {"NousResearch-Hermes-3-Llama-3.1-8B-tool_use", CHAT_FMT_HERMES},
        {"meta-llama-Llama-3.1-8B-Instruct", CHAT_FMT_LLAMA},
        {"meta-llama-Llama-3.2-3B-Instruct", CHAT_FMT_LLAMA},
        {"meta-llama-Llama-3.3-70B-Instruct", CHAT_FMT_LLAMA},
        {"mistralai-Mistral-Nemo-Instruct-2407", CHAT_FMT_MISTRAL},
        {"Mistral-Small-3.2-24B-Instruct-2506", CHAT_FMT_MISTRAL},
        {"unsloth-mistral-Devstral-Small-2507", CHAT_FMT_MISTRAL},
        {"deepseek-ai-DeepSeek-V3.1", CHAT_FMT_DEEPSEEK},
        {"deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", CHAT_FMT_DEEPSEEK},
        {"openai-gpt-oss-120b", CHAT_FMT_HARMONY},
        {"CohereForAI-c4ai-command-r-plus-tool_use", CHAT_FMT_COMMAND_R},
        {"CohereForAI-c4ai-command-r7b-12-2024-tool_use", CHAT_FMT_COMMAND_R},
        {"meetkai-functionary-medium-v3.1", CHAT_FMT_FUNCTIONARY},
        {"fireworks-ai-llama-3-firefunction-v2", CHAT_FMT_FIREFUNCTION},
        {"meetkai-functionary-medium-v3.2", CHAT_FMT_FUNCTIONARY2},
        {"google-gemma-2-2b-it", CHAT_FMT_HERMES},
        {"ByteDance-Seed-OSS", CHAT_FMT_SEED},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char path[256];
        snprintf(path, sizeof path, "tests/fixtures/chat-templates/%s.jinja", cases[i].file);
        size_t len;
        char *src = moe_test_read_file_or_fail(path, &len);
        if (!src)
            continue;
        CHECK_MSG(chat_fmt_detect(src, len) == cases[i].fmt, "%s: %s", cases[i].file,
                  chat_fmt_name(chat_fmt_detect(src, len)));
        free(src);
    }
    char err[256];
    struct chat_template *t;
    CHECK(chat_template_new(&t, chat_chatml_template, strlen(chat_chatml_template), CHAT_SRC_BUILTIN,
                            err, sizeof err) == 0);
    CHECK_EQ(chat_template_format(t), CHAT_FMT_HERMES);
    chat_template_free(t);
}

TEST(chat_output_llama_calls)
{
    enum chat_fmt f = CHAT_FMT_LLAMA;
    check_fmt(f, "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}", false, true, "", "",
              "0:call_x_0:get_weather({\"city\":\"Paris\"});");
    check_fmt(f, "<|python_tag|>{\"name\": \"a\", \"parameters\": {\"x\": 1}}", false, true, "", "",
              "0:call_x_0:a({\"x\":1});");
    check_fmt(f, "\n{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"parameters\": {\"s\": \"}\"}}", false,
              true, "", "", "0:call_x_0:a({});1:call_x_1:b({\"s\":\"}\"});");
    /* built-in tools and code */
    check_fmt(f, "<|python_tag|>brave_search.call(query=\"weather in Paris\", n=3, safe=True)", false, true, "",
              "", "0:call_x_0:brave_search({\"query\":\"weather in Paris\",\"n\":3,\"safe\":true});");
    check_fmt(f, "<|python_tag|>print(2 + 2)", false, true, "", "",
              "0:call_x_0:python({\"code\":\"print(2 + 2)\"});");
    check_fmt(f, "<|python_tag|>wolfram_alpha.call(query='it\\'s 2+2')", false, true, "", "",
              "0:call_x_0:wolfram_alpha({\"query\":\"it's 2+2\"});");
    /* keyword arguments that are not literals: the text is code */
    check_fmt(f, "<|python_tag|>x.call(q)", false, true, "", "", "0:call_x_0:python({\"code\":\"x.call(q)\"});");
    check_fmt(f, "<|python_tag|>x.call(q=\"open)", false, true, "", "",
              "0:call_x_0:python({\"code\":\"x.call(q=\\\"open)\"});");
    /* text, then a tagged call; a JSON answer that is no call stays content */
    check_fmt(f, "Let me look. <|python_tag|>{\"name\": \"a\", \"parameters\": {}}", false, true, "",
              "Let me look.", "0:call_x_0:a({});");
    check_fmt(f, "{\"answer\": 4} is it", false, true, "", "{\"answer\": 4} is it", "");
    check_fmt(f, "{\"name\": \"a\", \"parameters\": {oops}}", false, true, "",
              "{\"name\": \"a\", \"parameters\": {oops}}", "");
    check_fmt(f, "The JSON {\"name\": \"a\", \"parameters\": {}} is text here", false, true, "",
              "The JSON {\"name\": \"a\", \"parameters\": {}} is text here", "");
    check_fmt(f, "{\"name\": \"a\", \"parameters\": {}}", false, false, "", "{\"name\": \"a\", \"parameters\": {}}", "");
}

TEST(chat_output_mistral_calls)
{
    enum chat_fmt f = CHAT_FMT_MISTRAL;
    /* Nemo: a JSON list */
    check_fmt(f, "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {\"x\": [1, \"]\"]}}, {\"name\": \"b\", "
                 "\"arguments\": {}, \"id\": \"abcdefghi\"}]", false, true, "", "",
              "0:call_x_0:a({\"x\":[1,\"]\"]});1:call_x_1:b({});");
    /* Small 3.2, Devstral: name[ARGS]{...}, one marker per call */
    check_fmt(f, "Checking. [TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}[TOOL_CALLS]get_time[CALL_ID]"
                 "a1b2c3d4e[ARGS]{}", false, true, "", "Checking.",
              "0:call_x_0:get_weather({\"city\":\"Paris\"});1:call_x_1:get_time({});");
    check_fmt(f, "[TOOL_CALLS]a[ARGS]{\"x\": 1} Done.", false, true, "", "Done.", "0:call_x_0:a({\"x\":1});");
    check_fmt(f, "[TOOL_CALLS]a[ARGS]{\"x\": oops}", false, true, "", "[TOOL_CALLS]a[ARGS]{\"x\": oops}", "");
    check_fmt(f, "[TOOL_CALLS][{\"name\": \"a\"", false, true, "", "[TOOL_CALLS][{\"name\": \"a\"", "");
    check_fmt(f, "[TOOL_CALLS]a[ARGS]{}", false, false, "", "[TOOL_CALLS]a[ARGS]{}", "");
}

TEST(chat_output_deepseek_calls)
{
    enum chat_fmt f = CHAT_FMT_DEEPSEEK;
    /* V3.1 */
    check_fmt(f, "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\"}"
                 "<｜tool▁call▁end｜><｜tool▁call▁begin｜>b<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
              false, true, "", "Sure.", "0:call_x_0:get_weather({\"city\":\"Paris\"});1:call_x_1:b({});");
    /* R1: the type, then the name and a fenced JSON */
    check_fmt(f, "<think>\nHmm.\n</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
                 "get_weather\n```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
              false, true, "Hmm.", "", "0:call_x_0:get_weather({\"city\":\"Paris\"});");
    check_fmt(f, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>a<｜tool▁sep｜>{oops}<｜tool▁call▁end｜>"
                 "<｜tool▁calls▁end｜> after", false, true, "",
              "<｜tool▁call▁begin｜>a<｜tool▁sep｜>{oops}<｜tool▁call▁end｜><｜tool▁calls▁end｜> after", "");
    check_fmt(f, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>a<｜tool▁sep｜>{\"q\": 1}", false, true, "", "",
              "0:call_x_0:a({\"q\":1});");
}

TEST(chat_output_harmony_channels_and_calls)
{
    enum chat_fmt f = CHAT_FMT_HARMONY;
    check_fmt(f, "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
                 "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>",
              false, true, "Need the weather.", "", "0:call_x_0:get_weather({\"city\":\"Paris\"});");
    check_fmt(f, "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.",
              false, false, "Easy.", "It is 4.", "");
    check_fmt(f, "<|channel|>final<|message|>Hi<|return|>", false, true, "", "Hi", "");
    /* the recipient before the channel, as the template writes past calls */
    check_fmt(f, "<|start|>assistant to=functions.a<|channel|>commentary json<|message|>{}<|call|>", false, true,
              "", "", "0:call_x_0:a({});");
    check_fmt(f, "<|channel|>commentary to=functions.a <|constrain|>json<|message|>{oops}<|call|>", false, true,
              "", "{oops}", "");
    check_fmt(f, "plain text", false, true, "", "plain text", "");
}

TEST(chat_output_command_r_functionary_firefunction_calls)
{
    check_fmt(CHAT_FMT_COMMAND_R, "I will look it up.\nAction: ```json\n[\n    {\n        \"tool_name\": \"search\",\n"
              "        \"parameters\": {\"q\": \"a\"}\n    },\n    {\"tool_name\": \"b\", \"parameters\": {}}\n]\n```",
              false, true, "", "I will look it up.", "0:call_x_0:search({\"q\":\"a\"});1:call_x_1:b({});");
    check_fmt(CHAT_FMT_COMMAND_R, "<|START_ACTION|>[\n    {\"tool_call_id\": \"0\", \"tool_name\": \"a\", "
              "\"parameters\": {\"x\": 1}}\n]<|END_ACTION|>", false, true, "", "", "0:call_x_0:a({\"x\":1});");
    check_fmt(CHAT_FMT_COMMAND_R, "<|START_THINKING|>I will search.<|END_THINKING|><|START_ACTION|>[{\"tool_call_id\": "
              "\"0\", \"tool_name\": \"a\", \"parameters\": {}}]<|END_ACTION|>", false, true, "I will search.", "",
              "0:call_x_0:a({});");
    check_fmt(CHAT_FMT_COMMAND_R, "Action: nothing to do", false, true, "", "Action: nothing to do", "");
    check_fmt(CHAT_FMT_FUNCTIONARY, "<function=get_weather>{\"city\": \"Paris\"}</function>\n<function=b>{}</function>",
              false, true, "", "", "0:call_x_0:get_weather({\"city\":\"Paris\"});1:call_x_1:b({});");
    check_fmt(CHAT_FMT_FUNCTIONARY, "Text <function=a>{bad}</function>", false, true, "",
              "Text<function=a>{bad}</function>", "");
    check_fmt(CHAT_FMT_FIREFUNCTION, " functools[{\"name\": \"a\", \"arguments\": {\"x\": 1}}, {\"name\": \"b\", "
              "\"arguments\": {}}]", false, true, "", "", "0:call_x_0:a({\"x\":1});1:call_x_1:b({});");
    enum chat_fmt f2 = CHAT_FMT_FUNCTIONARY2;
    check_fmt(f2, "all\nLet me check.>>>get_weather\n{\"city\": \"Paris\"}>>>b\n{}", false, true, "", "Let me check.",
              "0:call_x_0:get_weather({\"city\":\"Paris\"});1:call_x_1:b({});");
    check_fmt(f2, "python\nprint(1)\n>>>all\nDone.", false, true, "", "Done.",
              "0:call_x_0:python({\"code\":\"print(1)\"});");
    check_fmt(f2, "all\nHello!", false, false, "", "Hello!", "");
    check_fmt(f2, "a\n{oops}>>>all\nok", false, true, "", "a\n{oops}ok", "");
    check_fmt(f2, "a\n{}", false, false, "", "a\n{}", "");
    check_fmt(CHAT_FMT_SEED, "<seed:think>Look it up.</seed:think>Checking.\n<seed:tool_call>\n<function=get_weather>\n"
              "<parameter=city>Paris</parameter>\n<parameter=days>3</parameter>\n<parameter=note>two\nlines"
              "</parameter>\n</function>\n</seed:tool_call><seed:tool_call><function=b></function></seed:tool_call>",
              false, true, "Look it up.", "Checking.",
              "0:call_x_0:get_weather({\"city\":\"Paris\",\"days\":3,\"note\":\"two\\nlines\"});1:call_x_1:b({});");
    check_fmt(CHAT_FMT_SEED, "<seed:tool_call><function=a><parameter=x>1</function></seed:tool_call>", false, true,
              "", "<seed:tool_call><function=a><parameter=x>1</function></seed:tool_call>", "");
    check_fmt(CHAT_FMT_FIREFUNCTION, "functools[{\"name\": 1}]", false, true, "", "functools[{\"name\": 1}]", "");
}

TEST(api_stop_strings)
{
    char *stops[] = {"\n\n", "END", "éx"};
    const char *t = "abc EN";
    CHECK_EQ(api_find_stop(t, strlen(t), 0, stops, 3), -1);
    /* "EN" could become "END": hold it back. */
    CHECK_EQ(api_stop_holdback(t, strlen(t), stops, 3), 2);
    t = "abc ENDx";
    CHECK_EQ(api_find_stop(t, strlen(t), 0, stops, 3), 4);
    t = "one\n\ntwo END";
    CHECK_EQ(api_find_stop(t, strlen(t), 0, stops, 3), 3);   /* the earliest one wins */
    CHECK_EQ(api_find_stop(t, strlen(t), 6, stops, 3), 9);
    t = "line\n";
    CHECK_EQ(api_stop_holdback(t, strlen(t), stops, 3), 1);
    t = "caf\xc3";                                             /* first byte of é */
    CHECK_EQ(api_stop_holdback(t, strlen(t), stops, 3), 1);
    t = "nothing";
    CHECK_EQ(api_stop_holdback(t, strlen(t), stops, 3), 0);
    CHECK_EQ(api_stop_holdback("", 0, stops, 3), 0);
}

TEST(api_admin_peer_check)
{
    struct api *a;
    char err[256];
    struct api_opts o = {.model = {.id = "m", .arch = "qwen3moe"}, .admin_uid = 1234,
                         .admin_gid = 4321, .have_admin_gid = true};
    CHECK(api_new(&a, &o, err, sizeof err) == 0);
    struct http_peer p = {.transport = HTTP_TRANSPORT_UNIX, .has_cred = true, .uid = 0, .gid = 0};
    CHECK(api_peer_is_admin(a, &p));                  /* root */
    p.uid = 1234;
    p.gid = 1;
    CHECK(api_peer_is_admin(a, &p));                  /* the daemon's own user */
    p.uid = 5555;
    CHECK(!api_peer_is_admin(a, &p));                 /* someone else */
    p.gid = 4321;
    CHECK(api_peer_is_admin(a, &p));                  /* primary group = admin group */
    p.transport = HTTP_TRANSPORT_TCP;
    p.uid = 0;
    CHECK(!api_peer_is_admin(a, &p));                 /* never over TCP */
    p.transport = HTTP_TRANSPORT_UNIX;
    p.has_cred = false;
    CHECK(!api_peer_is_admin(a, &p));                 /* unknown peer */
    api_free(a);
}

/* The rendered chat (the model's own template), tokenized span by span, equals tokenizing the
 * whole text with special tokens parsed (what llama.cpp does) when the messages hold no
 * special-token text. */
TEST(api_chat_tokens_match_whole_text)
{
    struct gguf_file *g;
    struct moe_tokenizer *t = golden_tokenizer(&g);
    char err[512];
    const char *src = moe_tok_chat_template(t);
    CHECK(src);
    struct chat_template *ct;
    CHECK_MSG(chat_template_new(&ct, src, strlen(src), CHAT_SRC_MODEL, err, sizeof err) == 0, "%s", err);
    json_t *vars = json_pack("{s:[{s:s,s:s},{s:s,s:s}],s:b}", "messages", "role", "system", "content",
                             "You are a helpful assistant.", "role", "user", "content",
                             "Write 3 words about the sea, please!\n\nThanks.", "add_generation_prompt", 1);
    struct chat_rendered r;
    CHECK(chat_render(ct, t, vars, 0, &r, err, sizeof err) == 0);
    int32_t *whole;
    size_t n_whole;
    CHECK(moe_tok_encode(t, r.text, r.len, true, &whole, &n_whole) == 0);
    int32_t spans[512];
    size_t n = 0;
    for (size_t i = 0; i < r.n_spans; i++) {
        if (r.spans[i].id >= 0) {
            spans[n++] = r.spans[i].id;
        } else {
            int32_t *ids;
            size_t k;
            CHECK(moe_tok_encode(t, r.text + r.spans[i].off, r.spans[i].len, false, &ids, &k) == 0);
            CHECK(n + k < 512);
            memcpy(spans + n, ids, k * sizeof *ids);
            n += k;
            free(ids);
        }
    }
    CHECK_EQ(n, n_whole);
    for (size_t i = 0; i < n; i++)
        CHECK_EQ(spans[i], whole[i]);
    free(whole);
    chat_rendered_free(&r);
    json_decref(vars);
    chat_template_free(ct);
    moe_tok_free(t);
    gguf_close(g);
}

/* The example config shipped in systemd/ must load as it is. */
TEST(config_example_file_loads)
{
    struct moed_config c;
    CHECK(config_init(&c) == 0);
    char err[512];
    int rc = config_load_file(&c, "systemd/moed.conf", err, sizeof err);
    CHECK_MSG(rc == 0, "%s", err);
    CHECK(c.model && strstr(c.model, ".gguf"));
    CHECK_STREQ(c.socket, "/run/moed/moed.sock");
    CHECK_STREQ(c.devices, "auto");
    CHECK_EQ(c.ctx, 4096);
    config_free(&c);

    /* Every option the example shows commented out is a real one with a valid value. */
    size_t n;
    char *text = moe_test_read_file_or_fail("systemd/moed.conf", &n);
    char path[512];
    snprintf(path, sizeof path, "%s/all.conf", moe_test_tmpdir());
    FILE *f = fopen(path, "w");
    CHECK(f);
    int uncommented = 0;
    for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
        if (!strncmp(line, "# ", 2) && line[2] >= 'a' && line[2] <= 'z' && strstr(line, " = ")) {
            fprintf(f, "%s\n", line + 2);
            uncommented++;
        } else {
            fprintf(f, "%s\n", line);
        }
    }
    fclose(f);
    free(text);
    CHECK(uncommented >= 10);
    CHECK(config_init(&c) == 0);
    rc = config_load_file(&c, path, err, sizeof err);
    CHECK_MSG(rc == 0, "%s", err);
    CHECK_EQ(c.max_conns, 1024u);
    config_free(&c);
}

TEST(parse_share_accepts_fractions_and_percent)
{
    double v;
    CHECK(moe_parse_share("0.6", &v) == 0 && v == 0.6);
    CHECK(moe_parse_share("60%", &v) == 0 && fabs(v - 0.6) < 1e-12);
    CHECK(moe_parse_share(" 100% ", &v) == 0 && v == 1.0);
    CHECK(moe_parse_share("1", &v) == 0 && v == 1.0);
    CHECK_EQ(moe_parse_share("0", &v), MOE_ERANGE);
    CHECK_EQ(moe_parse_share("101%", &v), MOE_ERANGE);
    CHECK_EQ(moe_parse_share("1.5", &v), MOE_ERANGE);
    CHECK_EQ(moe_parse_share("-0.5", &v), MOE_EFORMAT);
    CHECK_EQ(moe_parse_share("60%%", &v), MOE_EFORMAT);
    CHECK_EQ(moe_parse_share("nan", &v), MOE_EFORMAT);
    CHECK_EQ(moe_parse_share("", &v), MOE_EFORMAT);
}

TEST(config_offload_options)
{
    struct moed_config c;
    bool help;
    char err[512];
    CHECK(config_init(&c) == 0);
    CHECK_EQ(c.cache_slots, 0);
    CHECK(c.expert_residency == 0.0);
    char *argv[] = {"moed", "--model", "m", "--expert-residency", "60%", "--cache-slots", "off",
                    NULL};
    CHECK_MSG(config_parse_args(&c, 7, argv, &help, err, sizeof err) == 0, "%s", err);
    CHECK(fabs(c.expert_residency - 0.6) < 1e-12);
    CHECK_EQ(c.cache_slots, -1);
    config_free(&c);

    CHECK(config_init(&c) == 0);
    char *argv2[] = {"moed", "--model", "m", "--cache-slots", "12", NULL};
    CHECK_MSG(config_parse_args(&c, 5, argv2, &help, err, sizeof err) == 0, "%s", err);
    CHECK_EQ(c.cache_slots, 12);
    config_free(&c);

    CHECK(config_init(&c) == 0);
    CHECK_EQ(c.max_conns, 1024u);
    CHECK_EQ(c.admin_reserve, 16u);
    CHECK_EQ(c.max_write_queue, 4ull << 20);
    CHECK_EQ(c.worker_silent_s, 10u);
    char *argv3[] = {"moed", "--model", "m", "--max-conns", "5", "--max-total-body", "1G",
                     "--worker-stall-timeout", "30", NULL};
    CHECK_MSG(config_parse_args(&c, 9, argv3, &help, err, sizeof err) == 0, "%s", err);
    CHECK_EQ(c.max_conns, 5u);
    CHECK_EQ(c.max_total_body, 1ull << 30);
    CHECK_EQ(c.worker_stall_s, 30u);
    config_free(&c);

    static const char *const bad[][2] = {{"--max-conns", "0"},
                                         {"--max-write-queue", "1k"},
                                         {"--worker-silent-timeout", "0"},
                                         {"--expert-residency", "0"},
                                         {"--expert-residency", "150%"},
                                         {"--expert-residency", "most"},
                                         {"--cache-slots", "-1"},
                                         {"--cache-slots", "0"},
                                         {"--cache-slots", "lots"}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        CHECK(config_init(&c) == 0);
        char *av[] = {"moed", "--model", "m", (char *)bad[i][0], (char *)bad[i][1], NULL};
        CHECK_MSG(config_parse_args(&c, 5, av, &help, err, sizeof err) != 0, "%s %s", bad[i][0],
                  bad[i][1]);
        CHECK_MSG(strstr(err, bad[i][0] + 2), "%s", err);
        config_free(&c);
    }
}
