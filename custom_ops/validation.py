"""Checks of layout *values* (cumulative lengths, offsets, permutations, segment tables) and the
checked mode: the public names of :mod:`custom_ops.runtime.validation` (docs/design.md section 1,
"What is checked when")."""

from custom_ops.runtime.validation import (
    call_checked,
    checked,
    checks_enabled,
    set_checks,
    validate_cumulative,
    validate_offsets,
    validate_padded,
    validate_permutation,
    validate_thd,
    validate_varlen_segments,
)

__all__ = [
    "set_checks",
    "checks_enabled",
    "checked",
    "call_checked",
    "validate_cumulative",
    "validate_padded",
    "validate_thd",
    "validate_offsets",
    "validate_permutation",
    "validate_varlen_segments",
]
