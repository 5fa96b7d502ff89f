"""Pipeline parallelism. Landed so far: schedules as data (per-rank action lists), their
lowering to point-to-point communication, a validator and a time/memory simulator.
Stages and the runtime that executes the action lists come next."""
