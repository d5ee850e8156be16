# moed — one Makefile for the whole tree.
#
#   make                 build bin/moed-worker, bin/moectl (and bin/moed when daemon/main.c exists)
#   make test            install missing Debian packages, build, run every test that needs no GPU
#   make test-gpu        build and run the GPU tests (build/tests/moe-gpu-tests; needs a CUDA build
#                        and a GPU, TESTFLAGS='-f NAME -v' passes runner options); CI never runs it
#   make demo            the README's main job: serve the bundled model and answer one request
#   make fuzz            build the libFuzzer targets (clang) into build/fuzz/
#   make V=1             show the commands
#   make SANITIZE=address|undefined
#   make CUDA=auto|0|1   build worker/cuda/*.cu with nvcc (auto: when nvcc is found)
#   make O=DIR           put build/ and bin/ under DIR (lets several builds share one tree)

O        ?= .
BUILD    := $(O)/build
BINDIR   := $(O)/bin
CC       ?= cc
CUDA     ?= auto
CUDA_HOME ?= /usr/local/cuda
CUDA_ARCH ?= -gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90

ifeq ($(V),1)
Q :=
else
Q := @
endif

CPPFLAGS += -I. -I$(BUILD) -D_GNU_SOURCE
CFLAGS   ?= -O2 -g
CFLAGS   += -std=c11 -Wall -Wextra -Werror -pthread -MMD -MP -fno-strict-aliasing
LDLIBS   += -luv -lprotobuf-c -llmdb -lhttp_parser -ljansson -lpcre2-8 -lxxhash -lsystemd -lm -lpthread

ifneq ($(SANITIZE),)
CFLAGS  += -fsanitize=$(SANITIZE) -fno-omit-frame-pointer -fno-sanitize-recover=all
LDFLAGS += -fsanitize=$(SANITIZE)
endif

# CUDA: auto-detect nvcc.
NVCC := $(or $(shell command -v nvcc 2>/dev/null),$(wildcard $(CUDA_HOME)/bin/nvcc))
ifeq ($(CUDA),0)
NVCC :=
endif
ifeq ($(CUDA),1)
ifeq ($(NVCC),)
$(error CUDA=1 but nvcc was not found (looked on PATH and in $(CUDA_HOME)/bin))
endif
endif
# Only what computes gets the CUDA flags: worker/ objects, the programs linking libmoeworker
# (moed-worker, moectl, the test binaries, bench programs) and the GPU tests. The daemon and the
# store never see MOE_HAVE_CUDA nor the CUDA runtime (see the target-specific lines further down).
CUDA_SRC := $(wildcard worker/cuda/*.cu)
ifneq ($(and $(NVCC),$(CUDA_SRC)),)
CUDA_CPPFLAGS := -DMOE_HAVE_CUDA=1 -I$(CUDA_HOME)/include
CUDA_OBJ := $(CUDA_SRC:%.cu=$(BUILD)/%.o)
# The CUDA runtime is linked statically, so the programs start (and fall back to the CPU) on
# machines without the CUDA libraries on the loader path.
CUDA_LDLIBS := -L$(CUDA_HOME)/lib64 -lcudart_static -ldl -lrt -lstdc++
NVCCFLAGS ?= -O3 -lineinfo
NVCCFLAGS += $(CUDA_ARCH) -std=c++17 -Xcompiler -Wall,-Werror -I. -I$(BUILD) -MMD -MP
endif

# Sources are found by folder, so adding a file never means editing this Makefile.
PROTO_FILES := $(wildcard proto/*.proto)
PROTO_GEN_C := $(PROTO_FILES:%.proto=$(BUILD)/%.pb-c.c)
PROTO_GEN_H := $(PROTO_FILES:%.proto=$(BUILD)/%.pb-c.h)

STORE_SRC  := $(wildcard store/*.c) $(wildcard proto/*.c)
WORKER_SRC := $(filter-out worker/main.c,$(wildcard worker/*.c worker/cpu/*.c))
DAEMON_SRC := $(filter-out daemon/main.c,$(wildcard daemon/*.c))
CLI_SRC    := $(wildcard cli/*.c)
TEST_SRC   := $(wildcard tests/test_*.c) tests/harness.c
# Host-only checks of the CUDA code (its __host__ __device__ parts), built when nvcc is.
TEST_CU_SRC := $(if $(CUDA_OBJ),$(wildcard tests/test_*.cu))
FUZZ_SRC   := $(wildcard tests/fuzz_*.c)
BENCH_SRC  := $(wildcard bench/*.c)
# GPU tests need a GPU to run, so `make test` never runs them; they are built whenever the CUDA
# objects are, so that CI compiles them.
GPU_TEST_SRC := $(if $(CUDA_OBJ),$(wildcard tests/gpu/test_*.c) tests/harness.c)

STORE_OBJ  := $(STORE_SRC:%.c=$(BUILD)/%.o) $(PROTO_GEN_C:%.c=%.o)
WORKER_OBJ := $(WORKER_SRC:%.c=$(BUILD)/%.o) $(CUDA_OBJ)
DAEMON_OBJ := $(DAEMON_SRC:%.c=$(BUILD)/%.o)
CLI_OBJ    := $(CLI_SRC:%.c=$(BUILD)/%.o)
TEST_OBJ   := $(TEST_SRC:%.c=$(BUILD)/%.o) $(TEST_CU_SRC:%.cu=$(BUILD)/%.o)
GPU_TEST_OBJ := $(GPU_TEST_SRC:%.c=$(BUILD)/%.o)
BENCH_OBJ  := $(BENCH_SRC:%.c=$(BUILD)/%.o)
BENCH_BINS := $(BENCH_SRC:bench/%.c=$(BUILD)/bench/%)
# CUDA micro-benchmarks with kernels of their own (bench/*.cu), built when nvcc is.
BENCH_CU_SRC  := $(if $(CUDA_OBJ),$(wildcard bench/*.cu))
BENCH_CU_BINS := $(BENCH_CU_SRC:bench/%.cu=$(BUILD)/bench/%)

LIBSTORE  := $(BUILD)/libmoestore.a
LIBWORKER := $(BUILD)/libmoeworker.a
LIBDAEMON := $(BUILD)/libmoedaemon.a

PROGRAMS := $(BINDIR)/moed-worker $(BINDIR)/moectl
ifneq ($(wildcard daemon/main.c),)
PROGRAMS += $(BINDIR)/moed
endif
TEST_BIN := $(BUILD)/tests/moe-tests
GPU_TEST_BIN := $(if $(GPU_TEST_OBJ),$(BUILD)/tests/moe-gpu-tests)

.PHONY: all test test-build test-gpu demo deps fuzz clean bench install
all: $(PROGRAMS) $(GPU_TEST_BIN) $(BENCH_BINS) $(BENCH_CU_BINS)

# Generated protobuf-c code lives in build/, never in git. Keep it even when a build fails.
.SECONDARY: $(PROTO_GEN_C) $(PROTO_GEN_H)
$(BUILD)/proto/%.pb-c.c $(BUILD)/proto/%.pb-c.h: proto/%.proto
	@mkdir -p $(BUILD)
	@echo "  PROTOC  $<"
	$(Q)protoc-c --c_out=$(BUILD) $<

ALL_OBJ := $(STORE_OBJ) $(WORKER_OBJ) $(DAEMON_OBJ) $(CLI_OBJ) $(TEST_OBJ) $(GPU_TEST_OBJ) \
           $(BENCH_OBJ) $(BUILD)/worker/main.o $(BUILD)/daemon/main.o

$(BUILD)/%.o: %.c | $(PROTO_GEN_H)
	@mkdir -p $(dir $@)
	@echo "  CC      $<"
	$(Q)$(CC) $(CPPFLAGS) $(CFLAGS) -c -o $@ $<

$(BUILD)/proto/%.pb-c.o: $(BUILD)/proto/%.pb-c.c
	@echo "  CC      $<"
	$(Q)$(CC) $(CPPFLAGS) $(filter-out -Werror,$(CFLAGS)) -c -o $@ $<

$(BUILD)/%.o: %.cu | $(PROTO_GEN_H)
	@mkdir -p $(dir $@)
	@echo "  NVCC    $<"
	$(Q)$(NVCC) $(CPPFLAGS) $(NVCCFLAGS) -c -o $@ $<

# CUDA flags, target by target (empty without a CUDA build). Objects only: a target-specific
# variable on a program would be inherited by the store and daemon objects it depends on.
$(WORKER_OBJ) $(BUILD)/worker/main.o $(CLI_OBJ) $(BENCH_OBJ) $(filter $(BUILD)/tests/gpu/%,$(GPU_TEST_OBJ)): \
    CPPFLAGS += $(CUDA_CPPFLAGS)
$(BINDIR)/moed-worker $(BINDIR)/moectl $(TEST_BIN) $(GPU_TEST_BIN) $(BENCH_BINS): LDLIBS += $(CUDA_LDLIBS)

$(LIBSTORE): $(STORE_OBJ)
$(LIBWORKER): $(WORKER_OBJ)
$(LIBDAEMON): $(DAEMON_OBJ)
$(LIBSTORE) $(LIBWORKER) $(LIBDAEMON):
	@mkdir -p $(dir $@)
	@echo "  AR      $@"
	$(Q)rm -f $@ && ar rcs $@ $^

$(BINDIR)/moed-worker: $(BUILD)/worker/main.o $(LIBWORKER) $(LIBSTORE)
$(BINDIR)/moectl: $(CLI_OBJ) $(LIBWORKER) $(LIBSTORE)
$(BINDIR)/moectl: LDLIBS += -ledit
$(BINDIR)/moed: $(BUILD)/daemon/main.o $(LIBDAEMON) $(LIBSTORE)
$(TEST_BIN): $(TEST_OBJ) $(LIBDAEMON) $(LIBWORKER) $(LIBSTORE)
$(GPU_TEST_BIN): $(GPU_TEST_OBJ) $(LIBWORKER) $(LIBSTORE)
$(BENCH_BINS): $(BUILD)/bench/%: $(BUILD)/bench/%.o $(LIBWORKER) $(LIBSTORE)
$(PROGRAMS) $(TEST_BIN) $(GPU_TEST_BIN) $(BENCH_BINS):
	@mkdir -p $(dir $@)
	@echo "  LD      $@"
	$(Q)$(CC) $(LDFLAGS) $(CFLAGS) -o $@ $(filter %.o,$^) -Wl,--start-group $(filter %.a,$^) -Wl,--end-group $(LDLIBS)

$(BENCH_CU_BINS): $(BUILD)/bench/%: $(BUILD)/bench/%.o
	@mkdir -p $(dir $@)
	@echo "  LD      $@"
	$(Q)$(CC) $(LDFLAGS) -o $@ $< $(CUDA_LDLIBS) -lpthread

deps:
	$(Q)scripts/deps.sh

test-build: all $(TEST_BIN)

test: deps
	$(Q)$(MAKE) --no-print-directory test-build
	$(Q)MOE_BIN=$(BINDIR) MOE_TEST_BIN=$(TEST_BIN) tests/run.sh

# The GPU tests, with the runner's usual conventions: all tests, one at a time unless
# MOE_TEST_JOBS=N, "N passed, N failed" at the end, MOE_BIN pointing at the programs. Then the
# engine and parity tests of `make test` again with MOE_TEST_DEVICE=cuda:0 (same thresholds).
test-gpu:
ifeq ($(GPU_TEST_BIN),)
	@echo "make test-gpu: CUDA is not built (nvcc not found, CUDA=0, or no worker/cuda/*.cu): no GPU tests to run" >&2
	@exit 1
else
	$(Q)$(MAKE) --no-print-directory all $(TEST_BIN)
	$(Q)MOE_BIN=$(BINDIR) $(GPU_TEST_BIN) $(TESTFLAGS); a=$$?; \
	MOE_TEST_DEVICE=cuda:0 MOE_BIN=$(BINDIR) $(TEST_BIN) -f parity -f engine $(TESTFLAGS); b=$$?; \
	test $$a = 0 && test $$b = 0
endif

demo: deps
	$(Q)$(MAKE) --no-print-directory all
	$(Q)MOE_BIN=$(BINDIR) scripts/demo.sh

# libFuzzer targets: clang with -fsanitize=fuzzer,address, linked against sanitized store objects
# (and the daemon's Jinja renderer, which depends on nothing else of the daemon).
FUZZ_BUILD := $(O)/build/fuzz
FUZZ_BINS  := $(FUZZ_SRC:tests/%.c=$(FUZZ_BUILD)/%)
FUZZ_DAEMON_SRC := $(wildcard daemon/jinja*.c)
# fuzz_api drives the API itself: it also links the chat layer, the scheduler and the log (the
# HTTP connection and the worker are played by the target).
FUZZ_API_SRC := daemon/api.c daemon/chat.c daemon/sched.c daemon/log.c
$(FUZZ_BUILD)/fuzz_api: FUZZ_DAEMON_SRC += $(FUZZ_API_SRC)
$(FUZZ_BUILD)/fuzz_api: $(FUZZ_API_SRC)
fuzz: $(FUZZ_BINS)
$(FUZZ_BUILD)/%: tests/%.c $(STORE_SRC) $(FUZZ_DAEMON_SRC) | $(PROTO_GEN_H)
	@mkdir -p $(dir $@)
	@echo "  FUZZ    $@"
	$(Q)clang $(CPPFLAGS) -std=c11 -O1 -g -fsanitize=fuzzer,address,undefined -o $@ $< $(STORE_SRC) $(FUZZ_DAEMON_SRC) $(PROTO_GEN_C) $(LDLIBS)

bench: all $(BENCH_BINS)

# make install [PREFIX=/usr/local] [DESTDIR=...]: programs, the systemd unit and its sysusers and
# tmpfiles snippets, an example config (kept if one exists), docs. See docs/operations.md.
PREFIX ?= /usr/local
SYSCONFDIR ?= /etc
install: all
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(SYSCONFDIR)/systemd/system \
		$(DESTDIR)$(SYSCONFDIR)/sysusers.d $(DESTDIR)$(SYSCONFDIR)/tmpfiles.d \
		$(DESTDIR)$(SYSCONFDIR)/moed $(DESTDIR)$(PREFIX)/share/doc/moed
	install -m 0755 $(PROGRAMS) $(DESTDIR)$(PREFIX)/bin/
	sed 's|/usr/local/|$(PREFIX)/|g' systemd/moed.service > $(DESTDIR)$(SYSCONFDIR)/systemd/system/moed.service
	install -m 0644 systemd/moed.sysusers $(DESTDIR)$(SYSCONFDIR)/sysusers.d/moed.conf
	install -m 0644 systemd/moed.tmpfiles $(DESTDIR)$(SYSCONFDIR)/tmpfiles.d/moed.conf
	test -e $(DESTDIR)$(SYSCONFDIR)/moed/moed.conf || install -m 0644 systemd/moed.conf $(DESTDIR)$(SYSCONFDIR)/moed/moed.conf
	install -m 0644 README.md docs/*.md $(DESTDIR)$(PREFIX)/share/doc/moed/

clean:
	rm -rf $(BUILD) $(BINDIR)

-include $(ALL_OBJ:.o=.d)
