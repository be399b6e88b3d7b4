"""All-gather CP attention's FlashAttention 4 backend: which calls take it, and the translation of
the op's layout into FlashAttention 4's varlen arguments.

On the CPU the backend's calls reach a torch emulation of the FlashAttention 4 semantics the
backend relies on (tests/cp_ops/fa4_emulation.py: an emulation, not the library), so a wrong
offset, a missed chunk or a dk/dv not summed fails against ``ag_thd_attention_reference`` here:
float64 data, with the log-sum-exp kept in float32 between forward and backward as FlashAttention
4 keeps it, so to 1e-6 (errors of the translation are of order 1). The GPU tests at the end run the real kernels
against our segment kernels and the float32 reference, bf16 to TOLERANCE[bf16] (as the CP
attention GPU tests: tests/cp_ops/test_gpu_multi_rank.py).
"""

from __future__ import annotations

import contextlib
import types

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from cp_ops import pad_cu_seqlens, shard_thd
from custom_ops import ag_thd_attention, ag_thd_attention_reference, env
from custom_ops.ag_attention import backends
from custom_ops.ag_attention.fa4 import fa4_attention, fa4_tables, set_interface, zero_uncovered_rows
from custom_ops.ag_attention.op import _ag_thd_attention
from custom_ops.runtime.groups import resolve_group
from custom_ops.testing import TOLERANCE, poisoned_allocations, rel_error, thd_layouts
from tests._dist import run_ranks
from tests.cp_ops import fa4_emulation
from tests.cp_ops.test_attention import _assert_close, _cp_run, _global_case, _reference

TOL = 1e-6  # float64 data, float32 lse (see above)

# (seqlens, (Hq, Hkv), D, causal, window): lengths 0 and 1, below a chunk, odd; GQA; the window
# forms the backend takes (causal with a left window or none; non-causal without one)
CASES = [
    ([9, 0, 1, 23, 6], (8, 1), 8, True, (-1, -1)),
    ([17, 1, 0, 30], (6, 2), 4, True, (5, -1)),
    ([17, 1, 0, 30], (4, 2), 4, True, (3, 4)),  # the right window is moot under causality
    ([2, 33, 0], (4, 2), 8, False, (-1, -1)),
    ([0], (2, 1), 4, True, (-1, -1)),
]


@contextlib.contextmanager
def _emulation():
    """The backend's FlashAttention 4 calls reach the emulation."""
    set_interface(fa4_emulation.EMULATION)
    try:
        yield
    finally:
        set_interface(None)


@pytest.fixture
def emulated():
    with _emulation():
        yield


@pytest.fixture(autouse=True)
def no_override():
    yield
    backends.set_backend(None)


# --- which calls take the backend -------------------------------------------------------------------


def _cuda_like(rows, heads, dim, dtype=torch.bfloat16, index=0):
    """What resolve reads of a CUDA tensor (device, shape, dtype), without a GPU."""
    return types.SimpleNamespace(device=torch.device("cuda", index), shape=(rows, heads, dim), dtype=dtype)


def _machine(version="4.0.0b36", capability=(9, 0)):
    return backends.Machine(version, lambda index: capability)


HOPPER = _machine()


def test_cpu_tensors_take_the_segment_path_whatever_is_asked(monkeypatch):
    q = torch.zeros(4, 2, 8, dtype=torch.bfloat16)
    for asked in backends.BACKENDS:
        monkeypatch.setenv("CP_OPS_ATTENTION_BACKEND", asked)
        for given_ in backends.BACKENDS:
            assert backends.resolve(q, q, True, (-1, -1), given_) == "segment"


def test_auto_takes_fa4_where_the_call_fits_it(monkeypatch):
    q, k = _cuda_like(64, 16, 256), _cuda_like(64, 2, 256)
    assert backends.resolve(q, k, machine=HOPPER) == "fa4"
    assert backends.resolve(q, k, True, (100, -1), machine=HOPPER) == "fa4"
    assert backends.resolve(q, k, False, (-1, -1), machine=HOPPER) == "fa4"
    assert backends.resolve(q, k, machine=_machine(capability=(10, 0))) == "fa4"
    assert backends.resolve(q, k, machine=_machine(version=None)) == "segment"
    monkeypatch.setenv("CP_OPS_ATTENTION_BACKEND", "segment")
    assert backends.resolve(q, k, machine=HOPPER) == "segment"
    backends.set_backend("fa4")  # over the variable
    assert backends.resolve(q, k, machine=HOPPER) == "fa4"
    assert backends.resolve(q, k, backend="segment", machine=HOPPER) == "segment"  # a backend given is kept


@pytest.mark.parametrize(
    "q, k, capability, causal, window, reason",
    [
        (_cuda_like(8, 4, 64, torch.float32), _cuda_like(8, 2, 64, torch.float32), (9, 0), True, (-1, -1),
         "bfloat16 or float16"),
        (_cuda_like(8, 4, 512), _cuda_like(8, 2, 512), (9, 0), True, (-1, -1), "8 to 256 on SM90, got 512"),
        (_cuda_like(8, 4, 192), _cuda_like(8, 2, 192), (10, 0), True, (-1, -1), "8 to 128 or 256 on SM100, got 192"),
        (_cuda_like(8, 4, 60), _cuda_like(8, 2, 60), (9, 0), True, (-1, -1), "multiples of 8, got 60"),
        (_cuda_like(8, 4, 64), _cuda_like(8, 2, 64), (8, 0), True, (-1, -1), "9.x or 10.x, got 8.x"),
        (_cuda_like(8, 4, 64), _cuda_like(8, 2, 64), (12, 0), True, (-1, -1), "got 12.x"),
        (_cuda_like(8, 4, 64), _cuda_like(8, 2, 64), (9, 0), False, (4, 2), "non-causal window"),
        (_cuda_like(8, 4, 64), _cuda_like(8, 2, 64), (9, 0), False, (-1, 0), "non-causal window"),
    ],
)  # fmt: skip
def test_calls_fa4_cannot_run_fall_back_or_raise(q, k, capability, causal, window, reason):
    machine = _machine(capability=capability)
    assert reason in backends.fa4_unfit(q, k, causal, window, machine)
    assert backends.resolve(q, k, causal, window, machine=machine) == "segment"
    backends.set_backend("fa4")
    with pytest.raises(ValueError, match="CP_OPS_ATTENTION_BACKEND=fa4, but .*use 'auto'"):
        backends.resolve(q, k, causal, window, machine=machine)


def test_fa4_missing_names_the_extra():
    q = _cuda_like(8, 2, 64)
    assert "pip install 'cp-ops[fa4]'" in backends.fa4_unfit(q, q, True, (-1, -1), _machine(version=None))
    backends.set_backend("fa4")
    with pytest.raises(ValueError, match=r"flash-attn-4 is not installed"):
        backends.resolve(q, q, machine=_machine(version=None))


def test_bad_names_and_the_cache_tag(monkeypatch):
    with pytest.raises(ValueError, match="'auto', 'segment' or 'fa4', got 'flash'"):
        backends.set_backend("flash")
    with pytest.raises(ValueError, match="backend must be one of"):
        backends.resolve(_cuda_like(1, 1, 8), _cuda_like(1, 1, 8), backend="flash")
    monkeypatch.setenv("CP_OPS_ATTENTION_BACKEND", "flash")
    with pytest.raises(ValueError, match="CP_OPS_ATTENTION_BACKEND must be auto, segment or fa4, got 'flash'"):
        env.attention_backend()
    monkeypatch.delenv("CP_OPS_ATTENTION_BACKEND")
    with torch.compiler.config.patch(cache_key_tag="mine+attn-auto-fa4-none"):
        backends.set_backend("segment")
        tag = torch.compiler.config.cache_key_tag.split("+")
        assert tag[0] == "mine" and [p for p in tag if p.startswith("attn-")] == [
            f"attn-segment-fa4-{backends.fa4_version() or 'none'}"
        ]
    assert backends.describe() == ("segment" if not torch.cuda.is_available() else backends.describe())


# --- the translation, through the emulation -----------------------------------------------------------


@given(thd_layouts(max_seqs=5, max_len=30, cp_sizes=(1, 2, 3, 4)), st.sampled_from(
    [(True, (-1, -1)), (True, (3, -1)), (True, (0, -1)), (False, (-1, -1))]))  # fmt: skip
def test_tables_give_each_rank_its_attention(layout, mask):
    """For every rank r: the calls of fa4_tables(r) on shard_r(q) against the global keys give
    shard_r of the global attention and of dq, and their dk/dv summed over the ranks give the
    global dk/dv (what the reduce-scatter sums). The op after its all-gather and reorder."""
    world, seqlens = layout
    causal, window = mask
    cu, cup, q, k, v, dout = _global_case(seqlens, (4, 2), 4, world, seed=len(seqlens))
    want = _reference(q, k, v, dout, cu, cup, causal, window)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for rank in range(world):
        with _emulation(), poisoned_allocations():
            _check_rank(q, k, v, dout, cu, cup, world, rank, causal, window, want, dk, dv)
    assert rel_error(dk, want[2]) < TOL and rel_error(dv, want[3]) < TOL


def _check_rank(q, k, v, dout, cu, cup, world, rank, causal, window, want, dk, dv):
    """Rank ``rank``'s calls against ``want``'s shard; adds its dk, dv to ``dk``, ``dv``."""
    tables = fa4_tables(cu, cup, world, torch.tensor(rank), causal)
    assert all(t.dtype == torch.int32 for t in tables) and tables[0].shape[0] == (1 if world == 1 else 2)
    q_r = shard_thd(q, cup, world, rank).requires_grad_()
    k_r, v_r = k.clone().requires_grad_(), v.clone().requires_grad_()
    out = fa4_attention(q_r, k_r, v_r, tables, causal, window[0], None)
    out.backward(shard_thd(dout, cup, world, rank))
    assert rel_error(out, shard_thd(want[0], cup, world, rank)) < TOL, f"out W={world} rank {rank}"
    assert rel_error(q_r.grad, shard_thd(want[1], cup, world, rank)) < TOL, f"dq W={world} rank {rank}"
    dk += k_r.grad
    dv += v_r.grad


def test_tables_of_a_rank():
    """W = 2, rank 0, one sequence of 11 tokens padded to 12 (chunks of 3): the first local chunk
    (positions 0-2) against keys 0-2, the second (positions 9-10, two real rows) against keys
    0-10; local rows 0-2 and 3-5."""
    cu, cup = pad_cu_seqlens([11], 2)
    cu_q, used_q, cu_k, used_k = (t.tolist() for t in fa4_tables(cu, cup, 2, torch.tensor(0), True))
    assert cu_q == [[0, 6], [3, 6]] and used_q == [[3], [2]]
    assert cu_k == [[0, 12], [0, 12]] and used_k == [[3], [11]]
    # rank 1 of [2]: its second chunk (positions 2-3 of chunks of 1) has no real row, so no keys
    cu, cup = pad_cu_seqlens([2], 2)
    assert fa4_tables(cu, cup, 2, torch.tensor(1), True)[1].tolist() == [[1], [0]]
    assert fa4_tables(cu, cup, 2, torch.tensor(1), True)[3].tolist() == [[2], [0]]


def _uncovered_rows_case(layout, rank, trailing):
    """Rank ``rank``'s tables for ``layout`` and a tensor of its local rows, each row holding its
    index (rows no call covers: the padding rows, a chunk's rows past its sequence's end)."""
    world, seqlens = layout
    cu, cup = pad_cu_seqlens(seqlens, world)
    cu_q, used_q = fa4_tables(cu, cup, world, torch.tensor(rank % world), True)[:2]
    rows = int(cup[-1]) // world
    x = torch.arange(1, rows + 1, dtype=torch.float32).reshape(-1, *[1] * len(trailing)).expand(-1, *trailing)
    covered = torch.zeros(rows, dtype=torch.bool)
    for c in range(cu_q.shape[0]):
        for start, used in zip(cu_q[c, :-1].tolist(), used_q[c].tolist()):
            covered[start : start + used] = True
    return x.contiguous(), cu_q, used_q, covered


ZERO_PATHS = [pytest.param("torch", id="torch"), pytest.param("kernel", id="kernel", marks=pytest.mark.interpret)]


@pytest.mark.parametrize("path", ZERO_PATHS)
@given(thd_layouts(max_seqs=6, max_len=40, cp_sizes=(1, 2, 3, 4), min_seqs=0), st.integers(0, 3),
       st.sampled_from([(), (3,), (2, 5), (1, 1200)]))  # fmt: skip
def test_zero_uncovered_rows(path, layout, rank, trailing):
    """Rows no call covers become 0; covered rows keep their values (the kernel over several
    column blocks at 1200 columns; the torch path without Triton)."""
    x, cu_q, used_q, covered = _uncovered_rows_case(layout, rank, trailing)
    want = torch.where(covered.reshape(-1, *[1] * len(trailing)), x, 0.0)
    assert torch.equal(zero_uncovered_rows(x, cu_q, used_q), want)


def test_zero_uncovered_rows_kernel_compiles_for_hopper():
    """The GPU runs the kernel the interpreter tests: it compiles for sm_90 (bf16 rows)."""
    pytest.importorskip("triton.backends.nvidia")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from custom_ops.ag_attention.fa4 import _ZERO_COLS, _ZERO_ROWS
    from custom_ops.ag_attention.kernels import zero_uncovered_rows_kernel as kernel

    constants = dict(BLOCK_R=_ZERO_ROWS, BLOCK_D=_ZERO_COLS)
    pointers = {"x_ptr": "*bf16", "cu_ptr": "*i32", "used_ptr": "*i32"}
    signature = {n: "constexpr" if n in constants else pointers.get(n, "i32") for n in kernel.arg_names}
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(kernel.arg_names.index(k),): v for k, v in constants.items()})  # fmt: skip
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    except (ImportError, TypeError, AttributeError) as e:  # compile API of another triton release
        pytest.skip(f"cannot compile for sm_90 with triton {triton.__version__}: {e}")
    assert "st.global" in compiled.asm["ptx"]


def _op(group=None, head_groups=1):
    """``fn(q, k, v, cu, cup, causal, window)``: the op's decomposition with the backend given
    (the public op resolves it; on CPU tensors always to ``segment``)."""
    group_name, world = resolve_group(group)

    def fn(q, k, v, cu, cup, causal, window, backend="fa4"):
        return _ag_thd_attention(q, k, v, cu, cup, causal, window[0], window[1], None, group_name, world,
                                 head_groups=head_groups, backend=backend)  # fmt: skip

    return fn


@pytest.mark.parametrize("case", range(len(CASES)))
def test_op_at_w1(emulated, poison_empty, case):
    """The op (W = 1) on the FlashAttention 4 path matches the reference, padding rows (zero
    output, zero gradient) included, with and without head groups."""
    seqlens, heads, d, causal, window = CASES[case]
    cu, cup, q, k, v, dout = _global_case(seqlens, heads, d, 1, seed=case)
    want = _reference(q, k, v, dout, cu, cup, causal, window)
    for g in (1, 2) if heads[1] % 2 == 0 else (1,):
        _assert_close(_cp_run(_op(head_groups=g), q, k, v, dout, cu, cup, causal, window), want, TOL, f"case {case}")


def test_op_compiles_with_no_graph_break(emulated):
    """torch.compile(fullgraph=True) traces through the op on the FlashAttention 4 path: the
    calls are opaque ops with fakes and an autograd formula."""
    seqlens, heads, d, causal, window = CASES[1]
    cu, cup, q, k, v, dout = _global_case(seqlens, heads, d, 1, seed=1)
    compiled = torch.compile(_op(), fullgraph=True, backend="aot_eager")
    got = _cp_run(compiled, q, k, v, dout, cu, cup, causal, window)
    _assert_close(got, _reference(q, k, v, dout, cu, cup, causal, window), TOL, "compiled")


def test_fa4_ops_opcheck(emulated):
    cu, cup = pad_cu_seqlens([9, 0, 5], 2)
    q, k, v = (torch.randn(int(cup[-1]), h, 8, dtype=torch.float64) for h in (4, 2, 2))
    tables = fa4_tables(cu, cup, 2, torch.tensor(1), True)
    q_r = shard_thd(q, cup, 2, 1).requires_grad_()
    torch.library.opcheck(torch.ops.cp_ops.fa4_varlen_forward.default,
                          (q_r, k.requires_grad_(), v.requires_grad_(), *tables, True, 3, 0.25))  # fmt: skip


def _op_rank(rank, world):
    set_interface(fa4_emulation.EMULATION)
    group = dist.group.WORLD
    for i, (seqlens, heads, d, causal, window) in enumerate(CASES):
        cu, cup, q, k, v, dout = _global_case(seqlens, heads, d, world, seed=i)
        want = [shard_thd(t, cup, world, rank) for t in _reference(q, k, v, dout, cu, cup, causal, window)]
        local = [shard_thd(t, cup, world, rank) for t in (q, k, v, dout)]
        for g in (1, 2) if heads[1] % 2 == 0 else (1,):
            got = _cp_run(_op(group, g), *local, cu, cup, causal, window)
            _assert_close(got, want, TOL, f"W={world} rank {rank} case {i} head_groups={g}")


# slow: the fast tier checks every rank's calls in one process (test_tables_give_each_rank_its_attention)
@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
def test_op_on_ranks(world):
    """The op on W gloo ranks on the FlashAttention 4 path: the gathered K/V put in sequence
    order, two calls a rank, dk/dv back to rank order and reduce-scattered."""
    run_ranks(world, _op_rank)


# --- GPU: the real kernels ---------------------------------------------------------------------------

GPU_SEQLENS = [1000, 0, 1, 3000, 77, 5]


def _gpu_case(world, heads, d, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    cu, cup = pad_cu_seqlens(GPU_SEQLENS, world, device="cuda")
    rows = int(cup[-1])
    q, k, v = (torch.randn(rows, h, d, device="cuda", dtype=torch.bfloat16, generator=gen) for h in (heads[0], *heads[1:] * 2))
    return cu, cup, q, k, v, torch.randn(rows, heads[0], d, device="cuda", dtype=torch.bfloat16, generator=gen)


def _gpu_compare(run, cu, cup, q, k, v, dout, causal, window, world, rank, what):
    """``run(q, k, v)`` (this rank's shards, bf16) against the float32 reference's shard and
    against the segment kernels' result, to TOLERANCE[bf16]."""
    ref = _reference(*(t.float() for t in (q, k, v, dout)), cu, cup, causal, window)
    local = [shard_thd(t, cup, world, rank) for t in (q, k, v)]
    got = run(*local, shard_thd(dout, cup, world, rank), "fa4")
    seg = run(*local, shard_thd(dout, cup, world, rank), "segment")
    for name, a, b, s in zip(("out", "dq", "dk", "dv"), got, ref, seg):
        b = shard_thd(b, cup, world, rank)
        assert rel_error(a, b) < TOLERANCE[torch.bfloat16], f"{what} {name} against the reference"
        assert rel_error(a, s) < TOLERANCE[torch.bfloat16], f"{what} {name} against the segment kernels"


def _runner(group, causal, window, cu, cup, head_groups=1):
    fn = _op(group, head_groups)

    def run(q, k, v, dout, backend):
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        out = fn(q, k, v, cu, cup, causal, window, backend)
        out.backward(dout)
        return out.detach(), q.grad, k.grad, v.grad

    return run


GPU_MASKS = [(True, (-1, -1)), (True, (256, -1)), (False, (-1, -1))]


@pytest.mark.gpu
@pytest.mark.parametrize("heads, d", [((16, 2), 256), ((8, 1), 128)])
@pytest.mark.parametrize("causal, window", GPU_MASKS)
def test_gpu_w1_against_segment_kernels_and_reference(heads, d, causal, window):
    pytest.importorskip("flash_attn.cute", reason="needs the fa4 extra")
    cu, cup, q, k, v, dout = _gpu_case(1, heads, d)
    _gpu_compare(_runner(None, causal, window, cu, cup), cu, cup, q, k, v, dout, causal, window, 1, 0, "W=1")


@pytest.mark.gpu
def test_gpu_w1_compiled_fullgraph():
    """The public op with CP_OPS_ATTENTION_BACKEND's choice fa4, compiled with Inductor and no
    graph break, against the eager FlashAttention 4 path."""
    pytest.importorskip("flash_attn.cute", reason="needs the fa4 extra")
    cu, cup, q, k, v, dout = _gpu_case(1, (16, 2), 256)
    backends.set_backend("fa4")

    def step(q_, k_, v_):
        return ag_thd_attention(q_, k_, v_, cu, cup, causal=True)

    for fn in (step, torch.compile(step, fullgraph=True)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        out.backward(dout)
        if fn is step:
            want = (out.detach(), *(t.grad for t in leaves))
        else:
            for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in leaves)), want):
                assert rel_error(a, b) < TOLERANCE[torch.bfloat16], name


def _gpu_rank(rank, world):
    group = dist.group.WORLD
    for heads, d in (((16, 2), 256), ((8, 1), 128)):
        cu, cup, q, k, v, dout = _gpu_case(world, heads, d)
        for causal, window in GPU_MASKS:
            for g in (1, 2) if heads[1] % 2 == 0 else (1,):
                run = _runner(group, causal, window, cu, cup, head_groups=g)
                _gpu_compare(run, cu, cup, q, k, v, dout, causal, window, world, rank,
                             f"W={world} rank {rank} {heads} D={d} {causal} {window} head_groups={g}")  # fmt: skip


@pytest.mark.gpu
@pytest.mark.dist
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_w2_nccl():
    pytest.importorskip("flash_attn.cute", reason="needs the fa4 extra")
    run_ranks(2, _gpu_rank, backend="nccl")
