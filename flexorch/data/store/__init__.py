"""A prepared corpus: tokens written once, in parallel, into memory-mapped blocks with an index and a manifest.

``flexorch prepare SOURCE OUT`` and the start of ``flexorch train`` (into ``[data] cache``) build one
(``flexorch.data.store.prepare``); the driver opens its index by memory map (``flexorch.data.store.open_store``)
and workers read their documents from the blocks (``flexorch.data.store.blocks``). The on-disk layout and the
manifest: ``flexorch.data.store.layout``; the fingerprints that decide whether a store fits a run:
``flexorch.data.store.fingerprint``.
"""
