"""The JAX-free core: the hardware topology and its catalogue, the Plan and its layout rules, the
model's shape, the schedule registry and the lowering of schedules to per-stage programs, the
executor registry's names, collective byte formulas and codec names. Everything here is plain
data and rules; the planner reads it, and nothing in it imports JAX or anything above it."""
