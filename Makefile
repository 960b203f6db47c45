# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Both create the virtualenv first. torch is installed only when the venv lacks it, as
# the CPU build (TORCH_SPEC; set TORCH_INDEX to a CPU wheel index where the default
# index would serve a CUDA build, e.g. TORCH_INDEX=https://download.pytorch.org/whl/cpu).

PYTHON      ?= python3
VENV        ?= .venv
BIN         := $(VENV)/bin
TORCH_SPEC  ?= torch==2.13.0
TORCH_INDEX ?=
PYTEST_ARGS ?=
# verl's tests and benchmark run in a venv of their own (verl pins transformers < 5.11) that
# sees this venv's packages (torch, ...) behind its own through a .pth file.
VERL_VENV   ?= $(VENV)-verl
VERL_SPEC   ?= verl==0.9.1
# torchtitan's test runs in a venv of its own in the same way (its pins: spmd_types==0.2.3).
TITAN_VENV  ?= $(VENV)-titan
TITAN_SPEC  ?= torchtitan==0.3.0

.PHONY: setup verl-setup titan-setup test test-fast test-verl bench-verl bench-codecs demo fsdp-demo bench bench-full bench-fence bench-export bench-gpu bench-memory bench-incremental torture corruption soak fuzz-protocol torture-multinode multinode-demo bench-commit bench-scale clean bench-load bench-stage bench-dcp bench-s3 torture-s3 bench-70b

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || \
	  $(BIN)/pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[test]"
	touch $@

test: setup verl-setup titan-setup
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# The tests that start no process (no writer, torchrun or subprocess): tests/tiers.py marks
# the others `process` at collection.
test-fast: setup
	$(BIN)/python -m pytest -q -m "not process" $(PYTEST_ARGS)

demo: setup
	$(BIN)/python examples/demo.py

# Side-by-side benchmark against torch.save, safetensors and DCP, with the machine's limits.
bench: setup
	$(BIN)/pip install -q -e ".[bench]"
	$(BIN)/python -m benchmarks --quick

bench-full: setup
	$(BIN)/pip install -q -e ".[bench,realweights]"
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
bench-codecs: setup
	$(BIN)/pip install -q -e ".[bench,realweights]"
	$(BIN)/python -m benchmarks.codecs --reps 5

# Incremental saves of a PEFT LoRA and a full fine-tune (CPU, a Llama built from a config):
# bytes written and referenced, time to durable per save, next to full saves and DCP save.
bench-incremental: setup
	$(BIN)/pip install -q -e ".[bench,incremental]"
	$(BIN)/python -m benchmarks.incremental --hidden 1024 --layers 8 --saves 6 \
	  --out benchmarks/results/incremental.md

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
torture: setup
	$(BIN)/python scripts/faults/torture.py --kills 300 --ranks 3

# The same torture on an object-store root (SeaweedFS on loopback), the S3 server among the
# victims; the local-file attacks are left out there (tests/faults/test_s3_faults.py flips
# bytes in stored objects).
torture-s3: setup
	$(BIN)/python scripts/faults/torture.py --s3 --kills 100 --ranks 3

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
		--saves-from-1000 3 --kill node,leader-writer --kill-nodes 256 \
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
bench-dcp: setup
	$(BIN)/pip install -q -e ".[dcpbench]"
	$(BIN)/python -m benchmarks.dcp --gib 1,4 --fsdp2-gib 1 --reps 3 --out benchmarks/results/dcp.md
	$(BIN)/python -m benchmarks.warm_load --reps 5 --out benchmarks/results/warm_load.md

# An object-store root against SeaweedFS on loopback: time to durable and cold load of a
# 1 GiB state next to a plain multipart upload / ranged download of the same bytes and to
# s3torchconnector's DCP writer and reader; then the S3 client comparison.
bench-s3: setup
	$(BIN)/pip install -q -e ".[s3bench]"
	$(BIN)/python -m benchmarks.s3 --gib 1 --reps 3 --out benchmarks/results/s3
	$(BIN)/python -m benchmarks.s3_clients --mib 256 --reps 3 --out benchmarks/results/s3_clients.md

# Writer private memory while a 4 GiB state streams through a 256 MiB ring.
bench-memory: setup
	$(BIN)/python -m benchmarks.writer_memory --state-gib 4 --ring-mib 256

# A venv of its own for a package whose pins clash with this venv's: the package with
# --no-deps, plus our extra of the modules it imports, over this venv's packages (a .pth
# file), so torch is not installed twice. $(1) the venv, $(2) the package, $(3) the extra.
define side_venv
	test -x $(1)/bin/python || $(BIN)/python -m venv $(1)
	$(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > \
	  "$$($(1)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/zz-asyncckpt-base.pth"
	$(1)/bin/pip install -q --no-deps "$(2)"
	$(1)/bin/pip install -q --no-warn-conflicts -e ".[$(3)]"
	touch $(1)/.installed
endef

# verl (it pins transformers < 5.11) and torchtitan (spmd_types==0.2.3). Each is installed
# --no-deps (its full requirements are not what the tests need), so pip's resolver would
# print an "ERROR" about them after the second install: --no-warn-conflicts keeps that
# known noise out of a passing `make test`.
verl-setup: $(VERL_VENV)/.installed

$(VERL_VENV)/.installed: $(VENV)/.installed pyproject.toml
	$(call side_venv,$(VERL_VENV),$(VERL_SPEC),verl)

titan-setup: $(TITAN_VENV)/.installed

$(TITAN_VENV)/.installed: $(VENV)/.installed pyproject.toml
	$(call side_venv,$(TITAN_VENV),$(TITAN_SPEC),torchtitan)

# 2 FSDP2 ranks (CPU, gloo) save a Llama through the drop-in and through verl's own manager,
# resume bit-exact from each, and from the drop-in's at world size 1; verl's own
# test_fsdp_ckpt.py (ported to CPU) through the drop-in for fsdp and fsdp2, per-rank temp
# dirs, twice into the same directories; retention against verl's tracker file.
test-verl: setup verl-setup
	$(BIN)/python -m pytest -q tests/integrations

# Side by side with verl's manager and model merger at two model sizes (results in benchmarks/results/verl.md).
bench-verl: setup verl-setup
	$(BIN)/python -m benchmarks.verl --out benchmarks/results/verl.md

clean:
	rm -rf $(VENV) $(VERL_VENV) checkpoints fsdp-ckpt fsdp-ckpt.* multinode-ckpt multinode-ckpt.* .pytest_cache .hypothesis
