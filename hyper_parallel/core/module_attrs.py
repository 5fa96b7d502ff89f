"""The attributes core's parallelisms set on a framework module, named once.

A parallelism applied to a module keeps its state in one attribute of the module
(``vars(module)``), so that another parallelism applied later can tell, without importing
the first, what was applied already: activation checkpointing refuses a module that holds
fully sharded modules (fully_shard must come after it), and the pipeline's weight-gradient
split looks for fully sharded units. Each parallelism's package re-exports its own name.
"""

from __future__ import annotations

#: a fully sharded module's ``HSDPState`` (``core/fully_shard``)
FULLY_SHARDED_ATTR = "_hsdp_state"
