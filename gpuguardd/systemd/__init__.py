"""systemd: the unit watch (adoption rules, the systemd client, the watcher) and the drop-ins."""
