"""TileLang-Ascend kernels of the DeepSeek-V4-specific ops, written in ``tilelang.ascend.language``.

Each module builds a ``T.prim_func`` for TileLang's ``ascend`` target (Ascend 950, ``dav-3510``) from
compile-time parameters. Importing a module here imports ``tilelang``: the backend does so only when a
kernel is lowered or compiled, never when the plugin is imported.
"""
