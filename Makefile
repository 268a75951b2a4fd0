# Two entry points: `make demo` runs the default private training end to end,
# `make test` runs the test suite. Both create .venv on first use and install
# the pinned CPU build of torch before anything else.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test install clean bench

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[hf,dev,plot,examples]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m dptorch.examples.minilm

test: $(STAMP)
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python benchmarks/layers.py

clean:
	rm -rf $(VENV)
