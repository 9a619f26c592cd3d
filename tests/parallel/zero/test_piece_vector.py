"""PieceVector (parallel/core/piece_vector.py): ZeRO-2/3's gradient shard, one tensor per unit, read and written as the one
vector the step expects, whatever range it asks for."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minitrain.parallel.core.piece_vector import PieceVector, held_bytes


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 9), min_size=1, max_size=5), data=st.data())
def test_every_range_reads_and_writes_as_the_whole_vector(lengths, data):
    whole = torch.arange(sum(lengths), dtype=torch.float64)
    vector = PieceVector([piece.clone() for piece in whole.split(lengths)])
    n = whole.numel()
    a = data.draw(st.integers(0, n))
    b = data.draw(st.integers(a, n))
    assert torch.equal(vector[a:b], whole[a:b])
    size = data.draw(st.integers(1, n))
    assert all(torch.equal(got, want) for got, want in zip(vector.split(size), whole.split(size), strict=True))
    vector[a:b] = -whole[a:b] - 1  # written back across pieces, each element where it belongs
    whole[a:b] = -whole[a:b] - 1
    assert torch.equal(torch.cat(vector.pieces), whole)
    vector.div_(2)
    assert torch.equal(torch.cat(vector.pieces), whole / 2)
    assert vector.numel() == n and held_bytes(vector) == 8 * n


def test_a_range_inside_one_piece_is_a_view_of_it():
    vector = PieceVector([torch.zeros(4), torch.zeros(6)])
    vector[5:8].fill_(1.0)  # a view: written through
    assert vector.pieces[1].tolist() == [0, 1, 1, 1, 0, 0]
