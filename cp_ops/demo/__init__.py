"""The demo: train a small hybrid GDN / attention stack with context parallelism.

``python -m cp_ops demo [options]`` (or ``make demo``) runs it; ``--help`` lists the
options. A Qwen3-Next-style stack (:class:`cp_ops.GatedDeltaNet`, gated
:class:`cp_ops.Attention`, SwiGLU MLPs) is trained with next-token cross-entropy on
packed random sequences of mixed lengths (THD layout from :func:`cp_ops.pad_cu_seqlens`,
sharded with :func:`cp_ops.shard_thd`), AdamW, for ``--steps`` steps, on W = ``--cp-size``
local ranks that it spawns itself: gloo on CPU, NCCL on GPUs (rank r on GPU r). Every
rank builds the same weights and the same global batch and keeps its shard. Step 1 is
checked against the same model on one device, and the run prints ranks, backend,
tokens/s, step and compile time, graph breaks, recompiles, the error against one device
and peak memory.

The check runs in ``--check-dtype`` (default: ``--dtype``), at the tolerance
:data:`~cp_ops.demo.train.TOLERANCE` gives that dtype. Two correct bfloat16 runs that round differently differ by
several percent in every gradient of this model at initialisation, so a bfloat16 check
catches faults the size of one rank's rotary positions off by one, not subtler ones; ``--dtype
bfloat16 --check-dtype float32`` checks a float32 copy at a tight tolerance instead. On GPUs a
float32 check is only as good as Triton's float32 dots, TF32 unless ``TRITON_F32_DEFAULT=ieee``
is set, and it compiles and autotunes a second set of kernels (FLA's included), which makes a
cold-cache start take minutes longer (docs/benchmarks.md, section "The whole model").

It uses only the public API of ``cp_ops`` and ``custom_ops``, and nothing of the library imports
it. The modules, by job:

- :mod:`cp_ops.demo.model`: the hybrid stack (``HybridLM``);
- :mod:`cp_ops.demo.data`: the packed random batches (``make_batch``);
- :mod:`cp_ops.demo.train`: one rank's training loop and the check of step 1 (``train``);
- :mod:`cp_ops.demo.report`: the results over ranks, the summary, the printed table and its last line, PASS or FAIL;
- :mod:`cp_ops.demo.ranks`: spawning the local ranks and joining their group;
- :mod:`cp_ops.demo.cli`: the options, ``run`` (results as a dict) and ``main``.
"""
