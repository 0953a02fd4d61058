"""The KV-cache decoder on the real Gemma3-270M (its GGUF kept exactly, the default bundle): 64 greedy tokens on three
chat prompts identical to transformers generate() with the same PEFT adapter on the GGUF's weights, per-step logits
within 1e-4. Slow: builds the real bundle (about 2 minutes)."""
from __future__ import annotations

import numpy as np
import pytest

from ort_trainer.bundle import open_bundle


@pytest.mark.slow
def test_real_gemma3_greedy_tokens_match_transformers_with_an_adapter(tmp_path):
    from artifacts_gen.build import build_bundle
    from artifacts_gen.export import LoraSettings
    from artifacts_gen.source import EMBEDDED_DEFAULT
    from ort_trainer.adapter import export_peft
    from eval.decode_parity import run_decode_parity

    out = tmp_path / "bundle"
    build_bundle(EMBEDDED_DEFAULT, out, lora=LoraSettings(r=8, alpha=16.0, targets="mlp-out"), seq_len=128,
                 log=lambda *_: None)
    bundle = open_bundle(out)
    assert bundle.manifest.quant.mode == "keep"
    rng = np.random.default_rng(0)                       # an adapter that changes the answers
    lora = {t.onnx_name: (rng.standard_normal(t.shape) * 0.02).astype(np.float32) for t in bundle.manifest.trainable}
    peft = export_peft(bundle.manifest, lora, tmp_path / "peft")
    r = run_decode_parity(bundle, peft=str(peft), new=64)
    assert r["identical"] == 3, r
    assert max(p["max_logit_diff"] for p in r["prompts"]) <= 1e-4, r
