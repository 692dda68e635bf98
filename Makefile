# k3lit: `make train` and `make test` are the whole set-up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
RECIPE ?= tiny
ARGS ?=
SLURM_ARGS ?=
# torch and torchvision are pinned together (litdata imports torchvision); override for another CUDA/CPU build.
TORCH ?= torch==2.14.1 torchvision==0.29.1
PYTEST_ARGS ?=

BIN := $(VENV)/bin
RECIPE_PATH := $(if $(wildcard $(RECIPE)),$(RECIPE),recipes/$(RECIPE).yaml)

.PHONY: install train prepare generate slurm test lint clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

train: install  ## prepare the corpus if needed, then train RECIPE (default: tiny) with extra CLI ARGS
	$(BIN)/k3lit fit --config $(RECIPE_PATH) $(ARGS)

prepare: install
	$(BIN)/k3lit prepare --config $(RECIPE_PATH) $(ARGS)

generate: install  ## sample from the last checkpoint of RECIPE
	$(BIN)/k3lit generate --ckpt runs/$(basename $(notdir $(RECIPE_PATH)))/checkpoints/last.ckpt $(ARGS)

slurm: install  ## print an sbatch script for RECIPE: SLURM_ARGS go to `k3lit slurm`, ARGS to `k3lit fit`
	@$(BIN)/k3lit slurm --config $(RECIPE_PATH) $(SLURM_ARGS) -- $(ARGS)

test: install
	$(BIN)/pytest -n 2 --timeout 600 $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check k3lit tests benchmarks

clean:
	rm -rf runs .cache .pytest_cache
