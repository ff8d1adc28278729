"""Network models: links, named profiles, α-β costs of collectives. Pure Python, no torch.distributed."""
from .cost import ALLREDUCE, Cost, p2p, ring_allgather, ring_allreduce, tree_broadcast
from .link import PROFILES, Link, parse_network

__all__ = ["ALLREDUCE", "Cost", "Link", "PROFILES", "p2p", "parse_network", "ring_allgather",
           "ring_allreduce", "tree_broadcast"]
