"""The small core of ninfer. It never imports ``ninfer.plugins`` or ``ninfer.protocols`` by name."""
