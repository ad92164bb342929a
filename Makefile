# make test: set up .venv, install with test extras, run the whole suite (CI calls this).
# make serve: set up .venv, install, run the main job.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test test-fast serve install clean

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

serve: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m jaxserve.cli serve $(if $(CONFIG),--config $(CONFIG))

clean:
	rm -rf $(VENV)
