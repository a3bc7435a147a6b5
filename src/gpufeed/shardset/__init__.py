"""The shard-set format's members and tar layer (docs/design.md §2); every job imports it, none re-implements it.

- :mod:`gpufeed.shardset.keys`: the key rule (:func:`~gpufeed.shardset.keys.split_member`,
  :func:`~gpufeed.shardset.keys.wanted`, metadata members), member extensions and sample grouping
  (:class:`~gpufeed.shardset.keys.SampleGrouper`).
- :mod:`gpufeed.shardset.tar`: the tar header reader and writer (``parse_header``, ``HeaderChain``,
  ``ustar_header``), the lean sample reader (``iter_samples``) and the checking pass of index and verify
  (``TarPass``).

The manifest, the index table schema, the label rule and shard names are :mod:`gpufeed.shardset.manifest`. Nothing here
imports torch.
"""
