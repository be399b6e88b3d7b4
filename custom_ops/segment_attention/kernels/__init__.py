"""The segment-attention Triton kernels (docs/design.md section 5): the per-tile pieces
(tiles.py), the tile schedule (schedule.py), the forward (forward.py) and the backward
(backward.py)."""
