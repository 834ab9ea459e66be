"""The engine: find GPU holders, attribute them, sweep a scope and verify the memory came back.

Free of D-Bus and of the daemon, so gpuguardd, `gpuguardctl --local` and the tests drive the
same code (tests/unit/test_layers.py holds it to that). `engine.Engine` is the entry point.
"""
