# One venv, made by the targets that need it. torch==2.13.0 is pinned at install time only
# because that is the local CPU wheel; the package itself needs torch>=2.11.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test lint bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/afd-compile demo

test: $(VENV)/.installed
	$(VENV)/bin/ruff check afd_compile tests benchmarks examples
	$(PY) -m pytest -q

bench: $(VENV)/.installed
	$(PY) benchmarks/pass_time.py

clean:
	rm -rf $(VENV) build *.egg-info
