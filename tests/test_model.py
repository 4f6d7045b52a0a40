"""Our BERT against `transformers.BertForPreTraining` on the same random weights."""

import numpy as np
import pytest
import torch

from trainbench.errors import DataError
from trainbench.families.encoder.family import load_checkpoint
from trainbench.families.encoder.model import BertConfig, BertForPreTraining, from_hf_state_dict, to_hf_state_dict

transformers = pytest.importorskip("transformers")

CFG = dict(vocab_size=211, hidden_size=64, num_layers=3, num_heads=4, intermediate_size=96, max_position_embeddings=48)


def make_pair(seed=0):
    hf_cfg = transformers.BertConfig(
        vocab_size=CFG["vocab_size"],
        hidden_size=CFG["hidden_size"],
        num_hidden_layers=CFG["num_layers"],
        num_attention_heads=CFG["num_heads"],
        intermediate_size=CFG["intermediate_size"],
        max_position_embeddings=CFG["max_position_embeddings"],
        layer_norm_eps=1e-12,
        hidden_act="gelu",
    )
    torch.manual_seed(seed)
    hf = transformers.BertForPreTraining(hf_cfg).eval()
    # Non-trivial LayerNorm and bias values, so a swapped or dropped tensor cannot go unnoticed.
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    ours = BertForPreTraining(BertConfig(**CFG)).eval()
    ours.load_state_dict(from_hf_state_dict(hf.state_dict()))
    return hf, ours


def inputs(batch=4, seq=40, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CFG["vocab_size"], (batch, seq), generator=g)
    types = torch.randint(0, 2, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, 30:] = 0
    mask[3, 12:] = 0
    return ids, types, mask


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def test_logits_match_transformers():
    hf, ours = make_pair()
    ids, types, mask = inputs()
    with torch.no_grad():
        ref = hf(input_ids=ids, token_type_ids=types, attention_mask=mask)
        mlm, nsp = ours(ids, types, mask)
    valid = mask.bool()  # HF's logits at padded positions are as meaningless as ours; compare the real ones
    assert rel_err(mlm[valid], ref.prediction_logits[valid]) <= 1e-5
    assert rel_err(nsp, ref.seq_relationship_logits) <= 1e-5


def test_masked_positions_head_equals_full_head_gathered():
    _, ours = make_pair()
    ids, types, mask = inputs()
    positions = torch.tensor([[1, 5, 9], [2, 3, 29], [7, 8, 0], [1, 11, 0]])
    with torch.no_grad():
        full, _ = ours(ids, types, mask)
        part, _ = ours(ids, types, mask, positions)
    expected = torch.gather(full, 1, positions[..., None].expand(-1, -1, full.shape[-1]))
    torch.testing.assert_close(part, expected, rtol=1e-5, atol=1e-5)


def test_our_weights_load_into_transformers():
    hf, ours = make_pair()
    fresh = transformers.BertForPreTraining(hf.config).eval()
    fresh.load_state_dict(to_hf_state_dict(ours.state_dict()), strict=True)
    ids, types, mask = inputs()
    with torch.no_grad():
        a = fresh(input_ids=ids, token_type_ids=types, attention_mask=mask).prediction_logits
        b = hf(input_ids=ids, token_type_ids=types, attention_mask=mask).prediction_logits
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("fmt", ["hf_pt", "mlperf_pt", "safetensors", "ours"])
def test_init_checkpoint_formats(tmp_path, fmt):
    hf, ref = make_pair()
    sd = hf.state_dict()
    if fmt == "hf_pt":
        path = tmp_path / "pytorch_model.bin"
        torch.save(sd, path)
    elif fmt == "mlperf_pt":
        # The converted MLPerf checkpoint: {"model": ...}, NVIDIA's `dense_act` names, no tied decoder.
        renamed = {
            k.replace("intermediate.dense.", "intermediate.dense_act.").replace(
                "transform.dense.", "transform.dense_act."
            ): v
            for k, v in sd.items()
            if "decoder" not in k
        }
        path = tmp_path / "model.ckpt-28252.pt"
        torch.save({"model": renamed}, path)
    elif fmt == "safetensors":
        from safetensors.torch import save_file

        path = tmp_path / "model.safetensors"
        save_file({k: v.contiguous() for k, v in sd.items() if "decoder" not in k}, str(path))
    else:
        path = tmp_path / "ours.pt"
        torch.save(ref.state_dict(), path)
    model = BertForPreTraining(BertConfig(**CFG)).eval()
    load_checkpoint(model, path)
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values(), strict=False):
        torch.testing.assert_close(a, b, msg=name)


def test_init_checkpoint_errors(tmp_path):
    model = BertForPreTraining(BertConfig(**CFG))
    with pytest.raises(DataError, match="does not exist"):
        load_checkpoint(model, tmp_path / "nope.pt")
    torch.save({"encoder.weird": torch.zeros(1)}, tmp_path / "other.pt")
    with pytest.raises(DataError, match="not BERT pretraining weights"):
        load_checkpoint(model, tmp_path / "other.pt")
    big = BertForPreTraining(BertConfig(**(CFG | {"hidden_size": 32, "num_heads": 2})))
    torch.save(big.state_dict(), tmp_path / "small.pt")
    with pytest.raises(DataError, match="does not fit the model config"):
        load_checkpoint(model, tmp_path / "small.pt")


def _tf_name(hf_name: str) -> tuple[str, bool]:
    """HF name -> the name Google's TF BERT checkpoint gives the same variable (and whether it is a kernel)."""
    name = hf_name.replace(".layer.", ".layer_").replace(".", "/")
    if name.endswith("LayerNorm/weight"):
        return name[: -len("weight")] + "gamma", False
    if name.endswith("LayerNorm/bias"):
        return name[: -len("bias")] + "beta", False
    if name.endswith("_embeddings/weight"):
        return name[: -len("/weight")], False
    if name == "cls/predictions/bias":
        return "cls/predictions/output_bias", False
    if name.startswith("cls/seq_relationship/"):
        return name.replace("/weight", "/output_weights").replace("/bias", "/output_bias"), False
    if name.endswith("/weight"):
        return name[: -len("weight")] + "kernel", True
    return name, False


def test_tf_checkpoint_variables_convert_to_our_weights():
    from trainbench.convert import convert_tf_variables
    from trainbench.families.encoder.model import to_hf_state_dict

    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig(vocab_size=100, hidden_size=32, num_layers=2, num_heads=4,
                                          intermediate_size=64, max_position_embeddings=64))  # fmt: skip
    tf_vars = {}
    for hf_name, tensor in to_hf_state_dict(model.state_dict()).items():
        if hf_name.startswith("cls.predictions.decoder"):
            continue  # tied: not a variable of its own in the TF checkpoint
        name, kernel = _tf_name(hf_name)
        tf_vars[name] = (tensor.T if kernel else tensor).numpy()
    tf_vars["bert/encoder/layer_0/attention/self/query/kernel/adam_m"] = np.zeros((32, 32), np.float32)
    tf_vars["global_step"] = np.array(28252)
    ours = convert_tf_variables(tf_vars)
    expected = model.state_dict()
    assert set(ours) == set(expected)
    for key, value in expected.items():
        assert torch.equal(ours[key], value), key


def test_convert_reads_a_real_tensorflow_checkpoint(tmp_path):
    tf = pytest.importorskip("tensorflow", reason="TensorFlow is an optional extra: pip install -e '.[tf]'")
    from trainbench.cli import main
    from trainbench.families.encoder.model import to_hf_state_dict

    torch.manual_seed(1)
    model = BertForPreTraining(BertConfig(vocab_size=100, hidden_size=32, num_layers=2, num_heads=4,
                                          intermediate_size=64, max_position_embeddings=64))  # fmt: skip
    graph = tf.Graph()
    with graph.as_default():
        for hf_name, tensor in to_hf_state_dict(model.state_dict()).items():
            if not hf_name.startswith("cls.predictions.decoder"):
                name, kernel = _tf_name(hf_name)
                tf.compat.v1.get_variable(name, initializer=(tensor.T if kernel else tensor).numpy())
        tf.compat.v1.train.get_or_create_global_step()
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(tf.compat.v1.global_variables_initializer())
            prefix = saver.save(session, str(tmp_path / "model.ckpt"), global_step=28252)
    assert main(["convert", "bert", "--tf-checkpoint", prefix, "--out", str(tmp_path / "model.pt")]) == 0
    converted = torch.load(tmp_path / "model.pt")
    assert all(torch.equal(converted[k], v) for k, v in model.state_dict().items())


def _loss_batch(packed: bool):
    """A batch with padding predictions (position 0) and, for packed rows, empty sequence slots (label -1)."""
    g = torch.Generator().manual_seed(0)
    rows, preds = 4, 10
    positions = torch.randint(1, 60, (rows, preds), generator=g)
    positions[:, 7:] = 0  # padding predictions
    positions[2, 3:] = 0
    batch = {
        "masked_lm_positions": positions.int(),
        "masked_lm_ids": torch.randint(0, 50, (rows, preds), generator=g).int(),
    }
    if packed:
        batch["next_sentence_labels"] = torch.tensor([[0, 1, -1], [1, -1, -1], [0, 0, 1], [1, 0, -1]]).to(torch.int8)
        nsp_shape = (rows, 3, 2)
    else:
        batch["next_sentence_labels"] = torch.tensor([0, 1, 1, 0]).to(torch.int8)
        nsp_shape = (rows, 2)
    mlm_logits = torch.randn(rows, preds, 50, generator=g, requires_grad=True)
    nsp_logits = torch.randn(*nsp_shape, generator=g, requires_grad=True)
    return batch, mlm_logits, nsp_logits


@pytest.mark.parametrize("packed", [False, True])
def test_pretraining_loss_ignores_padding_like_selecting_the_valid_positions(packed):
    """The loss ignores padding predictions and empty sequence slots by label (no boolean index, so no host
    sync): loss and gradients equal those of cross entropy over the valid positions only."""
    import torch.nn.functional as F

    from trainbench.benchmarks.bert import BertBenchmark

    batch, mlm_logits, nsp_logits = _loss_batch(packed)
    bench = BertBenchmark()
    weights = bench.loss_weights(batch)
    ours = bench.loss(lambda *a, **k: (mlm_logits, nsp_logits), batch | {"input_ids": None, "segment_ids": None,
                                                                           "input_mask": None}, weights)  # fmt: skip
    ours_grads = torch.autograd.grad(ours, [mlm_logits, nsp_logits])
    valid = batch["masked_lm_positions"] > 0
    labels = batch["next_sentence_labels"].long()
    mlm = F.cross_entropy(mlm_logits[valid], batch["masked_lm_ids"][valid].long(), reduction="sum")
    nsp = F.cross_entropy(nsp_logits[labels >= 0], labels[labels >= 0], reduction="sum")
    reference = mlm / valid.sum() + nsp / (labels >= 0).sum()
    assert weights.tolist() == [valid.sum().item(), (labels >= 0).sum().item()]
    torch.testing.assert_close(ours, reference)
    for a, b in zip(ours_grads, torch.autograd.grad(reference, [mlm_logits, nsp_logits]), strict=True):
        torch.testing.assert_close(a, b)


def test_low_precision_residual_keeps_the_stream_in_bf16_under_autocast_only():
    """model.low_precision_residual (the default) keeps every layer's output in bf16 under bf16 autocast, and
    in fp32 without autocast, where it changes nothing. Under autocast the loss and gradients stay within bf16
    rounding of the fp32 residual stream."""
    _, ours = make_pair()
    ours.train()
    ids, types, mask = inputs()
    positions = torch.tensor([[1, 5, 9], [2, 3, 29], [7, 8, 4], [1, 11, 2]])
    dtypes = []
    for layer in ours.layers:
        layer.register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))

    def run(low_precision: bool, autocast: bool):
        ours.cfg.low_precision_residual = low_precision
        ours.zero_grad()
        dtypes.clear()
        torch.manual_seed(0)  # the same dropout masks
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            mlm, nsp = ours(ids, types, mask, positions)
        loss = mlm.float().log_softmax(-1).mean() + nsp.float().log_softmax(-1).mean()
        loss.backward()
        return loss.item(), torch.cat([p.grad.flatten() for p in ours.parameters()]), set(dtypes)

    assert BertConfig().low_precision_residual
    fp32 = [run(low_precision, autocast=False) for low_precision in (True, False)]
    assert fp32[0][0] == fp32[1][0] and torch.equal(fp32[0][1], fp32[1][1])
    assert fp32[0][2] == fp32[1][2] == {torch.float32}
    (loss_lp, grad_lp, dtypes_lp), (loss_hp, grad_hp, dtypes_hp) = (run(lp, autocast=True) for lp in (True, False))
    assert dtypes_lp == {torch.bfloat16} and dtypes_hp == {torch.float32}
    assert loss_lp != loss_hp  # the switch does act under autocast
    assert abs(loss_lp - loss_hp) <= 1e-4 * abs(loss_hp)  # 2e-7 measured
    assert 0 < rel_err(grad_lp, grad_hp) <= 1e-2  # 2.5e-3 measured
