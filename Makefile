# Two entry points: `make demo` runs the default private training end to end
# (pictures into $(PLOTS); BASELINE=no skips the non-private run), `make test`
# runs the test suite. Both create .venv on first use (`make install` does only
# that) and install the pinned CPU build of torch before anything else. Then:
# `source .venv/bin/activate`, or prefix commands with .venv/bin/.
# PY names the Python 3.11 that creates .venv: `make demo PY=python3` where it is not `python3.11`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test install clean bench

$(STAMP): pyproject.toml constraints.txt
	@echo "== Setting up $(VENV) (first run only: 87 s measured on a 2-core machine, mostly downloads, longer on a slow connection; later runs reuse it)"
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@echo "== 1/2 torch 2.13.0, CPU build, first (an open range could pull a multi-GB CUDA build)"
	$(BIN)/python -m pip install --progress-bar on $(TORCH)
	@echo "== 2/2 dptorch with transformers, peft, trl, accelerate, DeepSpeed, bitsandbytes, Optuna, dp-accounting, plotting and test tools"
	$(BIN)/python -m pip install --progress-bar on -c constraints.txt -e '.[hf,dev,plot,examples,deepspeed,tune,qlora]'
	touch $(STAMP)
	@echo "== Ready. Use the environment with: source $(VENV)/bin/activate  (or prefix commands with $(BIN)/)"

install: $(STAMP)

# make demo PLOTS=dir (where the pictures go), BASELINE=no (skip the non-private run, about half the time)
PLOTS ?= demo-pictures
BASELINE ?= yes

demo: $(STAMP)
	$(BIN)/python -m dptorch.cli.examples.minilm --plots $(PLOTS) $(if $(filter no 0 false off,$(BASELINE)),--no-baseline)
	@echo "== Pictures in $(PLOTS)/. Use the environment in a new shell with: source $(VENV)/bin/activate"

# make test WORKERS=n: the suite on n worker processes (pytest-xdist; 0, the default and what CI runs, is this one
# process). Each file runs on one worker, and the files sharing a launch of several processes (tests/conftest.py)
# on one. WORKERS=2 took 10:40-10:58 on 2 cores against 15-19 minutes, but one run of six failed one test
# that passes alone and in one process (tests/validate/test_validator.py::test_fixed_resnet_trains_privately):
# an order dependence not yet found, so it is not the default.
WORKERS ?= 0

test: $(STAMP)
	$(BIN)/python -m pytest -n $(WORKERS) --dist loadfile

bench: $(STAMP)
	$(BIN)/python benchmarks/layers.py

clean:
	rm -rf $(VENV)
