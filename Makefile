# The one place that knows how to set deepreduce up.
#
#   make demo    set up (if needed), train on two Horovod ranks: dense versus deepreduce
#                (BACKEND=torch: on two PyTorch DDP ranks)
#   make bench   set up (if needed), capture real gradients, compare every codec on them
#   make test    set up (if needed), run the test suite
#   make docs    set up (if needed), serve the documentation site at http://127.0.0.1:8000
#   make test-core  the core's tests on a newer Python with numpy 2, no frameworks
#   make test-torchft  the torchft adapter's tests in .venv-torchft (torch and torchft, no
#                TensorFlow: torchft's protobuf is newer than TensorFlow 2.15 accepts)
#   make test-wheel the sdist and the wheel (python -m build in dist/), installed into clean
#                venvs: the core tests with the compiled extensions, then without them, and
#                the sdist with the torch extra
#   make venv    only set up: .venv in this checkout with TensorFlow, Horovod, torch and deepreduce
#
# Needs python3 (3.9 to 3.11: TensorFlow 2.15 has no wheels for newer ones) with its
# venv module, gcc/g++ and cmake (Horovod is compiled from source), and pip access.

# TensorFlow 2.15.1 supports Python 3.9-3.11; prefer an interpreter in that range.
PYTHON ?= $(firstword $(shell command -v python3.11 python3.10 python3.9 2>/dev/null) python3)
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
STAMP := $(VENV)/.deepreduce-installed
GRADIENTS := benchmarks/cache/gradients.npz

# Horovod 0.28.1 (its last release) does not build against newer TensorFlow (XLA
# headers). Keras 2.15 needs numpy < 2.
TENSORFLOW := tensorflow-cpu==2.15.1
HOROVOD := horovod==0.28.1
# The CPU build of torch 2.13.0 lies on this project's machines; any other version
# (or a plain "torch") downloads several GB of CUDA builds.
TORCH := torch==2.13.0
# Only TensorFlow and Gloo: no MPI needed to run several ranks on one machine.
# CMAKE_POLICY_VERSION_MINIMUM lets a CMake 4 (which rejects the bundled Gloo's
# cmake_minimum_required 2.8) build it too; CMake 3.x ignores it.
HOROVOD_BUILD_ENV := HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
	HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 CMAKE_POLICY_VERSION_MINIMUM=3.5

ifdef CI
export PIP_PROGRESS_BAR := off
endif
export TF_CPP_MIN_LOG_LEVEL ?= 2

# The core (everything but the Horovod and torch integrations) on a current Python and
# numpy 2, without TensorFlow, Horovod, torch or ml_dtypes: a second, lighter venv.
# Python 3.12 (through pyenv where it provides it); else the default Python, with a note.
CORE_PYTHON ?= PYENV_VERSION=3.12.1 python3.12
CORE_VENV := .venv-core
CORE_STAMP := $(CORE_VENV)/.deepreduce-installed

.PHONY: venv test test-core test-torchft test-wheel demo bench docs clean help

help:
	@echo "make demo    set up (if needed), train on two Horovod ranks: dense versus deepreduce"
	@echo "             (make demo BACKEND=torch: PyTorch DDP with deepreduce's hook)"
	@echo "make bench   set up (if needed), capture real gradients, compare every codec on them"
	@echo "make test    set up (if needed), run the test suite"
	@echo "make docs    set up (if needed), serve the documentation at http://127.0.0.1:8000"
	@echo "make test-core  the core's tests on Python 3.12+ with numpy 2, without the frameworks"
	@echo "make test-torchft  the torchft adapter's tests in .venv-torchft (torch + torchft, no TensorFlow)"
	@echo "make test-wheel build the sdist and the wheel into dist/ and test them installed"
	@echo "make venv    only set up .venv (TensorFlow, Horovod, torch, deepreduce with its extras)"
	@echo "make clean   remove .venv, the gradient cache and build leftovers"

venv: $(STAMP)

# the C extensions lie beside their users (setup.py's EXTENSIONS)
C_SOURCES := $(wildcard deepreduce/*.c deepreduce/*.h codecs/*.c codecs/*/*.c)

# The stamp lives inside .venv, so deleting .venv starts over. Every step below is
# idempotent; re-running after an edit of setup.cfg only installs what changed, and
# an edit of a C extension (a C_SOURCES file) recompiles it.
# Horovod is compiled only when `import horovod.tensorflow` fails; pip's wheel cache
# (kept on purpose) makes a rebuild in a new venv take seconds instead of minutes.
$(STAMP): setup.cfg setup.py pyproject.toml Makefile $(C_SOURCES)
	@for tool in gcc g++ cmake; do command -v $$tool >/dev/null || { \
		echo "make: $$tool not found; Horovod is compiled from source and needs gcc, g++ and cmake" \
		     "(Debian: apt-get install build-essential cmake python3-venv)" >&2; exit 1; }; done
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -c 'import sys; sys.exit(not (3, 9) <= sys.version_info[:2] <= (3, 11))' || { \
		echo "make: $(VENV) uses Python $$($(BIN)/python -V); TensorFlow 2.15 needs 3.9-3.11." \
		     "Remove $(VENV) and run again with PYTHON=/path/to/python3.11" >&2; exit 1; }
	$(PIP) install --upgrade pip setuptools wheel
	$(PIP) install $(TENSORFLOW) "numpy<2" packaging wheel
	$(BIN)/python -c 'import horovod.tensorflow' 2>/dev/null \
		|| $(HOROVOD_BUILD_ENV) $(PIP) install --no-build-isolation $(HOROVOD)
	@$(BIN)/python -c 'import horovod.tensorflow' || { \
		echo "make: horovod is installed but horovod.tensorflow does not import. A wheel built" \
		     "without TensorFlow may sit in pip's cache: run '$(PIP) uninstall -y horovod;" \
		     "$(PIP) cache remove horovod' and make again" >&2; exit 1; }
	$(PIP) install $(TORCH)
	$(PIP) install -e ".[horovod,torch,dev,notebooks,docs]"
	touch $@

# .venv/bin goes first on PATH so that tools the tests start by name (horovodrun,
# deepreduce, notebook kernels) are the environment's own.
RUN := PATH="$(CURDIR)/$(BIN):$$PATH"

# ruff first (the rule set is in pyproject.toml): a lint error fails the run early; then
# the documentation site, strictly: a broken link or API reference fails too.
test: $(STAMP)
	$(BIN)/ruff check .
	$(DOCS_ENV) $(BIN)/mkdocs build --strict --site-dir build/site
	$(RUN) $(BIN)/python -m pytest -q

# The documentation site (mkdocs.yml, docs/), rebuilt on every edit while it is served.
# NO_MKDOCS_2_WARNING quiets the banner mkdocs-material prints on every build.
DOCS_ENV := NO_MKDOCS_2_WARNING=1
docs: $(STAMP)
	$(DOCS_ENV) $(BIN)/mkdocs serve

$(CORE_STAMP): setup.cfg setup.py pyproject.toml Makefile $(C_SOURCES)
	test -x $(CORE_VENV)/bin/python || $(CORE_PYTHON) -m venv $(CORE_VENV) 2>/dev/null || { \
		echo "make: $(CORE_PYTHON) not found; the core leg runs on $$($(PYTHON) -V)" \
		     "with numpy 2"; $(PYTHON) -m venv $(CORE_VENV); }
	$(CORE_VENV)/bin/python -m pip install --upgrade pip setuptools wheel
	$(CORE_VENV)/bin/python -m pip install "numpy>=2" -e ".[dev]"
	touch $@

# The integrations' tests skip themselves there (no TensorFlow, Horovod or torch).
test-core: $(CORE_STAMP)
	@$(CORE_VENV)/bin/python -c 'import sys, numpy; print("core tests on Python", \
		sys.version.split()[0], "and numpy", numpy.__version__)'
	$(CORE_VENV)/bin/python -m pytest -q -p no:cacheprovider

# torchft (deepreduce.torch.torchft) in a venv of its own: torchft's opentelemetry
# exporter needs protobuf >= 5, TensorFlow 2.15 needs protobuf < 5, so the two cannot
# share .venv. torch goes in first and a constraint holds it there, so that torchft's
# "torch>=2.7" never makes pip fetch another (CUDA) build.
TORCHFT_VENV := .venv-torchft
TORCHFT_STAMP := $(TORCHFT_VENV)/.deepreduce-installed
TORCHFT_PIP := $(TORCHFT_VENV)/bin/python -m pip

$(TORCHFT_STAMP): setup.cfg setup.py pyproject.toml Makefile $(C_SOURCES)
	test -x $(TORCHFT_VENV)/bin/python || $(PYTHON) -m venv $(TORCHFT_VENV)
	$(TORCHFT_PIP) install --upgrade pip setuptools wheel
	$(TORCHFT_PIP) install $(TORCH)
	echo "$(TORCH)" >$(TORCHFT_VENV)/torch-constraint.txt
	$(TORCHFT_PIP) install -c $(TORCHFT_VENV)/torch-constraint.txt -e ".[torchft,dev]"
	touch $@

# Only the adapter's tests: the rest of the suite runs in .venv (make test).
test-torchft: $(TORCHFT_STAMP)
	@$(TORCHFT_VENV)/bin/python -c 'from importlib.metadata import version as v; \
		print("torchft", v("torchft"), "| torch", v("torch"), "| protobuf", v("protobuf"))'
	$(TORCHFT_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_torchft.py

# The package as users get it, in new venvs under build/pkg/ that share only pip's cache;
# each leg prints its wall time.
#   dist      `python -m build` (in its own venv) makes dist/deepreduce-V.tar.gz and the wheel
#             from a copy of the checkout's tracked and unignored files, so nothing built in
#             place (.so, egg-info) rides along; MANIFEST.in says what the sdist holds
#   compiled  the wheel with [dev] in a new venv; the core tests (the frameworks' skip) run
#             from the sdist's tests/ copied outside the checkout, where `import deepreduce`
#             can only be the installed package (checked first); test_setup checks that every
#             extension is compiled and what the sdist and the wheel hold
#   numpy     the same with a wheel built from the sdist with DEEPREDUCE_NO_EXTENSIONS=1 (no C
#             extension in it); test_setup checks that every numpy fallback serves
#   torch     pip install "dist/deepreduce-V.tar.gz[torch]" (torch held to $(TORCH) by a
#             constraint) in a new venv; deepreduce.torch allreduces on one gloo rank
PKG := build/pkg
VERSION := $(shell sed -n 's/^version *= *//p' setup.cfg)
SDIST := dist/deepreduce-$(VERSION).tar.gz
WHEEL = $(wildcard dist/deepreduce-$(VERSION)-*.whl)

.PHONY: test-wheel-dist test-wheel-compiled test-wheel-numpy test-wheel-torch
test-wheel:
	@times=; for leg in dist compiled numpy torch; do start=$$(date +%s); \
		$(MAKE) --no-print-directory test-wheel-$$leg || exit 1; \
		times="$$times $$leg $$(( $$(date +%s) - start )) s;"; \
		echo "test-wheel: $$leg leg took $$(( $$(date +%s) - start )) s"; done; \
		echo "test-wheel: every leg passed:$$times"

test-wheel-dist:
	rm -rf $(PKG)/src $(SDIST) dist/deepreduce-$(VERSION)-*.whl
	mkdir -p $(PKG)/src dist
	test -x $(PKG)/build-venv/bin/python || $(PYTHON) -m venv $(PKG)/build-venv
	$(PKG)/build-venv/bin/python -m pip install -q build
	git ls-files -z --cached --others --exclude-standard \
		| tar --null -T - --ignore-failed-read -cf - | tar -xf - -C $(PKG)/src
	cd $(PKG)/src && ../build-venv/bin/python -m build --outdir $(CURDIR)/dist . >../build.log 2>&1 \
		|| { tail -n 40 ../build.log; exit 1; }
	ls -l dist/deepreduce-$(VERSION)[.-]*

# $(1): the venv; then the sdist's tests run in a temporary folder with the venv first on PATH
define WHEEL_TESTS
tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	tar -xzf $(CURDIR)/$(SDIST) -C "$$tmp" --strip-components=1 deepreduce-$(VERSION)/tests && \
	cd "$$tmp" && PATH="$(CURDIR)/$(1)/bin:$$PATH" && \
	python -c 'import deepreduce, pathlib, sys, sysconfig; \
		where = pathlib.Path(deepreduce.__file__).resolve().parent; print("deepreduce from", where); \
		sys.exit(not where.is_relative_to(pathlib.Path(sysconfig.get_paths()["platlib"]).resolve()))' && \
	python -m pytest -q -p no:cacheprovider tests
endef

test-wheel-compiled:
	rm -rf $(PKG)/venv-compiled && $(PYTHON) -m venv $(PKG)/venv-compiled
	$(PKG)/venv-compiled/bin/python -m pip install -q "$(WHEEL)[dev]"
	export DEEPREDUCE_SDIST=$(CURDIR)/$(SDIST) DEEPREDUCE_WHEEL=$(CURDIR)/$(WHEEL) && \
		$(call WHEEL_TESTS,$(PKG)/venv-compiled)

test-wheel-numpy:
	rm -rf $(PKG)/sdist-src $(PKG)/dist-numpy && mkdir -p $(PKG)/sdist-src
	tar -xzf $(SDIST) -C $(PKG)/sdist-src --strip-components=1
	cd $(PKG)/sdist-src && DEEPREDUCE_NO_EXTENSIONS=1 ../build-venv/bin/python -m build --wheel \
		--outdir ../dist-numpy . >../build-numpy.log 2>&1 || { tail -n 40 ../build-numpy.log; exit 1; }
	rm -rf $(PKG)/venv-numpy && $(PYTHON) -m venv $(PKG)/venv-numpy
	$(PKG)/venv-numpy/bin/python -m pip install -q "$$(ls $(PKG)/dist-numpy/*.whl)[dev]"
	export DEEPREDUCE_EXPECT_IMPLEMENTATION=numpy DEEPREDUCE_SDIST=$(CURDIR)/$(SDIST) \
		DEEPREDUCE_WHEEL=$$(ls $(CURDIR)/$(PKG)/dist-numpy/*.whl) && $(call WHEEL_TESTS,$(PKG)/venv-numpy)

test-wheel-torch:
	rm -rf $(PKG)/venv-torch && $(PYTHON) -m venv $(PKG)/venv-torch
	echo "$(TORCH)" >$(PKG)/torch-constraint.txt
	$(PKG)/venv-torch/bin/python -m pip install -q -c $(PKG)/torch-constraint.txt "$(SDIST)[torch]"
	tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && cd "$$tmp" && \
		$(CURDIR)/$(PKG)/venv-torch/bin/python -c 'import torch, torch.distributed as dist; \
		import deepreduce.torch as drt; from deepreduce import sums; \
		dist.init_process_group("gloo", init_method="file://" + "'"$$tmp"'/store", rank=0, world_size=1); \
		g = torch.arange(10_000.0); state = drt.DeepReduceState(sparsifier="topk:0.01", value="raw"); \
		assert torch.equal(drt.allreduce(g, state, name="g"), torch.where(g >= 9_900, g, 0)); \
		print("torch", torch.__version__, "| deepreduce.torch from", drt.__file__, \
		      "| sums:", sums.SUM_IMPLEMENTATION); dist.destroy_process_group()'

# The main job: two Horovod ranks train the same model with dense allreduce and
# with deepreduce, and print bytes per step, step time and accuracy side by side.
# BACKEND=torch: the same comparison with PyTorch DDP and deepreduce's communication
# hook, on a character model of the standard library's sources.
# The demo's own results go to benchmarks/cache/ so the committed ones stay as measured.
BACKEND ?= horovod
demo: $(STAMP)
	mkdir -p benchmarks/cache
ifeq ($(BACKEND),torch)
	$(RUN) $(BIN)/python -m benchmarks.train_text --out benchmarks/cache/train_text.md
else ifeq ($(BACKEND),horovod)
	$(RUN) $(BIN)/horovodrun -np 2 -H localhost:2 --gloo \
		$(BIN)/python -m benchmarks.train_digits --out benchmarks/cache/train_digits.md
else
	@echo "make: BACKEND must be horovod (the default) or torch, got '$(BACKEND)'" >&2; exit 1
endif

# Every codec on real gradients of three small Keras models (captured once, kept
# until gradients.py changes).
bench: $(GRADIENTS)
	$(RUN) $(BIN)/deepreduce bench $(GRADIENTS)

$(GRADIENTS): benchmarks/gradients.py | $(STAMP)
	$(RUN) $(BIN)/python -m benchmarks.gradients --out $(GRADIENTS:.npz=.partial.npz)
	mv $(GRADIENTS:.npz=.partial.npz) $@

clean:
	rm -rf $(VENV) $(CORE_VENV) $(TORCHFT_VENV) benchmarks/cache build *.egg-info .pytest_cache .hypothesis \
		deepreduce/*.so codecs/*.so codecs/*/*.so
