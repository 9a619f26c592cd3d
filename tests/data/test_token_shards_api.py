"""minitrain.TokenShards in a user's own loop: a Hugging Face Llama under prepare(zero=1) on 2 ranks reads a
sharded corpus, saves the loader's position in the checkpoint's extra, and a resume in fresh processes continues
bit for bit; at 1 rank with the same global batch, the same training to 1e-12."""
import torch

import minitrain
from tests.helpers.dist import run_ranks
from tests.helpers.hf_models import OPTIMIZERS, SEQ, VOCAB, make_model
from tests.helpers.shards import write_corpus

GLOBAL_BATCH = 4


def _loss(model, x, y):
    logits = model(input_ids=x).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def _train(topo, corpus, root, steps, resume):
    minitrain.init_distributed(topology=topo)
    model, opt = minitrain.prepare(make_model("llama", seed=1), OPTIMIZERS["adamw"], zero=1)
    world = minitrain.dp_world_size()
    data = minitrain.TokenShards(corpus, SEQ, GLOBAL_BATCH // world, rank=minitrain.dp_rank(), world_size=world,
                                 seed=9, shuffle_block=2)
    first = 0
    if resume:
        first, extra = minitrain.load_checkpoint(root, model, opt)
        data.load_state_dict(extra["data"])
    for step in range(first, steps):
        x, y = data.next_batch()
        _loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        if step + 1 == 3 and not resume:
            minitrain.save_checkpoint(root, model, opt, 3, extra={"data": data.state_dict()})
    data.close()
    return minitrain.full_state_dict(model)


def test_a_users_loop_reads_shards_and_resumes_mid_epoch_bit_for_bit(tmp_path):
    corpus = str(tmp_path / "corpus")
    write_corpus(corpus, [90] * 8, vocab=VOCAB)  # 11 windows of 8 a shard: the resume is mid-block, mid-epoch
    whole = run_ranks(_train, 2, corpus, str(tmp_path / "a"), 8, False)[0]
    run_ranks(_train, 2, corpus, str(tmp_path / "b"), 3, False)
    resumed = run_ranks(_train, 2, corpus, str(tmp_path / "b"), 8, True)[0]
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    one = run_ranks(_train, 1, corpus, str(tmp_path / "c"), 8, False)[0]
    assert max((whole[k] - one[k]).abs().max().item() for k in whole) < 1e-12
