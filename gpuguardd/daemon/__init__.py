"""gpuguardd: the service that keeps the live inventory, runs sweeps and keeps the history.

Uses the engine, the bus layer and the systemd layer; never the CLI.
"""
