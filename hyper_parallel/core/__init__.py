"""Core algorithms, written once against ``hyper_parallel.platform``.

Nothing here imports a framework (an import-linter contract checks it): every tensor
operation beyond the documented tensor methods goes through ``get_platform()``,
resolved at call time.
"""
