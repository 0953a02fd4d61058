"""A correct fast tokenizer for GGUF files whose vocabulary is SentencePiece-BPE (`tokenizer.ggml.model
= "llama"`, e.g. Gemma 3).

transformers 4.57 turns such a vocabulary into a tokenizer that splits common words into short
pieces ("▁cat" comes out as "▁c" + "at"), because it reads the piece scores (BPE merge ranks)
as unigram log-probabilities. The model never saw that tokenization. Here the merges are
rebuilt from the scores the way HF's SentencePieceExtractor does for a .model file, into the
byte-fallback BPE that transformers' GemmaConverter builds, so the result equals SentencePiece's
own BPE encoding (tests/test_gguf_tokenizer.py checks it against the sentencepiece library).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


@dataclass
class SpmVocab:
    pieces: list[str]
    scores: np.ndarray
    types: np.ndarray
    bos_id: int
    eos_id: int
    unk_id: int
    pad_id: int
    add_bos: bool
    add_space_prefix: bool


def read_spm_vocab(gguf_path: str | Path) -> SpmVocab | None:
    """The SentencePiece vocabulary of a GGUF file, or None if its tokenizer is not SentencePiece."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf_path)).fields

    def scalar(key, default=None):
        f = fields.get(key)
        return default if f is None else f.parts[f.data[0]][0]

    model = fields.get("tokenizer.ggml.model")
    if model is None or bytes(model.parts[model.data[0]]).decode() != "llama" or "tokenizer.ggml.merges" in fields:
        return None
    tok = fields["tokenizer.ggml.tokens"]
    pieces = [bytes(tok.parts[i]).decode("utf-8") for i in tok.data]
    scores = np.array([fields["tokenizer.ggml.scores"].parts[i][0] for i in fields["tokenizer.ggml.scores"].data])
    types = np.array([fields["tokenizer.ggml.token_type"].parts[i][0] for i in fields["tokenizer.ggml.token_type"].data])
    return SpmVocab(pieces, scores, types, int(scalar("tokenizer.ggml.bos_token_id", 2)),
                    int(scalar("tokenizer.ggml.eos_token_id", 1)), int(scalar("tokenizer.ggml.unknown_token_id", 3)),
                    int(scalar("tokenizer.ggml.padding_token_id", 0)), bool(scalar("tokenizer.ggml.add_bos_token", True)),
                    bool(scalar("tokenizer.ggml.add_space_prefix", False)))


def bpe_merges(vocab: SpmVocab) -> list[tuple[str, str]]:
    """Every split of every piece into two pieces of the vocabulary, best merged-piece score first."""
    index = {p: i for i, p in enumerate(vocab.pieces)}
    merges = []
    for piece, i in index.items():
        local = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in index and piece[k:] in index]
        local.sort(key=lambda lr: (index[lr[0]], index[lr[1]]))
        merges.extend((lr, vocab.scores[i]) for lr in local)
    merges.sort(key=lambda m: m[1], reverse=True)      # stable: ties keep vocabulary order
    return [lr for lr, _ in merges]


def build_fast_tokenizer(vocab: SpmVocab):
    """A transformers PreTrainedTokenizerFast equivalent to SentencePiece BPE with byte fallback."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    bpe = models.BPE(vocab={p: i for i, p in enumerate(vocab.pieces)}, merges=bpe_merges(vocab),
                     unk_token=vocab.pieces[vocab.unk_id], fuse_unk=True, byte_fallback=True, dropout=None)
    tok = Tokenizer(bpe)
    steps = [normalizers.Prepend("▁")] if vocab.add_space_prefix else []
    tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + ([decoders.Strip(" ", 1, 0)] if vocab.add_space_prefix else []))
    # Control tokens match the raw text (HF's convention for special tokens). SentencePiece matches
    # user-defined pieces after escaping spaces to "▁", so a piece holding a literal space (Gemma's
    # "  ", "   ", ...) can never be produced: those stay out of the added tokens. The rest
    # ("\n\n", "\t", ...) hold nothing the normalizer changes, so matching raw text is the same.
    specials = [AddedToken(vocab.pieces[i], special=vocab.types[i] != USER_DEFINED, normalized=False)
                for i in range(len(vocab.pieces))
                if vocab.types[i] in (CONTROL, UNKNOWN) or (vocab.types[i] == USER_DEFINED and " " not in vocab.pieces[i])]
    tok.add_tokens(specials)
    bos = vocab.pieces[vocab.bos_id]
    if vocab.add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab.bos_id)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=vocab.pieces[vocab.eos_id],
        unk_token=vocab.pieces[vocab.unk_id], pad_token=vocab.pieces[vocab.pad_id],
        add_bos_token=vocab.add_bos, add_eos_token=False, clean_up_tokenization_spaces=False,
    )
