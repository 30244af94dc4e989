# The two commands a newcomer types: `make run` (the main job) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN = $(VENV)/bin
# The CPU wheel of this torch release is what the dev/test set-up is pinned to.
TORCH = torch==2.13.0
SUDO = $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install test-deps browser compiler llama-converter lint run test test-all clean

# What `make run` needs: gptkit and torch, no test tools. pip shows its progress (torch is a download of a few
# hundred MB: minutes on a slow line).
$(BIN)/gptkit: pyproject.toml
	@echo "make: setting up $(VENV) with $(TORCH) (CPU build) and gptkit; the first time takes a few minutes"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --progress-bar on $(TORCH)
	$(BIN)/pip install --progress-bar on -e .
	touch $(BIN)/gptkit

install: $(BIN)/gptkit

# The test extras, only for `make test`.
TEST_DEPS = $(VENV)/.test-deps
$(TEST_DEPS): pyproject.toml | install
	@echo "make: adding the test extras to $(VENV)"
	$(BIN)/pip install --progress-bar on -e '.[test]'
	touch $(TEST_DEPS)

test-deps: $(TEST_DEPS)

# The playground test drives Debian's Chromium (never a browser downloaded by a test tool).
browser:
	@command -v chromium >/dev/null || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q chromium; }

# torch.compile and gptkit's own CPU kernels (gptkit/csrc) compile C++ at run time.
compiler:
	@command -v g++ >/dev/null || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q g++; }

# The main job: prepare the bundled corpus, train nanoGPT's CPU recipe, print a sample. Running it again
# resumes an interrupted run (or, once finished, only samples).
RUN_DIR = runs/shakespeare-char-cpu
run: install
	$(BIN)/gptkit prepare --tokenizer char --out data/shakespeare_char
	$(BIN)/gptkit train --config configs/shakespeare-char-cpu.yaml $$(test -f $(RUN_DIR)/latest && echo --resume)
	$(BIN)/gptkit generate $(RUN_DIR)/checkpoints/step-002000 --prompt "ROMEO:" --max-new-tokens 300 --temperature 0.8 --seed 1337

# llama.cpp's own HF-to-GGUF converter, a reference the GGUF tests run: unpacked from the llama.cpp that the
# llama-cpp-python source distribution on PyPI carries (nothing is built).
LLAMA_CPP_PYTHON = llama-cpp-python==0.3.36
CONVERTER = .cache/llama.cpp/convert_hf_to_gguf.py
$(CONVERTER): | test-deps
	rm -rf .cache/llama.cpp && mkdir -p .cache/llama.cpp/sdist
	$(BIN)/pip download --quiet --no-deps --no-binary :all: $(LLAMA_CPP_PYTHON) -d .cache/llama.cpp/sdist
	tar xzf .cache/llama.cpp/sdist/*.tar.gz -C .cache/llama.cpp --strip-components 3 --wildcards \
		'*/vendor/llama.cpp/convert_hf_to_gguf.py' '*/vendor/llama.cpp/conversion/*' '*/vendor/llama.cpp/gguf-py/*'
	rm -rf .cache/llama.cpp/sdist

llama-converter: $(CONVERTER)

LINTED = gptkit tests benchmarks examples

lint: test-deps
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/ruff check $(LINTED)

test: test-deps browser compiler llama-converter lint
	$(BIN)/python -m pytest -q

test-all: test-deps browser compiler llama-converter
	$(BIN)/python -m pytest -q -m ''

clean:
	rm -rf $(VENV) build *.egg-info .cache
