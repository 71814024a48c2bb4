# qic: `make run` installs, builds the embedded tiny model and generates an image; `make test` runs the suite.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROMPT ?= a red bicycle leaning against a blue wall

.PHONY: install run test bench warm clean

install: $(STAMP)

# Re-installs only when the package metadata or the pins change; `make install` twice does nothing.
$(STAMP): pyproject.toml constraints-ci.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints-ci.txt -e '.[dev]'
	touch $(STAMP)

run: install
	$(BIN)/qic build
	$(BIN)/qic run artifacts/tiny --prompt "$(PROMPT)" --output artifacts/tiny.png

test: install
	$(BIN)/python -m pytest -q

# Fill the compile cache from a warm matrix: `make warm MATRIX=configs/warm/qwen-image.yaml SHARD=1/4`.
MATRIX ?= configs/warm/tiny.yaml
warm: install
	$(BIN)/qic warm $(MATRIX) $(if $(SHARD),--shard $(SHARD)) $(if $(CACHE),--cache-dir $(CACHE))

bench: install
	$(BIN)/python -m qic.bench.all

clean:
	rm -rf artifacts .qic-cache
