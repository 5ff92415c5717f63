"""Network addresses as the services write them: 'host:port', '[v6]:port', 'dns:///host:port'.

One reading for every listen and dial rule (serving/security.py's TLS rules, the multi-host op
channel's plaintext rule): which host an address names, and whether it is this machine's
loopback (the only place plaintext or a bearer token without TLS is allowed)."""

from __future__ import annotations

import ipaddress


def host_of(address: str) -> str:
    """'host:port' / '[v6]:port' / 'dns:///host:port' -> host ('' for ':port', every interface)."""
    a = address.split("///", 1)[-1]
    if a.startswith("["):
        return a[1:a.find("]")]
    return a.rsplit(":", 1)[0] if a.count(":") == 1 else a


def is_loopback(host: str) -> bool:
    """localhost or a loopback IP; a name other than localhost, or '' / '0.0.0.0' (every interface), is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
