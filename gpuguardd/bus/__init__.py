"""D-Bus: the connection, the interface defined by dbus/*.xml, marshalling and authorization."""
