"""families/decoder/embedding_rows: an embedding whose backward adds its gradient into .grad by the rows a micro-batch
touches, against torch's embedding and autograd's accumulation (tests/test_gpu_llm.py holds it to them on CUDA too)."""

import pytest
import torch

from trainbench.families.decoder.embedding_rows import distinct_rows, rows_into_grad


def pair(vocab: int = 1000, width: int = 64):
    torch.manual_seed(0)
    plain, ours = torch.nn.Embedding(vocab, width), torch.nn.Embedding(vocab, width)
    ours.load_state_dict(plain.state_dict())
    rows_into_grad(ours)
    return plain, ours


@pytest.mark.parametrize("with_zero", [True, False])  # row 0 touched, or only the compact table's unused rows there
def test_the_gradient_is_autograds_bit_for_bit_over_micro_batches(with_zero):
    plain, ours = pair()
    for mb in range(3):
        ids = torch.randint(1, 60, (4, 33), generator=torch.Generator().manual_seed(mb))
        ids[0, :7] = 0 if with_zero else 5  # repeats
        upstream = torch.randn(4, 33, 64, generator=torch.Generator().manual_seed(10 + mb))
        out_plain, out_ours = plain(ids), ours(ids)
        assert torch.equal(out_plain, out_ours)
        (out_plain * upstream).sum().backward()
        (out_ours * upstream).sum().backward()
        assert torch.equal(plain.weight.grad, ours.weight.grad), mb
    touched = plain.weight.grad.abs().sum(1) > 0
    assert 10 < int(touched.sum()) < 61 and bool(touched[0]) is with_zero


def test_distinct_rows_sums_each_id_once_and_pads_with_zero_sums_at_row_0():
    ids = torch.tensor([7, 3, 7, 7, 2])
    grad = torch.arange(10.0).reshape(5, 2)
    rows, sums = distinct_rows(ids, grad)
    assert rows.tolist() == [2, 3, 7, 0, 0]
    assert sums.tolist() == [[8, 9], [2, 3], [0 + 4 + 6, 1 + 5 + 7], [0, 0], [0, 0]]


def test_without_gradients_it_is_the_plain_lookup_and_odd_embeddings_are_refused():
    plain, ours = pair()
    ids = torch.tensor([[1, 2, 2]])
    with torch.no_grad():
        out = ours(ids)
    assert out.grad_fn is None and torch.equal(out, plain(ids).detach())
    with pytest.raises(ValueError, match="plain embedding"):
        rows_into_grad(torch.nn.Embedding(10, 4, padding_idx=0))
    with pytest.raises(ValueError, match="dense embedding"):
        rows_into_grad(torch.nn.Embedding(10, 4, sparse=True))
