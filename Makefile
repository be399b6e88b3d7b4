# Every target works in a virtual environment: the active one (VIRTUAL_ENV), else .venv, made on first use;
# make refuses a PYTHON outside one. On a machine without an NVIDIA GPU (no nvidia-smi) torch comes from
# PyTorch's index of CPU builds (TORCH_INDEX; PyPI's Linux torch is a CUDA build of several GB).
#
# make test         the fast tier, what CI runs (.ci/run): install the pinned versions (constraints.txt) into the
#                   environment, then the CPU suite, the Triton kernels in Triton's interpreter and the compile
#                   tests with the kernels as opaque ops, each on two pytest workers; tests marked slow left out
# make test-all     everything: the same passes with the slow tests, hypothesis's thorough profile (8x the
#                   examples) and, on a machine with a GPU, the gpu tests; on demand and on the GPU machine
# make demo         the same install, then train a small hybrid GDN / attention model with CP (python -m cp_ops demo,
#                   the demo in cp_ops/demo)
# make test-latest  the fast tier in .venv-latest against the newest versions pyproject.toml allows
# make pins         regenerate constraints.txt from a fresh environment (the notebooks extra's pins last)
# GPU tests and benchmarks (on a GPU machine): python benchmarks/gpu_suite.py
#
# Hypothesis draws new examples every run, from one seed that each pass prints (pytest's header
# and summary). A failure reproduces with HYPOTHESIS_SEED=<seed> make test, or one test with
# python -m pytest --hypothesis-seed=<seed> tests/<file>.py::<test>; then pin the failing input
# with @example on the test (tests/_profiles.py).
ifdef VIRTUAL_ENV
PYTHON ?= python3
else
PYTHON ?= .venv/bin/python
endif
# PyTorch's CPU builds where no NVIDIA GPU is seen; empty: the indexes pip is configured with
TORCH_INDEX ?= $(if $(shell command -v nvidia-smi),,https://download.pytorch.org/whl/cpu)
# pip arguments that install the pinned torch alone, from TORCH_INDEX
TORCH_PIN = --no-deps -c constraints.txt $(if $(TORCH_INDEX),--retries 1 --index-url $(TORCH_INDEX)) torch
TORCH_FAILED = { echo "make: no torch from $(or $(TORCH_INDEX),pip's indexes); TORCH_INDEX=URL names another index"; exit 1; }
EXTRAS = test,hf
# pytest workers (pytest-xdist): most tests keep one core busy (tracing, Triton's interpreter); each pass
# lists its 15 longest tests last, where a pass's time goes
JOBS ?= 2
PYTEST = $(PYTHON) -m pytest -n $(JOBS) --dist worksteal --durations=15
# the tier: make test-all sets it empty
NOT_SLOW = and not slow

# Bytecode caches are written (Python's default) even where the environment turns them off: the
# suite's processes import the same modules hundreds of times, and pytest caches its rewritten tests.
# So pip installs without compiling (--no-compile): a module is compiled when first imported, and the
# thousands that never are (most of torch's and transformers') cost nothing.
export PYTHONDONTWRITEBYTECODE =

# one seed for every pass of a run (tests/conftest.py reads it; a seed given is kept)
ifeq ($(origin HYPOTHESIS_SEED),undefined)
HYPOTHESIS_SEED := $(shell python3 -c "import secrets; print(secrets.randbelow(2**32))")
endif
export HYPOTHESIS_SEED

.PHONY: test test-all deps venv test-cpu test-interpret test-opaque test-latest pins demo

test: deps test-cpu test-interpret test-opaque

test-all: deps
	$(MAKE) test-cpu test-interpret test-opaque NOT_SLOW= HYPOTHESIS_PROFILE=thorough

.venv/bin/python:
	python3 -m venv .venv

# The environment make installs into: .venv where none is active; PYTHON given outside one is refused.
venv: $(filter .venv/bin/python,$(PYTHON))
	@$(PYTHON) -c "import os, sys; sys.exit(sys.prefix == sys.base_prefix and os.environ.get('CONDA_PREFIX') != sys.prefix)" || { \
		echo "make: $(PYTHON) is not in a virtual environment, and make installs packages into it."; \
		echo "      Activate one (python3 -m venv .venv && . .venv/bin/activate) or run make without PYTHON=."; \
		exit 1; }

# Always applied: an installed package of another version is replaced by the pinned one. torch first,
# alone and from TORCH_INDEX, so that the next line finds it installed and takes no other build.
deps: venv
	$(PYTHON) -m pip install -q --no-compile $(TORCH_PIN) || $(TORCH_FAILED)
	$(PYTHON) -m pip install -q --no-compile -c constraints.txt -e ".[$(EXTRAS)]"
	@$(PYTHON) tools/pins.py check constraints.txt

# The fast tier compiles each kernel family's ops in bf16 once, in test-opaque's form (kernels run in the
# interpreter inside the compiled graph); each op's own tests compile it with visible kernels here. So
# does the valid-token copy's dynamic-shape compile.
BF16_IN_TEST_OPAQUE = $(foreach op,thd_reorder thd_copy_valid_tokens permute_sections varlen_attention \
	varlen_attention_key_rows ag_thd_attention causal_conv1d segment_matmul, \
	--deselect 'tests/custom_ops/test_op_contracts.py::test_compiled_bf16[$(op)]') \
	--deselect 'tests/custom_ops/test_thd_copy_valid_tokens.py::test_compiled_fullgraph_dynamic_no_recompile[in_place]'
test-cpu:
	$(PYTEST) -m "not interpret $(NOT_SLOW)" $(if $(NOT_SLOW),$(BF16_IN_TEST_OPAQUE))

# Triton kernels on CPU tensors: TRITON_INTERPRET must be set before triton is imported; fewer
# hypothesis examples a property than test-cpu (tests/_profiles.py), a profile given is kept.
# Only the files that mark tests interpret are collected (importing the others, transformers' Trainer
# among them, takes each worker seconds).
INTERPRET_FILES = $(shell grep -rl --include='*.py' 'mark\.interpret' tests)
test-interpret:
	TRITON_INTERPRET=1 HYPOTHESIS_PROFILE=$(or $(HYPOTHESIS_PROFILE),interpret) $(PYTEST) -m "interpret $(NOT_SLOW)" \
		$(INTERPRET_FILES)

# The compile tests again with the kernels registered as opaque ops, the form the ops take when the
# installed triton is newer than the one torch pins (custom_ops.runtime.registration.kernels_visible_to_compiler):
# layout, all-to-all and attention kernels in Triton's interpreter (the two-rank compiles with visible
# kernels are in test-cpu), and the eager checked mode, whose compiled graphs call the opaque ops' bodies
# and read nothing. Left out: the compiled tests whose graphs hold only ops registered opaque in either
# form, on their torch references (the GDN core and the loss, one-rank GDN layers and demo steps), the
# same graphs as test-cpu's.
SAME_GRAPHS = --deselect tests/custom_ops/test_gdn_ops.py::test_compiled_fullgraph_forward_backward \
	--deselect tests/custom_ops/test_gdn_ops.py::test_compiled_with_state_fullgraph_forward_backward \
	--deselect 'tests/custom_ops/test_op_contracts.py::test_compiled_bf16[gated_delta_rule]' \
	--deselect 'tests/custom_ops/test_op_contracts.py::test_compiled_bf16[linear_cross_entropy]' \
	--deselect tests/custom_ops/test_linear_cross_entropy.py::test_compiled_fullgraph_two_packings_no_recompile \
	--deselect tests/cp_ops/test_demo.py::test_compiled_step_matches_eager
# The fast tier leaves out the all-to-all's two-rank compile in the interpreter and two ops' own
# dynamic-shape compiles ($(OPAQUE_IN_TEST_ALL)): each op's compile in this form is in test_op_contracts.py,
# and those tests run in test-cpu with the kernels visible to the compiler.
OPAQUE_IN_TEST_ALL = --deselect tests/cp_ops/test_comm.py::test_compiled_single_all_to_all_groups_baseline_shims_bad_input \
	--deselect tests/custom_ops/test_varlen_attention.py::test_compiled_fullgraph_dynamic_no_recompile \
	--deselect tests/custom_ops/test_permute_sections.py::test_compiled_fullgraph
# The checked mode's compiled tests run in the first pytest run; the layers' two-rank compiles (slow
# tests only) without the interpreter, in a second.
test-opaque:
	CP_OPS_OPAQUE_KERNELS=1 TRITON_INTERPRET=1 $(PYTEST) -q $(if $(NOT_SLOW),-m "not slow") -k compiled \
		tests/custom_ops tests/cp_ops/test_comm.py tests/cp_ops/test_attention.py tests/test_checked_mode.py \
		$(SAME_GRAPHS) $(if $(NOT_SLOW),$(OPAQUE_IN_TEST_ALL))
	$(if $(NOT_SLOW),,CP_OPS_OPAQUE_KERNELS=1 $(PYTEST) -q -k compiled tests/cp_ops/test_gdn_cp.py tests/cp_ops/test_demo.py \
		$(SAME_GRAPHS))

demo: deps
	$(PYTHON) -m cp_ops demo

# The newest versions allowed, in an environment of their own, torch kept at its pin (a newer
# torch from PyPI is a multi-GB CUDA build); prints what differs from constraints.txt first.
test-latest:
	$(PYTHON) -m venv .venv-latest
	grep '^torch==' constraints.txt > .venv-latest/torch-pin.txt
	.venv-latest/bin/python -m pip install -q $(TORCH_PIN) || $(TORCH_FAILED)
	.venv-latest/bin/python -m pip install -q -c .venv-latest/torch-pin.txt --upgrade --upgrade-strategy eager -e ".[$(EXTRAS)]"
	.venv-latest/bin/python tools/pins.py diff constraints.txt
	$(MAKE) test-cpu test-interpret test-opaque PYTHON=.venv-latest/bin/python

pins:
	rm -rf .venv-pins && $(PYTHON) -m venv .venv-pins
	.venv-pins/bin/python -m pip install -q $(TORCH_PIN) || $(TORCH_FAILED)
	.venv-pins/bin/python -m pip install -q -e ".[$(EXTRAS)]"
	# the flashqla, trainer, attention-baselines and fa4 extras' pins (tested on GPU machines and by hand): kept as they are
	sed -n '/^# optional: the flashqla extra/,$$p' constraints.txt > .venv-pins/flashqla.txt
	.venv-pins/bin/python tools/pins.py freeze > constraints.txt
	.venv-pins/bin/python -m pip install -q -c constraints.txt -e ".[notebooks]"
	.venv-pins/bin/python tools/pins.py freeze-optional constraints.txt notebooks > .venv-pins/optional.txt
	cat .venv-pins/optional.txt .venv-pins/flashqla.txt >> constraints.txt
	rm -rf .venv-pins
