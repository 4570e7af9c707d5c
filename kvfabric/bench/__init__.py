"""``kvfabric bench ...``: benchmarks that print a table and write JSON.

Each submodule has ``main(argv) -> int``; ``benchmarks/<name>.py`` are thin
wrappers around them.
"""
