"""Network models: links, named profiles, α-β costs of collectives. Pure Python, no torch.distributed."""
from .cost import ALLREDUCE, COLLECTIVE_SLOTS, Cost, p2p, ring_allgather, ring_allreduce, tree_broadcast
from .link import PROFILES, Islands, Link, parse_bandwidth, parse_network

__all__ = ["ALLREDUCE", "COLLECTIVE_SLOTS", "Cost", "Islands", "Link", "PROFILES", "p2p", "parse_bandwidth", "parse_network", "ring_allgather",
           "ring_allreduce", "tree_broadcast"]
