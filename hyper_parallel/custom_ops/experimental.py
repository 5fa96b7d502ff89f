"""Ascend custom kernels that MindFormers' DeepSeek-style models import (sparse and
lightning-indexer attention, mHC): this package builds none of them. Importing the
names always works; calling one raises ``NotImplementedError`` naming the requirement,
on every device, before any computation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["npu_lightning_indexer_v2", "npu_mhc_post", "npu_mhc_pre_sinkhorn", "npu_sparse_attn_shared_kv",
           "npu_sparse_lightning_indexer_grad_kl_loss_v2"]


def _ascend_only(name: str) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"hyper_parallel.custom_ops.experimental.{name} is an Ascend custom kernel (CANN), "
                                  "which this package does not build; run the model with its standard attention / "
                                  "hyper-connection configuration instead")

    kernel.__name__ = kernel.__qualname__ = name
    kernel.__doc__ = f"Ascend custom kernel ``{name}``: not built by this package; raises NotImplementedError."
    return kernel


npu_lightning_indexer_v2 = _ascend_only("npu_lightning_indexer_v2")
npu_mhc_post = _ascend_only("npu_mhc_post")
npu_mhc_pre_sinkhorn = _ascend_only("npu_mhc_pre_sinkhorn")
npu_sparse_attn_shared_kv = _ascend_only("npu_sparse_attn_shared_kv")
npu_sparse_lightning_indexer_grad_kl_loss_v2 = _ascend_only("npu_sparse_lightning_indexer_grad_kl_loss_v2")
