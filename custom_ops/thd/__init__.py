"""The THD layout with dual-chunk CP sharding (docs/design.md section 1): its index maps
(:mod:`~custom_ops.thd.index`), the free checks of its arguments (:mod:`~custom_ops.thd.checks`),
the checks of its values (:mod:`~custom_ops.thd.validation`) and the checked mode that says when
those run (:mod:`~custom_ops.thd.checked_mode`). Nothing here imports the op machinery of
:mod:`custom_ops.runtime` or an op family."""
