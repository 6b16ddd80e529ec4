"""The Zarr store: from drained steps to chunk files that ``xarray.open_datatree`` opens.

* ``preflight``: whether a path may be written or resumed (before the model loads), atomic creation;
* ``chunks``: one array's chunk files encoded and written atomically (``ArrayFile``), codecs, dtypes;
* ``rows``: a drained record's bytes as named output arrays, rows copied into chunk buffers;
* ``exporter``: the writer of a run's steps (``ZarrExporter``), made of ``layout`` (the store's groups
  and arrays, created or resumed), ``assembly`` (a step's rows into the open chunks),
  ``chunk_threads`` (chunks encoded and written by a thread pool), ``commits`` (the commit protocol
  and row accounting) and ``drops`` (the drops table, a failed store);
* ``writer``: that exporter in a child process (``store.writer: process``, ``policy.drain: process``);
* ``pool``, ``chunkwriter``: chunks assembled in shared memory, encoded and written by worker
  processes (``store.writer: pool``);
* ``shards``: tensor-parallel ranks writing their shards of one store (``sharding``, ``merged_store``,
  ``rank_writer``, ``merge``, ``rank_exporter``);
* ``inspect``: a store's summary (``dmi inspect``).
"""
