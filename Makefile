# k3lit: `make train` and `make test` are the whole set-up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
RECIPE ?= tiny
ARGS ?=
SLURM_ARGS ?=
# torch and torchvision are pinned together (litdata imports torchvision); override for another CUDA/CPU build.
TORCH ?= torch==2.14.1 torchvision==0.29.1
# Exact version of every package install puts in the venv (pip constraints, written by `make lock`); LOCK= installs
# the newest versions pyproject.toml's ranges allow instead.
LOCK ?= requirements/constraints.txt
LOCK_VENV ?= $(or $(TMPDIR),/tmp)/k3lit-lock-venv
PYTEST_ARGS ?=

BIN := $(VENV)/bin
RECIPE_PATH := $(if $(wildcard $(RECIPE)),$(RECIPE),recipes/$(RECIPE).yaml)

.PHONY: install lock recipe train prepare generate slurm test lint clean

install: $(VENV)/.installed

# pip and setuptools (k3lit's build backend, used without build isolation) come from the lock too.
$(VENV)/.installed: pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade $(if $(LOCK),-c $(LOCK)) pip setuptools
	$(BIN)/pip install -q $(if $(LOCK),-c $(LOCK)) $(TORCH)
	$(BIN)/pip install -q $(if $(LOCK),-c $(LOCK)) --no-build-isolation -e ".[dev]"
	touch $@

lock:  ## rewrite LOCK with what an unconstrained install into a fresh venv gets today
	rm -rf $(LOCK_VENV)
	$(MAKE) --no-print-directory install VENV=$(LOCK_VENV) LOCK=
	{ echo "# Exact versions for make install and CI (pip install -c); rewritten by make lock (README, Set-up)."; \
	  $(LOCK_VENV)/bin/python -c 'import platform as p; print("# Resolved on CPython", p.python_version(), "on", \
	  p.system(), p.machine())'; $(LOCK_VENV)/bin/pip freeze --all --exclude-editable; } > $(LOCK).new
	mv $(LOCK).new $(LOCK)
	rm -rf $(LOCK_VENV)

recipe:  # RECIPE names a file, or a recipe in recipes/: said before anything installs
	@test -f $(RECIPE_PATH) || { echo "make: no recipe '$(RECIPE)': RECIPE= takes a file or one of:" \
	  $$(ls recipes | sed -n 's/\.yaml$$//p'); exit 2; }

train: recipe install  ## prepare the corpus if needed, then train RECIPE (default: tiny) with extra CLI ARGS
	$(BIN)/k3lit fit --config $(RECIPE_PATH) $(ARGS)

prepare: recipe install
	$(BIN)/k3lit prepare --config $(RECIPE_PATH) $(ARGS)

generate: recipe install  ## sample from the last checkpoint of RECIPE
	$(BIN)/k3lit generate --ckpt runs/$(basename $(notdir $(RECIPE_PATH)))/checkpoints/last.ckpt $(ARGS)

slurm: recipe install  ## print an sbatch script for RECIPE: SLURM_ARGS go to `k3lit slurm`, ARGS to `k3lit fit`
	@$(BIN)/k3lit slurm --config $(RECIPE_PATH) $(SLURM_ARGS) -- $(ARGS)

test: install
	$(BIN)/pytest -n 2 --timeout 600 $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check k3lit tests benchmarks

clean:
	rm -rf runs .cache .pytest_cache
