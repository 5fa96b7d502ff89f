"""fully_shard: per-parameter sharding with FSDP2 semantics, HSDP on a 2-D mesh."""

from hyper_parallel.core.fully_shard.api import HSDPModule, fully_shard, hsdp_state
from hyper_parallel.core.fully_shard.buffer_pool import GatherBufferPool
from hyper_parallel.core.fully_shard.hsdp_param import HSDPParam
from hyper_parallel.core.fully_shard.hsdp_state import HSDPState, TrainingState
from hyper_parallel.core.fully_shard.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from hyper_parallel.core.fully_shard.state_dict import (Box, copy_overlap, full_state_dict, load_full_state_dict,
                                                        load_sharded_state_dict, local_boxes, materialize,
                                                        save_sharded_state_dict, sharded_state_dict)
from hyper_parallel.core.fully_shard.weight_parallel import find_blocks, weight_parallel

__all__ = ["Box", "CPUOffloadPolicy", "GatherBufferPool", "HSDPModule", "HSDPParam", "HSDPState", "MixedPrecisionPolicy",
           "OffloadPolicy", "TrainingState", "copy_overlap", "find_blocks", "full_state_dict", "fully_shard",
           "hsdp_state", "load_full_state_dict", "load_sharded_state_dict", "local_boxes", "materialize", "save_sharded_state_dict",
           "sharded_state_dict", "weight_parallel"]
