"""The contract every strategy fills in (strategy.py: FlatStrategy) and what it is made of: flat parameters cut into
units, gradient buckets, global norms, the memory math, the optimizer over a shard. A reader of one strategy opens
its folder and this one."""
