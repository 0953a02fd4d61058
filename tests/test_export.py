"""Adapters out of the device: PEFT directory and standalone ONNX, each checked against ORT's eval logits."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from ort_trainer.bundle import open_bundle
from ort_trainer.adapter import export_onnx, export_peft
from ort_trainer.session import EvalSession
from tests.bundle_helpers import (
    build_tiny_bundle, is_vocab, random_lora, sample_batch, to_onnx_layout, torch_batch, weight_reads,
    with_dequantized_base,
)
from tests.tiny_models import FAMILIES


@pytest.fixture(scope="module", params=[(f, "none") for f in FAMILIES] + [("gpt2", "int8"), ("gemma3", "int4")],
                ids=lambda p: "-".join(p))
def trained(request, tmp_path_factory):
    """A bundle (float32, or with a quantized base: issue 29) plus 'trained' LoRA values (random, non-zero B) in
    ONNX layout."""
    family, quant = request.param
    root = tmp_path_factory.mktemp(f"{family}-{quant}")
    ckpt, path = build_tiny_bundle(family, root, quant=quant)
    bundle = open_bundle(path)
    lora = to_onnx_layout(bundle.manifest, random_lora(bundle.manifest, seed=5))
    batch = sample_batch(bundle.manifest.model.vocab_size, 2, 30, seed=6)
    loss, logits = EvalSession(bundle, lora).run(batch)
    return ckpt, bundle, lora, batch, logits, root


def test_peft_directory_loads_and_reproduces_ort_logits(trained):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ckpt, bundle, lora, batch, ort_logits, root = trained
    out = export_peft(bundle.manifest, lora, root / "peft")
    base = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with_dequantized_base(base, bundle)      # the same LoRA tensors, on the base the bundle computes with
    model = PeftModel.from_pretrained(base, out).eval()
    with torch.no_grad():
        logits = model(**{k: v for k, v in torch_batch(batch).items() if k != "labels"}).logits
    keep = torch.from_numpy(batch["labels"][:, 1:] != -100)
    assert np.abs(logits[:, :-1][keep].numpy() - ort_logits).max() <= 1e-4


def test_standalone_onnx_runs_on_plain_inference_session(trained):
    ckpt, bundle, lora, batch, ort_logits, root = trained
    path = export_onnx(bundle, lora, root / "merged" / "model.onnx")
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert {i.name for i in sess.get_inputs()} == {"input_ids", "attention_mask", "labels", "loss_scale"}
    _, logits = sess.run(["loss", "logits"], {**batch, "loss_scale": np.array(1.0, dtype=np.float32)})
    assert np.abs(logits - ort_logits).max() <= 1e-4
    # self-contained: it does not read the bundle's shards
    assert not any(p.name.startswith("weights-") for p in path.parent.iterdir())
    # a quantized base stays quantized: the codes and the just-in-time DequantizeLinear nodes, no float32 copy
    q = bundle.manifest.quant
    if q.weights:
        import onnx

        g = onnx.load(str(path), load_external_data=False).graph
        inits = {i.name: i.data_type for i in g.initializer}
        assert all(w.codes in inits and w.onnx_name not in inits for w in q.weights)
        linear = [w for w in q.weights if not is_vocab(w)]   # the vocabulary's: Gather + Mul, DQ
        assert {c for _, _, c in weight_reads(g)} >= {w.codes for w in linear}
