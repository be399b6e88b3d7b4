# make test         install the pinned versions (constraints.txt) into the active Python, run the CPU suite
# make demo         the same install, then train a small hybrid GDN / attention model with CP (python -m cp_ops demo,
#                   the example application in examples/cp_ops_demo)
# make test-latest  the suite in .venv-latest against the newest versions pyproject.toml allows
# make pins         regenerate constraints.txt from a fresh environment
# GPU tests and benchmarks (on a GPU machine): python benchmarks/gpu_suite.py
PYTHON ?= python3
EXTRAS = test,hf

.PHONY: test deps test-cpu test-interpret test-opaque test-latest pins demo

test: deps test-cpu test-interpret test-opaque

# Always applied: an installed package of another version is replaced by the pinned one. The
# pinned torch is the CPU build (a bare `torch` requirement pulls a multi-GB CUDA build).
deps:
	$(PYTHON) -m pip install -q -c constraints.txt -e ".[$(EXTRAS)]"
	@$(PYTHON) tools/pins.py check constraints.txt

test-cpu:
	$(PYTHON) -m pytest -m "not interpret"

# Triton kernels on CPU tensors: TRITON_INTERPRET must be set before triton is imported.
test-interpret:
	TRITON_INTERPRET=1 $(PYTHON) -m pytest -m interpret

# The compile tests again with the kernels registered as opaque ops, the form the ops take when the
# installed triton is newer than the one torch pins (custom_ops._common.kernels_visible_to_compiler):
# layout, all-to-all and attention kernels in Triton's interpreter, the GDN layers on references.
test-opaque:
	CP_OPS_OPAQUE_KERNELS=1 TRITON_INTERPRET=1 $(PYTHON) -m pytest -q -k compiled \
		tests/custom_ops tests/cp_ops/test_comm.py tests/cp_ops/test_attention.py \
		--deselect tests/custom_ops/test_gdn_ops.py::test_compiled_fullgraph_forward_backward
	CP_OPS_OPAQUE_KERNELS=1 $(PYTHON) -m pytest -q -k compiled \
		tests/cp_ops/test_gdn_cp.py tests/cp_ops/test_gdn_layer.py tests/examples/test_demo.py

demo: deps
	$(PYTHON) -m cp_ops demo

# The newest versions allowed, in an environment of their own, torch kept at its pin (a newer
# torch from PyPI is a multi-GB CUDA build); prints what differs from constraints.txt first.
test-latest:
	$(PYTHON) -m venv .venv-latest
	grep '^torch==' constraints.txt > .venv-latest/torch-pin.txt
	.venv-latest/bin/python -m pip install -q -c .venv-latest/torch-pin.txt --upgrade --upgrade-strategy eager -e ".[$(EXTRAS)]"
	.venv-latest/bin/python tools/pins.py diff constraints.txt
	$(MAKE) test-cpu test-interpret test-opaque PYTHON=.venv-latest/bin/python

pins:
	rm -rf .venv-pins && $(PYTHON) -m venv .venv-pins
	.venv-pins/bin/python -m pip install -q torch==2.13.0
	.venv-pins/bin/python -m pip install -q -e ".[$(EXTRAS)]"
	.venv-pins/bin/python tools/pins.py freeze > constraints.txt
	rm -rf .venv-pins
