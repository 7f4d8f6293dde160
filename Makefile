# One venv, made by the targets that need it. torch==2.13.0 is pinned at install time only
# because that is the local CPU wheel; the package itself needs torch>=2.11.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
EXTRA_SPEC ?=
# `make test` also runs the golden graphs and the MoE recognition under each other transformers
# release a golden is recorded for (tests/golden/*.transformers-X.Y.txt; the main venv has the
# newest): per release a venv holding only transformers and what it needs beyond the main venv,
# whose packages (torch, afd_compile) it reads (seconds to make). TF_RELEASES= leaves them out.
TF_RELEASES ?= 5.17.0 5.24.0
TF_TESTS ?= tests/test_split.py tests/test_moe_recognise.py tests/test_roles.py tests/test_ffn_tp.py \
	tests/test_generate.py::test_golden_of_a_cached_model_split

.PHONY: demo test test-transformers test-torch211 lint bench readme clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)" $(EXTRA_SPEC)
	$(PY) -m pip install -q -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/afd-compile demo

# two pytest workers (pytest-xdist), each test file kept whole on one worker (its module fixtures
# built once): on 2 cores the suite spends a third of its time in one process's single-threaded
# work (export, tracing, imports), which the other worker fills; PYTEST_WORKERS=0 runs it serially
PYTEST_WORKERS ?= 2
test: $(VENV)/.installed $(foreach r,$(TF_RELEASES),.venv-tf$(r)/.installed)
	$(VENV)/bin/ruff check afd_compile tests benchmarks examples
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --durations=25
	$(foreach r,$(TF_RELEASES),$(MAKE) test-transformers TF=$(r) &&) true

.venv-tf%/.installed: $(VENV)/.installed
	$(PYTHON) -m venv .venv-tf$*
	main=$$($(PY) -c 'import site; print(site.getsitepackages()[0])'); \
	own=$$(.venv-tf$*/bin/python -c 'import site; print(site.getsitepackages()[0])'); \
	echo "import site; site.addsitedir('$$main')" > $$own/zz_main_venv.pth
	.venv-tf$*/bin/python -m pip install -q transformers==$*
	touch $@

# the goldens and the MoE recognition under transformers $(TF) (make test-transformers TF=5.17.0)
test-transformers: .venv-tf$(TF)/.installed
	.venv-tf$(TF)/bin/python -c "import transformers as t; assert t.__version__ == '$(TF)', t.__version__"
	.venv-tf$(TF)/bin/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile $(TF_TESTS)

# the oldest supported torch (the GPU host's: torch 2.11, transformers 5.17) in a second venv,
# CPU only (the torch 2.11 wheel pulls its CUDA libraries: a few GB)
test-torch211:
	CUDA_VISIBLE_DEVICES= AFD_BACKEND=gloo \
		$(MAKE) test VENV=.venv-211 TORCH_SPEC=torch==2.11.0 EXTRA_SPEC=transformers==5.17.0 TF_RELEASES=

# the README's generated parts: the support table (from the test matrices) and the plan pictures
readme: $(VENV)/.installed
	$(PY) tests/support_table.py --write
	$(PY) -m pytest -q tests/test_cli.py -k readme_figures --update-goldens

bench: $(VENV)/.installed
	$(PY) benchmarks/pass_time.py

clean:
	rm -rf $(VENV) .venv-tf* .venv-211 build *.egg-info
