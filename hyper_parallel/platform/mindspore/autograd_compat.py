"""``enable_mindspore_backward_compat``: the switch MindFormers' PyNative ``Trainer``
flips to get torch-style ``loss.backward()`` / ``param.grad`` on MindSpore tensors.

MindSpore 2.10 has no ``Tensor.backward``; providing one means replacing attributes of
MindSpore's tensor class for the whole process, which this project does not do (no
framework is patched). Training on MindSpore goes through ``mindspore.value_and_grad``
(see ``docs/mindformers.md``). The function exists so that MindFormers' trainer module
loads; calling it raises before anything is changed.
"""

from __future__ import annotations


def enable_mindspore_backward_compat() -> None:
    """Not supported (see the module docstring).

    Raises:
        NotImplementedError: always.
    """
    raise NotImplementedError("enable_mindspore_backward_compat: a torch-style Tensor.backward() on MindSpore tensors "
                              "would patch MindSpore's tensor class process-wide, which hyper_parallel does not do; "
                              "compute gradients with mindspore.value_and_grad (MindFormers' pynative Trainer, which "
                              "calls this, is not supported yet: see docs/mindformers.md)")
