"""Layout helpers: pad_cu_seqlens, validate_thd, validate_offsets, shard/unshard, pack."""

import pytest
import torch
from hypothesis import given

import cp_ops

import custom_ops
from custom_ops.testing import random_tensor, thd_layouts, trailing_shapes
from custom_ops.thd_reorder.reference import thd_seq_to_rank_order_loop


@given(thd_layouts())
def test_pad_cu_seqlens_formula(layout):
    cp_size, seqlens = layout
    cu, cup = cp_ops.pad_cu_seqlens(seqlens, cp_size)
    assert cu.dtype == cup.dtype == torch.int32
    assert cu.tolist() == [sum(seqlens[:i]) for i in range(len(seqlens) + 1)]
    padded = cup.diff().tolist()
    for n, p in zip(seqlens, padded):
        assert p % (2 * cp_size) == 0 and n <= p < n + 2 * cp_size
    custom_ops.validate_thd(cu, cup, cp_size, int(cup[-1]))


def test_pad_cu_seqlens_from_tensor_keeps_device_and_rejects_negative():
    cu, cup = cp_ops.pad_cu_seqlens(torch.tensor([3, 0, 5]), 2)
    assert cu.tolist() == [0, 3, 3, 8] and cup.tolist() == [0, 4, 4, 12]
    with pytest.raises(ValueError, match="sequence 1 has negative length -2"):
        cp_ops.pad_cu_seqlens([3, -2], 2)


@given(thd_layouts(), trailing_shapes())
def test_shard_unshard_round_trip(layout, trailing):
    cp_size, seqlens = layout
    _, cup = cp_ops.pad_cu_seqlens(seqlens, cp_size)
    x = random_tensor((int(cup[-1]),) + trailing, torch.float32)
    shards = [cp_ops.shard_thd(x, cup, cp_size, r) for r in range(cp_size)]
    assert torch.equal(torch.cat(shards), thd_seq_to_rank_order_loop(x, cup, cp_size))
    assert torch.equal(cp_ops.unshard_thd(shards, cup, cp_size), x)


def test_pack_places_real_tokens_then_padding():
    seqs = [torch.randn(5, 2), torch.randn(0, 2), torch.randn(1, 2)]
    x, cu, cup = cp_ops.pack(seqs, 2, padding_value=-1.0)
    assert cu.tolist() == [0, 5, 5, 6] and cup.tolist() == [0, 8, 8, 12]
    assert torch.equal(x[0:5], seqs[0]) and torch.equal(x[8:9], seqs[2])
    assert (x[5:8] == -1).all() and (x[9:12] == -1).all()
    with pytest.raises(ValueError, match="tensor 1 has shape"):
        cp_ops.pack([torch.randn(3, 2), torch.randn(3, 4)], 2)


def _valid():
    return cp_ops.pad_cu_seqlens([5, 0, 9], 2)


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda cu, cup: (cu, torch.tensor([0, 6, 6, 18], dtype=torch.int32)), "sequence 0 has padded length 6, not a multiple of 2\\*cp_size = 4"),
        (lambda cu, cup: (torch.tensor([0, 5, 4, 14], dtype=torch.int32), cup), "cu_seqlens must be non-decreasing: sequence 1"),
        (lambda cu, cup: (cu, torch.tensor([0, 8, 4, 16], dtype=torch.int32)), "cu_seqlens_padded must be non-decreasing: sequence 1"),
        (lambda cu, cup: (cu + 1, cup), "cu_seqlens must start at 0, got 1"),
        (lambda cu, cup: (cu, cup + 4), "cu_seqlens_padded must start at 0, got 4"),
        (lambda cu, cup: (torch.tensor([0, 9, 9, 18], dtype=torch.int32), cup), "sequence 0 has real length 9 > padded length 8"),
        (lambda cu, cup: (cu.float(), cup), "cu_seqlens must be int32 or int64"),
        (lambda cu, cup: (cu[:-1], cup), "must have one length"),
        (lambda cu, cup: (cu.to("meta"), cup), "cu_seqlens is on meta"),
    ],
)
def test_validate_thd_rejects(mutate, message):
    cu, cup = mutate(*_valid())
    with pytest.raises((ValueError, TypeError), match=message):
        custom_ops.validate_thd(cu, cup, 2)


def test_validate_thd_rows_and_cp_size():
    cu, cup = _valid()
    custom_ops.validate_thd(cu, cup, 2, 20)
    with pytest.raises(ValueError, match="cu_seqlens_padded\\[-1\\] = 20 but the tensor has 24 rows"):
        custom_ops.validate_thd(cu, cup, 2, 24)
    with pytest.raises(ValueError, match="cp_size must be >= 1"):
        custom_ops.validate_thd(cu, cup, 0)


def test_validate_offsets():
    cu = torch.tensor([0, 3, 3, 5], dtype=torch.int32)
    custom_ops.validate_offsets(torch.tensor([0, 4, 4, 8]), cu, 8)
    custom_ops.validate_offsets(torch.tensor([0, 3, 3]), cu, 5)
    with pytest.raises(ValueError, match="sequence 2 starts at row 2, inside sequence 1"):
        custom_ops.validate_offsets(torch.tensor([0, 3, 2]), torch.tensor([0, 3, 4, 5]), 8)
    with pytest.raises(ValueError, match="ends at row 10, past the 8 rows"):
        custom_ops.validate_offsets(torch.tensor([0, 4, 8]), cu, 8)
    with pytest.raises(ValueError, match="negative row"):
        custom_ops.validate_offsets(torch.tensor([-1, 4, 4]), cu, 8)


def test_shard_thd_bad_input():
    cu, cup = _valid()
    x = torch.randn(20, 3)
    with pytest.raises(ValueError, match="rank must be in \\[0, 2\\)"):
        cp_ops.shard_thd(x, cup, 2, 2)
    with pytest.raises(ValueError, match="expected 2 shards"):
        cp_ops.unshard_thd([x[:10]], cup, 2)


@given(thd_layouts())
def test_local_positions_match_shard_of_global_positions(layout):
    cp_size, seqlens = layout
    _, cup = cp_ops.pad_cu_seqlens(seqlens, cp_size)
    global_pos = torch.cat([torch.arange(int(n)) for n in cup.diff()] + [torch.zeros(0, dtype=torch.long)])
    for r in range(cp_size):
        expected = cp_ops.shard_thd(global_pos, cup, cp_size, r)
        assert torch.equal(custom_ops.local_positions(cup, cp_size, r, int(cup[-1]) // cp_size), expected)


# --- data preparation refuses layouts it would turn into wrong rows ------------------------------


def test_pad_cu_seqlens_refuses_int32_overflow_and_non_integers():
    with pytest.raises(ValueError, match="past int32 .* from sequence 0 on"):
        cp_ops.pad_cu_seqlens([3, 5], 2**30)
    with pytest.raises(ValueError, match="past int32 .* from sequence 1 on"):
        cp_ops.pad_cu_seqlens([2**30, 2**30], 1)
    with pytest.raises(ValueError, match="past int32"):
        cp_ops.pad_cu_seqlens([2**30, 2**30], 1)
    with pytest.raises(ValueError, match="sequence 1 has length 2.5, not an int"):
        cp_ops.pad_cu_seqlens([3, 2.5], 2)
    with pytest.raises(ValueError, match="1-D integer tensor"):
        cp_ops.pad_cu_seqlens(torch.tensor([3.0, 2.0]), 2)
    cu, cup = cp_ops.pad_cu_seqlens([2**30 - 1, 2**30 - 8], 4)  # just inside int32
    assert int(cup[-1]) == 2**31 - 8 and cu.dtype == torch.int32


def test_pack_refuses_a_tensor_of_rows():
    with pytest.raises(ValueError, match="got one tensor of shape \\(3, 2\\)"):
        cp_ops.pack(torch.randn(3, 2), 2)
    with pytest.raises(ValueError, match="tensor 1 is a list"):
        cp_ops.pack([torch.randn(3, 2), [1.0, 2.0]], 2)


@pytest.mark.parametrize(
    "cup, message",
    [
        ([0, 8, 4, 12], "sequence 1 has cu_seqlens_padded\\[1\\] = 8 > cu_seqlens_padded\\[2\\] = 4"),  # non-monotone
        ([0, 6, 12], "sequence 0 has padded length 6, not a multiple of 2\\*cp_size = 4"),
        ([0, 4, 8], "cu_seqlens_padded\\[-1\\] = 8 but the tensor has 12 rows"),
        ([2, 8, 12], "must start at 0"),
    ],
)
def test_shard_unshard_and_local_offsets_refuse_bad_padded_layouts(cup, message):
    cup = torch.tensor(cup, dtype=torch.int32)
    x = torch.randn(12, 3)
    with pytest.raises(ValueError, match=message):
        cp_ops.shard_thd(x, cup, 2, 1)
    with pytest.raises(ValueError, match=message):
        cp_ops.unshard_thd([x[:6], x[6:]], cup, 2)
    if "rows" not in message:
        with pytest.raises(ValueError, match=message):
            cp_ops.local_cu_seqlens(cup, 2)


def test_unshard_refuses_shards_that_differ():
    _, cup = cp_ops.pad_cu_seqlens([5, 7], 2)
    with pytest.raises(ValueError, match="shard 1 is \\(6, 3\\)"):
        cp_ops.unshard_thd([torch.randn(6, 2), torch.randn(6, 3)], cup, 2)
    with pytest.raises(ValueError, match="got one tensor"):
        cp_ops.unshard_thd(torch.randn(2, 6, 2), cup, 2)


def test_validate_thd_names_swapped_lengths():
    cu, cup = cp_ops.pad_cu_seqlens([5, 7], 2)
    with pytest.raises(ValueError, match="swapped"):
        custom_ops.validate_thd(cup, cu, 2)
