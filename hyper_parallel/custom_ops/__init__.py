"""Fused kernels outside the frameworks (``experimental``: Ascend-only names MindFormers
imports; none is built by this package)."""
