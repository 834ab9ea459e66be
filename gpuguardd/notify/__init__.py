"""gpuguard-notify: gpuguardd's events as freedesktop notifications, for desktops without the
GNOME Shell extension (KDE, Xfce, wlroots compositors with mako or dunst). A systemd user
service, off unless the user enables it (`systemctl --user enable --now gpuguard-notify`).

events.py decides what is worth a notification and says it (pure: no D-Bus); main.py
listens on the system bus (through the CLI's D-Bus client) and calls
org.freedesktop.Notifications on the user's session bus.
"""
