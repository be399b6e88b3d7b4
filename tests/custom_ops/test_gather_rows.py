"""gather_rows: the row-gather kernel against index_select, every dtype and row width."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from custom_ops.runtime.gather import gather_rows, launch_gather_rows
from custom_ops.testing import random_tensor
from tests._profiles import examples

DTYPES = [torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int64, torch.bool, torch.uint16]


@pytest.mark.interpret
@settings(max_examples=examples(20))
@given(st.integers(0, 70), st.sampled_from([(), (1,), (3,), (2, 5), (4, 33)]), st.sampled_from(DTYPES),
       st.sampled_from([torch.int32, torch.int64]), st.integers(0, 2**16))  # fmt: skip
def test_kernel_matches_index_select(rows, trailing, dtype, index_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = random_tensor((rows, *trailing), dtype, generator=gen)
    idx = torch.randint(0, max(rows, 1), (rows,), generator=gen).to(index_dtype)
    got = launch_gather_rows(x, idx)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert torch.equal(got, x[idx.long()])


def test_reference_path_is_index_select():
    x = torch.arange(12.0).reshape(4, 3)
    rows = torch.tensor([3, 0, 0, 2])
    assert torch.equal(gather_rows(x, rows), x[rows])
