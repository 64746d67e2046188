# Quick start: `make demo` and `make test`. Both create .venv and install the project on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_ENV := DS_ACCELERATOR=cpu OMP_NUM_THREADS=2

.PHONY: setup demo test clean-demo

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade "pip>=24"
	$(BIN)/python -m pip install -e ".[test]"
	touch $(STAMP)

# Synthetic archive -> stage 1: plain SimMIM makes a small RGB teacher -> stage 2: GFM with that teacher.
demo: setup
	$(BIN)/geofm demo-data --out data/demo
	$(DEMO_ENV) $(BIN)/geofm pretrain --config configs/pretrain/demo_simmim_swin_micro__img64_win4__rgb_teacher.yaml
	$(DEMO_ENV) $(BIN)/geofm pretrain --config configs/pretrain/demo_gfm_swin_micro__img64_win4__4band.yaml

test: setup
	DS_ACCELERATOR=cpu $(BIN)/python -m pytest -q

clean-demo:
	rm -rf runs/demo_simmim_swin_micro__img64_win4__rgb_teacher runs/demo_gfm_swin_micro__img64_win4__4band
