"""The typed records every layer hands every other: holders, GPUs, scans, requests, reports,
their enums and selectors, and their wire form (codec.py). A leaf package: it imports nothing
of gpuguardd but the shared leaves (tests/unit/test_layers.py holds it to that).
"""
