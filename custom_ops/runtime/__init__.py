"""What every op family uses to become an op: registration, launching, ahead-of-time compiles,
word views and row tiles, process groups and collectives. The THD layout it serves is in
:mod:`custom_ops.thd`; nothing here imports an op family."""
