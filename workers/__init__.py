"""Data plane: worker actors, process groups, sequence-parallel attention kernels and the model.

Sequence-parallel attention (DESIGN.md §3) lives in small modules, imported explicitly so that
``import workers`` stays light (no ``torch.distributed`` or ``ray`` at package import):

* ``workers.process_groups``: ``ProcessGroupRegistry``, one torch.distributed world per membership epoch.
* ``workers.sharding``: pure per-rank layouts (contiguous for Ulysses, zigzag for ring) and their inverses.
* ``workers.kernels``: varlen attention kernels returning the log-sum-exp (flash-attn, torch CPU, math).
* ``workers.ulysses`` / ``workers.ring``: the two exact sequence-parallel attention methods.
* ``workers.attention``: the public ``*_varlen_func`` API.
"""
