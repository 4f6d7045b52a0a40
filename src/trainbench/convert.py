"""Checkpoint conversion: MLPerf's TensorFlow BERT checkpoint -> trainbench's state dict.

MLPerf's BERT reference starts from a TensorFlow checkpoint (``model.ckpt-28252``). TensorFlow is needed
only to read it (``pip install -e '.[tf]'`` in trainbench's clone); the name mapping below is plain Python and tested
without it. Optimizer slots (LAMB/Adam moments, the global step) are skipped.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from trainbench.errors import DataError, UserError
from trainbench.families.encoder.model import from_hf_state_dict

# TF variable name pieces -> HF name pieces. Dense kernels are [in, out] in TF and [out, in] in torch.
_SKIP = re.compile(r"(^|/)(adam_[mv]|global_step|bad_steps|good_steps|loss_scale|LAMB\w*|Momentum)(/|$)")


def tf_name_to_hf(name: str) -> tuple[str, bool]:
    """(HF parameter name, whether to transpose) for one TF variable name."""
    parts = name.split("/")
    out, transpose = [], False
    for part in parts:
        if m := re.fullmatch(r"layer_(\d+)", part):
            out += ["layer", m[1]]
        elif part == "kernel":
            out.append("weight")
            transpose = True
        elif part in ("gamma", "output_weights"):
            out.append("weight")
        elif part in ("beta", "output_bias"):
            out.append("bias")
        else:
            out.append(part)
    hf = ".".join(out)
    if hf.endswith(("_embeddings", "word_embeddings")):
        hf += ".weight"
    return hf, transpose


def convert_tf_variables(variables: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """TF variables (name -> array) -> trainbench's state dict."""
    hf: dict[str, torch.Tensor] = {}
    for name, value in variables.items():
        if _SKIP.search(name):
            continue
        key, transpose = tf_name_to_hf(name)
        tensor = torch.from_numpy(np.ascontiguousarray(value.T if transpose else value)).float()
        hf[key] = tensor
    try:
        return from_hf_state_dict(hf)
    except KeyError as exc:
        raise DataError(f"not a BERT pretraining checkpoint: {exc.args[0]}") from None


def read_tf_checkpoint(prefix: str | Path) -> dict[str, np.ndarray]:
    try:
        import tensorflow as tf
    except ImportError:
        raise UserError(
            "reading a TensorFlow checkpoint needs TensorFlow: pip install -e '.[tf]' in trainbench's clone "
            "(HF safetensors weights load directly with model.init_checkpoint=...)"
        ) from None
    prefix = str(prefix)
    if not Path(prefix + ".index").exists():
        raise DataError(f"{prefix}.index not found: give the checkpoint prefix, e.g. model.ckpt-28252")
    reader = tf.train.load_checkpoint(prefix)
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}


def convert_bert(tf_checkpoint: str | Path, out: str | Path) -> dict[str, torch.Tensor]:
    state = convert_tf_variables(read_tf_checkpoint(tf_checkpoint))
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    torch.save(state, tmp)
    tmp.replace(out)
    return state
