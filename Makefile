# normfold: commands for a fresh machine.
#   make demo   fold the bundled default model and print the report
#   make test   the whole test suite (Triton kernels run on the CPU through TRITON_INTERPRET=1)
#   make wheel-check   build the wheel and sdist, install the wheel into a fresh venv, walk a user's path there
#   make docs   the API reference (build/docs) from the docstrings; fails on any warning
#   make oldest-stack   ops tests and GPU dry runs on the oldest supported torch/triton (separate venv)
# Each creates or reuses .venv/ idempotently (.[dev] includes the onnx extra, so tests/export run rather than
# skip). torch is installed first with an overridable spec, because a bare torch requirement would pull a multi-GB CUDA build on CPU machines.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
# Where torch comes from: empty for the default index (PyPI, or a local wheel pip finds); on a machine
# without a GPU, `make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu` avoids PyPI's CUDA build.
TORCH_INDEX ?=
TORCH_FROM = $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
TORCH_INSTALL = $(PY) -m pip install -q $(TORCH_FROM)
STAMP := $(VENV)/.normfold-installed
DEMO_STAMP := $(VENV)/.normfold-demo-installed
PYTEST_ARGS ?=
N ?= 2000

.PHONY: venv demo test wheel-check docs oldest-stack fuzz tamper-fuzz bench bench-e2e bench-onnx bench-fold-large default-model gpu-check gpu-e2e gpu-overhead clean

# The venv with torch first (TORCH_FROM), then normfold editable with the extras $(1); touches the stamp $@.
define install_venv
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(TORCH_INSTALL)
	$(PY) -m pip install -q -e ".[$(1)]"
	touch $@
endef

$(STAMP): pyproject.toml
	$(call install_venv,dev)

venv: $(STAMP)

# The demo needs only torch and the cli extra (transformers, safetensors, matplotlib, rich), not dev's.
$(DEMO_STAMP): pyproject.toml
	$(call install_venv,cli)

demo: $(DEMO_STAMP)
	$(VENV)/bin/normfold demo

test: venv
	$(PY) -m normfold.ops.build  # build the C++ kernel once, before the workers need it
	TRITON_INTERPRET=1 TRITON_DEFAULT_FP_FUSION=1 $(PY) -m pytest -q -n 2 --dist loadgroup $(PYTEST_ARGS) tests

# The package as users get it: sdist, then the wheel built from that sdist (python -m build), installed
# with the hf extra into a fresh venv (torch first, from TORCH_SPEC), with its own C++ kernel cache.
# There: a smoke import, --version, the demo, and scripts/walkthrough.py (fold, load fast, fuse, generate).
WHEEL_CHECK ?= build/wheel-check
WHEEL_PY := $(WHEEL_CHECK)/venv/bin/python
wheel-check: venv
	rm -rf $(WHEEL_CHECK)
	$(PY) -m build -q --outdir $(WHEEL_CHECK)/dist .
	$(PYTHON) -m venv $(WHEEL_CHECK)/venv
	$(WHEEL_PY) -m pip install -q $(TORCH_FROM)
	$(WHEEL_PY) -m pip install -q "$$(ls $(WHEEL_CHECK)/dist/normfold-*.whl)[hf]"
	cd $(WHEEL_CHECK) && export NORMFOLD_CACHE_DIR="$$PWD/cache" && \
	  venv/bin/python -c "import normfold; print('smoke import: normfold', normfold.__version__)" && \
	  venv/bin/normfold --version && \
	  venv/bin/normfold demo && \
	  venv/bin/python $(CURDIR)/scripts/walkthrough.py --wheel "$$(ls dist/normfold-*.whl)"

# The API reference (build/docs/index.html) from the docstrings of the public API (each module's
# __all__); any warning (an annotation pdoc cannot resolve, a module that fails to import) fails it.
docs: venv
	rm -rf build/docs
	$(PY) -W error -m pdoc --docformat google normfold -o build/docs

bench: venv
	$(PY) -m normfold.ops.build
	$(PY) benchmarks/bench_norm.py

# original vs folded vs folded+fused models, interleaved (benchmarks/results/e2e.*)
bench-e2e: venv
	$(PY) -m normfold.ops.build
	$(PY) benchmarks/bench_e2e.py --threads 1

# original vs folded vs folded+fused exports in ONNX Runtime, and the single-op table (benchmarks/results/onnx*.*;
# the onnx extra comes with .[dev])
bench-onnx: venv
	$(PY) -m normfold.ops.build
	$(PY) benchmarks/bench_onnx.py --ops

# a 13 GB OPT-6.7B-shaped fp16 checkpoint folded shard by shard (needs ~30 GB free disk)
bench-fold-large: venv
	nice -n 10 $(PY) benchmarks/bench_fold_large.py

# retrain the bundled default model (deterministic; 250 steps, ~13 minutes measured on a shared 2-core machine)
default-model: venv
	nice -n 10 $(PY) scripts/train_default_model.py

# random-architecture fuzzing of the fold engine (make fuzz N=5000); record in benchmarks/results/fuzz.md
fuzz: venv
	nice -n 10 $(PY) benchmarks/fuzz_fold.py --n $(N)

# one random change to random folded, rotated and approximate folders: does verify exit nonzero?
# (make tamper-fuzz TAMPER_N=1000); record in benchmarks/results/tamper_fuzz.md
TAMPER_N ?= 500
tamper-fuzz: venv
	nice -n 10 $(PY) benchmarks/tamper_fuzz.py --n $(TAMPER_N)

# CUDA machines only: kernel correctness vs the fp64 reference and timings vs torch (tables in benchmarks/results/),
# then training time of the norm variants at width 384 and 1024 (tables in experiments/results/; each into $OUT if set)
gpu-check:
	bash benchmarks/gpu_check.sh
	bash benchmarks/gpu_train.sh

# CUDA machines only: folded vs original models end to end (fp16, batch 1/8, seq 128-4096)
gpu-e2e:
	bash benchmarks/gpu_e2e.sh

# CUDA machines only: where a norm call's time goes (host µs per call, fwd+bwd kernels, compile; ~2 min)
gpu-overhead:
	bash benchmarks/gpu_overhead.sh

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache

# The oldest supported stack (pyproject's floors: torch 2.11, triton 3.6) in a venv of its own, with
# numpy<2.4 (triton 3.6's interpreter needs it) and Python $(PYTHON): the ops tests and the three GPU
# scripts' dry runs, from the source tree. PyPI's only torch 2.11 for Linux is the CUDA build (it runs
# on the CPU): ~4.7 GB installed with its nvidia-* wheels. Measured on the shared 2-core machine: 7.5 min
# from nothing (install ~2.5, ops tests 3.6, dry runs ~1.5), so CI does not run it.
OLDEST ?= build/oldest-stack
OLDEST_SPEC ?= torch==2.11.0 triton==3.6.0 numpy<2.4
OLDEST_PY := $(OLDEST)/venv/bin/python
OLDEST_STAMP := $(OLDEST)/venv/.normfold-installed

$(OLDEST_STAMP):
	test -x $(OLDEST_PY) || $(PYTHON) -m venv $(OLDEST)/venv
	$(OLDEST_PY) -m pip install -q $(foreach spec,$(OLDEST_SPEC),"$(spec)")
	$(OLDEST_PY) -m pip install -q ninja "pytest>=8" "hypothesis>=6" "transformers>=4.45" "safetensors>=0.4"
	touch $@

oldest-stack: $(OLDEST_STAMP)
	$(OLDEST_PY) -c "import sys, torch, triton, numpy; print('oldest stack: python', sys.version.split()[0], \
	  'torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__)"
	export PYTHONPATH="$(CURDIR)/src" NORMFOLD_CACHE_DIR="$(abspath $(OLDEST))/cache" PYTHON="$(abspath $(OLDEST_PY))" \
	  OUT="$(abspath $(OLDEST))/results" TRITON_INTERPRET=1 TRITON_DEFAULT_FP_FUSION=1 && \
	  $(OLDEST_PY) -m pytest -q -p no:cacheprovider tests/ops && \
	  bash benchmarks/gpu_check.sh --dry-run && \
	  bash benchmarks/gpu_e2e.sh --dry-run && \
	  bash benchmarks/gpu_overhead.sh --dry-run && \
	  bash benchmarks/gpu_train.sh --dry-run
