# `make demo` and `make test` each create .venv when missing and install what they need.
# torch is pinned for development and CI (pip takes the CPU build on this kind of machine);
# pyproject keeps a range for users.  An installed torch is never replaced.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.rlx_nb-installed
TORCH_PIN := torch==2.13.0

.PHONY: demo test lint format bench bench-check notebooks clean

$(STAMP): pyproject.toml requirements/runtimes.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q $(TORCH_PIN)
	$(BIN)/python -m pip install -q -e '.[onnx,openvino,notebook,browser,bench,graph,dev]'
	$(BIN)/python -m pip install -q --no-deps -r requirements/runtimes.txt
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/rlx-nb demo

LINTED := rlx_nb rlx_nb_cli.py rlx_nb_pytest.py tests bench

lint: $(STAMP)
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)

format: $(STAMP)
	$(BIN)/ruff format $(LINTED)
	$(BIN)/ruff check --fix $(LINTED)

# numpy's bundled OpenBLAS can hang in a threaded call after the process forked
# (OpenMathLib/OpenBLAS#5520); rlx_nb makes no BLAS call, and the suite keeps it single-threaded.
# The suite runs in one pytest-xdist worker per core (TEST_WORKERS=0 for one process); a notebook's
# tests share a worker, so each notebook executes once.
# Each worker runs torch on one thread (TEST_THREADS): two workers of two OpenMP threads each on two cores made
# libgomp's spinning threads wait on each other (a test's one-second matmul took a minute under load).
# Inductor compiles in the process itself (TORCHINDUCTOR_COMPILE_THREADS=1): its default pool of compile workers is
# started by every process that compiles (each worker, notebook kernel and CLI run), each importing torch again.
# Bytecode is cached (PYTHONDONTWRITEBYTECODE unset; __pycache__ is ignored by git): where the environment turns it
# off, every worker, notebook kernel and command-line run compiled rlx_nb again, and pytest rewrote the asserts of
# 300 modules in each worker (7 s of its collection).
# OpenMP's idle threads sleep (OMP_WAIT_POLICY=PASSIVE): a run on another thread count (training's envelope and its
# `threads` backend) spun its second thread against the other worker, and 20,000 small matmuls took 3.5x as long.
# A test that hangs fails after 10 minutes (pytest-timeout, by a signal in the test's own thread: its thread method ends
# the worker, and pytest-xdist's loadgroup scheduler then waits for ever for the dead worker's tests); one stuck in C,
# where no signal lands, prints every thread's stack at 11 (faulthandler_timeout).  As the suite runs, the controller
# names each test still running after 5 minutes and each that took over 90 s (tests/watch.py), and the slowest 25 are
# listed at the end: a run cut short by CI's limit says what it was doing.
TEST_WORKERS ?= auto
TEST_THREADS ?= 1
test: lint
	env -u PYTHONDONTWRITEBYTECODE OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=$(TEST_THREADS) OMP_WAIT_POLICY=PASSIVE \
		TORCHINDUCTOR_COMPILE_THREADS=1 \
		$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=25

# A quick set of the ratio benchmarks against the committed results (a few minutes; not part of `make test`):
# fails when a ratio is more than 25% worse than committed or misses its target (an end-to-end size that fails is
# measured again in another fresh process, up to 3, and the best kept).  Run it before resolving an issue that
# touches rlx_nb/.
bench-check: $(STAMP)
	OPENBLAS_NUM_THREADS=1 $(BIN)/python bench/check.py

bench: $(STAMP)
	$(BIN)/python bench/metrics_speed.py
	$(BIN)/python bench/heatmap_speed.py
	$(BIN)/python bench/end_to_end.py
	$(BIN)/python bench/explorer_speed.py
	$(BIN)/python bench/notebook_speed.py
	$(BIN)/python bench/report_memory.py
	$(BIN)/python bench/growth.py
	$(BIN)/python bench/gather_speed.py
	$(BIN)/python bench/detection.py
	$(BIN)/python bench/extra_metrics_cost.py
	$(BIN)/python bench/baseline_speed.py

notebooks: $(STAMP)
	$(BIN)/python notebooks/build_notebooks.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
