"""One measured generation process of bench/decode.py: ours (the bundle's decoder, onnxruntime), torch
(transformers generate() with the PEFT-wrapped model, its default SDPA attention and DynamicCache) or llama
(llama.cpp through llama-cpp-python, on a GGUF).

    python -m bench.decode_worker ours|torch|llama SPEC_JSON      prints one BENCH_RESULT line (bench/children.emit)

Both greedy-decode the same random prompt with the same random LoRA (B non-zero: the adapter is live, not merged).
ttft: the prefill and the first token; decode tok/s: the new tokens after the first over the time after it."""
from __future__ import annotations

import json
import sys
import time

import numpy as np

from bench.children import emit


def _lora(manifest, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {t.onnx_name: (rng.standard_normal(t.shape) * 0.02).astype(np.float32) for t in manifest.trainable}


def ours(spec: dict) -> dict:
    from ort_trainer.bundle import open_bundle
    from ort_trainer.decoder import Decoder, generate
    from ort_trainer.sampling import Sampling
    from ort_trainer.session import RuntimeOptions

    t0 = time.perf_counter()
    bundle = open_bundle(spec["bundle"], verify="none")
    decoder = Decoder(bundle, RuntimeOptions(threads=spec["threads"], memory=spec.get("memory", "normal")))
    load_s = time.perf_counter() - t0
    lora = _lora(bundle.manifest)
    switches = []
    for _ in range(5):                    # to the adapter and back to none, then the adapter for the run
        switches += [decoder.use_adapter(lora, "a"), decoder.use_adapter(None)]
    switches.append(decoder.use_adapter(lora, "a"))
    prompt = np.random.default_rng(1).integers(0, bundle.manifest.model.vocab_size, spec["prompt_len"]).tolist()
    stamps: list[float] = []
    t_start = time.perf_counter()
    out = generate(decoder, [prompt], Sampling(max_new_tokens=spec["new"], temperature=0), set(), 0,
                   on_logits=lambda _x: stamps.append(time.perf_counter()))
    return _timings(load_s, t_start, stamps, len(out[0].token_ids), spec, switch_s=float(np.median(switches)))


def _timings(load_s, t_start, stamps, new, spec, **extra) -> dict:
    """stamps: when each step's logits were ready (the first: after the prefill)."""
    ttft = stamps[0] - t_start
    decode = stamps[-1] - stamps[0]
    return {"load_s": load_s, "ttft_s": ttft, "prefill_tok_s": spec["prompt_len"] / ttft,
            "decode_tok_s": (len(stamps) - 1) / decode if decode > 0 else None, "new_tokens": new, **extra}


def llama(spec: dict) -> dict:
    """llama.cpp (llama-cpp-python) on the GGUF itself: its own Q4_K_M kernels, no adapter."""
    from llama_cpp import Llama

    t0 = time.perf_counter()
    llm = Llama(model_path=spec["gguf"], n_threads=spec["threads"], n_threads_batch=spec["threads"],
                n_ctx=spec["prompt_len"] + spec["new"] + 8, n_batch=spec["prompt_len"], verbose=False)
    load_s = time.perf_counter() - t0
    prompt = np.random.default_rng(1).integers(0, llm.n_vocab(), spec["prompt_len"]).tolist()
    stamps: list[float] = []
    t_start = time.perf_counter()
    for _tok in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        stamps.append(time.perf_counter())
        if len(stamps) == spec["new"]:
            break
    return _timings(load_s, t_start, stamps, len(stamps), spec)


def torch_side(spec: dict) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    from ort_trainer.manifest import Manifest

    torch.set_num_threads(spec["threads"])
    t0 = time.perf_counter()
    manifest = Manifest.load(spec["bundle"])
    base = AutoModelForCausalLM.from_pretrained(spec["ckpt"], dtype=torch.float32,
                                                **({"gguf_file": spec["gguf_file"]} if spec.get("gguf_file") else {}))
    base = base.eval()
    lora = manifest.lora
    model = get_peft_model(base, LoraConfig(r=lora.r, lora_alpha=lora.alpha, target_modules=lora.target_modules,
                                            fan_in_fan_out=lora.fan_in_fan_out)).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape) * 0.02)
    load_s = time.perf_counter() - t0
    prompt = np.random.default_rng(1).integers(0, manifest.model.vocab_size, spec["prompt_len"]).tolist()
    stamps: list[float] = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    ids = torch.tensor([prompt])
    with torch.no_grad():
        t_start = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=spec["new"],
                             min_new_tokens=spec["new"], do_sample=False, eos_token_id=None, pad_token_id=0,
                             logits_processor=LogitsProcessorList([Stamp()]))
    return _timings(load_s, t_start, stamps, out.shape[1] - len(prompt), spec)


def main() -> None:
    kind, spec = sys.argv[1], json.loads(sys.argv[2])
    emit({"ours": ours, "torch": torch_side, "llama": llama}[kind](spec))


if __name__ == "__main__":
    main()
