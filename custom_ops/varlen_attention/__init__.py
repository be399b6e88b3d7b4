"""Segment ("varlen") attention: many query/key segments in one launch (docs/design.md section 5)."""

from custom_ops.varlen_attention.op import validate_varlen_segments, varlen_attention
from custom_ops.varlen_attention.reference import varlen_attention_loop, varlen_attention_reference

__all__ = ["varlen_attention", "varlen_attention_reference", "varlen_attention_loop", "validate_varlen_segments"]
