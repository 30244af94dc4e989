# The two commands a newcomer types: `make run` (the main job) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN = $(VENV)/bin
# The CPU wheel of this torch release is what the dev/test set-up is pinned to.
TORCH = torch==2.13.0

.PHONY: install run test test-all clean

$(BIN)/gptkit: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(BIN)/gptkit

install: $(BIN)/gptkit

run: install
	$(BIN)/gptkit info gpt2

test: install
	$(BIN)/python -m pytest -q

test-all: install
	$(BIN)/python -m pytest -q -m ''

clean:
	rm -rf $(VENV) build *.egg-info
