"""What differs per model family, in one table.

Every family-specific fact the generator needs lives here: how HF names the architecture,
where the decoder body sits, which Linear layers LoRA targets, the opset, and which config
keys hold the context length and the final logit soft-cap. No other module branches on family.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]     # HF class names in config.json "architectures"
    model_types: tuple[str, ...]       # config.model_type values (GGUF-loaded configs have no "architectures")
    body_attr: str                     # attribute of the *ForCausalLM holding the decoder body
    attn_targets: tuple[str, ...]      # PEFT target_modules for --targets attn
    mlp_targets: tuple[str, ...]       # added for --targets all-linear
    mlp_out_target: str                # --targets mlp-out: the MLP's output projection only
    fan_in_fan_out: bool               # GPT-2's Conv1D stores (in, out)
    opset: int                         # Gemma3's sliding-window mask needs opset 18 (bitwise_and)
    max_positions_key: str
    softcap_key: str | None = None     # config key of a final logit soft-cap, if the family has one
    # Targets ORT 1.19's training-graph builder cannot take for this family, and why (refused before export)
    broken_targets: tuple[tuple[str, str], ...] = ()

    def target_modules(self, targets: str) -> list[str]:
        if targets == "attn":
            return list(self.attn_targets)
        if targets == "mlp-out":
            return [self.mlp_out_target]
        if targets == "all-linear":
            return list(self.attn_targets + tuple(t for t in self.mlp_targets if t not in dict(self.broken_targets)))
        return [t.strip() for t in targets.split(",") if t.strip()]


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            name="gpt2",
            architectures=("GPT2LMHeadModel",),
            model_types=("gpt2",),
            body_attr="transformer",
            # GPT-2 has c_proj in both attention and MLP: qualify with the parent to stay in attention.
            attn_targets=("attn.c_attn", "attn.c_proj"),
            mlp_targets=("mlp.c_fc", "mlp.c_proj"),
            mlp_out_target="mlp.c_proj",
            fan_in_fan_out=True,
            opset=17,
            max_positions_key="n_positions",
        ),
        Family(
            name="qwen2",
            architectures=("Qwen2ForCausalLM",),
            model_types=("qwen2",),
            body_attr="model",
            attn_targets=("q_proj", "k_proj", "v_proj", "o_proj"),
            mlp_targets=("gate_proj", "up_proj", "down_proj"),
            mlp_out_target="down_proj",
            fan_in_fan_out=False,
            opset=17,
            max_positions_key="max_position_embeddings",
        ),
        Family(
            name="gemma3",
            architectures=("Gemma3ForCausalLM",),
            model_types=("gemma3_text", "gemma3"),
            body_attr="model",
            attn_targets=("q_proj", "k_proj", "v_proj", "o_proj"),
            mlp_targets=("gate_proj", "up_proj", "down_proj"),
            mlp_out_target="down_proj",
            fan_in_fan_out=False,
            opset=18,
            max_positions_key="max_position_embeddings",
            softcap_key="final_logit_softcapping",
            # A LoRA sum feeding the tanh-GELU: generate_artifacts dies in a pre-training graph transformer with
            # "Graph::RemoveEdge ... Argument mismatch when removing edge" (tiny and real model alike).
            broken_targets=(("gate_proj", "ORT 1.19's gradient-graph builder fails on a LoRA sum feeding Gemma3's "
                                          "tanh-GELU (Graph::RemoveEdge: argument mismatch)"),),
        ),
    )
}

SUPPORTED = ", ".join(f"{f.name} ({'/'.join(f.architectures)})" for f in FAMILIES.values())


class UnsupportedModel(ValueError):
    pass


def family_for(architectures: list[str] | None, model_type: str | None, where: str) -> Family:
    """The family of a config, or an error that lists what is supported."""
    for fam in FAMILIES.values():
        if architectures and any(a in fam.architectures for a in architectures):
            return fam
    for fam in FAMILIES.values():
        if not architectures and model_type in fam.model_types:
            return fam
    got = "/".join(architectures or []) or f"model_type={model_type!r}"
    raise UnsupportedModel(
        f"{where}: architecture {got} is not supported. Supported: {SUPPORTED}."
    )
