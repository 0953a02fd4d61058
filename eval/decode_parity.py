"""`pocketlora eval decode`: the bundle's KV-cache decoder against transformers generate() with the PEFT-loaded
adapter, on the weights the bundle computes with (eval.reference_model), greedy, step by step.

For each prompt (chat-templated, as `pocketlora generate` sends it) both sides decode `new` tokens with no stop
token; reported: whether the tokens are identical, the first step where they differ, and the largest logit
difference over the steps both sides took on the same prefix."""
from __future__ import annotations

import numpy as np

from ort_trainer.adapter import resolve_lora, to_peft
from ort_trainer.decoder import Decoder, generate
from ort_trainer.sampling import Sampling
from ort_trainer.tokenizer import TextTokenizer, generation_prompt_ids

from .ort_scorer import as_bundle

PROMPTS = ("What was my step total for June 30?", "What happened on June 7, according to my notes?",
           "Tell me something about the history of Rome.")


def run_decode_parity(bundle, *, run=None, peft=None, prompts=PROMPTS, new: int = 64, threads: int = 0) -> dict:
    import torch

    from ort_trainer.session import RuntimeOptions

    from .reference_model import torch_lora_model

    bundle = as_bundle(bundle)
    lora, weights = resolve_lora(bundle, run, peft)
    tok = TextTokenizer.from_dir(bundle.tokenizer_dir)
    decoder = Decoder(bundle, RuntimeOptions(threads=threads))
    decoder.use_adapter(lora, weights)
    if threads:
        torch.set_num_threads(threads)
    ref = torch_lora_model(bundle, to_peft(bundle.manifest, lora))
    rows = []
    for text in prompts:
        ids = generation_prompt_ids(tok, [{"role": "user", "content": text}])
        steps: list[np.ndarray] = []
        ours = generate(decoder, [ids], Sampling(max_new_tokens=new, temperature=0), set(), 0,
                        on_logits=lambda x: steps.append(x[0].copy()))[0].token_ids
        x = torch.tensor([ids])
        with torch.no_grad():
            out = ref.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=new,
                               min_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0,
                               return_dict_in_generate=True, output_logits=True)
        theirs = out.sequences[0, len(ids):].tolist()
        first_diff = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        same_prefix = len(ours) if first_diff is None else first_diff + 1
        diff = max(float(np.abs(steps[i] - out.logits[i][0].numpy()).max()) for i in range(same_prefix))
        scale = max(float(np.abs(out.logits[i][0].numpy()).max()) for i in range(same_prefix))
        rows.append({"prompt": text, "prompt_tokens": len(ids), "identical": ours == theirs, "first_diff": first_diff,
                     "max_logit_diff": diff, "max_logit": scale, "text": tok.decode(ours, skip_special_tokens=True)})
    return {"bundle": str(bundle.path), "weights": weights, "new": new, "prompts": rows,
            "identical": sum(r["identical"] for r in rows)}


def print_decode_parity(r: dict) -> None:
    print(f"decoder vs transformers generate() ({r['weights']}), {r['new']} greedy tokens per prompt: "
          f"{r['identical']} of {len(r['prompts'])} identical")
    for p in r["prompts"]:
        where = "identical" if p["identical"] else f"first differs at new token {p['first_diff']}"
        print(f"  {p['prompt']!r} ({p['prompt_tokens']} tokens): {where}; largest logit difference "
              f"{p['max_logit_diff']:.2e} (logits up to {p['max_logit']:.1f})")
