"""The runtime every layer above stands on: topology, comm (the only caller of torch.distributed collectives), clocks, the collective watch and its diagnosis, the launcher, stop signals."""
