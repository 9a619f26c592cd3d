"""Context parallelism: a sequence too long for one rank's activations, split over the ranks of a group.

Read in this order:
- layout.py: which tokens a rank holds (two chunks of 2N, one early and one late, so the causal work is even);
- ring.py: attention by passing keys and values round the ring, with the online softmax, and its backward;
- ulysses.py: attention by two all-to-alls, from a split of the tokens to a split of the heads and back;
- apply.py: the model changed from outside (its plan names the attention cores and the position embedding),
  and every sequence it is given cut to this rank's tokens.

Everything but attention works token by token, so it runs on this rank's tokens as it would on all of them. The
ranks of a group hold the same parameters: each computes the mean loss of its tokens (the same number on every
rank), and the gradients are averaged over the group and the data-parallel replicas together, which is the
gradient of the mean over every token of the batch. So data parallelism and ZeRO treat dp x cp ranks as one group
of replicas (runtime/topology.py: with_context), and the ranks that read different sequences are the dp ones.
"""
