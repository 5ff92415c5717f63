"""WAN link emulation between cluster A and cluster B (userspace TCP proxy)."""
