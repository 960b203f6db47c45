# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Both build the virtualenv first, from a lock: every environment the Makefile builds (the
# main test venv, the benchmarks' extras, the verl and torchtitan venvs) installs exactly
# the versions in locks/*.txt, synced by uv (which removes what the lock does not list).
# `make lock` refreshes the locks; `make test-latest` runs the suite on the newest releases
# to report drift (not in CI). The package's own dependencies stay ranges (pyproject.toml).
#
# torch is the CPU build (torch==2.13.0+cpu in the locks). uv finds it through pip's
# find-links on this machine kind (FIND_LINKS), or through TORCH_INDEX, a CPU wheel index
# (e.g. TORCH_INDEX=https://download.pytorch.org/whl/cpu) where the default index would
# serve a CUDA build.

SHELL       := /bin/bash
# Python may keep the bytecode it compiles (__pycache__/, ignored by git) even where the
# machine says not to: every writer, torchrun worker and command the tests start would
# otherwise compile torch and the package from source again (1.4 s more per process).
unexport PYTHONDONTWRITEBYTECODE
PYTHON      ?= python3
VENV        ?= .venv
BIN         := $(VENV)/bin
TORCH_SPEC  ?= torch==2.13.0
TORCH_INDEX ?=
PYTEST_ARGS ?=
# uv resolves (make lock) and installs (uv pip sync: exactly the lock, nothing else, in
# seconds from its cache); it lives in a venv of its own so that no sync removes it.
UV_VERSION  ?= 0.13.9
UV_VENV     ?= .venv-uv
UV          := $(UV_VENV)/bin/uv
FIND_LINKS  ?= $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null)
UV_SOURCES  := $(foreach d,$(FIND_LINKS),--find-links $(d)) \
               $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX) --index-strategy unsafe-best-match)
LOCKS       := locks
# verl's tests and benchmark run in a venv of their own (verl pins transformers < 5.11),
# resolved as a whole (its lock holds torch and everything it imports; it sees nothing of
# the main venv).
VERL_VENV   ?= $(VENV)-verl
VERL_SPEC   ?= verl==0.9.1
# torchtitan's test runs in a venv of its own in the same way (its pins: spmd_types==0.2.3).
TITAN_VENV  ?= $(VENV)-titan
TITAN_SPEC  ?= torchtitan==0.3.0
# The frameworks' integrations (HF Trainer, Accelerate, PEFT, Lightning; torchtune apart:
# it pins a torchao < 0.16 that peft refuses) are tested in venvs of their own, from their
# own locks.
FRAMEWORKS_VENV ?= $(VENV)-frameworks
TORCHTUNE_VENV  ?= $(VENV)-torchtune
# make test-latest: the newest releases (torch stays LATEST_TORCH, a CPU build)
LATEST      ?= .venv-latest
LATEST_TORCH ?= $(TORCH_SPEC)

.PHONY: lint setup bench-setup lock test-latest verl-setup titan-setup frameworks-setup torchtune-setup test-frameworks bench-frameworks test-dcp-upstream bench-memory-tier torture-memory test test-fast test-verl bench-verl bench-codecs demo fsdp-demo bench bench-full bench-fence bench-export bench-gpu bench-memory bench-incremental bench-dedup-trust torture corruption soak fuzz-protocol torture-multinode multinode-demo bench-commit bench-scale clean bench-load bench-stage bench-dcp bench-s3 torture-s3 bench-70b bench-writer-cpu

setup: $(UV)
	$(call sync_venv,$(VENV),$(LOCKS)/test.txt)

# The main venv with the benchmarks' extras too (their lock is the test lock plus them).
bench-setup: $(UV)
	$(call sync_venv,$(VENV),$(LOCKS)/bench.txt)

$(UV):
	test -x $(UV_VENV)/bin/python || $(PYTHON) -m venv $(UV_VENV)
	$(UV_VENV)/bin/pip install -q "uv==$(UV_VERSION)"

# A venv synced to a lock: $(1) the venv, $(2) the lock. asyncckpt itself comes editable
# (locks/project.txt), built in isolation by the setuptools of locks/build.txt. A venv made
# by an older Makefile saw the main venv through a .pth file: that file goes.
define sync_venv
	test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	rm -f $(1)/lib/python*/site-packages/zz-asyncckpt-base.pth
	$(UV) pip sync -q --python $(1)/bin/python $(UV_SOURCES) --build-constraints $(LOCKS)/build.txt \
	  $(2) $(LOCKS)/project.txt
	touch $(1)/.installed
endef

# $(1) the lock to write, $(2) what it holds (extras of pyproject.toml and other flags),
# $(3) the directory of the torch pin. --upgrade: the newest releases within the ranges.
define compile_lock
	$(UV) pip compile -q --upgrade --python-version 3.11 $(UV_SOURCES) \
	  --custom-compile-command "make lock" pyproject.toml $(3)/torch.in $(2) -o $(1)
endef

# A package installed without its dependencies (its full requirements pull wandb, hydra,
# tensorboard, ... that none of the modules the tests import need): appended to its lock.
define append_no_deps
	printf '%s\n' "" "# installed without its dependencies (its extra above is what it imports)" "$(2)" >> $(1)
endef

BENCH_EXTRAS := --extra test --extra lint --extra s3 --extra bench --extra realweights --extra dcpbench \
                --extra s3bench --extra incremental

# $(1) the output directory, $(2) the directory of the torch pin
define write_locks
	printf '%s\n' "setuptools>=64" | $(UV) pip compile -q --upgrade --python-version 3.11 \
	  --custom-compile-command "make lock" - -o $(1)/build.txt
	$(call compile_lock,$(1)/test.txt,--extra test --extra lint,$(2))
	$(call compile_lock,$(1)/bench.txt,$(BENCH_EXTRAS) -c $(1)/test.txt,$(2))
	$(call compile_lock,$(1)/verl.txt,--extra verl,$(2))
	$(call append_no_deps,$(1)/verl.txt,$(VERL_SPEC))
	$(call compile_lock,$(1)/titan.txt,--extra torchtitan,$(2))
	$(call append_no_deps,$(1)/titan.txt,$(TITAN_SPEC))
	$(call compile_lock,$(1)/frameworks.txt,--extra frameworks,$(2))
	$(call compile_lock,$(1)/torchtune.txt,--extra torchtune-env,$(2))
endef

# Refresh every lock from pyproject.toml's ranges (then run `make test` and commit them).
lock: $(UV)
	printf '%s\n' "# torch as the tests run it: the CPU build (TORCH_SPEC in the Makefile)" "$(TORCH_SPEC)" > $(LOCKS)/torch.in
	$(call write_locks,$(LOCKS),$(LOCKS))

# The suite against the newest releases (fresh locks in $(LATEST)-locks, venvs $(LATEST)*),
# after a list of every pin that moved: a report of drift, not part of CI.
test-latest: $(UV)
	rm -rf $(LATEST)-locks && mkdir -p $(LATEST)-locks
	printf '%s\n' "$(LATEST_TORCH)" > $(LATEST)-locks/torch.in
	$(call write_locks,$(LATEST)-locks,$(LATEST)-locks)
	for f in test verl titan; do echo "== $$f: locked (<) -> newest (>)"; \
	  diff <(grep -E '^[A-Za-z0-9]' $(LOCKS)/$$f.txt) <(grep -E '^[A-Za-z0-9]' $(LATEST)-locks/$$f.txt) \
	  | grep '^[<>]' || echo "   no pin moved"; done
	$(call sync_venv,$(LATEST),$(LATEST)-locks/test.txt)
	$(call sync_venv,$(LATEST)-verl,$(LATEST)-locks/verl.txt)
	$(call sync_venv,$(LATEST)-titan,$(LATEST)-locks/titan.txt)
	ASYNCCKPT_UNLOCKED=1 ASYNCCKPT_VERL_PYTHON=$(CURDIR)/$(LATEST)-verl/bin/python \
	ASYNCCKPT_TITAN_PYTHON=$(CURDIR)/$(LATEST)-titan/bin/python \
	  $(LATEST)/bin/python -m pytest -q $(PYTEST_ARGS)

# ruff (pyproject's rules and line length) and mypy (pyproject's config) on the package.
lint: setup
	$(BIN)/ruff check asyncckpt tests benchmarks examples scripts
	$(BIN)/mypy

test: setup verl-setup titan-setup frameworks-setup torchtune-setup
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# The tests that start no process (no writer, torchrun or subprocess): a test is in the
# `process` tier by its mark, a `@process_fixture` it uses, or its folder (tests/tiers.py).
test-fast: setup
	$(BIN)/python -m pytest -q -m "not process" $(PYTEST_ARGS)

demo: setup
	$(BIN)/python examples/demo.py

# Side-by-side benchmark against torch.save, safetensors and DCP, with the machine's limits.
bench: bench-setup
	$(BIN)/python -m benchmarks --quick

bench-full: bench-setup
	$(BIN)/python -m benchmarks --full
	$(BIN)/python -m benchmarks.readme_table

# Cold verified load per codec (and into=) vs safetensors.load_file and a cold read, 1 GiB
# transformer state (564 tensors) then 4 large tensors; medians of 5 interleaved.
bench-load: setup
	$(BIN)/python -m benchmarks.loadspeed --mib 1024 --state synthetic --reps 5
	$(BIN)/python -m benchmarks.loadspeed --mib 1024 --state large --reps 5 --codecs raw,zstd

# Export: peak memory of a 1 GiB sharded checkpoint, then time against a plain cold
# read + write + fsync of a 2 GiB one (with --jobs 2).
bench-export: setup
	$(BIN)/python -m benchmarks.export_memory --model-gib 1 --ranks 2
	$(BIN)/python -m benchmarks.export_speed --gib 2 --tensors 32 --reps 3

# One rank of a 512-rank Llama-70B job (real shapes, bf16 + fp32 master + Adam), measured,
# then projected to the whole job on 1, 8 and 64 hosts (benchmarks/results/llama70b.md).
bench-70b: setup
	$(BIN)/python -m benchmarks.llama70b --world 512 --reps 3

# Blocked time per save in a training loop, with and without the optimizer fence.
bench-fence: setup
	$(BIN)/python -m benchmarks.fence --params-mib 256 --saves 5 --batches 512,16

# Float compression: byte-plane codec candidates vs ZipNN on MiniLM weights and Adam moments.
bench-codecs: bench-setup
	$(BIN)/python -m benchmarks.codecs --reps 5

# Incremental saves of a PEFT LoRA and a full fine-tune (CPU, a Llama built from a config):
# bytes written and referenced, time to durable per save, next to full saves and DCP save.
bench-incremental: bench-setup
	$(BIN)/python -m benchmarks.incremental --hidden 1024 --layers 8 --saves 6 \
	  --out benchmarks/results/incremental.md

# Referenced bytes verified at every save vs trusted for dedup_trust_s (writer/dedup_trust.py).
bench-dedup-trust: setup
	$(BIN)/python -m benchmarks.dedup_trust --gib 1 --saves 6 --repeats 3

# On a CUDA machine: the CUDA staging tests, then D2H throughput and blocked time vs DCP.
bench-gpu: setup
	$(BIN)/python -m pytest -q -rs tests/rank/test_cuda_staging.py
	$(BIN)/python -m benchmarks.gpu --gib 2 --reps 3

# FSDP2 on 2 CPU ranks: Checkpointer with fence, SIGKILL at step 35, rerun, exact resume.
fsdp-demo: setup
	rm -rf fsdp-ckpt fsdp-ckpt.*
	-OMP_NUM_THREADS=1 $(BIN)/torchrun --nproc_per_node 2 examples/train_fsdp.py --dir fsdp-ckpt
	OMP_NUM_THREADS=1 $(BIN)/torchrun --nproc_per_node 2 examples/train_fsdp.py --dir fsdp-ckpt

# kill -9 a random process of a saving job 300 times; check every checkpoint after each.
torture: setup titan-setup
	$(BIN)/python scripts/faults/torture.py --kills 300 --ranks 3
	TIMELINE_TORTURE_SEEDS=50 $(BIN)/python -m pytest -q tests/faults/test_timeline_faults.py -k checkpointer
	VERL_TIMELINE_SEEDS=20 DCP_TIMELINE_SEEDS=50 TITAN_TIMELINE_SEEDS=10 $(BIN)/python -m pytest -q \
	  tests/faults/test_verl_timeline.py tests/faults/test_dcp_timeline_faults.py \
	  tests/integrations/test_torchtitan.py -k never_resumes

# The same torture on an object-store root (SeaweedFS on loopback), the S3 server among the
# victims; the local-file attacks are left out there (tests/faults/test_s3_faults.py flips
# bytes in stored objects).
torture-s3: setup
	$(BIN)/python scripts/faults/torture.py --s3 --kills 100 --ranks 3

# The memory tier: step time with no checkpointing, a memory save every step and a durable
# save every step (demo MLP, 1 rank, at a 16 ms and a 162 ms step); at 2 nodes x 2 ranks the
# same on shared CPUs and pinned (ranks and writers on CPUs of their own), the writers'
# memory against the node's shard, and the node-loss recovery times; then the replica
# transport's loopback throughput and the replacement-node test at its long size.
bench-memory-tier: setup
	$(BIN)/python -m benchmarks.memory_tier --steps 60 --batch 32
	$(BIN)/python -m benchmarks.memory_recovery --steps 40 --batch 256 --pin
	$(BIN)/python -m benchmarks.memory_tier --steps 60 --batch 2048
	$(BIN)/python -m benchmarks.replica_transport --mib 256 --chunk-mib 1
	ASYNCCKPT_MEMORY_LONG=1 $(BIN)/python -m pytest -q tests/multiprocess/test_memory_tier_nodes.py

# 2 simulated nodes x 2 ranks, every step to memory (durable every 5th): 100 kills of a
# whole node (ranks and writer), every restore compared bit for bit with what was saved;
# then 3 nodes x 1 rank (replicas round the ring), 20 kills.
torture-memory: setup
	$(BIN)/python -m benchmarks.memory_torture --kills 100
	$(BIN)/python -m benchmarks.memory_torture --nodes 3 --per-node 1 --kills 20

# 1,000 random damages to committed checkpoints; verify and load must catch every one.
corruption: setup
	$(BIN)/python scripts/faults/corruption.py --cases 1000

# 4 ranks x 500 consecutive saves with keep_last=3: no growth in memory, fds or shm.
soak: setup
	$(BIN)/python scripts/faults/soak.py --ranks 4 --saves 500

# 2 simulated nodes x 2 ranks: 100 random kill -9 (a rank, a node's writer, a whole node), keep_last=3.
torture-multinode: setup
	$(BIN)/python scripts/faults/torture_multinode.py --kills 100

# examples/train_fsdp.py as 2 simulated nodes: node 1 dies at step 35, both restart, exact resume.
multinode-demo: setup
	rm -rf multinode-ckpt multinode-ckpt.*
	$(BIN)/python tests/multiprocess/multinode.py demo --dir multinode-ckpt

# Commit latency (last rank staged -> committed): 2 nodes x 2 ranks next to 1 node x 4 ranks.
bench-commit: setup
	$(BIN)/python -m benchmarks.commit_latency --saves 15 --kib 256

# The several-node commit simulated at 8 to 256 nodes x 8 ranks (threads with the real
# coordination and TCPStore, real part files, gather and publish; 1000 tensors per rank),
# then a node and the leader's writer killed mid-save (results/scale.md).
bench-scale: setup
	$(BIN)/python -m benchmarks.scale --nodes 8,64,256,1000 --per-node 8 --tensors 1000 --saves 3 \
		--saves-from-1000 3 --procs 1,4 --kill node,leader-writer --kill-nodes 256 \
		--out benchmarks/results/scale.md

# A misbehaving authenticated rank sends 10,000+ random messages next to two ordinary
# ranks saving for real: writer alive, every save committed and verifying, no growth.
fuzz-protocol: setup
	$(BIN)/python scripts/faults/fuzz_protocol.py --seed 1 --messages 10000 --steps 8

# Staging vs a one-thread memcpy and DCP's reused stager, time to durable vs write + fsync,
# page-cache growth per codec (1 GiB state, interleaved medians; `--gib 4` for the large case).
bench-stage: setup
	$(BIN)/python -m benchmarks.stagespeed --gib 1 --reps 5

# asyncckpt's DCP StorageWriter (dcp.save, dcp.async_save) next to DCP's FileSystemWriter
# (sync, async default stager, async reused shared-memory stager) and torch-checkpointing,
# 1 and 4 GiB, with memcpy and write+fsync limits of the same run (results/dcp.md + .json);
# then a warm resharded FSDP2 load next to torch-checkpointing's (results/warm_load.md).
# The writer's CPU per tiny save (2 ranks, 3 MiB): what competes with training on small
# states, by thread with --threads, profiled with --profile.
bench-writer-cpu: setup
	$(BIN)/python -m benchmarks.writer_cpu --repeats 3 --saves 150

bench-dcp: bench-setup
	$(BIN)/python -m benchmarks.dcp --gib 1,4 --fsdp2-gib 1 --reps 3 --out benchmarks/results/dcp.md
	$(BIN)/python -m benchmarks.warm_load --reps 5 --out benchmarks/results/warm_load.md

# An object-store root against SeaweedFS on loopback: time to durable and cold load of a
# 1 GiB state next to a plain multipart upload / ranged download of the same bytes and to
# s3torchconnector's DCP writer and reader; then the S3 client comparison.
bench-s3: bench-setup
	$(BIN)/python -m benchmarks.s3 --gib 1 --reps 3 --out benchmarks/results/s3
	$(BIN)/python -m benchmarks.s3_clients --mib 256 --reps 3 --out benchmarks/results/s3_clients.md

# Writer private memory while a 4 GiB state streams through a 256 MiB ring.
bench-memory: setup
	$(BIN)/python -m benchmarks.writer_memory --state-gib 4 --ring-mib 256

# verl (it pins transformers < 5.11) and torchtitan (spmd_types==0.2.3): each in a venv of
# its own, synced to its own lock (the package itself without its dependencies; see
# append_no_deps).
verl-setup: $(UV)
	$(call sync_venv,$(VERL_VENV),$(LOCKS)/verl.txt)

titan-setup: $(UV)
	$(call sync_venv,$(TITAN_VENV),$(LOCKS)/titan.txt)

frameworks-setup: $(UV)
	$(call sync_venv,$(FRAMEWORKS_VENV),$(LOCKS)/frameworks.txt)

torchtune-setup: $(UV)
	$(call sync_venv,$(TORCHTUNE_VENV),$(LOCKS)/torchtune.txt)

# 2 FSDP2 ranks (CPU, gloo) save a Llama through the drop-in and through verl's own manager,
# resume bit-exact from each, and from the drop-in's at world size 1; verl's own
# test_fsdp_ckpt.py (ported to CPU) through the drop-in for fsdp and fsdp2, per-rank temp
# dirs, twice into the same directories; retention against verl's tracker file.
test-verl: setup verl-setup
	$(BIN)/python -m pytest -q tests/integrations

# Every framework test with the real packages, the ones past make test's time budget
# included (`full_only` in tests/integrations/frameworks/frameworks_venv.py: the HF
# Trainer's 2-rank runs, Accelerate's FSDP2 and older-step resumes, Lightning's older-step
# resume).
test-frameworks: setup frameworks-setup torchtune-setup
	ASYNCCKPT_FRAMEWORKS_FULL=1 $(BIN)/python -m pytest -q tests/integrations/frameworks

# Each framework's own checkpoint path (and its async mode) against asyncckpt's integration,
# a tiny model at 2 ranks and a 1 GiB state at 1 rank: blocked per save, durable, extra
# memory (benchmarks/results/frameworks.md). About 8 minutes here at load 15-30.
bench-frameworks: setup frameworks-setup torchtune-setup
	ASYNCCKPT_FRAMEWORKS_PYTHON=$(FRAMEWORKS_VENV)/bin/python \
	ASYNCCKPT_TORCHTUNE_PYTHON=$(TORCHTUNE_VENV)/bin/python \
	$(BIN)/python -m benchmarks.frameworks --out benchmarks/results/frameworks.md

# PyTorch's own DCP tests (and torchtitan's checkpoint tests) with asyncckpt's StorageWriter
# and StorageReader swapped in, at the commits tests/upstream/run.py names; the pass table
# goes to build/upstream/results.md (tests/upstream/README.md). About 40 minutes here.
test-dcp-upstream: setup titan-setup
	$(BIN)/python tests/upstream/run.py fetch
	$(BIN)/python tests/upstream/run.py

# Side by side with verl's manager and model merger at two model sizes (results in benchmarks/results/verl.md).
bench-verl: setup verl-setup
	$(BIN)/python -m benchmarks.verl --out benchmarks/results/verl.md

clean:
	rm -rf $(VENV) $(VERL_VENV) $(TITAN_VENV) $(FRAMEWORKS_VENV) $(TORCHTUNE_VENV) $(UV_VENV) $(LATEST) $(LATEST)-verl $(LATEST)-titan $(LATEST)-locks checkpoints fsdp-ckpt fsdp-ckpt.* multinode-ckpt multinode-ckpt.* .pytest_cache .hypothesis
