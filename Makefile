# make test   install what is missing into the active Python, then run the CPU test suite
# GPU tests and benchmarks (on a GPU machine): python benchmarks/gpu_suite.py
# make demo   install what is missing, then train a small hybrid GDN / attention model with CP (python -m cp_ops demo)
PYTHON ?= python3

.PHONY: test deps test-cpu test-interpret test-opaque demo

test: deps test-cpu test-interpret test-opaque

# torch first, pinned to the CPU build on a fresh machine (a bare `torch` requirement pulls a
# multi-GB CUDA build); an installed torch is kept. Then this package and its test extras.
deps:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q torch==2.13.0
	@$(PYTHON) -c "import triton, fla, einops, pytest, hypothesis, matplotlib, custom_ops" 2>/dev/null || $(PYTHON) -m pip install -q -e ".[test]"

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
		tests/cp_ops/test_gdn_cp.py tests/cp_ops/test_gdn_layer.py tests/cp_ops/test_demo.py

demo: deps
	$(PYTHON) -m cp_ops demo
