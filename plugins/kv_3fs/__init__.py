"""The ``3fs`` KV store plugin: persistent KV blocks on a local directory or a 3FS mount.

See ``plugins/kv_3fs/README.md``; the store is :class:`plugins.kv_3fs.store.ThreeFSStore`.
"""
