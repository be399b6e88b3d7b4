"""What every op family uses: registration, launching, ahead-of-time compiles, argument checks,
word views and row tiles, the THD index maps, process groups and collectives, and value
validation. Nothing here imports an op family."""
