"""gpuguard-notify: gpuguardd's events as freedesktop notifications, for desktops without the
GNOME Shell extension (KDE, Xfce, wlroots compositors with mako or dunst). A systemd user
service, off unless the user enables it (`systemctl --user enable --now gpuguard-notify`).
"""
