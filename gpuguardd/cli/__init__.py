"""gpuguardctl: commands, the D-Bus client, output and `watch`. Imports only what a verb needs."""
