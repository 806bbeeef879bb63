"""Recovery benchmarks: lost workers, nodes and drivers on a Ray cluster of several raylets on this machine."""
