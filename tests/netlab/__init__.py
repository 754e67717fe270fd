"""A network lab of Linux network namespaces for swarm tests and benchmarks (root only).

The code is organized as follows:
- ``lab``: ``Lab``, a context manager that builds the namespaces, links, NAT and shaping, and
  always tears them down (also on failure and at exit);
- ``delay``: a small NFQUEUE program that delays packets where the kernel has no ``netem``;
- ``peers``: starting a backbone and worker processes inside the lab's namespaces.

Layout: a "hub" namespace holds a bridge (the "public" segment, addresses 192.0.0.128/25, a range
reserved for protocol assignments that libp2p still treats as public: with 10.x addresses on this
segment a NATed peer never gets a relay address). Public hosts hang off the bridge. A home host
sits in 10.N.0.0/24 behind its own router namespace that masquerades (iptables) onto the bridge:
it can connect out, nobody can connect in. Every address lives inside the lab's own namespaces.
"""

from .lab import Host, Lab, LabUnavailable, lab_unavailable_reason

__all__ = ["Host", "Lab", "LabUnavailable", "lab_unavailable_reason"]
