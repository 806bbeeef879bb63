"""GPU benchmarks, for a lent GPU machine (torch, no Ray needed): the GPU check, the kernel profile, throughput."""
