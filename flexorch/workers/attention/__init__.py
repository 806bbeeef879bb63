"""Exact sequence-parallel attention: the public ``*_varlen_func`` face (:mod:`~.api`), the varlen kernels
returning the log-sum-exp (:mod:`~.kernels`, the flash-attn adapter in :mod:`~.flash`), Ulysses (:mod:`~.ulysses`),
zigzag ring (:mod:`~.ring`), Ulysses x ring (:mod:`~.hybrid`), attention over a segment with a K/V prefix
(:mod:`~.segment`), per-rank shard layouts (:mod:`~.sharding`) and the LSE merge (:mod:`~.merge`). Imported
explicitly: ``import flexorch.workers.attention`` loads no kernels."""
