# Basalt: `make run` starts the embedded default cluster, `make test` runs
# every test. Both install what they need (Go modules come from the proxy).
GO ?= go
BIN := bin/basalt

.PHONY: all build run test test-fault test-hadoop vet bench-raft clean

all: build

build:
	$(GO) build -o $(BIN) ./cmd/basalt

run: build
	./$(BIN) dev

vet:
	$(GO) vet ./...

test: vet
	$(GO) test -count=1 -timeout 20m ./...
	$(GO) test -count=1 -race -timeout 10m ./internal/raft/...

# Hadoop 3.4's own client (FsShell, a 300 MiB put/get) and FileSystem
# contract tests against the WebHDFS gateway of a fresh basalt dev (Java 17
# + Maven; artifacts cached in ~/.m2). Results: docs/WEBHDFS.md.
test-hadoop:
	GO=$(GO) BIN=$(BIN) ./scripts/test-hadoop.sh

# Issue 11's multi-process fault test (3 meta + 5 datanode processes on
# loopback, kill -9 / SIGSTOP / disk full during writes; ~4 minutes; root
# for the disk-full fault). Skipped by `make test`. Replay a run with
# BASALT_FAULT_SEED=<seed printed>; BASALT_BIN=<binary> tests that binary.
test-fault:
	BASALT_FAULT_TEST=1 $(GO) test -count=1 -v -run '^TestFault$$' -timeout 12m ./internal/faulttest/

bench-raft:
	$(GO) test -run '^$$' -bench BenchmarkCommit -benchtime 4s -timeout 20m ./internal/raft/

clean:
	rm -rf bin

# V1 vs V2 write throughput on network namespaces with capped links, then on
# loopback (root; ~4 minutes; knobs: RATE, KEYS, SIZE, THREADS, OUT).
.PHONY: bench-net
bench-net:
	GO=$(GO) BIN=$(BIN) ./scripts/bench-net.sh

# Deterministic simulation (internal/sim) over SEEDS random seeds; every
# failing seed prints the one command that replays it.
SEEDS ?= 20
.PHONY: simulate
simulate:
	$(GO) test -count=1 -timeout 0 -run '^TestSimRandom$$' ./internal/sim -seeds=$(SEEDS)

# Issue 12's gray-failure test (3 meta + 5 datanode processes on loopback;
# the meta leader SIGSTOPped 20 s, then a datanode 30 s, under small-key
# writes; bounds the longest gap without a successful write and requires
# no failure after SIGCONT; about 2 minutes). Skipped by `make test`.
.PHONY: test-gray
test-gray:
	BASALT_GRAY_TEST=1 $(GO) test -count=1 -v -run '^TestGrayFailures$$' -timeout 8m ./internal/faulttest/

# The zoned backend on a real zonefs: a QEMU guest (software emulation)
# with zoned null_blk devices formatted by scripts/vm/mkzonefs runs the
# backend's tests and a 3-datanode `basalt dev --zoned=<mounts>` (put, get,
# restart, get). Kernel, busybox and binaries are fetched or built into
# ~/.cache/basalt-vm (BASALT_VM_CACHE), never into the repo; ~2-4 minutes
# once cached. Results: docs/ZONED.md.
.PHONY: test-zoned-vm test-zoned
test-zoned-vm:
	GO=$(GO) ./scripts/test-zoned-vm.sh
test-zoned: test-zoned-vm

# The cache tier on real DAX persistent memory: a QEMU guest (software
# emulation) with an emulated NVDIMM turned into an fsdax namespace and
# mounted with -o dax runs the cache tier's and the cluster's cache tests
# there and a `basalt dev --cache-dir` on it (directive, cached read,
# restart, still cached), then boots again on the same NVDIMM (still
# cached after a power-off). Not in .ci/run (about 10-20 minutes under
# TCG). Kernel and binaries in ~/.cache/basalt-vm. Results: docs/CACHE.md.
.PHONY: test-pmem
test-pmem:
	GO=$(GO) ./scripts/test-pmem.sh

# Zoned vs posix throughput (1 and 8 streams, medians of 3) on the disk of
# BENCH_DIR, and the cleaner's write amplification. Results:
# docs/BENCHMARKS.md, "Zoned backend".
BENCH_DIR ?= /tmp/basalt-zoned-bench
.PHONY: bench-zoned
bench-zoned:
	mkdir -p $(BENCH_DIR)
	BASALT_ZONED_BENCH=$(BENCH_DIR) $(GO) test -count=1 -run '^TestBenchmarkBackends$$' -v -timeout 60m ./internal/storage/zoned/

# Seed 001 reproduced: 1 pipeline per datanode against many, 6 datanodes ×
# 12 modelled HDDs (vfs.LatencyFS; one slow, stalling disk per datanode),
# many 4-64 KiB objects and a few 8 MiB ones; prints the share of writes
# under 200 ms per config (~2 minutes per run). Knobs: MR_RUNS, MR_DURATION,
# MR_MANY, MR_CONFIGS and the others in internal/cluster/multiraft_bench_test.go.
# Results: docs/BENCHMARKS.md, "Multi-raft on slow log disks".
.PHONY: bench-multiraft
bench-multiraft:
	BASALT_BENCH_MULTIRAFT=1 $(GO) test -count=1 -run '^TestBenchMultiRaft$$' -v -timeout 60m ./internal/cluster/
