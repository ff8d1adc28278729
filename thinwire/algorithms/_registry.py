"""The name → class table of the algorithms (one class per (algorithm, architecture)); each algorithm's module
registers itself here, and the package imports every module."""
from ..registry import Registry

registry = Registry("algorithm", variant_param="architecture", default_variant=lambda cls: cls.architectures[0])
register = registry.register
get = registry.get
names = registry.names


def architectures(name: str) -> tuple[str, ...]:
    """The architectures `name` runs on, its default first (Tang et al. 2020, "Communication-Efficient
    Distributed Deep Learning: A Comprehensive Survey", arXiv 2003.06307, Table II)."""
    return tuple(dict.fromkeys([*registry.lookup(name).architectures, *registry.variants(name)]))
