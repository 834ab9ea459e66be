"""tests/unit: no root, no services (no bus, no systemd, no daemon); seconds in all.

`make check` runs them as nobody. A unit test never skips: tests/conftest.py turns a skip
here into a failure that says so, on every machine, CI or not.
"""
