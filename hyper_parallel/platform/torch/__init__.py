"""The torch backend: CPU (gloo), CUDA (NCCL), Ascend NPU through torch_npu (HCCL)."""

from hyper_parallel.platform.torch.platform import TorchPlatform

__all__ = ["TorchPlatform"]
