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
	$(BIN)/pip install --quiet -e '.[test,train]'
	# TF Privacy pins dp-accounting 0.4 and old TF packages; its query modules work on TF 2.21 without them.
	$(BIN)/pip install --quiet --no-deps tensorflow-privacy==0.9.0
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/madp generate $(DEMO)/records --records 100000 --graph skewed --seed 1 --holdout $(DEMO)/test.parquet
	$(BIN)/madp bound $(DEMO)/records $(DEMO)/bounded --max-contributions 3 --runner DirectRunner
	$(BIN)/madp verify-bound $(DEMO)/records $(DEMO)/bounded --max-contributions 3
	$(BIN)/madp batch $(DEMO)/bounded $(DEMO)/records $(DEMO)/batches --steps 500 --batch-size 256 \
		--min-sep 8 --max-batch-size 320 --output-shards 4 --runner DirectRunner
	$(BIN)/madp verify-batches $(DEMO)/batches $(DEMO)/records --min-sep 8 --max-batch-size 320
	$(BIN)/madp -q train $(DEMO)/batches $(DEMO)/private --epsilon 8 --delta 1e-5 --bands 8 \
		--eval-data $(DEMO)/test.parquet > /dev/null
	$(BIN)/madp -q train $(DEMO)/batches $(DEMO)/baseline --mechanism none --eval-data $(DEMO)/test.parquet > /dev/null
	@$(BIN)/python -c "import json; d = '$(DEMO)/'; load = lambda f: json.load(open(d + f)); \
		p = load('private/privacy.json'); a = load('private/metrics.json')['final']['accuracy']; \
		b = load('baseline/metrics.json')['final']['accuracy']; \
		print(f'test accuracy: private {a:.4f} vs non-private {b:.4f}; private model: {p[\"mechanism\"]}', \
		      f'with {len(p[\"bands\"])} bands, sigma {p[\"noise_multiplier\"]:.3g},', \
		      f'(epsilon, delta) = ({p[\"epsilon\"]:.4g}, {p[\"delta\"]:g})')"

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

bench: $(STAMP)
	$(BIN)/python benchmarks/bound.py
	$(BIN)/python benchmarks/batch.py
	$(BIN)/python benchmarks/train.py

clean:
	rm -rf $(VENV) $(DEMO) *.egg-info
