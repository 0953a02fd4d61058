"""Fixes applied to the traced forward graph before ORT builds the training artifacts.

1. name_initializers: the TorchScript exporter folds W^T of every nn.Linear into anonymous
   initializers (onnx::MatMul_123). We find each one's source tensor by value (same bytes, or
   transposed) and rename it to its HF / PEFT key, with ".T" when the graph holds the transpose.
2. untie_head: with tied embeddings the exporter keeps the embedding for Gather *and* a folded
   transposed copy for the LM head, doubling the largest tensor. The head's MatMul becomes
   Gemm(h, E, transB=1) on the one embedding.
   constants_to_initializers: large Constant nodes join the weights, so they are sharded too.
3. layernorm_stats: ORT's LayerNormalization gradient needs the optional mean / inv_std outputs.
   drop_causal_where: GPT-2 masks its attention scores twice, with its own causal buffer (a Where)
   and with the 4-D mask that transformers already builds causal; the Where goes.
4. write_initial_lora: the graph was traced with distinct placeholder LoRA values (see
   export.set_placeholders); PEFT's real initial values go back in here.
"""
from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ort_trainer.manifest import Trainable

from .export import ExportError
from .recompute import drop_dead

TRANSPOSED = ".T"


def _digest(a: np.ndarray) -> str:
    return hashlib.sha1(np.ascontiguousarray(a).tobytes()).hexdigest() + str(a.dtype) + str(a.shape)


@dataclass
class Naming:
    renamed: dict[str, str]          # old ONNX name -> new name
    aliases: dict[str, list[str]]    # new name -> other source keys with identical values
    unmatched: list[str]             # initializers derived from weights or buffers (e.g. Gemma's 1+w)


def split_value_merges(model: onnx.ModelProto) -> list[str]:
    """Undo the exporter's merging of parameters that merely hold equal values.

    In eval mode the TorchScript exporter deduplicates initializers by value: a parameter equal to an
    earlier one (every LayerNorm weight of a freshly initialised GPT-2 is all ones; real checkpoints hold
    zero biases and untouched norms) becomes Identity(earlier). ORT's gradient builder then fails with
    "Duplicate definition of name (..._grad)", and had it not, distinct parameters would be one tensor,
    the trap of the merged LoRA-B matrices (export.set_placeholders). Each Identity that reads an
    initializer becomes an initializer of its own, named after its output (the parameter's name): one
    tensor per parameter, as in the checkpoint. Parameters that share storage (tied embeddings) are
    merged by the exporter without an Identity and stay one tensor. Returns the names split off."""
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    graph_outputs = {o.name for o in g.output}
    split = []
    for node in list(g.node):
        if (node.op_type != "Identity" or len(node.input) != 1 or node.input[0] not in inits
                or node.output[0] in graph_outputs or node.output[0] in inits):
            continue
        copy = onnx.TensorProto()
        copy.CopyFrom(inits[node.input[0]])
        copy.name = node.output[0]
        g.initializer.append(copy)
        inits[copy.name] = copy
        g.node.remove(node)
        split.append(copy.name)
    if split:
        drop_dead(model.graph)
    return split


def name_initializers(model: onnx.ModelProto, sources: dict[str, np.ndarray]) -> Naming:
    """Rename initializers after the source tensors (by key) whose values they hold. Among several source
    tensors of equal value, the one whose key ends the exporter's own name for the initializer wins
    (e.g. peft_model.base_model.model.transformer.h.1.ln_2.weight), so equal tensors keep their names."""
    by_value: dict[str, list[tuple[str, bool]]] = {}
    for key, arr in sources.items():
        by_value.setdefault(_digest(arr), []).append((key, False))
        if arr.ndim == 2:
            by_value.setdefault(_digest(arr.T), []).append((key, True))

    renamed, aliases, unmatched, taken = {}, {}, [], set()
    for init in model.graph.initializer:
        hits = by_value.get(_digest(numpy_helper.to_array(init)), [])
        hits = [h for h in hits if h[0] + (TRANSPOSED if h[1] else "") not in taken]
        hits.sort(key=lambda h: not (not h[1] and init.name.replace(".base_layer", "").endswith("." + h[0])))
        if not hits:
            if init.dims and int(np.prod(init.dims)) > 1:
                unmatched.append(init.name)
            continue
        key, transposed = hits[0]
        new = key + (TRANSPOSED if transposed else "")
        taken.add(new)
        renamed[init.name] = new
        if len(hits) > 1:
            aliases[new] = [k for k, _ in hits[1:]]
    _rename(model, renamed)
    return Naming(renamed, aliases, unmatched)


def _rename(model: onnx.ModelProto, mapping: dict[str, str]) -> None:
    for init in model.graph.initializer:
        init.name = mapping.get(init.name, init.name)
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            if name in mapping:
                node.input[i] = mapping[name]
    for vi in model.graph.value_info:
        vi.name = mapping.get(vi.name, vi.name)


def untie_head(model: onnx.ModelProto) -> list[str]:
    """MatMul(h, E.T) -> Gemm(h, E, transB=1) where E is also an initializer; drop E.T."""
    inits = {i.name: i for i in model.graph.initializer}
    fixed = []
    for idx, node in enumerate(list(model.graph.node)):
        if node.op_type != "MatMul" or not node.input[1].endswith(TRANSPOSED):
            continue
        base = node.input[1][: -len(TRANSPOSED)]
        if base not in inits:
            continue
        gemm = helper.make_node("Gemm", [node.input[0], base], list(node.output), name=node.name + "_untied", transB=1)
        model.graph.node.remove(node)
        model.graph.node.insert(idx, gemm)
        fixed.append(node.input[1])
    still_used = {n for node in model.graph.node for n in node.input}
    for name in fixed:
        if name not in still_used:
            model.graph.initializer.remove(inits[name])
    return fixed + _head_rows_first(model)


def _head_rows_first(model: onnx.ModelProto) -> list[str]:
    """An untied LM head MatMul(h, W.T [H, V]) -> Gemm(h, W [V, H], transB=1), W stored as the checkpoint
    holds it: each vocabulary entry's row is then contiguous, and the training graph's head can read
    the vocabulary in slices that are views of the shard file (head_loss._vocab_slices)."""
    producer = {o: n for n in model.graph.node for o in n.output}
    node = producer.get("logits")
    while node is not None and node.op_type not in ("MatMul", "Gemm"):
        node = producer.get(node.input[0])
    inits = {i.name: i for i in model.graph.initializer}
    if node is None or node.op_type != "MatMul" or node.input[1] not in inits:
        return []
    w_t = inits[node.input[1]]
    uses = sum(name == w_t.name for n in model.graph.node for name in n.input)
    if uses != 1 or len(w_t.dims) != 2:
        return []
    base = w_t.name[: -len(TRANSPOSED)] if w_t.name.endswith(TRANSPOSED) else w_t.name + ".rows"
    if base in inits:
        return []
    rows = numpy_helper.from_array(np.ascontiguousarray(numpy_helper.to_array(w_t).T), base)
    idx = list(model.graph.node).index(node)
    model.graph.node.remove(node)
    model.graph.node.insert(idx, helper.make_node("Gemm", [node.input[0], base], list(node.output),
                                                  name=node.name + "_untied", transB=1))
    model.graph.initializer.remove(w_t)
    model.graph.initializer.append(rows)
    return [w_t.name]


def check_untied_head(model: onnx.ModelProto) -> None:
    """Gemm needs a 2-D input. Run after the weights went to shards: shape inference serializes the
    whole proto, which with the weights inline costs several GB and fails past protobuf's 2 GB."""
    names = [n.input[0] for n in model.graph.node if n.name.endswith("_untied")]
    if not names:
        return
    inferred = onnx.shape_inference.infer_shapes(model)
    ranks = {vi.name: len(vi.type.tensor_type.shape.dim) for vi in inferred.graph.value_info}
    bad = [n for n in names if ranks.get(n, 2) != 2]
    if bad:
        raise ExportError(f"tied LM head input {bad} is not 2-D; cannot use Gemm(transB=1)")


def constants_to_initializers(model: onnx.ModelProto, min_bytes: int) -> int:
    """Large Constant nodes (e.g. GPT-2's 1 MiB causal-mask buffer) become initializers, so they go to
    the shards with the weights; ORT would otherwise inline them into the training graph."""
    moved = 0
    for node in list(model.graph.node):
        if node.op_type != "Constant" or len(node.attribute) != 1 or node.attribute[0].name != "value":
            continue
        tensor = node.attribute[0].t
        if numpy_helper.to_array(tensor).nbytes < min_bytes:
            continue
        init = onnx.TensorProto()
        init.CopyFrom(tensor)
        init.name = node.output[0]
        model.graph.initializer.append(init)
        model.graph.node.remove(node)
        moved += 1
    return moved


MASK_FILL_MAX = -1e30        # a fill value at or below this is "masked out" (transformers uses finfo.min)
POSITION_TESTS = {"LessOrEqual", "Less", "GreaterOrEqual", "Greater"}
RESHAPING = {"Slice", "Reshape", "Expand", "Unsqueeze", "Squeeze", "Cast", "Transpose", "Gather"}


def drop_causal_where(model: onnx.ModelProto) -> int:
    """Remove `Where(causal_buffer, scores, min) -> Add(., mask)` where the added mask is causal itself.

    GPT-2's eager attention masks the scores with its lower-triangular `attn.bias` buffer, then adds
    the 4-D mask, which transformers builds from a position comparison (kv <= q) and the padding. The
    Where changes nothing then: a masked score is min either way, exp(min - rowmax) is 0, and so is its
    gradient. But it costs a pass over [B, heads, L, L] forward and another backward (~1.4% of a GPT-2
    124M step at micro-batch 8). Matched strictly: a scalar fill <= -1e30, a condition sliced from a
    lower-triangular bool initializer, one consumer, an Add whose other operand comes from a position
    comparison. Returns how many were removed; the buffer goes when nothing reads it any more."""
    g = model.graph
    producer = {o: n for n in g.node for o in n.output}
    consumers: dict[str, list] = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    inits = {i.name: i for i in g.initializer}

    def const(name: str):
        if name in inits:
            return numpy_helper.to_array(inits[name])
        p = producer.get(name)
        if p is not None and p.op_type == "Constant" and p.attribute and p.attribute[0].name == "value":
            return numpy_helper.to_array(p.attribute[0].t)
        return None

    def causal_buffer(name: str) -> bool:
        while name not in inits:
            p = producer.get(name)
            if p is None or p.op_type not in RESHAPING:
                return False
            name = p.input[0]
        a = numpy_helper.to_array(inits[name])
        if a.dtype != np.bool_ or a.ndim < 2 or a.shape[-1] != a.shape[-2]:
            return False
        return bool((a.reshape(-1, *a.shape[-2:]) == np.tril(np.ones(a.shape[-2:], bool))).all())

    def from_position_test(name: str, limit: int = 400) -> bool:
        seen, todo = set(), deque([name])       # breadth first; through a reshaping op, only its data input
        while todo and len(seen) < limit:
            p = producer.get(todo.popleft())
            if p is None or p.name in seen:
                continue
            if p.op_type in POSITION_TESTS:
                return True
            seen.add(p.name)
            todo += [i for i in (p.input[:1] if p.op_type in RESHAPING else p.input) if i]
        return False

    removed = []
    for node in g.node:
        if node.op_type != "Where" or len(node.input) != 3:
            continue
        cond, scores, fill = node.input
        f = const(fill)
        users = consumers.get(node.output[0], [])
        if f is None or f.size != 1 or not float(f.reshape(-1)[0]) <= MASK_FILL_MAX or len(users) != 1:
            continue
        add = users[0]
        if add.op_type != "Add" or any(o.name == node.output[0] for o in g.output):
            continue
        other = add.input[1] if add.input[0] == node.output[0] else add.input[0]
        if causal_buffer(cond) and from_position_test(other):
            for k, i in enumerate(add.input):
                if i == node.output[0]:
                    add.input[k] = scores
            removed.append(node)
    for node in removed:
        g.node.remove(node)
    if removed:
        drop_dead(model.graph)
    return len(removed)


def layernorm_stats(model: onnx.ModelProto) -> int:
    n = 0
    for node in model.graph.node:
        if node.op_type == "LayerNormalization" and len(node.output) == 1:
            node.output.extend([node.output[0] + "_mean", node.output[0] + "_inv_std"])
            n += 1
    return n


def trainables(naming: Naming, lora_keys: list[str], model: onnx.ModelProto) -> list[Trainable]:
    """The trainable ONNX tensors, one for one with PEFT's LoRA keys (else the export tied layers)."""
    inits = {i.name: i for i in model.graph.initializer}
    found: list[Trainable] = []
    for key in lora_keys:
        names = [n for n in (key, key + TRANSPOSED) if n in inits]
        if len(names) != 1:
            raise ExportError(
                f"LoRA tensor {key} maps to {len(names)} graph initializers (expected exactly 1); "
                "the exporter merged or dropped it"
            )
        name = names[0]
        if name in naming.aliases:
            raise ExportError(f"LoRA tensor {key} shares its initializer with {naming.aliases[name]}")
        found.append(Trainable(name, key, list(inits[name].dims), name.endswith(TRANSPOSED)))
    return found


def write_initial_lora(model: onnx.ModelProto, train: list[Trainable], initial: dict[str, np.ndarray]) -> None:
    inits = {i.name: i for i in model.graph.initializer}
    for t in train:
        value = initial[t.peft_key].T if t.transposed else initial[t.peft_key]
        inits[t.onnx_name].CopyFrom(numpy_helper.from_array(np.ascontiguousarray(value), t.onnx_name))


def known_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with every tensor shape that ONNX shape inference finds when it also propagates the values of
    Shape-computed tensors (data_prop), e.g. through GPT-2's Conv1D view(-1, K) ... view(*rows, N). ORT's
    gradient builder reads these shapes: where it could not tell that both inputs of a residual Add are
    [1, T, D], it summed the gradient over the leading axis of size 1 (a [1, T, D] copy per Add)."""
    return onnx.shape_inference.infer_shapes(model, data_prop=True)
