# make test: set up .venv, install with test extras, run the whole suite (CI calls this).
# make serve: set up .venv, install, run the main job.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

SOAK_S ?= 3600

.PHONY: test test-fast serve soak install clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	# one pip command: torch==2.13.0 (CPU build) is pinned with everything else so nothing pulls a CUDA build
	$(VENV)/bin/pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q tests

test-fast: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -m "not slow" tests

# make soak: an hour (SOAK_S seconds) of Poisson load at 80% of capacity on `jaxserve serve`, RSS / threads / fds /
# free blocks sampled (bench/soak.py); JSON and PNG into bench/results/
soak: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m bench.soak --json bench/results/soak.json --png bench/results/soak.png --duration $(SOAK_S)

serve: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m router.cli serve $(if $(CONFIG),--config $(CONFIG))

clean:
	rm -rf $(VENV)
