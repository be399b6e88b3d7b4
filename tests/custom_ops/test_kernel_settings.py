"""The launch settings of the row-moving kernels (RowSettings) and the conv kernels (ConvSettings):
frozen values with the tuned defaults, passed to the launchers; other settings change the
launch, never the result. Every op passes its family's settings at each launcher call.
(Segment attention's settings: tests/custom_ops/test_varlen_attention.py.)"""

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

import custom_ops
from custom_ops.conv1d import op as conv
from custom_ops.conv1d.op import CONV_SETTINGS, ConvConfig, ConvSettings
from custom_ops.runtime.launch import launch
from custom_ops.runtime.tiles import ROW_SETTINGS, RowSettings, cdiv, row_tile
from custom_ops.testing import random_tensor


def test_row_tile_defaults_and_other_tiles():
    """The ops' tile: 16 KiB tiles, rows up to 8 KiB, 4 warps; a program takes at most 64 rows
    and wider rows split over a second grid axis. Another RowSettings changes only the shape."""
    assert (ROW_SETTINGS.tile_bytes, ROW_SETTINGS.max_row_bytes, ROW_SETTINGS.num_warps) == (16384, 8192, 4)
    assert row_tile(64, 2) == (64, 64, 4)
    assert row_tile(1024, 2) == (8, 1024, 4)
    assert row_tile(100000, 4) == (2, 2048, 4)
    assert row_tile(1024, 2, ROW_SETTINGS) == row_tile(1024, 2)
    assert row_tile(1024, 2, RowSettings(tile_bytes=65536, max_row_bytes=16384, num_warps=16)) == (32, 1024, 16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ROW_SETTINGS.num_warps = 8


@pytest.mark.interpret
def test_reorder_kernel_under_another_row_tile():
    """The reorder kernel launched with another tile's shape (as a benchmark sweeping tiles
    launches it) moves the same rows as the op."""
    from custom_ops.thd_reorder.kernels import thd_reorder_kernel

    cup = torch.tensor([0, 8, 12, 12, 28], dtype=torch.int32)
    x = random_tensor((28, 3, 5), torch.float32)
    words = x.reshape(28, -1)
    out = torch.empty_like(words)
    block_r, block_d, num_warps = row_tile(words.shape[1], words.element_size(), RowSettings(tile_bytes=16, max_row_bytes=16))
    assert (block_r, block_d) == (1, 4)
    grid = (cdiv(words.shape[0], block_r), cdiv(words.shape[1], block_d))
    launch(thd_reorder_kernel, grid, words, out, cup, cup.shape[0] - 1, words.shape[0], words.shape[1], 2,
           TO_RANK=True, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=num_warps)  # fmt: skip
    assert torch.equal(out.view(x.shape), custom_ops.thd_seq_to_rank_order(x, cup, 2))


def test_conv_settings_defaults():
    """CUDA launches take the tuned configs; the interpreter its small blocks."""
    assert CONV_SETTINGS.config("fwd", on_gpu=True) == (256, 512, 4, 1)
    assert CONV_SETTINGS.config("bwd", on_gpu=True) == (512, 512, 4, 1)
    assert CONV_SETTINGS.config("fwd", on_gpu=False) == CONV_SETTINGS.config("bwd", on_gpu=False) == (8, 16, 1, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        CONV_SETTINGS.fwd = ConvConfig(32, 512, 4, 4)
    with pytest.raises(ValueError, match="kernel"):
        CONV_SETTINGS.config("backward", on_gpu=True)
    for rows in (0, 6):  # the kernels take rows in steps of ROW_STEP = 4
        with pytest.raises(ValueError, match=f"bwd.rows must be a positive multiple of 4 .*got {rows}"):
            ConvSettings(bwd=ConvConfig(rows, 512, 4, 1))


@pytest.mark.interpret
def test_conv_launchers_take_settings():
    """The conv launchers under other blocks (rows carried over other program boundaries, other
    channel splits) give the results of the defaults."""
    cu = torch.tensor([0, 9, 9, 30], dtype=torch.int32)
    x = random_tensor((30, 11), torch.float32)
    w = random_tensor((11, 4), torch.float32) / 2
    b = random_tensor((11,), torch.float32)
    dy = random_tensor((30, 11), torch.float32)
    other = ConvSettings(interpreter=ConvConfig(rows=4, block_c=8, num_warps=1, num_stages=1))
    for settings in (CONV_SETTINGS, other):
        y = conv._conv_forward(x, w, b, cu, "silu", settings=settings)
        dx, dw, db = conv._conv_backward_kernel(dy, x, w, b, cu, "silu", settings=settings)
        if settings is CONV_SETTINGS:
            want = (y, dx, dw, db)
        else:
            torch.testing.assert_close((y, dx, dw, db), want, rtol=1e-5, atol=1e-5)


# (op module, its launchers, the settings constant each call passes): docs/design.md section 5
LAUNCH_CALLS = [
    ("thd_reorder/op.py", ("launch_rows",), "ROW_SETTINGS"),
    ("valid_tokens/op.py", ("launch_rows",), "ROW_SETTINGS"),
    ("sections/op.py", ("_launch",), "SECTION_SETTINGS"),
    ("conv1d/op.py", ("_conv_forward", "_conv_backward_kernel"), "CONV_SETTINGS"),
    ("segment_attention/op.py", ("forward", "backward"), "ATTENTION_SETTINGS"),
]


@pytest.mark.parametrize(("module", "launchers", "constant"), LAUNCH_CALLS, ids=[m for m, _, _ in LAUNCH_CALLS])
def test_ops_pass_their_settings_explicitly(module, launchers, constant):
    """Each call of a family's launchers in its op module names the family's settings constant
    as an argument, so no op relies on a launcher's default."""
    path = Path(custom_ops.__file__).parent / module
    calls = [
        node
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in launchers
    ]
    assert calls, f"{module} calls none of {launchers}"
    for call in calls:
        args = [*call.args, *(k.value for k in call.keywords)]
        assert any(isinstance(a, ast.Name) and a.id == constant for a in args), (
            f"{module}:{call.lineno}: {call.func.id}(...) does not pass {constant}"
        )
