# Two commands on a fresh clone: `make demo` (the main job end to end) and `make test`.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO := demo-output

.PHONY: demo test bench clean

$(STAMP): setup.py
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (set PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/madp generate $(DEMO)/records --records 100000 --graph skewed --seed 1
	$(BIN)/madp bound $(DEMO)/records $(DEMO)/bounded --max-contributions 3 --runner DirectRunner
	$(BIN)/madp verify-bound $(DEMO)/records $(DEMO)/bounded --max-contributions 3
	$(BIN)/madp batch $(DEMO)/bounded $(DEMO)/records $(DEMO)/batches --steps 500 --batch-size 256 \
		--min-sep 8 --max-batch-size 320 --output-shards 4 --runner DirectRunner
	$(BIN)/madp verify-batches $(DEMO)/batches $(DEMO)/records --min-sep 8 --max-batch-size 320

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

bench: $(STAMP)
	$(BIN)/python benchmarks/bound.py
	$(BIN)/python benchmarks/batch.py

clean:
	rm -rf $(VENV) $(DEMO) *.egg-info
