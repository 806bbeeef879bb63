"""Data plane: worker actors, process groups, sequence-parallel attention kernels and the model.

Sequence-parallel attention (DESIGN.md §3) lives in small modules, imported explicitly so that
``import flexorch.workers`` stays light (no ``torch.distributed`` or ``ray`` at package import):

* ``flexorch.workers.process_groups``: ``ProcessGroupRegistry``, one torch.distributed world per membership epoch.
* ``flexorch.workers.attention.sharding``: pure per-rank layouts (contiguous for Ulysses, zigzag for ring) and their
  inverses.
* ``flexorch.workers.attention.kernels``: varlen attention kernels returning the log-sum-exp (flash-attn, torch CPU,
  math).
* ``flexorch.workers.attention.ulysses`` / ``flexorch.workers.attention.ring``: the two exact sequence-parallel
  attention methods.
* ``flexorch.workers.attention.api``: the public ``*_varlen_func`` API.
"""
