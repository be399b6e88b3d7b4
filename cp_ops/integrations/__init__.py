"""Bridges from other libraries' models to this package's layers.

``cp_ops.integrations.transformers``: Qwen3-Next models from Hugging Face transformers trained
with context parallelism (needs ``pip install cp-ops[hf]``). Each bridge is imported on its own,
so this package never imports an optional dependency.
"""
