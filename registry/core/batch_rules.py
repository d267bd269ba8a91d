"""Batching rules in C++ over functorch's slower ones (``kernels/batch_rules.cpp``), inside ``use()`` only.

- ``nll_loss_forward`` and ``nll_loss_backward``, which every classifier's ``cross_entropy`` reaches under
  vmap(grad): functorch registers ``torch._decomp``'s Python decompositions of these at FuncTorchBatched, about ten
  aten ops from Python a call. The rules fold the batch into the loss's rows (B samples of N rows are one call of
  PyTorch's own kernel on B * N rows, reduced per sample after).
- ``native_group_norm`` and ``native_group_norm_backward``: functorch's C++ rules apply the affine parameters and
  form the weight's gradient as separate whole-tensor batched ops; the rules fold the batch into the samples and run
  PyTorch's kernel once, the per-sample weight and bias gradients from two per-channel sums.
- ``convolution_backward`` of a 2-d convolution with fewer than 8 input channels whose weight the samples share
  (per-sample gradients of an image model's first layer): functorch's rule forms the B weight gradients as one
  grouped convolution (``groups = B``, each group a few channels wide, where PyTorch's CPU kernels are slow); the rule
  runs one convolution with the input's channels and the batch swapped (1.5-3.5x faster at batch 4-64).
- ``_scaled_dot_product_flash_attention_for_cpu`` and its ``_backward`` (what ``F.scaled_dot_product_attention``
  runs on 4-d CPU inputs): functorch has no rule for either, so vmap loops over the samples; the rules fold the batch
  into the kernel's N (attention is per row and head), one call each way. They serve the calls the selector leaves
  to PyTorch's kernel (by cost, at small batches) and any program's SDPA under vmap inside ``use()``.
- ``embedding_dense_backward`` where the indices are batched (per-sample gradients of a shared embedding table):
  functorch's rule calls PyTorch's kernel on the B tables at once, which makes them with ``at::zeros``: B tables of
  fresh memory at every step, every page faulted in (82 MB for a 5,000 x 64 table at batch 64: 36 ms of a 4 ms
  step). The rule does the same arithmetic (offset indices, one ``index_add_``) into the output pool's memory
  (``kernels/output_pool.cpp``), kept mapped between steps.
- ``native_layer_norm_backward``: functorch's rule multiplies the output gradient by the weight as a batched op of
  its own, calls PyTorch's kernel without the weight, and forms each sample's weight gradient from whole batched
  temporaries (``(x - mean) * rstd * dy``) before summing them. Layer norm is per row, so the rule runs PyTorch's
  kernel once over the folded samples with the weight inside it, and each sample's weight and bias gradients in one
  pass over the rows with no temporary.

Every rule checks, before it excludes functorch's Batched key, that the operands it would hand PyTorch's kernels are
ordinary tensors at its level (not batched at an outer vmap level, not wrapped by a grad or jvp level below it); where
they are not it declines, and functorch's rule runs as it was called (with its key, which the levels below need).

Under ``use(policy="native")`` the rules stay out too (routing.py's ``NATIVE_POLICY_BIT``): that policy is PyTorch's
own kernels and rules throughout.

Outside ``use()`` each rule runs the kernel it overrides (one boxed call more), so PyTorch's results outside
``use()`` are unchanged. They go into the C++ routing's Library, and with it at uninstall or a switch to the Python
backend (whose kernels have no such rules: there PyTorch's rules run). ``set_batch_rules_enabled(False)`` on the
compiled module turns them off inside ``use()`` too (``bench/batch_rules.py``'s baseline).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import ModuleType


class BatchRules:
    """The patch that registers the C++ batching rules with the compiled routing kernels. It keeps no state: the
    compiled module says whether its Library holds them (``batch_rules_registered``), and the rules go with it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def install(self, active: Callable[[], bool]) -> None:
        """Nothing outside the dispatcher: the rules read the thread's ``use()`` frame themselves."""

    def uninstall(self) -> None:
        """Nothing: the rules go with the compiled routing's Library, which the router destroys."""

    def register_compiled(self, module: ModuleType) -> None:
        """Register the rules into the compiled routing's Library, once per Library, over functorch's decompositions
        (loaded first: functorch loads them at the first vmap, and they would override rules registered before)."""
        from torch._functorch import predispatch  # noqa: PLC2701 - functorch's internals have no public API

        with self.lock:
            predispatch.lazy_load_decompositions()
            if not module.batch_rules_registered():
                module.register_batch_rules()

    def compiled_dropped(self) -> None:
        """Nothing: the Library that held the rules is gone, and ``batch_rules_registered`` says so."""


PATCH = BatchRules()
