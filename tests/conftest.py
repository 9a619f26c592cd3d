import torch

# The parent test process stays single-threaded too: ranks it spawns share 2 cores.
torch.set_num_threads(1)
