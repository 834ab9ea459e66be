"""gpuguard-exporter: serves the daemon's GetMetrics over HTTP, unprivileged and socket-activated."""
